"""SmolLM2-135M forward throughput: KV-cached decode steps at several batch sizes, and prefill.

    python benchmarks/model_forward.py [--dtype=float32] [--steps=10] [--cache_len=512]

Decode: one jitted step (forward of 1 token per row over a cache of ``cache_len`` positions, half of them committed,
greedy pick, cache append; cache donated), warm-up excluded, ``steps`` timed steps ending in block_until_ready.
Prefill: jitted forward of the whole prompt into an empty cache, logits at the last position only.
Writes benchmarks/results/model_forward.json and prints a table.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from tlt_jax.models import DEFAULT_MODEL, KVCache, from_pretrained  # noqa: E402

flags.DEFINE_string("model", DEFAULT_MODEL, "Model path or alias.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute and parameter dtype.")
flags.DEFINE_integer("steps", 10, "Timed decode steps per batch size.")
flags.DEFINE_integer("cache_len", 512, "KV cache positions.")
flags.DEFINE_list("decode_batches", ["1", "8", "32"], "Decode batch sizes.")
flags.DEFINE_list("prefill_shapes", ["1x256", "8x128"], "Prefill shapes BxT.")
flags.DEFINE_string("out", str(Path(__file__).parent / "results" / "model_forward.json"), "JSON output path.")


def bench_decode(graphdef, state, cfg, batch: int, cache_len: int, steps: int, dtype) -> dict:
    def step(state, tok, cache):
        out = nnx.merge(graphdef, state)(tok[:, None], cache=cache)
        return jnp.argmax(out.logits[:, -1], -1).astype(jnp.int32), cache.append(out.k_new, out.v_new)

    fn = jax.jit(step, donate_argnums=(2,))
    cache = KVCache.zeros(cfg, batch, cache_len, dtype)
    cache = KVCache(cache.k, cache.v, jnp.full((batch,), cache_len // 2, jnp.int32))
    tok = jnp.zeros((batch,), jnp.int32)
    t0 = time.perf_counter()
    tok, cache = fn(state, tok, cache)  # compile + first step
    jax.block_until_ready(tok)
    compile_s = time.perf_counter() - t0
    tok, cache = fn(state, tok, cache)  # one more warm-up step
    jax.block_until_ready(tok)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok, cache = fn(state, tok, cache)
    jax.block_until_ready((tok, cache))
    dt = time.perf_counter() - t0
    return {
        "batch": batch,
        "cache_len": cache_len,
        "steps": steps,
        "ms_per_step": 1e3 * dt / steps,
        "tokens_per_s": batch * steps / dt,
        "first_call_s": compile_s,
    }


def bench_prefill(graphdef, state, cfg, batch: int, t: int, reps: int, dtype) -> dict:
    def prefill(state, ids):
        cache = KVCache.zeros(cfg, batch, t, dtype)
        out = nnx.merge(graphdef, state)(ids, cache=cache, logits_indices=jnp.full((batch, 1), t - 1, jnp.int32))
        return out.logits, cache.append(out.k_new, out.v_new)

    fn = jax.jit(prefill)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, t)), jnp.int32)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(state, ids))
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(fn(state, ids))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(state, ids))
        times.append(time.perf_counter() - t0)
    best, med = min(times), float(np.median(times))
    return {
        "batch": batch,
        "tokens": t,
        "reps": reps,
        "ms_median": 1e3 * med,
        "ms_best": 1e3 * best,
        "tokens_per_s": batch * t / med,
        "first_call_s": compile_s,
    }


def main(argv):
    del argv
    f = flags.FLAGS
    dtype = jnp.dtype(f.dtype)
    t0 = time.perf_counter()
    model = from_pretrained(f.model, dtype)
    load_s = time.perf_counter() - t0
    cfg = model.config
    graphdef, state = nnx.split(model)
    decode = [bench_decode(graphdef, state, cfg, int(b), f.cache_len, f.steps, dtype) for b in f.decode_batches]
    prefill = []
    for shape in f.prefill_shapes:
        b, t = (int(x) for x in shape.split("x"))
        prefill.append(bench_prefill(graphdef, state, cfg, b, t, 3, dtype))
    result = {
        "model": str(f.model),
        "params": cfg.num_params(),
        "dtype": f.dtype,
        "load_s": load_s,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "devices": len(jax.devices()),
            "note": "shared CPU: other jobs ran concurrently; timings are indicative (+-30%)",
        },
        "decode": decode,
        "prefill": prefill,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out = Path(f.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{f.model} ({cfg.num_params() / 1e6:.1f} M params, {f.dtype}) on {jax.default_backend()} "
        f"x{os.cpu_count()} cores; load {load_s:.2f} s"
    )
    print(f"{'decode batch':>12} {'cache':>6} {'ms/step':>9} {'tokens/s':>9} {'compile s':>9}")
    for r in decode:
        print(
            f"{r['batch']:>12} {r['cache_len']:>6} {r['ms_per_step']:>9.1f} {r['tokens_per_s']:>9.1f} "
            f"{r['first_call_s']:>9.2f}"
        )
    print(f"{'prefill BxT':>12} {'':>6} {'ms':>9} {'tokens/s':>9} {'compile s':>9}")
    for r in prefill:
        print(
            f"{str(r['batch']) + 'x' + str(r['tokens']):>12} {'':>6} {r['ms_median']:>9.1f} "
            f"{r['tokens_per_s']:>9.1f} {r['first_call_s']:>9.2f}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
