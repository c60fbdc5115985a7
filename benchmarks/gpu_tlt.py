"""TLT's speedups with real weights on one GPU: speculative decoding, the adaptive engine and the RL step (issue 45).

    pip install -e '.[gpu]'
    python benchmarks/gpu_tlt.py --model=PATH [--drafter=DIR]   # one H100 / H200 -> results/gpu/tlt_smollm2.json
    python benchmarks/gpu_tlt.py --smoke --out=/tmp/tlt_smoke.json   # the same code on CPU, tiny model, < 2 min
    python benchmarks/gpu_tlt.py --prepare_data=DIR                  # the prompts as files (gpu_tlt_data.py), then
    python3 benchmarks/gpu_tlt.py --data_dir=DIR ...                  # on a machine without reasoning-gym

--model: GGUF / HF directory, --drafter: EAGLE drafter directory (defaults: SmolLM2 and its shipped drafter).
Decoding cells (``speculative.py``'s workload): plain, fixed EAGLE and n-gram trees and the adaptive engine, at
starting batches 1, 4, 16, 64, greedy and T = 0.9; one untimed pass, then --passes timed interleaved ones, under fp32
and --sd_precision: token mismatches against plain are counted (``lossless``), not fatal. RL cells (``e2e_step.py``'s
modes): configs/gsm8k.py at --prompts x --samples, --e2e_steps steps per mode; ratios of the steady steps' summed
seconds. Cells run in priority order (batch 1 fixed arms; RL off and tlt; batch 64; batches 4 and 16; adaptive; RL
adaptive); one whose estimate, scaled by the finished cells', does not fit --time_budget_s is skipped (``skipped``).
The JSON is rewritten after every cell. --smoke with a real --model: a dry run (2 x 2 RL prompts, 16 new tokens).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import e2e_step as e2e  # noqa: E402
import gpu_tlt_data as data  # noqa: E402

RESULT = HERE / "results" / "gpu" / "tlt_smollm2.json"
# Expected seconds per cell on one H100 / H200 (guesses) and in --smoke, scaled by the finished cells' actual / estimate
ESTIMATE = {"sd": {1: 50, 64: 60, 4: 40, 16: 45}, "adaptive": {1: 30, 64: 30, 4: 25, 16: 25},
            "e2e": {"off": 100, "tlt": 130, "adaptive": 120}}
SMOKE_ESTIMATE = {"sd": {1: 8, 2: 8}, "adaptive": {1: 5, 2: 5}, "e2e": {"off": 15, "tlt": 20, "adaptive": 20}}
GOALS = {"sd_b1_greedy": 2.5, "sd_b1_t0.9": 1.8, "adaptive_over_plain_min": 0.95, "adaptive_over_best_fixed_min": 0.95,
         "e2e_tlt_over_off": 1.3}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="policy GGUF / HF dir (default: the embedded SmolLM2)")
    ap.add_argument("--drafter", default=None, help="EAGLE drafter dir (default: the shipped eagle-smollm2-gsm)")
    ap.add_argument("--smoke", action="store_true", help="CPU, random tiny model and drafter, configs/tiny.py")
    ap.add_argument("--out", default=str(RESULT))
    ap.add_argument("--time_budget_s", type=float, default=225.0, help="skip cells that would not fit")
    ap.add_argument("--batches", default="1,64,4,16", help="decoding cells' starting batches, in priority order")
    ap.add_argument("--tokens", default="1:128,4:96,16:64,64:48", help="new tokens per row by batch")
    ap.add_argument("--b1_prompts", type=int, default=2, help="batch 1: prompts decoded one after the other")
    ap.add_argument("--temperatures", default="0,0.9")
    ap.add_argument("--arms", help="fixed arms by batch", default="1:eagle:5x1x6+eagle:6x4x16+ngram:3x1x4,"
                    "4:eagle:5x1x6+ngram:3x1x4,16:eagle:3x1x4+ngram:3x1x4,64:eagle:3x1x4+ngram:2x1x3")
    ap.add_argument("--passes", type=int, default=2, help="timed interleaved passes per decoding cell")
    ap.add_argument("--sd_precision", default="highest", help="jax_default_matmul_precision of the decoding cells")
    ap.add_argument("--e2e_precision", default="", help="... of the RL cells ('' = JAX's default)")
    ap.add_argument("--layers", default="auto", help="decoding engines' layer layout (auto: the main job's)")
    ap.add_argument("--e2e_modes", default="off,tlt,adaptive")
    ap.add_argument("--e2e_steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64, help="RL cells: prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="RL cells: samples per prompt")
    ap.add_argument("--set", action="append", default=[], help="extra RL config override KEY=VALUE")
    ap.add_argument("--data_dir", default=None, help="prompts from files (gpu_tlt_data.py), no reasoning-gym needed")
    ap.add_argument("--prepare_data", default=None, metavar="DIR", help="write those files to DIR, then exit")
    if ap.parse_known_args(argv)[0].smoke:  # smaller defaults; flags given still win
        ap.set_defaults(model="tiny", batches="1,2", tokens="1:12,2:8", arms="1:eagle:3x1x4+ngram:2x1x3,2:eagle:2x1x3",
                        e2e_modes="off,tlt", e2e_steps=2, passes=1, prompts=2, samples=2, time_budget_s=600.0)
    return ap.parse_args(argv)


class Budget:
    """Priority-ordered cells against a wall-clock budget."""

    def __init__(self, total_s: float, estimates: dict):
        self.total, self.estimates, self.t0 = total_s, estimates, time.perf_counter()
        self.ratios: list[float] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def scale(self) -> float:
        return min(3.0, max(0.3, statistics.median(self.ratios))) if self.ratios else 1.0

    def fits(self, est: float) -> tuple[bool, str]:
        need, left = est * self.scale(), self.total - self.elapsed()
        return need <= left, f"needs ~{need:.0f} s (estimate {est:.0f} s x {self.scale():.2f}), {left:.0f} s left"

    def done(self, est: float, seconds: float) -> None:
        self.ratios.append(seconds / est)


def rl_setup(args, real: bool) -> tuple[str, dict]:
    """The RL cells' config and overrides: configs/gsm8k.py at --prompts x --samples with the policy from --model
    (--smoke: 16 new tokens), or configs/tiny.py for the random tiny model; then --set."""
    extra: dict = {}
    if real:
        extra = {"data.prompts_per_step": args.prompts, "rollout.samples_per_prompt": args.samples,
                 "rl.micro_batch_size": min(32, args.prompts * args.samples), "data.eval_size": 8,
                 "eval.batch_size": 8, "eval.max_new_tokens": 16, "checkpoint.every_steps": 1000}
        if args.smoke:
            extra["rollout.max_new_tokens"] = 16
        if args.model:
            extra |= {"model.source": "path", "model.path": str(Path(args.model).resolve())}
    return ("gsm8k" if real else "tiny"), extra | e2e.parse_sets(args.set)


def rl_data_config(name: str, extra: dict):
    """The data block of the RL cells' config (what they would generate)."""
    return e2e.load_config(name, {**e2e.OVERRIDES.get(name, {}), **extra}).data


