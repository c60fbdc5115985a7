"""How much a program traced or compiled on another thread slows the host loop (issue 17).

    python benchmarks/trace_contention.py [--seconds=5] [--out=FILE.json]

The adaptive engine compiles new speculative steps on the step pool's worker thread while the host loop keeps
decoding. Two foreground loads are timed, each for ``--seconds``:
- a host round trip: a small compiled step, a device-to-host read and a little Python bookkeeping;
- a decode-like step: a chain of [4, 2048] x [2048, 2048] matmuls (256 MiB of weights), which on a CPU backend runs
  on every core, as a policy's decode step does.
Each is timed alone; beside a thread that traces fresh programs over and over (Python); beside a thread that builds
(traces, lowers, compiles) fresh programs over and over, as the pool's worker does, at the default CPU priority; and
the same at the pool's ``BACKGROUND_NICE`` (Linux). Every background program is new (a new function and a new
constant), so nothing comes from JAX's caches. Prints and writes seconds per iteration, the ratio to alone and how
many background programs were built meanwhile.
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

flags.DEFINE_float("seconds", 5.0, "seconds each foreground load is timed for, per measurement")
flags.DEFINE_string("out", "benchmarks/results/trace_contention_cpu.json", "JSON output")
_F = flags.FLAGS


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tlt_jax.rollout.pool import BACKGROUND_NICE, lower_thread_priority

    small = jax.jit(lambda x: (x @ x).sum())
    x = jnp.ones((64, 64))
    weights = [jnp.full((2048, 2048), 1e-3) for _ in range(16)]

    @jax.jit
    def decode_like(ws, h):
        for w in ws:
            h = jnp.tanh(h @ w)
        return h.sum()

    h = jnp.ones((4, 2048))
    small(x).block_until_ready()
    decode_like(weights, h).block_until_ready()

    def round_trip():
        np.asarray(jax.device_get(small(x)))
        sum(int(i) for i in range(200))  # the host's bookkeeping between round trips

    def decode():
        float(decode_like(weights, h))

    def timed(load) -> float:
        """Seconds per call of ``load``, over at least ``--seconds``."""
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < _F.seconds:
            load()
            n += 1
        return (time.perf_counter() - t0) / n

    made = [0]

    def fresh():
        """A new function with a new constant each time (as the pool's builders make one per key), so neither its
        trace nor its compile comes from a cache: an unrolled chain of 400 ops."""
        made[0] += 1
        k = float(made[0])

        def program(z):
            for i in range(400):
                z = jnp.tanh(z * 1.01 + i + k)
            return z

        return program

    arg = jax.ShapeDtypeStruct((8,), jnp.float32)
    t0 = time.perf_counter()
    jax.jit(fresh()).trace(arg)
    trace_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.jit(fresh()).lower(arg).compile()
    build_s = time.perf_counter() - t0

    def beside(load, work, nice: bool) -> tuple[float, int]:
        """(seconds per ``load``, background programs made meanwhile) with ``work`` looping on another thread, timed
        from its first finished program on."""
        stop, done = threading.Event(), [0]

        def loop():
            if nice:
                lower_thread_priority()
            while not stop.is_set():
                work()
                done[0] += 1

        worker = threading.Thread(target=loop)
        worker.start()
        while done[0] == 0:
            time.sleep(0.01)
        before = done[0]
        try:
            return timed(load), done[0] - before
        finally:
            stop.set()
            worker.join()

    def trace():
        jax.jit(fresh()).trace(arg)

    def build():
        jax.jit(fresh()).lower(arg).compile()

    results = {}
    for name, load in dict(round_trip=round_trip, decode_step=decode).items():
        alone = timed(load)
        row = dict(alone_s=alone)
        for label, work, nice in [
            ("beside_tracing", trace, False),
            ("beside_building", build, False),
            ("beside_building_nice", build, True),
        ]:
            s, count = beside(load, work, nice)
            row[label] = dict(seconds=s, ratio_to_alone=s / alone, background_programs=count)
        results[name] = row
        print(f"{name}: alone {alone * 1e3:.2f} ms; " + "; ".join(
            f"{k[7:]} {v['seconds'] * 1e3:.2f} ms ({v['ratio_to_alone']:.2f}x, {v['background_programs']} built)"
            for k, v in row.items() if k != "alone_s"))
    out = dict(
        benchmark="trace_contention",
        machine=dict(platform=platform.platform(), cpu_count=os.cpu_count(), device_kind=jax.devices()[0].device_kind),
        seconds=_F.seconds,
        background_nice=BACKGROUND_NICE if sys.platform == "linux" else None,
        one_trace_s=trace_s,
        one_build_s=build_s,
        loads=results,
    )
    print(f"one trace {trace_s:.3f} s, one build (trace, lower, compile) {build_s:.3f} s of the background program")
    path = REPO / _F.out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
