"""Drafter work on the RL step's critical path with several rollout slices (issue 43's preemption goal).

Runs the main job on configs/tiny_tlt.py (two slices, long-tailed answers, a fresh EAGLE drafter trained only while
some slice still decodes, no drafter steps after the rollout) in one process, and with ``--processes 2`` as two
``jax.distributed`` processes on this machine (launch/local.sh, one slice per process). Per RL step it reports
``drafter/critical_s`` (what drafter work added after the last slice anywhere finished: the drafter step or held-out
scoring in flight, which ``controller/overhang_s`` measures alone, then the replicas' average and publishing; work not
yet started is dropped) against the run's mean drafter step (``drafter/step_s``, weighted by the steps), the drafter
steps each slice got, and the accept length of every step. ``--static`` adds a one-process run whose drafter does not
learn (``drafter.lr`` = 1e-12: Adam's steps of about 1e-12 leave the fresh drafter as it was), the baseline for the
accept length.

``--config`` / ``--set`` run another config the same way, e.g. the default run's SmolLM2 with two slices (about 20
minutes):

    python benchmarks/critical_path.py --steps 20 --processes 1,2 --static   # -> results/critical_path_tiny_tlt.json
    python benchmarks/critical_path.py --config configs/gsm8k.py --set rollout.num_slices=2 --set eval.every_steps=0 \
        --steps 6 --processes 1,2 --out benchmarks/results/critical_path_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "critical_path_tiny_tlt.json"


def run(processes: int, steps: int, workdir: Path, extra: tuple[str, ...] = (),
        config: Path = REPO / "configs" / "tiny_tlt.py") -> list[dict]:
    """The main job on ``config`` with ``processes`` processes (2 devices in all); its train rows of metrics.jsonl."""
    args = ["-m", "tlt_jax.main", f"--config={config}", f"--workdir={workdir}",
            f"--config.train.num_steps={steps}", "--config.eval.at_start=False", "--config.metrics.progress_bars=False",
            *extra]
    env = dict(os.environ)
    if processes == 1:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        cmd = [sys.executable, *args]
    else:
        cmd = [str(REPO / "launch" / "local.sh"), "-n", str(processes), "-d", str(2 // processes), "--",
               sys.executable, *args]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "train"]


def summary(rows: list[dict]) -> dict:
    crit = [r["drafter/critical_s"] for r in rows]
    in_flight = [r["controller/overhang_s"] for r in rows]  # the latest end, over the processes, of their work
    steps = sum(r["drafter/steps"] for r in rows)
    # the mean drafter step (wall seconds on its slice's thread); the slices' training time per step also holds the
    # held-out scorings and dropped steps
    step_s = sum(r["drafter/step_s"] * r["drafter/steps"] for r in rows if r["drafter/steps"]) / steps if steps else 0
    training_s = sum(r["controller/train_s"] for r in rows) / steps if steps else None
    slices = sorted(k for k in rows[0] if k.startswith("controller/train_steps/slice_"))
    return dict(
        critical_s=crit,
        critical_s_median=statistics.median(crit),
        critical_s_after_step_1_max=max(crit[1:]) if len(crit) > 1 else None,
        in_flight_s_median=statistics.median(in_flight),  # the drafter work in flight at the rollout's end
        beyond_in_flight_s_median=statistics.median(c - f for c, f in zip(crit, in_flight, strict=True)),
        # preemption's own bound: the work in flight at the rollout's end (any process) within one mean drafter step
        rl_steps_in_flight_within_one_step=sum(f <= step_s for f in in_flight) if steps else None,
        drafter_step_s=step_s,
        # each RL step's own mean drafter step (the step in flight itself where the RL step ran one), and how often the
        # work in flight / the whole critical path stayed within it
        drafter_step_s_per_rl_step=[r["drafter/step_s"] for r in rows],
        rl_steps_in_flight_within_own_step=sum(f <= r["drafter/step_s"] for f, r in zip(in_flight, rows, strict=True)
                                               if r["drafter/steps"]),
        rl_steps_critical_within_own_step=sum(c <= r["drafter/step_s"] for c, r in zip(crit, rows, strict=True)
                                              if r["drafter/steps"]),
        training_s_per_drafter_step=training_s,
        rl_steps_without_drafter_steps=sum(r["drafter/steps"] == 0 for r in rows),
        drafter_steps=[r["drafter/steps"] for r in rows],
        drafter_steps_per_slice={k.rsplit("_", 1)[1]: sum(r[k] for r in rows) for k in slices},
        accept_length=[r["rollout/accept_length"] for r in rows],
        accept_length_first_last_4=[statistics.mean(r["rollout/accept_length"] for r in rows[:4]),
                                    statistics.mean(r["rollout/accept_length"] for r in rows[-4:])],
        drafter_heldout_top1=[r["drafter/top1"] for r in rows],
        reward_mean=[r["reward/mean"] for r in rows],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--processes", default="1,2", help="comma list: 1 (2 slices in one process) and/or 2")
    ap.add_argument("--static", action="store_true", help="also a one-process run whose drafter does not learn")
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny_tlt.py"), help="the main job's config file")
    ap.add_argument("--set", action="append", default=[], help="a config override KEY=VALUE (repeatable)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    sets = tuple(f"--config.{kv}" for kv in args.set)
    out = {"command": "python benchmarks/critical_path.py " + " ".join(sys.argv[1:]), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for p in (int(x) for x in args.processes.split(",")):
            out["runs"][f"{p}_process"] = s = summary(run(p, args.steps, Path(tmp) / f"p{p}", sets, Path(args.config)))
            print(f"{p} process(es): critical path median {s['critical_s_median']:.3f} s per RL step (after step 1 "
                  f"at most {s['critical_s_after_step_1_max']:.3f} s; in flight {s['in_flight_s_median']:.3f} s, the "
                  f"rest {s['beyond_in_flight_s_median']:.3f} s); one drafter step {s['drafter_step_s']:.3f} s "
                  f"(in flight within it at {s['rl_steps_in_flight_within_one_step']} of {args.steps} RL steps); "
                  f"drafter steps per slice {s['drafter_steps_per_slice']}; accept length first / last 4 steps "
                  f"{s['accept_length_first_last_4']}")
        if args.static:
            rows = run(1, args.steps, Path(tmp) / "static", (*sets, "--config.drafter.lr=1e-12"), Path(args.config))
            out["runs"]["1_process_static"] = s = {
                "accept_length": [r["rollout/accept_length"] for r in rows],
                "accept_length_first_last_4": [statistics.mean(r["rollout/accept_length"] for r in rows[:4]),
                                               statistics.mean(r["rollout/accept_length"] for r in rows[-4:])],
                "reward_mean": [r["reward/mean"] for r in rows]}
            print(f"static drafter: accept length first / last 4 steps {s['accept_length_first_last_4']}")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
