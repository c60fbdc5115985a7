"""Controller benchmark: do mesh slices decode at the same time, and how much drafter training fits in the tail?

Workload: a tiny policy on 8 simulated CPU devices, prompts with heavy-tailed forced lengths (the longest ones on
the last slice, so the other slices finish early). Measured after a warm-up call (everything compiled):

- overlap: R = 2 sliced rollout, sum of the slices' generate wall times / the call's wall time (2.0 = perfect
  overlap, 1.0 = the slices ran one after the other), next to the R = 1 wall time of the same requests;
- controller: one RL step with the spot trainer: busy / idle / train seconds summed over slices, drafter steps run
  in the tail, and the overhang (time from the last shard's end to the step's end; at most one drafter step).

    python benchmarks/controller_step.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from tlt_jax.controller import Controller, ControllerConfig, SlicedRollout  # noqa: E402
from tlt_jax.distributed import MeshConfig, make_mesh  # noqa: E402
from tlt_jax.drafter import EagleDrafter  # noqa: E402
from tlt_jax.drafter.buffer import DrafterBuffer  # noqa: E402
from tlt_jax.drafter.spot import SpotTrainer  # noqa: E402
from tlt_jax.models import CausalLM, tiny_config  # noqa: E402
from tlt_jax.rollout import HiddenCapture, SamplingParams  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "controller_step.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max_new", type=int, default=96)
    args = ap.parse_args()
    cfg = tiny_config(hidden_size=128, intermediate_size=256, num_layers=4)
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    mesh = make_mesh(MeshConfig(data=8))
    kw = dict(max_batch=32, max_len=160, chunk_size=8, length_buckets=(64, 160), capture=HiddenCapture(window=32))
    prompts = [[(7 * i + k) % 250 + 2 for k in range(8)] for i in range(args.prompts)]
    # Heavy tail on the second half: the first slice's prompts are short.
    half = args.prompts // 2
    max_new = [args.max_new // 8] * half + [args.max_new // 4] * (args.prompts - half - 1) + [args.max_new]
    params = SamplingParams(temperature=1.0, n=4, max_new_tokens=max_new, seed=0, ignore_eos=True)
    one, two = SlicedRollout(model, mesh, 1, **kw), SlicedRollout(model, mesh, 2, **kw)
    out: dict = dict(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                     devices=len(jax.devices()), backend=jax.default_backend(), prompts=args.prompts, n=4,
                     max_new_tokens=max_new)
    walls = {1: [], 2: []}
    overlap = []
    for r in range(args.repeats + 1):
        for k, ro in ((1, one), (2, two)):
            t0 = time.perf_counter()
            res = ro.generate(prompts, params)
            wall = time.perf_counter() - t0
            if r == 0:
                continue  # warm-up (compiles)
            walls[k].append(wall)
            if k == 2:
                overlap.append(sum(s["wall_seconds"] for s in res.stats["slices"]) / wall)
    out["r1_wall_s"] = statistics.median(walls[1])
    out["r2_wall_s"] = statistics.median(walls[2])
    out["r2_overlap"] = statistics.median(overlap)
    trainer = SpotTrainer(EagleDrafter(cfg, rngs=nnx.Rngs(1)), two.meshes, two.policy)
    ctl = Controller(two, trainer=trainer, buffer=DrafterBuffer(64 * 2**20),
                     cfg=ControllerConfig(row_len=64, rows=8))
    steps = []
    for step in range(1, args.repeats + 2):
        _, m = ctl.run_step(step, prompts, params)
        if step > 1:  # the first step compiles the drafter step
            steps.append(m)
    out["controller"] = {k: statistics.median(m[k] for m in steps) for k in steps[0] if k.startswith("controller/")}
    out["controller"]["drafter_loss_last"] = steps[-1]["drafter/loss"]
    one.close()
    two.close()
    print(json.dumps(out, indent=1))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
