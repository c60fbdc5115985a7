"""SmolLM2-135M forward throughput: KV-cached decode steps at several batch sizes, and prefill.

    python benchmarks/model_forward.py [--dtype=float32] [--steps=10] [--cache_len=512]
    python benchmarks/model_forward.py --random_config=qwen2.5-7b --dtype=bfloat16 --attention_impl=pallas \
        --cache_len=4096 --verify_tokens=64 --prefill_shapes=   # GPU: real-size random weights, Pallas kernel
    python benchmarks/model_forward.py --random_config=tiny --attention_impl=pallas --cache_len=64 \
        --decode_batches=1 --verify_tokens=8 --steps=2 --prefill_shapes=   # CPU smoke run (kernel interpreted)

Decode: one jitted step (forward of 1 token per row over a cache of ``cache_len`` positions, half of them committed,
greedy pick, cache append; cache donated), warm-up excluded, ``steps`` timed steps ending in block_until_ready.
Verify (--verify_tokens=T): the same step for a T-token tree (a chain mask) over the cache, as tree verification.
Prefill: jitted forward of the whole prompt into an empty cache, logits at the last position only.
Every decode/verify row also reports the bytes a step must move (weights + the committed KV it reads) and the HBM
bandwidth they imply; the fraction of peak uses --hbm_gbps (default from the device kind; none on CPU).
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

from tlt_jax.models import (  # noqa: E402
    DEFAULT_MODEL,
    CausalLM,
    KVCache,
    ModelConfig,
    from_pretrained,
    rollout_copy,
    tiny_config,
)

# Real-size shapes for random-weight runs (weights don't change the cost of a step).
RANDOM_CONFIGS = {
    "tiny": tiny_config(),
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, tie_word_embeddings=True),
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                              num_heads=28, num_kv_heads=4, rope_theta=1e6, attention_bias=True, architecture="qwen2"),
    "llama3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                             num_heads=32, num_kv_heads=8, rope_theta=5e5),
}
# Peak HBM bandwidth (GB/s) by device kind substring, for the bandwidth fraction.
PEAK_GBPS = {"H200": 4800, "H100": 3350, "A100": 2039, "TPU v5p": 2765, "TPU v5 lite": 819, "TPU v4": 1228}

flags.DEFINE_string("model", DEFAULT_MODEL, "Model path or alias.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute and parameter dtype.")
flags.DEFINE_integer("steps", 10, "Timed decode steps per batch size.")
flags.DEFINE_integer("cache_len", 512, "KV cache positions.")
flags.DEFINE_list("decode_batches", ["1", "8", "32"], "Decode batch sizes.")
flags.DEFINE_list("prefill_shapes", ["1x256", "8x128"], "Prefill shapes BxT.")
flags.DEFINE_enum("random_config", None, list(RANDOM_CONFIGS), "Random weights of this shape instead of --model.")
flags.DEFINE_enum("attention_impl", "xla", ["xla", "pallas"], "Attention for cached steps (pallas: tree kernel).")
flags.DEFINE_integer("verify_tokens", 0, "Also time a verify step of this many tree tokens (0 = skip).")
flags.DEFINE_float("hbm_gbps", 0.0, "Peak HBM GB/s for the bandwidth fraction (0 = from the device kind).")
flags.DEFINE_string("out", str(Path(__file__).parent / "results" / "model_forward.json"), "JSON output path.")


def peak_gbps() -> float | None:
    if flags.FLAGS.hbm_gbps > 0:
        return flags.FLAGS.hbm_gbps
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_GBPS.items() if k in kind), None)


def bench_decode(graphdef, state, cfg, batch: int, cache_len: int, steps: int, dtype, tree_tokens: int = 1) -> dict:
    """ms per cached step of tree_tokens new tokens per row (1 = decode; T = a verify tree, chain-shaped)."""
    chain = jnp.broadcast_to(jnp.tril(jnp.ones((tree_tokens, tree_tokens), bool)), (batch, tree_tokens, tree_tokens))

    def step(state, tok, cache):
        ids = tok[:, None] + jnp.arange(tree_tokens, dtype=jnp.int32)[None, :]
        out = nnx.merge(graphdef, state)(ids % cfg.vocab_size, cache=cache, tree_mask=chain)
        cache = cache.append(out.k_new[:, :, :1], out.v_new[:, :, :1])  # commit one token, as a decode step does
        return jnp.argmax(out.logits[:, -1], -1).astype(jnp.int32), cache

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
    itemsize = jnp.dtype(dtype).itemsize
    moved = cfg.num_params() * itemsize + batch * (cache_len // 2) * cfg.kv_bytes_per_token(itemsize)
    gbps = moved / (dt / steps) / 1e9
    peak = peak_gbps()
    return {
        "batch": batch,
        "tree_tokens": tree_tokens,
        "cache_len": cache_len,
        "steps": steps,
        "ms_per_step": 1e3 * dt / steps,
        "tokens_per_s": batch * tree_tokens * steps / dt,
        "first_call_s": compile_s,
        "bytes_per_step": moved,
        "achieved_gbps": gbps,
        "hbm_fraction": None if peak is None else gbps / peak,
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
    if f.random_config:
        model = CausalLM(RANDOM_CONFIGS[f.random_config], dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    else:
        model = from_pretrained(f.model, dtype)
    model = rollout_copy(model, attention_impl=f.attention_impl)
    load_s = time.perf_counter() - t0
    cfg = model.config
    graphdef, state = nnx.split(model)
    decode = [bench_decode(graphdef, state, cfg, int(b), f.cache_len, f.steps, dtype) for b in f.decode_batches]
    if f.verify_tokens:
        decode += [bench_decode(graphdef, state, cfg, int(b), f.cache_len, f.steps, dtype, f.verify_tokens)
                   for b in f.decode_batches]
    prefill = []
    for shape in f.prefill_shapes:
        b, t = (int(x) for x in shape.split("x"))
        prefill.append(bench_prefill(graphdef, state, cfg, b, t, 3, dtype))
    result = {
        "model": f"random {f.random_config}" if f.random_config else str(f.model),
        "params": cfg.num_params(),
        "dtype": f.dtype,
        "attention_impl": f.attention_impl,
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
        f"{result['model']} ({cfg.num_params() / 1e6:.1f} M params, {f.dtype}, attention {f.attention_impl}) on "
        f"{jax.devices()[0].device_kind} x{os.cpu_count()} cores; load {load_s:.2f} s"
    )
    print(f"{'batch x T':>12} {'cache':>6} {'ms/step':>9} {'tokens/s':>9} {'compile s':>9} {'GB/s':>8} {'of peak':>7}")
    for r in decode:
        frac = "-" if r["hbm_fraction"] is None else f"{100 * r['hbm_fraction']:.0f}%"
        print(
            f"{str(r['batch']) + 'x' + str(r['tree_tokens']):>12} {r['cache_len']:>6} {r['ms_per_step']:>9.1f} "
            f"{r['tokens_per_s']:>9.1f} {r['first_call_s']:>9.2f} {r['achieved_gbps']:>8.2f} {frac:>7}"
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
