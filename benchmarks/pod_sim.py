"""Pod model of one RL step: the CPU validation of the rollout model and its projection to H100 pods.

The model (``pod_sim_model``) replays ``RolloutEngine``'s host loop on per-request lengths. Here it is checked against
the engine on this machine (``pod_sim_measure``: per-call costs measured on the engine's own compiled steps, then a
real ``generate`` of ``rollout_tail.py``'s long-tail workload) and projected to GPU pods (``pod_sim_roofline``: roofline
step costs for Qwen2.5-7B / 32B on H100; the pod spreads one step's responses over devices / tp engines, takes the
slowest engine as the rollout time, adds the policy's log-prob and update passes, and counts the device-seconds the
other engines wait: TLT trains the drafter there, and the drafter's staleness sets its acceptance).

Imports run one way: ``pod_sim`` (this command line) -> ``pod_sim_measure`` / ``pod_sim_gpu`` (GPU-measured costs,
on ``pod_sim_roofline``) / ``pod_sim_roofline`` -> ``pod_sim_model``; nothing imports this file.

    python benchmarks/pod_sim.py                    # CPU validation (tiny, SmolLM2, speculative) + projections
    python benchmarks/pod_sim.py --models= --spec=0  # projections only (minutes); both write results/pod_sim.json
    python benchmarks/pod_sim.py --step_costs       # one verify step against one plain step per engine call, printed
    python benchmarks/pod_sim.py --gpu_costs=PATH [--gpu_run=results/gpu/tlt_smollm2.json] [--gpu_project]
        # GPU-measured step costs (format: pod_sim_gpu.py) -> results/gpu/pod_sim_gpu.json (CPU parts not run)
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pod_sim_roofline as rf
from pod_sim_model import Arm, Staleness

PAPER_TABLE4_64 = {1: 3.62, 2: 3.38, 4: 2.98, 8: 2.27, 16: 1.91, 32: 1.70}  # Qwen-32B, TP 4, 64 verify tokens
PAPER_NODES = {"Qwen2.5-7B": {8: 1.21, 16: 1.45, 32: 1.62, 64: 1.76}, "Qwen2.5-32B": {32: 1.83, 64: 2.12}}


def _print_projection(rows: list[dict]) -> None:
    print(
        "| model | devices (engines) | max batch | plain rollout / step s | static: accept, step x | TLT: accept, "
        "rollout x, step x | idle device-s (TLT) | drafter demand device-s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        p, s, t = r["plain"], r["static"], r["tlt"]
        print(
            f"| {r['model']} | {r['devices']} ({r['engines']}) | {p['max_batch']:.0f} | {p['rollout_s']:.0f} / "
            f"{p['step_s']:.0f} | {s['accept']:.2f}, {s['step_speedup']:.2f}x | {t['accept']:.2f}, "
            f"{t['rollout_speedup']:.2f}x, {t['step_speedup']:.2f}x | {t['idle_device_s']:.0f} | "
            f"{r['drafter_demand_s']:.0f} |"
        )


def main(argv=None) -> int:
    import argparse
    import json
    import os
    import platform
    import time

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2", help="CPU validation models ('' to skip)")
    ap.add_argument("--rounds", type=int, default=3, help="validation rounds (calibrate, then a measured run)")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per cost key and round (median)")
    ap.add_argument(
        "--clock",
        default="cpu",
        choices=("cpu", "wall"),
        help="validation clock: process CPU seconds (robust to other users' load on a shared machine) or wall seconds",
    )
    ap.add_argument("--spec", type=int, default=1, help="also validate a speculative tail (SmolLM2 + EAGLE); 0 = skip")
    ap.add_argument("--step_costs", action="store_true", help="print the roofline's verify / plain step costs, exit")
    ap.add_argument(
        "--gpu_costs",
        default="",
        help="GPU-measured step costs (pod_sim_gpu.py's format or suite.json; "
        "PATH#KEY for a key of a file): predict and validate on them instead of the CPU parts",
    )
    ap.add_argument("--gpu_variant", default=None, help="with a suite.json: its decode variant (default the fastest)")
    ap.add_argument("--gpu_run", default="", help="a gpu_tlt.py result to validate the GPU costs against")
    ap.add_argument("--gpu_arm", default="5x1x6", help="tree of the speculative e2e modes in the validation")
    ap.add_argument("--gpu_project", action="store_true", help="also the 7B / 32B projection on fitted hardware")
    ap.add_argument("--out", default=None, help="default results/pod_sim.json (--gpu_costs: results/gpu/...)")
    args = ap.parse_args(argv)
    if args.step_costs:
        return _step_costs()
    if args.gpu_costs:
        return _gpu(args, sys.argv[1:] if argv is None else argv)
    args.out = args.out or str(Path(__file__).parent / "results" / "pod_sim.json")
    import jax

    jax.config.update("jax_compilation_cache_dir", str(Path(__file__).resolve().parents[1] / ".jax_cache"))
    results = dict(
        command="python benchmarks/pod_sim.py " + " ".join(sys.argv[1:] if argv is None else argv),
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), jax=jax.__version__),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        validation=[],
    )
    out = Path(args.out)
    if args.models:
        import pod_sim_measure as pm

        for name in args.models.split(","):
            results["validation"].append(pm.validate(name, rounds=args.rounds, reps=args.reps, cpu=args.clock == "cpu"))
            out.write_text(json.dumps(results, indent=1))
        if args.spec:
            results["validation_spec"] = pm.validate_spec(rounds=args.rounds - 1 or 1, reps=args.reps)
            out.write_text(json.dumps(results, indent=1))
    arm = Arm(depth=8, topk=4, verify_tokens=48, accept=6.53)  # TLT's default tree and threshold
    st = Staleness()
    setups = [(rf.QWEN25_7B, 4, 512), (rf.QWEN25_32B, 8, 2048)]
    results["projection"] = dict(
        hardware=dataclasses.asdict(rf.H100),
        tree=arm.name,
        threshold=32,
        staleness=dataclasses.asdict(st),
        run_steps=100,
        prompt_len=256,
        max_response=32768,
        lengths="rollout_tail.tail_lengths: log-normal, median max/8, sigma 1, longest at the max; seeds 0, 1, 2",
        rows=[],
    )
    for model, tp, responses in setups:
        rows = rf.projection_table(model, tp, responses, 32768, 256, arm=arm, staleness=st, run_steps=100)
        for r in rows:
            r["paper_step_speedup"] = PAPER_NODES.get(model.name, {}).get(r["devices"])
        results["projection"]["rows"] += rows
    results["sensitivity"] = rf.sensitivity(64, arm=arm, staleness=st, run_steps=100)
    results["paper_checks"] = dict(
        table2_7b_h100_bs1_plain_ms=dict(
            paper=1e3 / 164.65, model=1e3 * rf.Roofline(rf.QWEN25_7B, rf.H100, 1, 2048).policy(1, 1, 2048)
        ),
        table4_32b_tp4_64_tokens=[
            dict(batch=b, paper=v, model=rf.sd_speedup_check(rf.QWEN25_32B, 4, b, Arm(10, 4, 64, 8.29)))
            for b, v in PAPER_TABLE4_64.items()
        ],
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    for v in results["validation"]:
        print(
            f"validation {v['model']}: predicted {v['predicted_median_s']:.2f}s, measured {v['measured_median_s']:.2f}s"
            f" ({100 * v['error_of_medians']:+.1f}%)"
        )
    _print_projection(results["projection"]["rows"])
    for r in results["sensitivity"]:
        print(
            f"| {r['model']} | {r['variant']} | {r['plain_rollout_s']:.0f} | {r['static_step_speedup']:.2f}x | "
            f"{r['tlt_rollout_speedup']:.2f}x | {r['tlt_step_speedup']:.2f}x |"
        )
    print(json.dumps(results["paper_checks"], indent=1))
    print(f"wrote {out}")
    return 0


def _step_costs() -> int:
    """Batch 1, TLT's 8x4x48 tree at 6.53 tokens per verify: a verify step over a plain step as the engine calls
    them (4-step verify calls, 8-step plain chunks, a round trip each) and the decode speedup that leaves."""
    arm = Arm(depth=8, topk=4, verify_tokens=48, accept=6.53)
    print("| model | TP | cache positions | verify step / plain step | batch-1 decode speedup |")
    print("| --- | --- | --- | --- | --- |")
    for model, tp in ((rf.QWEN25_7B, 4), (rf.QWEN25_7B, 1), (rf.QWEN25_32B, 8)):
        for length in (2048, 8192, 32768):
            r = rf.verify_step_cost(model, tp, arm, length)
            print(f"| {model.name} | {tp} | {length} | {r['verify_over_plain']:.2f} | {r['speedup']:.2f}x |")
    return 0


def _gpu(args, argv) -> int:
    import json

    import pod_sim_gpu as pg

    costs = pg.load(args.gpu_costs, args.gpu_variant)
    run = json.loads(Path(args.gpu_run).read_text()) if args.gpu_run else None
    res = pg.report(costs, run, arm_name=args.gpu_arm, project=args.gpu_project, paper=PAPER_NODES)
    res["command"] = "python benchmarks/pod_sim.py " + " ".join(argv)
    out = Path(args.out or Path(__file__).parent / "results" / "gpu" / "pod_sim_gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    for r in res.get("sd_speedup", []):
        if "failed" not in r:
            print(
                f"T={r['temperature']} batch {r['batch']} {r['arm']}: predicted {r['predicted']:.2f}x, measured "
                f"{r['measured']:.2f}x ({100 * r['error']:+.1f} %)"
            )
    for mode, r in res.get("e2e_rollout", {}).items():
        if "failed" not in r:
            print(
                f"e2e {mode} rollouts: predicted {r['predicted']:.2f} s, measured {r['measured']:.2f} s "
                f"({100 * r['error']:+.1f} %, within +-{100 * r['tolerance']:.0f} %: {r['within']})"
            )
    proj = res.get("projection", {})
    if "error" in proj:
        print(proj["error"])
    elif proj:
        _print_projection(proj["rows"])
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
