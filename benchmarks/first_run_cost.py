"""How much longer a compiled step's first run takes than its next ones (why the adaptive engine's bandit does not
observe a step's first run, ``StepPool.first_run``).

    python benchmarks/first_run_cost.py [--trials=2] [--calls=6] [--out=FILE.json]

Per trial a fresh adaptive engine (SmolLM2, the committed EAGLE drafter, arms off and eagle:3x1x4) prefills one
held-out prompt; then the plain 8-step chunk and the EAGLE verify step (4 rounds, drafter catch-up over the prompt
included) are compiled and each called ``--calls`` times on fresh copies of the prefilled state. Prints and writes the
milliseconds of every call (compilation excluded) and the first call over the median of the others.
"""

from __future__ import annotations

import json
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from tlt_jax.assets import EMBEDDED_DRAFTER, resolve_drafter_path
from tlt_jax.drafter.export import load_drafter
from tlt_jax.drafter.warmup import load_policy_and_prompts
from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig, StepKey
from tlt_jax.rollout import buckets as bk
from tlt_jax.rollout.run import GenerateRun

flags.DEFINE_integer("trials", 2, "fresh engines (one held-out prompt each)")
flags.DEFINE_integer("calls", 6, "calls of each compiled step per trial")
flags.DEFINE_string("out", "benchmarks/results/first_run_cost_smollm2_cpu.json", "JSON output")
_F = flags.FLAGS


def main(argv):
    del argv
    policy, prompts, _ = load_policy_and_prompts(None, 16, 1000, "eval")
    drafter = load_drafter(resolve_drafter_path(EMBEDDED_DRAFTER))
    copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s))
    rows = []
    for trial in range(_F.trials):
        max_len = len(prompts[trial]) + 96 + 64
        spec = SpecConfig(arms=("off", "eagle:3x1x4"))
        engine = RolloutEngine(policy, drafter=drafter, spec=spec, max_batch=1, max_len=max_len)
        run = GenerateRun(engine, [prompts[trial]], [96], [0], SamplingParams(temperature=0.9, max_new_tokens=96), ())
        state, _, _, plen, _ = run.prefill([(0, 0)])
        length = bk.pick(engine.length_buckets, int(plen.max()) + 16)
        steps = (("off", StepKey("decode", 1, length, "plain"), ()),
                 ("eagle:3x1x4", StepKey("verify", 1, length, "tree/eagle/d3k1n4"), (run._rounds(4),)))
        for arm, key, extra in steps:
            t = time.perf_counter()
            exe = engine.pool.get(key, engine.step_params(), copy(state), *extra)
            compile_s = time.perf_counter() - t
            ms = []
            for _ in range(_F.calls):
                fresh = jax.block_until_ready(copy(state))
                t = time.perf_counter()
                jax.block_until_ready(exe(engine.step_params(), fresh, *extra))
                ms.append(1000 * (time.perf_counter() - t))
            ratio = ms[0] / statistics.median(ms[1:])
            row = dict(trial=trial, arm=arm, length=length, compile_s=compile_s, call_ms=ms, first_over_rest=ratio)
            rows.append(row)
            print(f"trial {trial} {arm:12s} compile {compile_s:.2f} s, calls ms {[round(x, 1) for x in ms]}: "
                  f"first / median of the rest {ratio:.2f}", flush=True)
    meta = dict(machine=platform.platform(), cpus=jax.local_device_count(), jax=jax.__version__,
                device=jax.devices()[0].device_kind, trials=_F.trials, calls=_F.calls)
    pathlib.Path(_F.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {_F.out}")


if __name__ == "__main__":
    app.run(main)
