"""How much a step traced or compiled on another thread holds up the host loop's dispatches (issue 17).

    python benchmarks/trace_contention.py [--iters=10] [--out=FILE.json]

The adaptive engine compiles new speculative steps on the step pool's worker thread while the host loop keeps
decoding. This measures one host round trip's dispatch pattern (a small compiled step, a device-to-host read and a
little Python bookkeeping) ``--iters`` times: alone, while another thread traces a program over and over
(``jax.jit(...).trace``: Python), and while another thread compiles an already lowered program over and over (XLA).
Prints and writes each as seconds per round trip and as a ratio to the loop alone.
"""

from __future__ import annotations

import json
import pathlib
import platform
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from absl import app, flags  # noqa: E402

flags.DEFINE_integer("iters", 10, "host round trips per measurement")
flags.DEFINE_string("out", "benchmarks/results/trace_contention_cpu.json", "JSON output")
_F = flags.FLAGS


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    step = jax.jit(lambda x: (x @ x).sum())
    x = jnp.ones((64, 64))
    step(x).block_until_ready()

    def round_trips(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            np.asarray(jax.device_get(step(x)))
            sum(int(i) for i in range(200))  # the host's bookkeeping between round trips
        return (time.perf_counter() - t0) / n

    def fresh():
        """A new function each time (as the pool's builders make one per key), so no trace comes from JAX's cache:
        an unrolled chain of 400 ops, whose trace takes a while."""

        def program(z):
            for i in range(400):
                z = jnp.tanh(z * 1.01 + i)
            return z

        return program

    arg = jax.ShapeDtypeStruct((8,), jnp.float32)
    lowered = jax.jit(fresh()).lower(arg)
    t0 = time.perf_counter()
    jax.jit(fresh()).trace(arg)
    trace_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    lowered.compile()
    compile_s = time.perf_counter() - t0

    def beside(work) -> float:
        stop = threading.Event()

        def loop():
            while not stop.is_set():
                work()

        worker = threading.Thread(target=loop)
        worker.start()
        time.sleep(0.2)
        try:
            return round_trips(_F.iters)
        finally:
            stop.set()
            worker.join()

    alone = round_trips(max(_F.iters, 100))
    tracing = beside(lambda: jax.jit(fresh()).trace(arg))
    compiling = beside(lowered.compile)
    out = dict(
        benchmark="trace_contention",
        machine=dict(platform=platform.platform(), cpu_count=__import__("os").cpu_count(),
                     device_kind=jax.devices()[0].device_kind),
        iters=_F.iters,
        one_trace_s=trace_s,
        one_compile_s=compile_s,
        round_trip_s=dict(alone=alone, beside_tracing=tracing, beside_compiling=compiling),
        ratio_to_alone=dict(beside_tracing=tracing / alone, beside_compiling=compiling / alone),
    )
    print(f"one trace {trace_s:.3f} s, one compile {compile_s:.3f} s of the other thread's program")
    print(f"host round trip alone {alone * 1e3:.2f} ms; beside tracing {tracing * 1e3:.1f} ms "
          f"({tracing / alone:.0f}x); beside compiling {compiling * 1e3:.2f} ms ({compiling / alone:.1f}x)")
    path = REPO / _F.out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
