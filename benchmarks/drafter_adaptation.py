"""Static vs adaptive EAGLE drafter while the policy learns (TLT's adaptive drafter; issues 16 and 60).

Runs the main job on configs/gsm8k.py (SmolLM2) from the shipped drafter once per --modes entry: ``static``,
``adaptive`` (trained online on --slices slices), ``adaptive_hot`` (``drafter.hot_swap``), all decoding with one tree
(--tree), so accept lengths compare like for like on the same samples (checked per step). Output: per mode and step
accept length, reward, drafter work and idle time, held-out evaluations; ``summary`` (issue 60): the first trained
mode's accept over static's in the second half and at the final held-out evaluation, held-out accuracy at the start
and end, drafter steps per slice; the trained run's timeline.png beside the JSON. Spot training only, 2 slices:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/drafter_adaptation.py --steps 60 \
        --drafter_lr 3e-4 --steps_without_idle 0 --slices 2 --eval_every 20 --checkpoint_every 10 \
        --out benchmarks/results/drafter_adaptation_2slices_60.json
"""

from __future__ import annotations

import argparse
import json
import shutil
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
# per mode and RL step: these metrics (drafter/step_s: the step's mean drafter step; drafter/critical_s: drafter work
# on the RL step's path)
SERIES = {"accept_length": "rollout/accept_length", "reward_mean": "reward/mean", "step_s": "time/step_s",
          "rollout_s": "time/rollout_s", "drafter_step_s": "drafter/step_s", "critical_s": "drafter/critical_s",
          "drafter_heldout_top1": "drafter/top1", "hot_swaps": "controller/hot_swaps", "idle_s": "controller/idle_s",
          "overhang_s": "controller/overhang_s", "tail_s": "time/tail_s", "kl_to_start": "train/kl_loss"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5, help="policy learning rate (high: the policy drifts)")
    ap.add_argument("--drafter_lr", type=float, default=2e-4, help="1e-3 erased part of the warm-up in its first steps")
    ap.add_argument("--slices", type=int, default=1, help="rollout.num_slices (needs that many devices)")
    ap.add_argument("--steps_without_idle", type=int, default=4)
    ap.add_argument("--tree", default="5x1x6", help="EAGLE tree of both runs (depth x topk x verify tokens)")
    ap.add_argument("--max_new_tokens", type=int, default=256)
    ap.add_argument("--kl_coef", type=float, default=1e-3, help="rl.kl_coef (> 0: train/kl_loss measures the drift)")
    ap.add_argument("--modes", default="static,adaptive", help="static, adaptive, adaptive_hot (--slices >= 2)")
    ap.add_argument("--eval_every", type=int, default=0, help="held-out greedy evaluation at the start and every N "
                    "steps (0: the final one only); summary.accuracy_start needs it")
    ap.add_argument("--checkpoint_every", type=int, default=1000, help="checkpoint.every_steps (a killed run resumes)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--workdir", default=None,
                    help="default: a fresh temporary directory; an earlier run's resumes each mode from its last "
                    "checkpoint (a larger --steps continues the runs; wall_s then counts only the new steps)")
    args = ap.parse_args()

    from tlt_jax.main import _enable_compilation_cache, run
    from tlt_jax.metrics import read_metrics

    _enable_compilation_cache()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="drafter_adaptation-"))
    depth, topk, verify = (int(x) for x in args.tree.split("x"))
    common = {"train.num_steps": args.steps, "optim.lr": args.lr, "optim.warmup_steps": 0,
              "rollout.max_new_tokens": args.max_new_tokens, "rollout.speculative": "eagle", "rollout.spec_arms": "",
              "rollout.spec_depth": depth, "rollout.spec_topk": topk, "rollout.spec_verify_tokens": verify,
              "rollout.drafter_path": str(DRAFTER), "rl.kl_coef": args.kl_coef, "eval.every_steps": args.eval_every,
              "eval.at_start": args.eval_every > 0, "checkpoint.every_steps": args.checkpoint_every,
              "metrics.progress_bars": False,
              "metrics.tensorboard": False}
    online = {"drafter.online": True, "drafter.lr": args.drafter_lr,
              "drafter.steps_without_idle": args.steps_without_idle}
    known = {"static": {"drafter.online": False}, "adaptive": online,
             "adaptive_hot": {**online, "drafter.hot_swap": True}}
    names = args.modes.split(",")
    if "static" not in names or any(n not in known for n in names):
        raise SystemExit(f"--modes: a comma list of {sorted(known)} including static, got {args.modes!r}")
    modes = {n: {**known[n], "rollout.num_slices": args.slices} for n in names}
    out: dict = {"args": vars(args), "modes": {}}
    for name, extra in modes.items():
        t0 = time.perf_counter()
        cfg = load_config("gsm8k", {**common, **extra})
        run(cfg, str(root / name))
        every = read_metrics(str(root / name))
        rows = [r for r in every if r["kind"] == "train"]
        final = [r for r in every if r["kind"] == "final"][-1:]  # the held-out greedy evaluation at the end
        out["modes"][name] = {
            **{k: [r.get(key) for r in rows] for k, key in SERIES.items()},
            **{k: [r.get(key, 0.0) for r in rows] for k, key in (("drafter_train_s", "controller/train_s"),
                                                                  ("drafter_steps", "drafter/steps"))},
            "drafter_steps_per_slice": [[r.get(f"controller/train_steps/slice_{k}", 0.0) for k in range(args.slices)]
                                        for r in rows],
            "final_eval": {k: final[0].get(f"eval/{k}") for k in ("accuracy", "accept_length")} if final else None,
            "heldout_accuracy": {r["step"]: r["eval/accuracy"] for r in every if "eval/accuracy" in r},
            "wall_s": time.perf_counter() - t0,
        }
    s = out["modes"]["static"]
    half = len(s["accept_length"]) // 2  # after the drift: the second half of the run
    # Same samples: per step, every run's response lengths (lengths.jsonl) and rewards. The fp32 logits differ in the
    # last bits between verify-tree and plain-step shapes: a near-tie can flip a sample (greedy runs stay identical).
    lengths = {n: [json.loads(x)["lengths"] for x in (root / n / "lengths.jsonl").read_text().splitlines()]
               for n in names}
    out["steps_with_other_samples"] = [
        k + 1 for k in range(len(s["reward_mean"])) if any(
            lengths[n][k] != lengths["static"][k] or m["reward_mean"][k] != s["reward_mean"][k]
            for n, m in out["modes"].items())]
    out["same_rollouts"] = not out["steps_with_other_samples"]
    for name, m in out["modes"].items():
        if name != "static":
            m["ratio_last"] = m["accept_length"][-1] / s["accept_length"][-1]
            m["ratio_second_half"] = sum(m["accept_length"][half:]) / sum(s["accept_length"][half:])
            # one drafter step's seconds (the run's mean) against what drafter work added after each rollout; the
            # slices' training time per step also holds the held-out scorings and dropped steps
            steps_run = sum(m["drafter_steps"])
            m["training_s_per_drafter_step"] = sum(m["drafter_train_s"]) / steps_run if steps_run else None
            m["drafter_step_s"] = sum(t * n for t, n in zip(m.pop("drafter_step_s"), m["drafter_steps"], strict=True)
                                      if n) / steps_run if steps_run else None
            crit = sorted(c for c in m["critical_s"] if c is not None)
            m["critical_s_median"] = crit[len(crit) // 2] if crit else None
            if (m["final_eval"] or {}).get("accept_length") and (s["final_eval"] or {}).get("accept_length"):
                m["ratio_final_eval"] = m["final_eval"]["accept_length"] / s["final_eval"]["accept_length"]
    trained = [n for n in names if n != "static"]
    if trained:  # issue 60's figures, for the first trained mode
        m, acc = out["modes"][trained[0]], s["heldout_accuracy"]
        out["summary"] = {"mode": trained[0], "second_half_ratio": m["ratio_second_half"],
                          "heldout_ratio": m.get("ratio_final_eval"), "accuracy_start": acc.get(0),
                          "accuracy_end": (s["final_eval"] or {}).get("accuracy"),
                          "drafter_steps_per_slice": [sum(c) for c in zip(*m["drafter_steps_per_slice"], strict=True)]}
        png = root / trained[-1] / "plots" / "timeline.png"  # one step's slices busy / idle / training
        if png.exists():
            out["timeline_png"] = str(Path(args.out).with_suffix(".timeline.png"))
            shutil.copyfile(png, out["timeline_png"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for k in range(len(s["accept_length"])):
        cells = "  ".join(f"{n} {m['accept_length'][k]:.2f}" for n, m in out["modes"].items())
        kl = s["kl_to_start"][k]
        print(f"step {k + 1}: accept {cells}  reward {s['reward_mean'][k]:.3f}"
              + (f"  KL to start {kl:.4f}" if kl is not None else ""))
    for n in trained:
        m = out["modes"][n]
        fmt = {k: "n/a" if m.get(k) is None else f"{m[k]:.3g}" for k in ("critical_s_median", "drafter_step_s",
                                                                            "ratio_final_eval")}
        print(f"{n}: drafter steps per slice {[sum(c) for c in zip(*m['drafter_steps_per_slice'], strict=True)]}, "
              f"{sum(m['drafter_train_s']):.1f} s; on the critical path, median {fmt['critical_s_median']} s per RL "
              f"step; one drafter step {fmt['drafter_step_s']} s; / static accept: last step {m['ratio_last']:.2f}, "
              f"second half {m['ratio_second_half']:.2f}, held-out (final greedy evaluation) {fmt['ratio_final_eval']}")
    print("summary:", json.dumps(out.get("summary")))
    print(f"same rollouts: {out['same_rollouts']} (steps whose samples differ between runs: "
          f"{out['steps_with_other_samples'] or 'none'}); {args.out}")


if __name__ == "__main__":
    main()
