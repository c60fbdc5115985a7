"""End-to-end RL step time breakdown: rollout (and its tail), log-prob recomputation, reward, policy update.

Runs the main job (``tlt_jax.main.run``) on each config for a few steps in a scratch workdir and reads back its
per-step metrics (step 1 includes the compiles; steps >= 2 are the steady state). Modes change only the decoding, so
all sample the same tokens (rewards asserted identical): ``off``, ``ngram``, ``static`` (TLT's baseline: a fixed EAGLE
drafter and tree), ``adaptive`` (the bandit over --spec_arms), ``tlt`` (adaptive, the drafter trained online),
``config`` (the file as it is). They run one after the other, so a drift in the machine's speed lands in their ratios
(``--repeats``: commit ff7a568); ``--paired MODE`` cancels it: one training run whose every rollout is decoded back to
back by an "off" engine and by MODE's (alternating which goes first; work still pending waited for outside both
timings, "drain"), compared step by step. Output: per config and mode the phases' steady medians and sums and the
ratios against off, or the paired summary.

    python benchmarks/e2e_step.py --configs gsm8k --modes off,static,tlt --steps 6   # the default run's table
    python benchmarks/e2e_step.py --configs tiny --steps 10 --modes off,ngram
    python benchmarks/e2e_step.py --configs gsm8k --paired adaptive --steps 12
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

RESULTS = Path(__file__).parent / "results" / "e2e_step.json"
PHASES = ("time/rollout_s", "time/tail_s", "time/logprob_s", "time/reward_s", "time/train_s", "time/step_s")
DEFAULT_STEPS = {"tiny": 20, "gsm8k": 2}
# No periodic evaluation (the final one stays); the data split as the config has it (data.eval_size picks the held-out
# seeds: changing it would change the training prompts, and the run would leave the default run's trajectory).
OVERRIDES = {"gsm8k": {"eval.every_steps": 0}, "tiny": {}}


def load_config(name: str, overrides: dict):
    """configs/NAME.py with ``overrides`` ({"rollout.spec_depth": 5, ...})."""
    from tlt_jax.config import config_file, from_config_dict

    cd = config_file(str(REPO / "configs" / f"{name}.py"), name).get_config()
    cd.update_from_flattened_dict(overrides)
    return from_config_dict(cd)


def parse_sets(items: list[str]) -> dict:
    """--set KEY=VALUE overrides: a JSON value (numbers, true / false) where VALUE parses as one, else the string."""
    out = {}
    for key, value in (kv.split("=", 1) for kv in items):
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def summarise(rows: list[dict]) -> dict:
    def med(key, rs):
        vals = [r[key] for r in rs if key in r]
        return statistics.median(vals) if vals else None

    steady = rows[1:] or rows
    out = {"first_step": {k: rows[0].get(k) for k in PHASES}, "steady_median": {k: med(k, steady) for k in PHASES}}
    # Steps differ in length as the policy learns: modes compare on sums over the same steps. Compile seconds (shapes
    # met mid-run) are inside the rollout's; background compiles ran beside it, which did not wait for them.
    out["steady_sum"] = {k: sum(r.get(k) or 0.0 for r in steady)
                         for k in (*PHASES, "rollout/compile_s", "rollout/background_compile_s")}
    s = out["steady_median"]
    names = dict(rollout="rollout_s", rollout_tail="tail_s", logprob="logprob_s", reward="reward_s", update="train_s")
    out["steady_share"] = {k: s[f"time/{v}"] / (s["time/step_s"] or 1.0) for k, v in names.items()}
    out["rollout_tail_share"] = med("rollout/tail_share", steady)
    out["rollout_tokens_per_s"] = med("rollout/tokens_per_s", steady)
    out["response_len_p50_p90_max"] = [med(f"response/len_{k}", steady) for k in ("p50", "p90", "max")]
    return out


ADAPTIVE_ARMS = "off,eagle:3x1x4,eagle:5x1x6"  # modes "adaptive" / "tlt": the bandit's arms (--spec_arms)
SHIPPED = "eagle-smollm2-gsm"


def mode_overrides(mode: str, arms: str, drafter: str, static_tree: str) -> dict:
    """Config overrides of one decoding mode (see the module docstring)."""
    if mode == "config":
        return {}
    online = {"drafter.online": mode == "tlt"}
    if mode in ("off", "ngram"):
        return {"rollout.speculative": mode, "rollout.spec_arms": "", **online}
    if mode == "static":
        depth, topk, n = (int(x) for x in static_tree.split("x"))
        return {"rollout.speculative": "eagle", "rollout.spec_arms": "", "rollout.drafter_path": drafter,
                "rollout.spec_depth": depth, "rollout.spec_topk": topk, "rollout.spec_verify_tokens": n, **online}
    if mode in ("adaptive", "tlt"):
        return {"rollout.speculative": "adaptive", "rollout.spec_arms": arms, "rollout.drafter_path": drafter, **online}
    raise ValueError(f"unknown mode {mode!r}")


def run_main(cfg, build_engine):
    """The main job on ``cfg`` in a scratch workdir, engines built by ``build_engine(build, cfg, model, mesh, data,
    workdir)`` (``build``: the main job's own): (final metrics, wall seconds, train rows, response lengths by step)."""
    import tlt_jax.main as main_mod
    from tlt_jax.metrics import read_metrics
    from tlt_jax.metrics.records import LENGTHS_FILE

    build = main_mod.build_engine
    main_mod.build_engine = lambda *a, **k: build_engine(build, *a, **k)
    try:
        with tempfile.TemporaryDirectory() as workdir:
            t0 = time.perf_counter()
            final = main_mod.run(cfg, workdir)
            wall = time.perf_counter() - t0
            rows = [r for r in read_metrics(workdir) if r["kind"] == "train"]
            lines = Path(workdir, LENGTHS_FILE).read_text().splitlines()
    finally:
        main_mod.build_engine = build
    return final, wall, rows, {d["step"]: d["lengths"] for d in map(json.loads, lines)}


def bench(name: str, steps: int, mode: str, arms: str = ADAPTIVE_ARMS, drafter: str = SHIPPED,
          static_tree: str = "5x1x6", extra: dict | None = None) -> dict:
    """One run of the main job in a scratch workdir: its per-step metrics, every response's length per step
    (``lengths``) and the engine's shape (``engine``: prompt_len, the mean; max_batch, max_len)."""
    overrides = {**OVERRIDES.get(name, {}), **mode_overrides(mode, arms, drafter, static_tree),
                 "train.num_steps": steps, "metrics.progress_bars": False, "eval.at_start": False, **(extra or {})}
    cfg, seen = load_config(name, overrides), {}

    def build_and_note(build, cfg_, model, mesh, data, workdir=None):
        engine = build(cfg_, model, mesh, data, workdir)
        one = getattr(getattr(engine, "rollout", None), "engines", [engine])[0]  # a controlled rollout's slice
        seen.update(prompt_len=statistics.mean(len(ex["prompt_ids"]) for ex in data.train), max_batch=one.max_batch,
                    max_len=one.max_len)
        return engine

    final, wall, rows, lengths = run_main(cfg, build_and_note)
    res = summarise(rows)
    res.update(config=f"configs/{name}.py", overrides=overrides, steps=steps,
               prompts_x_samples=[cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt],
               max_new_tokens=cfg.rollout.max_new_tokens, wall_s_including_setup_and_final_eval=wall,
               final_eval_s=final.get("eval/seconds"), speculative=mode,
               accept_length_per_step=[r.get("rollout/accept_length") for r in rows],
               reward_per_step=[r.get("reward/mean") for r in rows],
               per_step=[{k: r.get(k) for k in ("step", *PHASES, *STEP_EXTRAS)} for r in rows],
               lengths=[lengths.get(r["step"], []) for r in rows], engine=seen, group=cfg.rollout.samples_per_prompt)
    return res


STEP_EXTRAS = ("rollout/tail_share", "rollout/compile_s", "rollout/background_compile_s", "rollout/tokens",
               "rollout/accept_length", "drafter/steps", "drafter/top1", "controller/train_s", "reward/mean",
               "reward/accuracy", "response/len_max")


def compare_to_off(off: dict, res: dict) -> dict:
    """Steady-step ratios of a mode against "off" (sums over the same steps: every mode samples the same tokens)."""
    o, r = off["steady_sum"], res["steady_sum"]
    return {"steady_step_speedup_vs_off": o["time/step_s"] / r["time/step_s"],
            "steady_rollout_speedup_vs_off": o["time/rollout_s"] / r["time/rollout_s"],
            "steady_rollout_speedup_vs_off_without_compile":
                (o["time/rollout_s"] - o["rollout/compile_s"]) / (r["time/rollout_s"] - r["rollout/compile_s"])}


class PairedRollout:
    """``--paired``: decodes every rollout with both engines (same weights, prompts and seed, alternating which goes
    first), checks the tokens are the same and returns ``other``'s result; with ``chunks`` each call's record keeps
    both engines' host round trips (``CHUNK_KEYS``; ``steady_chunk_split`` at commit ff7a568)."""

    CHUNK_KEYS = ("batch", "active", "length", "choice", "seconds", "tokens", "lag_tokens", "steps", "first_run",
                  "compile_overlap", "catchup_seconds", "waited_for")

    def __init__(self, base, other, chunks: bool = False):
        self.base, self.other, self.chunks = base, other, chunks
        self.calls: list[dict] = []
        self._threads = thread_cpu_seconds()

    @property
    def params(self):
        return (self.base.params, self.other.params)

    @property
    def bandit(self):
        return getattr(self.other, "bandit", None)

    def set_params(self, model) -> None:
        self.base.set_params(model)
        self.other.set_params(model)

    def state_dict(self) -> dict:
        return self.other.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.other.load_state_dict(state)

    def history_state(self):
        return self.other.history_state()

    def load_history_state(self, state) -> None:
        self.other.load_history_state(state)

    def close(self) -> None:
        self.base.close()
        self.other.close()

    def generate(self, prompts, params, **kwargs):
        order = ("base", "other") if len(self.calls) % 2 == 0 else ("other", "base")
        rec, results = {"first": order[0], "temperature": params.temperature}, {}
        # CPU seconds of XLA's compile threads and the pool's worker since the last pair (outside both timings)
        now = thread_cpu_seconds()
        rec["between_thread_cpu_s"] = {k: round(v - self._threads.get(k, 0.0), 3) for k, v in now.items()
                                       if v - self._threads.get(k, 0.0) >= 0.005}
        # compile_between_calls: the mode's compiles wait for both rollouts of the pair, not only for its own
        hold = getattr(self.other, "compile_between_calls", False) and not self.other.pool.held
        if hold:
            self.other.pool.hold()
        try:
            self._pair(order, rec, results, prompts, params, kwargs)
        finally:
            if hold:
                self.other.pool.release()
        self._threads = thread_cpu_seconds()
        if results["base"].tokens != results["other"].tokens:
            raise AssertionError(f"paired rollout {len(self.calls)}: the two engines sampled different tokens")
        rec["tokens"] = int(sum(len(c) for comps in results["other"].tokens for c in comps))
        rec["arm_steps"] = results["other"].stats.get("arm_steps")
        bandit = results["other"].stats.get("bandit")
        if bandit is not None:  # the bandit's own estimate of its cost against plain decoding, so far
            rec["ledger"] = bandit.get("ledger")
        self.calls.append(rec)
        return results["other"]

    def _pair(self, order, rec, results, prompts, params, kwargs) -> None:
        import jax

        for name in order:
            t = time.perf_counter()
            for engine in (self.base, self.other):  # work left from before finishes outside the timings:
                engine.pool.collect(wait=True)  # background compiles,
                jax.block_until_ready((engine.params, engine.drafter_params))  # updates still in flight
            jax.block_until_ready(jax.live_arrays())  # and any other computation still running
            rec[f"{name}_drain_s"] = time.perf_counter() - t
            threads, t = thread_cpu_seconds(), time.perf_counter()
            own = kwargs if name == "other" else {k: v for k, v in kwargs.items() if k != "on_chunk"}  # its callback
            results[name] = getattr(self, name).generate(prompts, params, **own)
            rec[f"{name}_s"] = time.perf_counter() - t
            after = thread_cpu_seconds()  # which threads spent CPU seconds meanwhile
            rec[f"{name}_thread_cpu_s"] = {k: round(v - threads.get(k, 0.0), 3) for k, v in after.items()
                                           if v - threads.get(k, 0.0) >= 0.005}
            st = results[name].stats
            rec[f"{name}_compile_s"] = float(st.get("compile_seconds_this_call", 0.0))
            rec[f"{name}_background_compile_s"] = float(st.get("background_compile_seconds_this_call", 0.0))
            if self.chunks:
                rec[f"{name}_chunks"] = [{k: c[k] for k in self.CHUNK_KEYS if k in c} for c in st["chunks"]]


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds of this process's threads so far (Linux), summed by ``thread_kinds`` (a Python thread by its name,
    XLA's compile threads as "compile", its execution pool as "tf_XLAEigen", ...)."""
    from tlt_jax.rollout.pool import thread_kinds

    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid, kind in thread_kinds().items():
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class PairedSlice(PairedRollout):
    """``PairedRollout`` standing in for the one slice engine of a controlled rollout (``tlt``: the drafter trains
    online): every attribute but generate / set_params / close is the mode engine's (its params, drafter, pool)."""

    @property
    def params(self):
        return self.other.params

    def __getattr__(self, name):
        if name in ("base", "other"):  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.other, name)


