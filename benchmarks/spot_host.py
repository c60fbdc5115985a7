"""What each piece of the spot trainer's drafter work costs, on the tiny TLT config's model (two one-device slices).

The pieces that make up ``drafter/critical_s`` when drafter steps are milliseconds: a drafter step (steady, and the
first of an RL step, which starts from a copy of the current drafter), the held-out scoring, dispatching the
replicas' average (``SpotTrainer.average``, then waiting for it), and publishing the average to a slice's engine.
Each is timed ``--calls`` times, interleaved, on an otherwise idle machine: median wall milliseconds and process CPU
milliseconds per call.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/spot_host.py --calls 100
        # -> results/spot_host_tiny_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import jax
from flax import nnx

from tlt_jax.distributed import MeshConfig, make_mesh, engine_meshes
from tlt_jax.drafter import DrafterOptimConfig, EagleDrafter
from tlt_jax.drafter.buffer import DrafterBuffer
from tlt_jax.drafter.spot import SpotTrainer
from tlt_jax.models import CausalLM, tiny_config
from tlt_jax.rollout import HiddenCapture, RolloutEngine, SamplingParams, SpecConfig

RESULTS = Path(__file__).resolve().parent / "results" / "spot_host_tiny_cpu.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--row_len", type=int, default=64)  # configs/tiny_tlt.py's drafter batch
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if len(jax.devices()) < 2:
        raise SystemExit("needs 2 devices: XLA_FLAGS=--xla_force_host_platform_device_count=2")
    model = CausalLM(tiny_config(), rngs=nnx.Rngs(0))
    meshes = engine_meshes(make_mesh(MeshConfig(data=2), jax.devices()[:2]), 2)
    drafter = EagleDrafter(model.config, rngs=nnx.Rngs(7))
    engines = [RolloutEngine(model, m, max_batch=8, max_len=64, drafter=drafter, capture=HiddenCapture(window=16),
                             spec=SpecConfig(depth=3, topk=2, verify_tokens=6)) for m in meshes]
    prompts = [[5, 9, 17], [2, 200, 7, 8], [40, 41], [100, 3, 4, 5]]
    res = engines[0].generate(prompts, SamplingParams(temperature=0.8, n=2, max_new_tokens=16, seed=1,
                                                      ignore_eos=True))
    buf = DrafterBuffer(max_bytes=2**22)
    buf.start_step(1)
    buf.add_result(prompts, res)
    trainer = SpotTrainer(drafter, meshes, lambda s: nnx.merge(engines[s].graphdef, engines[s].params),
                          optim=DrafterOptimConfig(learning_rate=3e-3))
    trainer.compile(args.rows, args.row_len)
    batch, held = buf.batch(args.row_len, args.rows, seed=0), buf.step_batch(1, args.row_len, args.rows)
    wall, cpu = defaultdict(list), defaultdict(list)

    def timed(name, fn):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        wall[name].append(time.perf_counter() - w)
        cpu[name].append(time.process_time() - c)
        return out

    for k in range(args.calls + 3):
        trainer.begin_step(k + 1)
        timed("first drafter step of an RL step", lambda: trainer.train_step(0, batch))
        timed("drafter step", lambda: trainer.train_step(0, batch))
        trainer.train_step(1, batch)
        timed("held-out scoring", lambda: trainer.evaluate(1, held))
        timed("average: dispatch", trainer.average)
        timed("average: then done", trainer.step_metrics)
        timed("publish to one engine", lambda: engines[0].set_drafter_params(trainer.params_on(0)))
        if k == 2:  # the first calls warm up
            wall.clear(), cpu.clear()
    out = {"command": "python benchmarks/spot_host.py " + " ".join(f"--{k}={v}" for k, v in vars(args).items()
                                                                 if k != "out"),
           "leaves_per_replica": len(jax.tree.leaves(trainer.current)),
           "ms": {name: {"wall_median": 1e3 * statistics.median(wall[name]),
                         "cpu_median": 1e3 * statistics.median(cpu[name])} for name in wall}}
    for name, v in out["ms"].items():
        print(f"{name:34s} wall {v['wall_median']:6.2f} ms   cpu {v['cpu_median']:6.2f} ms")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    for e in engines:
        e.close()


if __name__ == "__main__":
    main()