def prepare_data(args) -> None:
    """--prepare_data: the decoding prompts and the RL data of a run with these flags (a real policy) as files."""
    name, extra = rl_setup(args, True)
    m = data.prepare(args.prepare_data, rl_data_config(name, extra))
    for f in [m["decode"], *((m["rl"]["train"], m["rl"]["eval"]) if m["rl"] else ())]:
        path = Path(args.prepare_data) / f["file"]
        print(f"{path}: {f['rows']} rows, {path.stat().st_size:,} bytes")
    print(f"RL data: {json.dumps({k: v for k, v in (m['rl'] or {}).items() if k in data.RL_KEYS})}")


def setup_data(args, real: bool) -> tuple[str, dict, dict | None]:
    """The RL cells' config and overrides, with the files of --data_dir (checked, and against this run's RL data)
    in place of reasoning-gym's generators; a DataError where neither is available."""
    name, extra = rl_setup(args, real)
    manifest = data.check(args.data_dir) if args.data_dir else None
    if real and manifest is not None:
        extra |= data.rl_overrides(args.data_dir, manifest, rl_data_config(name, extra))
    elif real and importlib.util.find_spec("reasoning_gym") is None:
        raise data.DataError(f"reasoning_gym is not installed here, so the prompts must come from files: {data.FIX}, "
                             "and pass --data_dir=DIR")
    return name, extra, manifest