def bench_paired(name: str, steps: int, mode: str, arms: str = ADAPTIVE_ARMS, drafter: str = SHIPPED,
                 static_tree: str = "5x1x6", extra: dict | None = None, chunks: bool = False) -> dict:
    """One training run of ``mode`` whose every rollout is also decoded by an "off" engine (``PairedRollout``)."""
    if mode not in ("off", "ngram", "static", "adaptive", "tlt"):
        raise ValueError(f"--paired takes off, ngram, static, adaptive or tlt, got {mode!r}")
    # synchronous checkpoints: an asynchronous write would slow the next step's first rollout, always the same engine's
    common = {**OVERRIDES.get(name, {}), "train.num_steps": steps, "metrics.progress_bars": False,
              "eval.at_start": False, "checkpoint.async_save": False, **(extra or {})}
    cfg_off = load_config(name, {**common, **mode_overrides("off", arms, drafter, static_tree)})
    cfg = load_config(name, {**common, **mode_overrides(mode, arms, drafter, static_tree)})
    paired: list[PairedRollout] = []

    def build_both(build, cfg_, model, mesh, data, workdir=None):
        engines = build(cfg_off, model, mesh, data), build(cfg_, model, mesh, data, workdir)
        slices = getattr(getattr(engines[1], "rollout", None), "engines", None)
        if slices is not None and len(slices) == 1 and hasattr(engines[0], "pool"):
            # a controlled rollout (tlt: the drafter trains online): the "off" engine pairs with its one slice
            paired.append(PairedSlice(engines[0], slices[0], chunks=chunks))
            slices[0] = paired[-1]
            return engines[1]
        if not all(hasattr(e, "pool") for e in engines):
            raise ValueError("--paired compares two RolloutEngines (or a one-slice controlled rollout); "
                             "this config builds more slices")
        paired.append(PairedRollout(*engines, chunks=chunks))
        return paired[-1]

    wall = run_main(cfg, build_both)[1]
    calls = paired[0].calls[:steps]  # the training rollouts (the final evaluation's calls come after)
    return {"config": f"configs/{name}.py", "mode": mode, "steps": steps, "wall_s": wall, "per_step": calls,
            "evaluation_calls": len(paired[0].calls) - len(calls), **summarise_paired(calls[1:])}


