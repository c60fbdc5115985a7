"""End-to-end RL step time breakdown: rollout (and its tail), log-prob recomputation, reward, policy update.

Runs the main job (``tlt_jax.main.run``) on each config for a few steps in a scratch workdir and reads back the
per-step metrics it records. Step 1 includes XLA compiles (persistent compilation cache on, so a second invocation is
closer to steady state); steps >= 2 are reported as steady state. Each config runs with speculative decoding off and
on (``rollout.speculative=ngram``: the model-free n-gram drafter, tree decoding once a wave has <= 32 live rows; an
EAGLE drafter is ``rollout.speculative=eagle`` with ``rollout.drafter_path``); the mean accept length is then in each
step's row.

    python benchmarks/e2e_step.py                              # tiny (20 steps) and gsm8k (2 steps), SD off and on
    python benchmarks/e2e_step.py --configs tiny --steps 10 --modes off
    python benchmarks/e2e_step.py --configs gsm8k --modes off,adaptive   # the bandit over --spec_arms
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
# Keep the benchmark about the training step: a small final evaluation.
OVERRIDES = {"gsm8k": {"data.eval_size": 4, "eval.batch_size": 4}, "tiny": {}}


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


ADAPTIVE_ARMS = "off,ngram:4x1x5"  # mode "adaptive": the bandit's arms (--spec_arms)


def bench(name: str, steps: int, mode: str, arms: str = ADAPTIVE_ARMS) -> dict:
    from tlt_jax.main import run
    from tlt_jax.metrics import read_metrics

    overrides = {
        **OVERRIDES.get(name, {}),
        "rollout.speculative": mode,
        "train.num_steps": steps,
        "metrics.progress_bars": False,
        "eval.at_start": False,
    }
    if mode == "adaptive":
        overrides["rollout.spec_arms"] = arms
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
            {k: r.get(k) for k in (*PHASES, "rollout/tail_share", "rollout/compile_s", "rollout/tokens")} for r in rows
        ],
    )
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny,gsm8k")
    ap.add_argument("--steps", type=int, default=0, help="steps per config (0: tiny 20, gsm8k 2)")
    ap.add_argument("--modes", default="off,ngram", help="speculative decoding modes to run")
    ap.add_argument("--spec_arms", default=ADAPTIVE_ARMS, help="arms of mode 'adaptive' (off,ngram:DxKxN,...)")
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
    for name in args.configs.split(","):
        for mode in args.modes.split(","):
            res = bench(name, args.steps or DEFAULT_STEPS.get(name, 2), mode, args.spec_arms)
            results["configs"].setdefault(name, {})[mode] = res
            s = res["steady_median"]
            print(
                f"{name} (SD {mode}): steady step {s['time/step_s']:.2f} s = rollout {s['time/rollout_s']:.2f} "
                f"(tail {s['time/tail_s']:.2f}) + logprob {s['time/logprob_s']:.2f} + reward {s['time/reward_s']:.2f} "
                f"+ update {s['time/train_s']:.2f}; first step {res['first_step']['time/step_s']:.2f} s; "
                f"{res['rollout_tokens_per_s']:.1f} rollout tok/s; accept lengths {res['accept_length_per_step']}",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
