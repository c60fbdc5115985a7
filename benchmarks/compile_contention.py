"""How much a background compile of a verify step slows plain decoding of the default run's policy (issue 17).

    python benchmarks/compile_contention.py [--calls=4] [--out=FILE.json]

The adaptive engine compiles a speculative step it meets for the first time on the step pool's worker thread while
the rollout decodes plainly. On a CPU backend both share the cores. The foreground load is the default config's
rollout (configs/gsm8k.py: its policy, two prompts x 4 samples, 48 new tokens, plain decoding, every step compiled
first); it is timed alone, then beside a thread that compiles the EAGLE arms' verify steps one after another (each a
new key, compiled for real: no persistent compilation cache), in two ways:
- ``worker_nice``: only the compiling thread at the pool's BACKGROUND_NICE (what the pool did before);
- ``compile_threads_nice``: that thread and XLA's own compile threads too (``lower_compile_threads``, what the pool
  does now before each background compile; once lowered they stay lowered, so this case runs second);
then alone again. Prints and writes seconds per rollout, the ratio to alone (the mean of the two alone timings),
and the compiles finished meanwhile with their mean seconds (a compile that yields the cores takes longer).

``--warm_cache`` measures what a steady run's background "compiles" are: with the persistent compilation cache on
and eight verify steps compiled once first, each build is a cache hit, i.e. Python tracing and lowering (which hold
the GIL) and a load; the thread rebuilds them over and over. ``--prompts=1 --n=1`` decodes at batch 1, where a
round trip is short and its host work (which needs the GIL) weighs most:

    python benchmarks/compile_contention.py --warm_cache --prompts=1 --n=1 \
        --out=benchmarks/results/compile_contention_warm_b1_cpu.json
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from absl import app, flags  # noqa: E402

flags.DEFINE_integer("calls", 4, "timed rollouts per case")
flags.DEFINE_integer("prompts", 2, "prompts per rollout")
flags.DEFINE_integer("n", 4, "samples per prompt")
flags.DEFINE_bool("warm_cache", False, "persistent compilation cache on, every step compiled once first: rebuilds")
flags.DEFINE_string("out", "benchmarks/results/compile_contention_cpu.json", "JSON output")
_F = flags.FLAGS


def main(argv):
    del argv
    import jax
    import numpy as np

    from benchmarks.e2e_step import load_config
    from tlt_jax.builders import build_data, build_engine, build_model
    from tlt_jax.distributed import make_mesh
    from tlt_jax.rollout import SamplingParams
    from tlt_jax.rollout.plan import step_key
    from tlt_jax.rollout.pool import lower_thread_priority

    if _F.warm_cache:
        from tlt_jax.main import _enable_compilation_cache

        _enable_compilation_cache()
    cfg = load_config("gsm8k", {"drafter.online": False})
    off_cfg = load_config("gsm8k", {"drafter.online": False, "rollout.speculative": "off", "rollout.spec_arms": ""})
    mesh = make_mesh(cfg.mesh)
    model, tok = build_model(cfg, mesh)
    data = build_data(cfg, tok, model.config)
    adaptive = build_engine(cfg, model, mesh, data)  # its pool builds the verify steps
    plain = build_engine(off_cfg, model, mesh, data)
    prompts = [data.train[i]["prompt_ids"] for i in range(_F.prompts)]
    params = SamplingParams(temperature=0.0, n=_F.n, max_new_tokens=48, seed=0)
    plain.generate(prompts, params)  # every plain step compiled
    keys = [
        (step_key(arm, b, length), arm, b, length)
        for arm in adaptive.arms if arm.speculative
        for b in adaptive.batch_buckets
        for length in adaptive.length_buckets
    ]
    if _F.warm_cache:  # eight of them, each in the persistent cache (a cache hit from here on)
        keys = keys[:8]
        for key, arm, b, length in keys:
            adaptive.pool._build(key, adaptive.abstract_args(arm, b, length))

    def rollouts() -> list[float]:
        out = []
        for _ in range(_F.calls):
            t0 = time.perf_counter()
            plain.generate(prompts, params)
            out.append(time.perf_counter() - t0)
        return out

    def beside(lower_xla: bool) -> dict:
        stop, compiles = threading.Event(), []

        def loop():
            lower_thread_priority()
            i = 0
            while not stop.is_set() and (_F.warm_cache or keys):
                key, arm, b, length = keys[i % len(keys)] if _F.warm_cache else keys.pop(0)
                i += 1
                t0 = time.perf_counter()
                adaptive.pool._build(key, adaptive.abstract_args(arm, b, length), background=lower_xla)
                compiles.append(time.perf_counter() - t0)

        worker = threading.Thread(target=loop)
        worker.start()
        time.sleep(1.0)  # the compile under way
        try:
            secs = rollouts()
        finally:
            stop.set()
            worker.join()
        return dict(rollout_s=secs, compiles=len(compiles), compile_s_mean=float(np.mean(compiles or [0.0])))

    first = rollouts()
    cases = dict(worker_nice=beside(False), compile_threads_nice=beside(True))
    last = rollouts()
    alone = float(np.mean([np.median(first), np.median(last)]))
    for c in cases.values():
        c["ratio_to_alone"] = float(np.median(c["rollout_s"])) / alone
    out = dict(
        benchmark="compile_contention",
        machine=dict(platform=platform.platform(), cpu_count=os.cpu_count(), device_kind=jax.devices()[0].device_kind),
        config="configs/gsm8k.py",
        warm_cache=_F.warm_cache,
        rollout=dict(prompts=len(prompts), n=params.n, max_new_tokens=params.max_new_tokens, temperature=0.0),
        alone_first_s=first,
        alone_last_s=last,
        alone_s=alone,
        **cases,
    )
    print(f"alone {alone:.3f} s per rollout (first {np.median(first):.3f}, last {np.median(last):.3f})")
    for name, c in cases.items():
        print(f"{name}: {np.median(c['rollout_s']):.3f} s per rollout ({c['ratio_to_alone']:.2f}x alone); "
              f"{c['compiles']} compiles meanwhile, {c['compile_s_mean']:.2f} s each")
    path = REPO / _F.out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
