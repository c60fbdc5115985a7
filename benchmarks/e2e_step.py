"""End-to-end RL step time breakdown: rollout (and its tail), log-prob recomputation, reward, policy update.

Runs the main job (``tlt_jax.main.run``) on each config for a few steps in a scratch workdir and reads back the
per-step metrics it records. Step 1 includes XLA compiles (persistent compilation cache on, so a second invocation is
closer to steady state); steps >= 2 are reported as steady state. Modes (``--modes``) change only how the rollout is
decoded, so every mode samples the same tokens: the script asserts identical rewards per step across modes.

- ``off``: plain decoding, no drafter.
- ``ngram``: the model-free n-gram drafter, one tree shape (``rollout.spec_*``).
- ``static``: TLT's baseline, a fixed EAGLE drafter (``--drafter``, default the shipped warmed-up one) with one
  tree shape (``--static_tree``), tree decoding once a wave has <= ``rollout.spec_threshold`` live rows.
- ``adaptive``: the bandit over ``--spec_arms`` with the drafter frozen.
- ``tlt``: the adaptive engine and the drafter trained online on the policy's rollouts (``drafter.online``).
- ``config``: the config file as it is (configs/gsm8k.py is ``tlt``).

Modes run one after the other, so a drift in the machine's speed lands in their ratios; ``--repeats N`` runs every
mode N times, alternating the order (A B, B A, ...), and reports each mode's ratios to "off" per repeat (the two ran
next to each other) and from each step's fastest rollout over the repeats (every repeat decodes the same tokens).

    python benchmarks/e2e_step.py --configs gsm8k --modes off,static,tlt --steps 6   # the default run's table
    python benchmarks/e2e_step.py --configs gsm8k --modes off,adaptive --steps 8 --repeats 3
    python benchmarks/e2e_step.py --configs tiny --steps 10 --modes off,ngram
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

RESULTS = Path(__file__).parent / "results" / "e2e_step.json"
PHASES = ("time/rollout_s", "time/tail_s", "time/logprob_s", "time/reward_s", "time/train_s", "time/step_s")
DEFAULT_STEPS = {"tiny": 20, "gsm8k": 2}
# Keep the benchmark about the training step: no periodic evaluation (the final one stays). The data split is left
# as the config has it (data.eval_size picks the held-out seeds, so changing it would change the training prompts
# and the run would no longer follow the default run's trajectory).
OVERRIDES = {"gsm8k": {"eval.every_steps": 0}, "tiny": {}}


def load_config(name: str, overrides: dict):
    from tlt_jax.config import from_config_dict

    spec = importlib.util.spec_from_file_location(f"cfg_{name}", REPO / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cd = module.get_config()
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = cd
        for p in parents:
            node = node[p]
        node[leaf] = value
    return from_config_dict(cd)


def summarise(rows: list[dict]) -> dict:
    def med(key, rs):
        vals = [r[key] for r in rs if key in r]
        return statistics.median(vals) if vals else None

    steady = rows[1:] or rows
    out = {"first_step": {k: rows[0].get(k) for k in PHASES}, "steady_median": {k: med(k, steady) for k in PHASES}}
    # Steps differ in length (responses shorten or grow as the policy learns), so modes compare best on sums over
    # the same steps; compile seconds (new batch / length / arm shapes met mid-run) are inside the rollout seconds;
    # background compiles (the adaptive engine's new verify steps) ran beside the rollout, which did not wait for them.
    out["steady_sum"] = {
        k: sum(r.get(k) or 0.0 for r in steady) for k in (*PHASES, "rollout/compile_s", "rollout/background_compile_s")
    }
    s = out["steady_median"]
    total = s["time/step_s"] or 1.0
    out["steady_share"] = {
        "rollout": s["time/rollout_s"] / total,
        "rollout_tail": s["time/tail_s"] / total,
        "logprob": s["time/logprob_s"] / total,
        "reward": s["time/reward_s"] / total,
        "update": s["time/train_s"] / total,
    }
    out["rollout_tail_share"] = med("rollout/tail_share", steady)
    out["rollout_tokens_per_s"] = med("rollout/tokens_per_s", steady)
    out["response_len_p50_p90_max"] = [
        med(k, steady) for k in ("response/len_p50", "response/len_p90", "response/len_max")
    ]
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


def bench(name: str, steps: int, mode: str, arms: str = ADAPTIVE_ARMS, drafter: str = SHIPPED,
          static_tree: str = "5x1x6", extra: dict | None = None) -> dict:
    from tlt_jax.main import run
    from tlt_jax.metrics import read_metrics

    overrides = {
        **OVERRIDES.get(name, {}),
        **mode_overrides(mode, arms, drafter, static_tree),
        "train.num_steps": steps,
        "metrics.progress_bars": False,
        "eval.at_start": False,
        **(extra or {}),
    }
    cfg = load_config(name, overrides)
    with tempfile.TemporaryDirectory() as workdir:
        t0 = time.perf_counter()
        final = run(cfg, workdir)
        wall = time.perf_counter() - t0
        rows = [r for r in read_metrics(workdir) if r["kind"] == "train"]
    res = summarise(rows)
    res.update(
        config=f"configs/{name}.py",
        overrides=overrides,
        steps=steps,
        prompts_x_samples=[cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt],
        max_new_tokens=cfg.rollout.max_new_tokens,
        wall_s_including_setup_and_final_eval=wall,
        final_eval_s=final.get("eval/seconds"),
        speculative=mode,
        accept_length_per_step=[r.get("rollout/accept_length") for r in rows],
        reward_per_step=[r.get("reward/mean") for r in rows],
        per_step=[
            {k: r.get(k) for k in (*PHASES, *STEP_EXTRAS)} for r in rows
        ],
    )
    return res


STEP_EXTRAS = ("rollout/tail_share", "rollout/compile_s", "rollout/background_compile_s", "rollout/tokens",
               "rollout/accept_length", "drafter/steps", "drafter/top1", "controller/train_s", "reward/mean",
               "reward/accuracy", "response/len_max")


def repeat_record(res: dict) -> dict:
    """What one repeat of a mode keeps: its sums over the steady steps and each step's rollout seconds."""
    return {
        "steady_sum": res["steady_sum"],
        "rollout_s_per_step": [r["time/rollout_s"] for r in res["per_step"]],
        "compile_s_per_step": [r["rollout/compile_s"] or 0.0 for r in res["per_step"]],
        "background_compile_s_per_step": [r.get("rollout/background_compile_s") or 0.0 for r in res["per_step"]],
        "accept_length_per_step": res["accept_length_per_step"],
        "wall_s_including_setup_and_final_eval": res["wall_s_including_setup_and_final_eval"],
    }


