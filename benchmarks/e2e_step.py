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

    python benchmarks/e2e_step.py --configs gsm8k --modes off,static,tlt --steps 6   # the default run's table
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
    # the same steps; compile seconds (new batch / length / arm shapes met mid-run) are inside the rollout seconds.
    out["steady_sum"] = {k: sum(r.get(k) or 0.0 for r in steady) for k in (*PHASES, "rollout/compile_s")}
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


STEP_EXTRAS = ("rollout/tail_share", "rollout/compile_s", "rollout/tokens", "rollout/accept_length", "drafter/steps",
               "drafter/top1", "controller/train_s", "reward/mean", "reward/accuracy", "response/len_max")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny,gsm8k")
    ap.add_argument("--steps", type=int, default=0, help="steps per config (0: tiny 20, gsm8k 2)")
    ap.add_argument("--modes", default="off,ngram", help="decoding modes: off,ngram,static,adaptive,tlt,config")
    ap.add_argument("--spec_arms", default=ADAPTIVE_ARMS, help="arms of modes adaptive / tlt (off,eagle:DxKxN,...)")
    ap.add_argument("--drafter", default=SHIPPED, help="EAGLE drafter of static / adaptive / tlt (name or dir)")
    ap.add_argument("--static_tree", default="5x1x6", help="tree of mode static (depth x topk x verify tokens)")
    ap.add_argument("--set", action="append", default=[], help="extra config override KEY=VALUE (repeatable)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

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
        for mode in args.modes.split(","):
            res = bench(name, args.steps or DEFAULT_STEPS.get(name, 2), mode, args.spec_arms, args.drafter,
                        args.static_tree, extra)
            results["configs"].setdefault(name, {})[mode] = res
            s = res["steady_median"]
            print(
                f"{name} (SD {mode}): steady step {s['time/step_s']:.2f} s = rollout {s['time/rollout_s']:.2f} "
                f"(tail {s['time/tail_s']:.2f}) + logprob {s['time/logprob_s']:.2f} + reward {s['time/reward_s']:.2f} "
                f"+ update {s['time/train_s']:.2f}; first step {res['first_step']['time/step_s']:.2f} s; "
                f"{res['rollout_tokens_per_s']:.1f} rollout tok/s; accept lengths {res['accept_length_per_step']}",
                flush=True,
            )
        modes = results["configs"][name]
        rewards = {m: r["reward_per_step"] for m, r in modes.items()}
        same = all(v == next(iter(rewards.values())) for v in rewards.values())
        results["configs"][name]["_rewards_identical_across_modes"] = same
        if "off" in modes:
            base = modes["off"]["steady_sum"]
            for r in modes.values():
                if isinstance(r, dict) and "steady_sum" in r:
                    s = r["steady_sum"]
                    r["steady_step_speedup_vs_off"] = base["time/step_s"] / s["time/step_s"]
                    r["steady_rollout_speedup_vs_off"] = base["time/rollout_s"] / s["time/rollout_s"]
                    r["steady_rollout_speedup_vs_off_without_compile"] = (
                        (base["time/rollout_s"] - base["rollout/compile_s"])
                        / (s["time/rollout_s"] - s["rollout/compile_s"]))
        print(f"{name}: rewards identical across modes: {same}", flush=True)
        if not same:
            raise AssertionError(f"{name}: the modes sampled different rewards per step: {rewards}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
