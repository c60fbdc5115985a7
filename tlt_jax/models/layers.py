"""Transformer building blocks. Every parameter carries logical axis names (metadata key ``logical_axes``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.distributed.sharding import LOGICAL_AXES, activation_context
from tlt_jax.kernels import prefix_tree_attention
from tlt_jax.models.config import ModelConfig

_INIT = nnx.initializers.normal(0.02)


def param(rngs: nnx.Rngs, shape, axes: tuple, dtype, init=_INIT) -> nnx.Param:
    """A parameter with its logical axis names attached (one name per dimension)."""
    assert len(axes) == len(shape), (shape, axes)
    return nnx.Param(init(rngs.params(), shape, dtype), **{LOGICAL_AXES: tuple(axes)})


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = param(rngs, (dim,), ("norm",), param_dtype, nnx.initializers.ones)

    def __call__(self, x):
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * x32).astype(dtype)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array):
    """cos/sin tables [B, T, head_dim] for integer positions [B, T] (HF's non-interleaved layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, heads, D] by position; cos/sin are [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return (x.astype(jnp.float32) * c + rotated.astype(jnp.float32) * s).astype(x.dtype)


# Queries per block of a long attention without a cache (the train step's and the log-prob passes' full sequences):
# each block's [B, KV, G, block, T] float32 scores, weights and their cotangents exist one block at a time (blocks
# rematerialised in the backward pass) instead of [B, KV, G, T, T] (1.06 GB per row of Qwen2.5-7B at T = 3072, of
# which the backward pass held three at once). Every query's softmax still spans all its keys: the values are the
# same; only the order in which the keys' and values' gradients sum over queries changes.
ATTENTION_BLOCK = 512


def attention(q, k_new, v_new, new_mask, k_cache=None, v_cache=None, cache_mask=None):
    """Grouped-query attention of T new queries over (cache keys ++ new keys); see :func:`attention_block`. Without a
    cache, more than ATTENTION_BLOCK queries are taken ATTENTION_BLOCK at a time (the last block padded)."""
    b, t = q.shape[:2]
    if k_cache is not None or t <= ATTENTION_BLOCK:
        return attention_block(q, k_new, v_new, new_mask, k_cache, v_cache, cache_mask)
    n = -(-t // ATTENTION_BLOCK)
    pad = n * ATTENTION_BLOCK - t

    def blocks(x):  # [B, T, ...] -> [n, B, ATTENTION_BLOCK, ...]; padded queries see no key (their rows are dropped)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, ATTENTION_BLOCK, *x.shape[2:]), 1, 0)

    one = jax.checkpoint(lambda qb, mb: attention_block(qb, k_new, v_new, mb))
    out = jax.lax.map(lambda xs: one(*xs), (blocks(q), blocks(new_mask)))
    return jnp.moveaxis(out, 0, 1).reshape(b, n * ATTENTION_BLOCK, *out.shape[3:])[:, :t]


def attention_block(q, k_new, v_new, new_mask, k_cache=None, v_cache=None, cache_mask=None):
    """Grouped-query attention of T new queries over (cache keys ++ new keys), all queries at once.

    q [B,T,H,D]; k_new, v_new [B,T,KV,D]; new_mask [B,T,T] bool (which new keys each query sees: causal, tree or
    segment mask); k_cache, v_cache [B,S,KV,D] and cache_mask [B,T,S] bool (which cached keys are visible).
    Softmax in float32 over the cache and the new keys as two blocks sharing one max and one sum (the cache is never
    concatenated with the new keys), normalised after the values are mixed: the weights' sum comes out of the value
    matmul (a ones column beside the values, which XLA:GPU fuses into the matmul's operand), so the weights are
    written once, in the values' dtype, and read once. The matmuls read q, keys and values in their own dtype and
    accumulate in float32 (no float32 copy of the cache); the cache block's mask is an additive bias, which XLA:GPU
    applies in the score matmul's epilogue. A single new token (decode) takes reductions instead
    of matmuls, which read the cache in its [B, S, KV, D] layout where a dot would first transpose it (a whole-cache
    copy per layer and step); so does the new-token block beside a cache (a verify tree: small), so that XLA does not
    merge its score matmul with the cache's by concatenating the keys. This is the plain XLA reference the
    tree-attention kernels are tested against.
    """
    b, t, h, d = q.shape
    kv = k_new.shape[2]
    f32 = jnp.float32
    qg = q.reshape(b, t, kv, h // kv, d)
    neg = jnp.finfo(f32).min
    scale = f32(d**-0.5)

    def reduced(k):  # [B, KV, G, T, S]: a reduction over head_dim, k read where it lies
        prod = qg.astype(f32)[:, :, None] * k.astype(f32)[:, None, :, :, None, :]  # [B, T, S, KV, G, D]
        return jnp.transpose(jnp.sum(prod, axis=-1), (0, 3, 4, 1, 2))

    def scores(k, mask, dot):
        if not dot:
            return jnp.where(mask[:, None, None], reduced(k) * scale, neg)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(q.dtype), preferred_element_type=f32)
        return s * scale + jnp.where(mask, f32(0), neg)[:, None, None]

    # (scores, values, by matmul): the new block by matmul only without a cache (training and prefill sequences)
    blocks = [(scores(k_new, new_mask, t > 1 and k_cache is None), v_new, t > 1 and k_cache is None)]
    if k_cache is not None:
        blocks.insert(0, (scores(k_cache, cache_mask, t > 1), v_cache, t > 1))
    top = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s, _, _ in blocks])
    weights = [jnp.exp(s - top) for s, _, _ in blocks]

    def mix(w, v, dot):  # [B, T, KV, G, D + 1]: the weights times the values, and (last) the weights' sum
        if dot:  # the sum by the same matmul (a ones column beside the values): the weights are read once
            v1 = jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), v.dtype)], axis=-1)
            return jnp.einsum("bkgts,bskd->btkgd", w.astype(v.dtype), v1, preferred_element_type=f32)
        p = jnp.transpose(w, (0, 3, 4, 1, 2))  # [B, T, S, KV, G]: a reduction over the positions, v where it lies
        out = jnp.sum(p[..., None] * v.astype(f32)[:, None, :, :, None, :], axis=2)
        return jnp.concatenate([out, jnp.sum(p, axis=2)[..., None]], axis=-1)

    out = functools.reduce(jnp.add, [mix(w, v, dot) for w, (_, v, dot) in zip(weights, blocks, strict=True)])
    out = out[..., :d] / out[..., d:]
    return out.reshape(b, t, h, d).astype(q.dtype)