def summarise_paired(steady: list[dict]) -> dict:
    """Ratios of "off" seconds over the mode's, from paired steps (``PairedRollout.calls``, steady steps only)."""
    def total(key, sel=steady):
        return sum(c[key] for c in sel)

    from tlt_jax.rollout.pool import COMPILE

    off_s, mode_s = total("base_s"), total("other_s")
    drain = total("base_drain_s") + total("other_drain_s")
    off_nc, mode_nc = off_s - total("base_compile_s"), mode_s - total("other_compile_s")
    # The ratio over the steps where "off" went first and over those where the mode did, and their geometric mean
    # (a crossover design: it cancels an order effect that scales both rollouts alike).
    by_order = {}
    for first in ("base", "other"):
        sel = [c for c in steady if c["first"] == first]
        by_order[first] = total("base_s", sel) / total("other_s", sel) if sel else None
    crossover = math.sqrt(by_order["base"] * by_order["other"]) if all(by_order.values()) else None
    # A 90 % bootstrap interval of the sum ratio, the steps resampled (fixed seed): steps are the unit of noise here
    rng = random.Random(0)
    boot = sorted(total("base_s", sample) / total("other_s", sample)
                  for sample in ([rng.choice(steady) for _ in steady] for _ in range(2000)))
    per_step = [c["base_s"] / c["other_s"] for c in steady]
    return {
        "steady_steps": len(steady), "steady_off_s": off_s, "steady_mode_s": mode_s,
        "steady_speedup_vs_off": off_s / mode_s, "steady_speedup_vs_off_without_compile": off_nc / mode_nc,
        "steady_per_step_speedup": per_step, "steady_per_step_speedup_median": statistics.median(per_step),
        "steady_speedup_vs_off_off_first": by_order["base"], "steady_speedup_vs_off_mode_first": by_order["other"],
        "steady_speedup_vs_off_crossover": crossover, "steady_speedup_vs_off_bootstrap_90": [boot[100], boot[1899]],
        "steady_steps_mode_faster": sum(c["other_s"] < c["base_s"] for c in steady),
        "steady_background_compile_s": total("other_background_compile_s"), "steady_drain_s": drain,
        # every drain (leftover compiles, updates in flight) charged to the mode, as if it had waited for them
        "steady_speedup_vs_off_drain_charged": off_s / (mode_s + drain),
        # CPU seconds of XLA's compile threads and the pool's worker between pairs (beside the policy update)
        "steady_between_compile_cpu_s": sum(v for c in steady for k, v in c.get("between_thread_cpu_s", {}).items()
                                            if k == COMPILE or k.startswith("step-compile")),
    }