def main(argv=None) -> int:
    args = parse(argv)
    from tlt_jax.config import ConfigError

    real = args.model != "tiny"
    try:
        if args.prepare_data:
            prepare_data(args)
            return 0
        e2e_name, e2e_extra, manifest = setup_data(args, real)
    except (data.DataError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import gpu_tlt_cells as cells
    import jax

    from tlt_jax.assets import EMBEDDED_DRAFTER, resolve_drafter_path
    from tlt_jax.drafter.warmup import load_policy_and_prompts
    from tlt_jax.main import _enable_compilation_cache

    _enable_compilation_cache()  # as the main job: $TLT_JAX_COMPILATION_CACHE, else tlt_jax's cache dir / xla
    batches = [int(b) for b in args.batches.split(",")]
    tokens = {int(k): int(v) for k, v in (x.split(":") for x in args.tokens.split(","))}
    arms = {int(k): v.split("+") for k, v in (x.split(":", 1) for x in args.arms.split(","))}
    temps = [float(t) for t in args.temperatures.split(",")]
    modes = [m for m in args.e2e_modes.split(",") if m]
    cmd = "python benchmarks/gpu_tlt.py " + " ".join(sys.argv[1:] if argv is None else argv)
    res = dict(benchmark="gpu_tlt", command=cmd, date=time.strftime("%Y-%m-%d %H:%M:%S"),
               device_kind=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
               platform=platform.platform(), cpu_count=os.cpu_count(), smoke=args.smoke,
               model=args.model or "SmolLM2-135M-Instruct (embedded)", data_dir=args.data_dir if real else None,
               time_budget_s=args.time_budget_s, sd_precision=args.sd_precision or "default",
               e2e_precision=args.e2e_precision or "default", cells={}, skipped=[], errors=[], sd={}, e2e={})
    out = Path(args.out)
    budget = Budget(args.time_budget_s, SMOKE_ESTIMATE if args.smoke else ESTIMATE)

    def log(msg: str) -> None:
        print(f"[{budget.elapsed():6.1f} s] {msg}", flush=True)

    t = time.perf_counter()
    if real and manifest is not None:
        policy, prompts, stops = data.load_policy_and_prompts(args.model, args.data_dir, 64)
    else:
        policy, prompts, stops = load_policy_and_prompts(args.model, 64, 1000, None if args.smoke else "eval")
    tmp = tempfile.TemporaryDirectory(prefix="gpu_tlt_")  # the random tiny model: the RL cells' random drafter
    if not real:
        from flax import nnx

        from tlt_jax.drafter.eagle import EagleDrafter

        eagle = EagleDrafter(policy.config, rngs=nnx.Rngs(0))
        e2e_drafter = cells.drafter_for_tiny_e2e(tmp.name)
    else:
        from tlt_jax.drafter.export import load_drafter

        e2e_drafter = args.drafter or resolve_drafter_path(EMBEDDED_DRAFTER)
        eagle = load_drafter(e2e_drafter)
    res.update(drafter=e2e_drafter if real else "random (smoke)", e2e_overrides=e2e_extra)
    dec = cells.Decoding(policy, {"eagle": eagle, "ngram": "ngram"}, prompts, stops, layers=args.layers)
    res["layers"] = dec.layout.get("layers", "the engine's default")
    log(f"{res['device_kind']} ({res['backend']}), jax {res['jax']}: policy and {len(prompts)} prompts loaded in "
        f"{time.perf_counter() - t:.1f} s")

    def precision(p: str) -> None:
        jax.config.update("jax_default_matmul_precision", p or None)

    def sd(b: int):
        precision(args.sd_precision)
        for temp in temps:
            c = dec.cell(b, tokens[b], temp, arms[b], b1_prompts=args.b1_prompts, passes=args.passes, log=log)
            res["sd"].setdefault(cells.temp_key(temp), {}).setdefault(str(b), {}).update(c)

    def adaptive(b: int):
        precision(args.sd_precision)
        for temp in temps:
            c = dec.cell(b, tokens[b], temp, [*arms[b], "adaptive:" + ",".join(arms[b])], b1_prompts=args.b1_prompts,
                         passes=args.passes, log=log)  # the fixed arms again, side by side (compiled unless skipped)
            row = c["arms"].pop("adaptive:" + ",".join(arms[b]))
            best = c.get("best_fixed") or dict(arm="plain", speedup=1.0)
            cell = res["sd"].setdefault(cells.temp_key(temp), {}).setdefault(str(b), {})
            if "arms" not in cell:  # "sd b" was skipped: this cell's fixed arms stand in for it
                cell.update(c)
            cell["adaptive"] = dict(row, over_plain=row["speedup"], over_best_fixed=row["speedup"] / best["speedup"],
                                    best_fixed_same_passes=best, plain_same_passes=c["plain"])

    def rl(mode: str):
        precision(args.e2e_precision)
        res["e2e"][mode] = r = cells.e2e_run(e2e_name, mode, args.e2e_steps, e2e_extra, e2e_drafter)
        log(f"RL {mode}: steady {r['steady_steps']} steps {r['steady_step_s']:.2f} s (rollouts "
            f"{r['steady_rollout_s']:.2f} s, of which compiles {r['steady_compile_s']:.2f} s); run {r['wall_s']:.0f} s")

    plan = [("sd", batches[0], sd)] + [("e2e", m, rl) for m in modes if m in ("off", "tlt")]
    plan += [("sd", b, sd) for b in batches[1:]] + [("adaptive", b, adaptive) for b in batches]
    plan += [("e2e", m, rl) for m in modes if m not in ("off", "tlt")]
    for kind, key, fn in plan:
        name = f"{kind} {key}"
        est = budget.estimates[kind].get(key, max(budget.estimates[kind].values()))
        if kind == "adaptive" and f"sd {key}" not in res["cells"]:
            est += budget.estimates["sd"].get(key, 0)  # compiles the fixed arms too
        ok, why = budget.fits(est)
        if not ok:
            res["skipped"].append(dict(cell=name, reason=f"time budget: {why}"))
            log(f"skip {name}: {why}")
            write(res, out, budget, final=False)
            continue
        log(f"cell {name} ({why})")
        t = time.perf_counter()
        try:
            fn(key)
            res["cells"][name] = dict(seconds=time.perf_counter() - t, estimate_s=est)
        except Exception as e:  # noqa: BLE001 - one failed cell must not lose the others (one GPU run, no retries)
            res["errors"].append(dict(cell=name, error=f"{type(e).__name__}: {e}"))
            log(f"cell {name} failed: {type(e).__name__}: {e}")
        budget.done(est, time.perf_counter() - t)
        write(res, out, budget, final=False)
    write(res, out, budget, final=True)
    tmp.cleanup()
    heads = ("sd_speedup", "adaptive_over_plain_min", "e2e_tlt_over_off", "lossless")
    log(f"wrote {out}: " + json.dumps({k: res[k] for k in heads}, default=str))
    return 0


def summarise(res: dict) -> None:
    """The issue's headline figures from the cells that ran (None where a cell was skipped or failed)."""
    sd = res["sd"]
    for key, field in (("sd_speedup", "speedup"), ("accept_length", "accept"), ("best_spec_arm", "arm")):
        res[key] = {t: {b: c["best_spec"][field] for b, c in cs.items() if "best_spec" in c} for t, cs in sd.items()}
    ada = {t: {b: c["adaptive"] for b, c in cs.items() if "adaptive" in c} for t, cs in sd.items()}
    res["adaptive_over_plain"] = {t: {b: a["over_plain"] for b, a in cs.items()} for t, cs in ada.items()}
    res["adaptive_over_best_fixed"] = {t: {b: a["over_best_fixed"] for b, a in cs.items()} for t, cs in ada.items()}
    flat = [a for cs in ada.values() for a in cs.values()]
    res["adaptive_cells"] = len(flat)
    res["adaptive_over_plain_min"] = min((a["over_plain"] for a in flat), default=None)
    res["adaptive_over_best_fixed_min"] = min((a["over_best_fixed"] for a in flat), default=None)
    e2e = res["e2e"]
    res["e2e_step_s"] = {m: r["steady_step_s"] for m, r in e2e.items()}
    res["e2e_rollout_s"] = {m: r["steady_rollout_s"] for m, r in e2e.items()}
    for m in ("tlt", "adaptive"):
        both = "off" in e2e and m in e2e and e2e["off"]["steady_steps"] == e2e[m]["steady_steps"]
        res[f"e2e_{m}_over_off"] = e2e["off"]["steady_step_s"] / e2e[m]["steady_step_s"] if both else None
        res[f"e2e_{m}_rollout_over_off"] = e2e["off"]["steady_rollout_s"] / e2e[m]["steady_rollout_s"] if both else None
    rewards = {m: [s["reward"] for s in r["steps"]] for m, r in e2e.items()}
    res["e2e_rewards_identical"] = len({json.dumps(v) for v in rewards.values()}) <= 1 if rewards else None
    mism = {t: {b: {k: a["mismatched_rows"] for k, a in [*c.get("arms", {}).items(), ("adaptive", c.get("adaptive"))]
                    if a} for b, c in cs.items()} for t, cs in sd.items()}
    rows = {t: {b: c.get("rows") for b, c in cs.items()} for t, cs in sd.items()}
    total = sum(n for cs in mism.values() for arms in cs.values() for n in arms.values())
    plain_det = all(c.get("plain", {}).get("deterministic", True) for cs in sd.values() for c in cs.values())
    res["lossless"] = dict(precision=res["sd_precision"], dtype="float32", rows=rows, mismatched_rows=mism,
                           mismatched_rows_total=total, plain_deterministic=plain_det,
                           identical=total == 0 and plain_det if mism else None)
    costs = {"source": "gpu_tlt.py decoding cells, greedy: mean ms per step over a cell (host round trips included; "
             "rows leave at EOS, so the batch is the starting one)", "device": res["device_kind"],
             "model": res["model"], "decode_ms": {}, "spec_step_ms": {}}
    for b, c in sd.get("greedy", {}).items():
        if c.get("plain", {}).get("ms_per_step"):
            costs["decode_ms"][b] = c["plain"]["ms_per_step"]
        for k, a in c.get("arms", {}).items():
            if k.startswith("eagle:") and a.get("ms_per_step"):
                costs["spec_step_ms"].setdefault(k.split(":")[1], {})[b] = a["ms_per_step"]
    res["step_costs"] = costs if costs["decode_ms"] else None
    g = res["sd_speedup"]
    got = {"sd_b1_greedy": g.get("greedy", {}).get("1"), "sd_b1_t0.9": g.get("t0.9", {}).get("1"),
           **{k: res[k] for k in ("adaptive_over_plain_min", "adaptive_over_best_fixed_min", "e2e_tlt_over_off")}}
    res["goals"] = {k: dict(goal=GOALS[k], value=v, met=None if v is None else v >= GOALS[k]) for k, v in got.items()}
    res["goals"]["lossless"] = dict(goal="identical tokens at fp32 / highest", value=total,
                                    met=res["lossless"]["identical"])


def write(res: dict, out: Path, budget: Budget, final: bool) -> None:
    summarise(res)
    res.update(complete=final, elapsed_s=budget.elapsed(), budget_scale=budget.scale())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str) + "\n")
    os.replace(tmp, out)


if __name__ == "__main__":
    raise SystemExit(main())