def compare_to_off(off: list[dict], runs: list[dict]) -> dict:
    """Steady-step ratios of a mode against "off": per repeat (the two ran next to each other) and from each step's
    fastest rollout over the repeats (every repeat decodes the same tokens, so machine noise mostly adds seconds)."""
    def sums(res):
        s = res["steady_sum"]
        return s["time/step_s"], s["time/rollout_s"], s["time/rollout_s"] - s["rollout/compile_s"]

    def fastest(rs, compile_too):
        steps = [r["per_step"][1:] for r in rs]  # steady steps
        return sum(min(r[i]["time/rollout_s"] - (0.0 if compile_too else (r[i]["rollout/compile_s"] or 0.0))
                       for r in steps) for i in range(len(steps[0])))

    pairs = [(sums(o), sums(r)) for o, r in zip(off, runs, strict=True)]
    step = [o[0] / r[0] for o, r in pairs]
    roll = [o[1] / r[1] for o, r in pairs]
    roll_nc = [o[2] / r[2] for o, r in pairs]
    return {
        "steady_step_speedup_vs_off": step[0],
        "steady_rollout_speedup_vs_off": roll[0],
        "steady_rollout_speedup_vs_off_without_compile": roll_nc[0],
        "paired_step_speedup_vs_off": step,
        "paired_rollout_speedup_vs_off": roll,
        "paired_rollout_speedup_vs_off_without_compile": roll_nc,
        "paired_rollout_speedup_vs_off_median": statistics.median(roll),
        "min_rollout_speedup_vs_off": fastest(off, True) / fastest(runs, True),
        "min_rollout_speedup_vs_off_without_compile": fastest(off, False) / fastest(runs, False),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny,gsm8k")
    ap.add_argument("--steps", type=int, default=0, help="steps per config (0: tiny 20, gsm8k 2)")
    ap.add_argument("--modes", default="off,ngram", help="decoding modes: off,ngram,static,adaptive,tlt,config")
    ap.add_argument("--spec_arms", default=ADAPTIVE_ARMS, help="arms of modes adaptive / tlt (off,eagle:DxKxN,...)")
    ap.add_argument("--drafter", default=SHIPPED, help="EAGLE drafter of static / adaptive / tlt (name or dir)")
    ap.add_argument("--static_tree", default="5x1x6", help="tree of mode static (depth x topk x verify tokens)")
    ap.add_argument("--set", action="append", default=[], help="extra config override KEY=VALUE (repeatable)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every mode this many times, alternating the order, and pair the ratios per repeat")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")

    import jax

    from tlt_jax.main import _enable_compilation_cache

    _enable_compilation_cache()
    results = {
        "benchmark": "e2e_step",
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "devices": jax.device_count(),
            "device_kind": jax.devices()[0].device_kind,
        },
        "configs": {},
    }
    extra = {}
    for kv in args.set:
        key, value = kv.split("=", 1)
        try:
            extra[key] = json.loads(value)  # numbers, true / false
        except json.JSONDecodeError:
            extra[key] = value
    results["extra_overrides"] = extra
    for name in args.configs.split(","):
        modes_list = args.modes.split(",")
        runs: dict[str, list[dict]] = {m: [] for m in modes_list}
        for rep in range(args.repeats):
            # Alternate the order (A B, B A, ...) so a drift in the machine's speed lands on both sides.
            for mode in modes_list if rep % 2 == 0 else modes_list[::-1]:
                res = bench(name, args.steps or DEFAULT_STEPS.get(name, 2), mode, args.spec_arms, args.drafter,
                            args.static_tree, extra)
                runs[mode].append(res)
                s, ss = res["steady_median"], res["steady_sum"]
                print(
                    f"{name} (SD {mode}, repeat {rep + 1}/{args.repeats}): steady step {s['time/step_s']:.2f} s = "
                    f"rollout {s['time/rollout_s']:.2f} (tail {s['time/tail_s']:.2f}) + logprob "
                    f"{s['time/logprob_s']:.2f} + reward {s['time/reward_s']:.2f} + update {s['time/train_s']:.2f}; "
                    f"first step {res['first_step']['time/step_s']:.2f} s; steady rollout sum "
                    f"{ss['time/rollout_s']:.2f} s (compile {ss['rollout/compile_s']:.2f}, in the background "
                    f"{ss['rollout/background_compile_s']:.2f}); "
                    f"{res['rollout_tokens_per_s']:.1f} rollout tok/s; accept lengths {res['accept_length_per_step']}",
                    flush=True,
                )
        modes = results["configs"].setdefault(name, {})
        for mode, rs in runs.items():
            modes[mode] = {**rs[0], "repeats": [repeat_record(r) for r in rs]}
        rewards = {f"{m}#{i}": r["reward_per_step"] for m, rs in runs.items() for i, r in enumerate(rs)}
        same = all(v == next(iter(rewards.values())) for v in rewards.values())
        modes["_rewards_identical_across_modes"] = same
        if "off" in runs:
            for mode, rs in runs.items():
                modes[mode].update(compare_to_off(runs["off"], rs))
                if mode != "off":
                    c = modes[mode]
                    print(
                        f"{name}: {mode} vs off, steady rollout: paired per repeat "
                        f"{[round(x, 3) for x in c['paired_rollout_speedup_vs_off']]} (median "
                        f"{c['paired_rollout_speedup_vs_off_median']:.3f}; without compile "
                        f"{[round(x, 3) for x in c['paired_rollout_speedup_vs_off_without_compile']]}); "
                        f"per-step fastest over repeats {c['min_rollout_speedup_vs_off']:.3f} (without compile "
                        f"{c['min_rollout_speedup_vs_off_without_compile']:.3f})",
                        flush=True,
                    )
        print(f"{name}: rewards identical across modes: {same}", flush=True)
        if not same:
            raise AssertionError(f"{name}: the modes sampled different rewards per step: {rewards}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