def combine_paired(paths: list[str], skip_steps: tuple[int, ...] = ()) -> dict:
    """One summary of the steady paired steps of several ``--paired`` result files (same config; modes pooled too,
    e.g. "adaptive+tlt"), without the steps numbered in ``skip_steps`` (1-based, in every file)."""
    runs = [json.loads(Path(p).read_text())["configs"] for p in paths]
    out = {}
    for name in runs[0]:
        res = [r[name]["paired"] for r in runs]
        mode = "+".join(dict.fromkeys(r["mode"] for r in res))
        steady = [c for r in res for i, c in enumerate(r["per_step"][1:], 2) if i not in skip_steps]
        out[name] = {"mode": mode, "files": paths, "skipped_steps": list(skip_steps), **summarise_paired(steady)}
    return out


def print_paired(name: str, mode: str, res: dict) -> None:
    print(f"{name}: {mode} vs off over {res['steady_steps']} steady steps, paired step by step: "
          f"{res['steady_off_s']:.1f} / {res['steady_mode_s']:.1f} s = {res['steady_speedup_vs_off']:.3f}x "
          f"(without in-place compiles {res['steady_speedup_vs_off_without_compile']:.3f}x; per-step median "
          f"{res['steady_per_step_speedup_median']:.3f}x; off first {res['steady_speedup_vs_off_off_first']:.3f}x, "
          f"{mode} first {res['steady_speedup_vs_off_mode_first']:.3f}x, crossover "
          f"{res['steady_speedup_vs_off_crossover']:.3f}x; 90 % bootstrap interval "
          f"{res['steady_speedup_vs_off_bootstrap_90'][0]:.3f}-{res['steady_speedup_vs_off_bootstrap_90'][1]:.3f}x; "
          f"{mode} faster in {res['steady_steps_mode_faster']} of {res['steady_steps']} steps); background compiles "
          f"{res['steady_background_compile_s']:.1f} s, drained before a timed rollout "
          f"{res['steady_drain_s']:.1f} s ({res['steady_speedup_vs_off_drain_charged']:.3f}x charged to {mode}); "
          f"compile CPU between pairs {res['steady_between_compile_cpu_s']:.1f} s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny,gsm8k")
    ap.add_argument("--steps", type=int, default=0, help="steps per config (0: tiny 20, gsm8k 2)")
    ap.add_argument("--modes", default="off,ngram", help="decoding modes: off,ngram,static,adaptive,tlt,config")
    ap.add_argument("--spec_arms", default=ADAPTIVE_ARMS, help="arms of modes adaptive / tlt (off,eagle:DxKxN,...)")
    ap.add_argument("--drafter", default=SHIPPED, help="EAGLE drafter of static / adaptive / tlt (name or dir)")
    ap.add_argument("--static_tree", default="5x1x6", help="tree of mode static (depth x topk x verify tokens)")
    ap.add_argument("--set", action="append", default=[], help="extra config override KEY=VALUE (repeatable)")
    ap.add_argument("--paired", default="",
                    help="one run of this mode with every rollout also decoded by an off engine, step by step")
    ap.add_argument("--combine", default="",
                    help="comma-separated --paired result files: pool their steady steps into one summary")
    ap.add_argument("--chunks", action="store_true",
                    help="with --paired: keep both engines' host round trips of every rollout in the result file")
    ap.add_argument("--skip_steps", default="",
                    help="with --combine: comma-separated step numbers to leave out (e.g. 5,9)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    import jax

    from tlt_jax.main import _enable_compilation_cache

    _enable_compilation_cache()
    results = {"benchmark": "e2e_step", "configs": {}, "machine": {
        "platform": platform.platform(), "cpu_count": os.cpu_count(), "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind}}
    results["extra_overrides"] = extra = parse_sets(args.set)
    if args.combine:
        skip = tuple(int(x) for x in args.skip_steps.split(",") if x.strip())
        results["combined"] = combine_paired(args.combine.split(","), skip)
        for name, res in results["combined"].items():
            print_paired(name, res["mode"], res)
    elif args.paired:
        for name in args.configs.split(","):
            res = bench_paired(name, args.steps or DEFAULT_STEPS.get(name, 2), args.paired, args.spec_arms,
                               args.drafter, args.static_tree, extra, args.chunks)
            results["configs"][name] = {"paired": res}
            for i, c in enumerate(res["per_step"]):
                print(f"{name} step {i + 1}: off {c['base_s']:.2f} s, {args.paired} {c['other_s']:.2f} s "
                      f"({c['base_s'] / c['other_s']:.3f}x; {c['first']} first; in-place compile "
                      f"{c['base_compile_s']:.2f} / {c['other_compile_s']:.2f} s, background "
                      f"{c['other_background_compile_s']:.2f} s, drain {c['base_drain_s'] + c['other_drain_s']:.2f} "
                      f"s); arm steps {c['arm_steps']}", flush=True)
            print_paired(name, args.paired, res)
    if args.paired or args.combine:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
        return
    for name in args.configs.split(","):
        modes = results["configs"].setdefault(name, {})
        for mode in args.modes.split(","):
            modes[mode] = res = bench(name, args.steps or DEFAULT_STEPS.get(name, 2), mode, args.spec_arms,
                                      args.drafter, args.static_tree, extra)
            s, ss = res["steady_median"], res["steady_sum"]
            print(f"{name} (SD {mode}): steady step {s['time/step_s']:.2f} s = rollout {s['time/rollout_s']:.2f} "
                  f"(tail {s['time/tail_s']:.2f}) + logprob {s['time/logprob_s']:.2f} + reward "
                  f"{s['time/reward_s']:.2f} + update {s['time/train_s']:.2f}; first step "
                  f"{res['first_step']['time/step_s']:.2f} s; steady rollout sum {ss['time/rollout_s']:.2f} s (compile "
                  f"{ss['rollout/compile_s']:.2f}, in the background {ss['rollout/background_compile_s']:.2f}); "
                  f"{res['rollout_tokens_per_s']:.1f} rollout tok/s; accept lengths {res['accept_length_per_step']}",
                  flush=True)
        rewards = {m: r["reward_per_step"] for m, r in modes.items()}
        same = all(v == next(iter(rewards.values())) for v in rewards.values())
        for mode in modes if "off" in modes else ():
            modes[mode].update(compare_to_off(modes["off"], modes[mode]))
            c = modes[mode]
            print(f"{name}: {mode} vs off, steady step {c['steady_step_speedup_vs_off']:.3f}x, rollout "
                  f"{c['steady_rollout_speedup_vs_off']:.3f}x (without compile "
                  f"{c['steady_rollout_speedup_vs_off_without_compile']:.3f}x)", flush=True)
        modes["_rewards_identical_across_modes"] = same
        print(f"{name}: rewards identical across modes: {same}", flush=True)
        if not same:
            raise AssertionError(f"{name}: the modes sampled different rewards per step: {rewards}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
