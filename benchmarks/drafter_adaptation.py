"""Static vs adaptive EAGLE drafter while the policy drifts (TLT's adaptive drafter, issue 16).

Runs the main job twice on configs/gsm8k.py (SmolLM2-135M-Instruct) from the committed warmed-up drafter (shipped
in the package: rollout.drafter_path="eagle-smollm2-gsm"), with a policy learning rate high enough that the policy
drifts away from
what the drafter was warmed up on: once with the drafter fixed (``drafter.online=False``) and once training it online
(``drafter.online=True``, ``rollout.num_slices`` slices). Speculative decoding is lossless, so both runs sample the
same tokens (checked: identical rewards per step) and the accept lengths compare on the same rollouts. Writes
benchmarks/results/drafter_adaptation.json and the adaptive run's plots (timeline.png: one step's slices busy /
idle / training) under the adaptive run's workdir.

    python benchmarks/drafter_adaptation.py --steps 6 --lr 1e-4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from e2e_step import load_config  # noqa: E402

from tlt_jax.assets import EMBEDDED_DRAFTER, resolve_drafter_path  # noqa: E402

DRAFTER = resolve_drafter_path(EMBEDDED_DRAFTER)
RESULTS = REPO / "benchmarks" / "results" / "drafter_adaptation.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-4, help="policy learning rate (high: the policy drifts)")
    ap.add_argument("--drafter_lr", type=float, default=3e-4)
    ap.add_argument("--slices", type=int, default=1, help="rollout.num_slices (needs that many devices)")
    ap.add_argument("--steps_without_idle", type=int, default=8)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--workdir", default=None, help="default: a fresh temporary directory")
    args = ap.parse_args()

    from tlt_jax.main import _enable_compilation_cache, run
    from tlt_jax.metrics import read_metrics

    _enable_compilation_cache()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="drafter_adaptation-"))
    common = {
        "train.num_steps": args.steps,
        "optim.lr": args.lr,
        "optim.warmup_steps": 0,
        "rollout.max_new_tokens": args.max_new_tokens,
        "rollout.speculative": "eagle",
        "rollout.drafter_path": str(DRAFTER),
        "data.eval_size": 4,
        "eval.batch_size": 4,
        "checkpoint.every_steps": 1000,
        "metrics.progress_bars": False,
        "metrics.tensorboard": False,
    }
    modes = {
        "static": {},
        "adaptive": {
            "drafter.online": True,
            "drafter.lr": args.drafter_lr,
            "drafter.steps_without_idle": args.steps_without_idle,
            "rollout.num_slices": args.slices,
            "drafter.rows": 1,
        },
    }
    out: dict = {"args": vars(args), "modes": {}}
    for name, extra in modes.items():
        t0 = time.perf_counter()
        cfg = load_config("gsm8k", {**common, **extra})
        run(cfg, str(root / name))
        rows = [r for r in read_metrics(str(root / name)) if r["kind"] == "train"]
        out["modes"][name] = {
            "accept_length": [r["rollout/accept_length"] for r in rows],
            "reward_mean": [r["reward/mean"] for r in rows],
            "step_s": [r["time/step_s"] for r in rows],
            "rollout_s": [r["time/rollout_s"] for r in rows],
            "drafter_train_s": [r.get("controller/train_s", 0.0) for r in rows],
            "drafter_steps": [r.get("drafter/steps", 0.0) for r in rows],
            "wall_s": time.perf_counter() - t0,
        }
    s, a = out["modes"]["static"], out["modes"]["adaptive"]
    out["same_rollouts"] = s["reward_mean"] == a["reward_mean"]
    out["ratio_last"] = a["accept_length"][-1] / s["accept_length"][-1]
    out["plots"] = os.path.join(root, "adaptive", "plots")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    for k in range(len(s["accept_length"])):
        print(f"step {k + 1}: accept static {s['accept_length'][k]:.2f} adaptive {a['accept_length'][k]:.2f}  "
              f"reward {s['reward_mean'][k]:.3f} / {a['reward_mean'][k]:.3f}  "
              f"drafter {a['drafter_steps'][k]:.0f} steps {a['drafter_train_s'][k]:.1f} s of {a['step_s'][k]:.1f} s")
    print(f"same rollouts: {out['same_rollouts']}; last-step ratio {out['ratio_last']:.2f}; plots {out['plots']}")


if __name__ == "__main__":
    main()