def kernel_attention(q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask):
    """The Pallas tree-attention kernel (interpreted on CPU), under ``jax.shard_map`` inside a sharded step (see
    ``distributed.activation_sharding``): each device runs it on its rows (batch over the data axes) and its heads
    (over "tensor"; query head groups stay with their KV head), so no cache is gathered into the kernel.
    The kernel is that of the step's devices (the mesh's platform: compiled for TPU devices from a CPU host, Mosaic's;
    on CPU devices the Triton kernel, interpreted)."""
    ctx = activation_context()
    platform = jax.default_backend() if ctx is None else ctx[0].devices.flat[0].platform
    call = functools.partial(prefix_tree_attention, interpret=platform == "cpu",
                             backend="tpu" if platform == "tpu" else "gpu")
    if ctx is None:
        return call(q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask)
    mesh, rules = ctx

    def heads(x, name):
        return rules.spec(("batch", None, name, None), mesh, x.shape)

    specs = (heads(q, "q_heads"), heads(k_cache, "kv_heads"), heads(v_cache, "kv_heads"),
             rules.spec(("batch",), mesh, cache_len.shape), heads(k_new, "kv_heads"), heads(v_new, "kv_heads"),
             rules.spec(("batch", None, None), mesh, tree_mask.shape))
    sharded = jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)
    return sharded(q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.dtype = dtype
        self.q_proj = param(rngs, (e, h, d), ("embed", "q_heads", "head_dim"), param_dtype)
        self.k_proj = param(rngs, (e, kv, d), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.v_proj = param(rngs, (e, kv, d), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.o_proj = param(rngs, (h, d, e), ("q_heads", "head_dim", "embed"), param_dtype)
        if cfg.attention_bias:
            zeros = nnx.initializers.zeros
            self.q_bias = param(rngs, (h, d), ("q_heads", "head_dim"), param_dtype, zeros)
            self.k_bias = param(rngs, (kv, d), ("kv_heads", "head_dim"), param_dtype, zeros)
            self.v_bias = param(rngs, (kv, d), ("kv_heads", "head_dim"), param_dtype, zeros)
        else:
            self.q_bias = self.k_bias = self.v_bias = None

    def _proj(self, x, w, b):
        y = jnp.einsum("bte,ehd->bthd", x, w[...].astype(self.dtype))
        return y if b is None else y + b[...].astype(self.dtype)

    def __call__(self, x, cos, sin, new_mask, k_cache=None, v_cache=None, cache_mask=None, cache_len=None):
        """cache_len [B] given (with a cache): the Pallas tree-attention kernel reads the cache prefix instead."""
        q = apply_rope(self._proj(x, self.q_proj, self.q_bias), cos, sin)
        k = apply_rope(self._proj(x, self.k_proj, self.k_bias), cos, sin)
        v = self._proj(x, self.v_proj, self.v_bias)
        if cache_len is not None and k_cache is not None:
            out = kernel_attention(q, k_cache, v_cache, cache_len, k, v, new_mask)
        else:
            out = attention(q, k, v, new_mask, k_cache, v_cache, cache_mask)
        return jnp.einsum("bthd,hde->bte", out, self.o_proj[...].astype(self.dtype)), (k, v)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.intermediate_size
        self.dtype = dtype
        self.gate_proj = param(rngs, (e, f), ("embed", "mlp"), param_dtype)
        self.up_proj = param(rngs, (e, f), ("embed", "mlp"), param_dtype)
        self.down_proj = param(rngs, (f, e), ("mlp", "embed"), param_dtype)

    def __call__(self, x):
        g = x @ self.gate_proj[...].astype(self.dtype)
        u = x @ self.up_proj[...].astype(self.dtype)
        return (jax.nn.silu(g) * u) @ self.down_proj[...].astype(self.dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer. ``input_norm=False`` gives the EAGLE drafter's layer (its input is already fused)."""

    def __init__(
        self, cfg: ModelConfig, *, input_norm: bool = True, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        kw = dict(param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw) if input_norm else None
        self.self_attn = Attention(cfg, dtype=dtype, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, dtype=dtype, **kw)

    def __call__(self, x, cos, sin, new_mask, k_cache=None, v_cache=None, cache_mask=None, cache_len=None):
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        a, kv = self.self_attn(h, cos, sin, new_mask, k_cache, v_cache, cache_mask, cache_len)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv
