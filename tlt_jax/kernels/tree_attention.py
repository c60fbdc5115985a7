"""Pallas tree attention for decode (T = 1) and tree verification (T = N new tokens), flash-decoding style.

Layout: one program per (row b, KV head h, block of query rows, cache split). Its query rows are the T new tokens
times the G = Hq / Hkv query heads sharing KV head h (row r = t * G + g), so every KV block is loaded once for all T
tokens and all G heads. A program runs an online softmax over its split of the cache prefix [0, prefix_len[b]) only
(blocks at or beyond prefix_len are never loaded), and the last split also folds in the T new keys under the tree
mask. The splits' partial (out, max, sum) are merged in XLA (a few KB). Written for the Triton lowering (masked
loads, an in-kernel loop with a data-dependent trip count); ``tree_attention_tpu`` is the Mosaic variant.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MIN_DIM = 16  # Triton's dot needs every dimension >= 16 (and powers of two)


def _pow2(n: int, floor: int = _MIN_DIM) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def check_shapes(q, k_cache, v_cache, prefix_len, k_new, v_new, tree_mask) -> None:
    """Clear errors for bad shapes (all checks are static)."""
    if q.ndim != 4:
        raise ValueError(f"tree attention: q must be [B, T, Hq, D], got shape {q.shape}")
    b, t, hq, d = q.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(
            f"tree attention: k and v must both be [B={b}, S, Hkv, D={d}], got {k_cache.shape} and {v_cache.shape}"
        )
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"tree attention: query heads ({hq}) must be a multiple of KV heads ({hkv}) for GQA")
    if k_new.shape != (b, t, hkv, d) or v_new.shape != (b, t, hkv, d):
        raise ValueError(f"tree attention: new keys/values must be [B, T, Hkv, D] = {(b, t, hkv, d)}, got "
                         f"{k_new.shape} and {v_new.shape}")
    if prefix_len.shape != (b,):
        raise ValueError(f"tree attention: cache_len must be [B] = ({b},) int32, got shape {prefix_len.shape}")
    if tree_mask.shape != (b, t, t):
        raise ValueError(f"tree attention: tree_mask must be [B, T, T] = {(b, t, t)}, got {tree_mask.shape}")


def group_queries(q, tree_mask, hkv: int, rows: int, new_cols: int):
    """q [B, T, Hq, D] -> [B, Hkv, rows, D] (row t * G + g, zero padded); tree mask -> [B, rows, new_cols] int32."""
    b, t, hq, d = q.shape
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))
    mask = jnp.repeat(tree_mask.astype(jnp.int32), g, axis=1)  # [B, T*G, T]
    mask = jnp.pad(mask, ((0, 0), (0, rows - t * g), (0, new_cols - t)))
    return qg, mask


def pad_new(x, cols: int):
    """New keys/values [B, T, Hkv, D] -> [B, cols, Hkv, D] (zero rows; masked off by the padded tree mask)."""
    return jnp.pad(x, ((0, 0), (0, cols - x.shape[1]), (0, 0), (0, 0)))


def merge_splits(o, m, den, t: int, g: int, dtype):
    """Combine per-split partial softmax results o [B, Hkv, P, R, D], m, den [B, Hkv, P, R] into [B, T, Hkv*G, D]."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.where(den > 0, jnp.exp(m - m_all), 0.0)
    num = jnp.sum(o * w[..., None], axis=2)
    total = jnp.sum(den * w, axis=2)
    out = jnp.where(total[..., None] > 0, num / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
    b, hkv, _, d = out.shape
    out = out[:, :, : t * g].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, hkv * g, d).astype(dtype)


def _online_update(carry, scores, visible, v, precision):
    """One flash step: fold a block of scores [R, K] (visible bool [R, K] or [1, K]) and values [K, D] in."""
    o, m, den = carry
    scores = jnp.where(visible, scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.where(visible, jnp.exp(scores - m_safe[:, None]), 0.0)
    alpha = jnp.exp(m - m_safe)  # exp(-inf) = 0 while nothing was visible
    den = alpha * den + jnp.sum(p, axis=1)
    o = alpha[:, None] * o + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return o, m_new, den


def _kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, o_ref, m_ref, l_ref, *, block_k, chunk,
            num_splits, seq_len, scale, precision):
    split = pl.program_id(3)
    length = len_ref[()]
    q = q_ref[...]
    rows = q.shape[0]
    start = split * chunk
    stop = jnp.minimum(jnp.minimum(start + chunk, length), seq_len)
    num_blocks = jnp.maximum(pl.cdiv(stop - start, block_k), 0)
    offs = jnp.arange(block_k, dtype=jnp.int32)

    def body(i, carry):
        first = start + i * block_k
        valid = (first + offs) < stop
        k = plgpu.load(k_ref.at[pl.ds(first, block_k), :], mask=valid[:, None], other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(first, block_k), :], mask=valid[:, None], other=0.0)
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale
        return _online_update(carry, s, valid[None, :], v, precision)

    d = q.shape[1]
    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    carry = jax.lax.fori_loop(0, num_blocks, body, init)

    def fold_new(c):
        kn, vn = kn_ref[...], vn_ref[...]
        s = plgpu.dot(q, kn, trans_b=True, precision=precision) * scale
        return _online_update(c, s, mask_ref[...] != 0, vn, precision)

    o, m, den = jax.lax.cond(split == num_splits - 1, fold_new, lambda c: c, carry)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = den


def plan(batch: int, seq_len: int, hkv: int, row_blocks: int, block_k: int, num_splits: int | None):
    """(block_k, num_splits, chunk): splits give every SM work when B * Hkv is small (flash-decoding)."""
    block_k = min(_pow2(block_k), _pow2(seq_len))
    blocks = max(1, -(-seq_len // block_k))
    if num_splits is None:
        num_splits = max(1, min(blocks, -(-256 // (batch * hkv * row_blocks))))
    if num_splits < 1:
        raise ValueError(f"tree attention: num_splits must be >= 1, got {num_splits}")
    num_splits = min(num_splits, blocks)
    chunk = -(-blocks // num_splits) * block_k
    return block_k, num_splits, chunk


@functools.partial(jax.jit, static_argnames=("interpret", "block_k", "block_m", "num_splits", "scale"))
def prefix_tree_attention_gpu(q, k_cache, v_cache, prefix_len, k_new, v_new, tree_mask, *, interpret=False,
                              block_k=64, block_m=64, num_splits=None, scale=None):
    """Tree attention over a cache prefix plus T new tokens held apart (the model's layout; see module doc).

    q [B, T, Hq, D]; k_cache, v_cache [B, S, Hkv, D] (positions < prefix_len[b] are visible to every query);
    prefix_len [B] int32; k_new, v_new [B, T, Hkv, D]; tree_mask [B, T, T] bool (query i sees new token j).
    Returns [B, T, Hq, D] in q's dtype; softmax in float32. A query that sees nothing returns zeros.
    Tuning: block_k cache positions per loop step, block_m query rows per program, num_splits cache splits
    (default: enough programs to fill a GPU). scale defaults to 1/sqrt(D).
    """
    check_shapes(q, k_cache, v_cache, prefix_len, k_new, v_new, tree_mask)
    b, t, hq, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    dp = _pow2(d)
    if dp != d:  # Triton tiles are powers of two >= 16: pad (copies the cache; real heads are 64/128/256 wide)
        pad = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, dp - d),))  # noqa: E731
        out = prefix_tree_attention_gpu(pad(q), pad(k_cache), pad(v_cache), prefix_len, pad(k_new), pad(v_new),
                                        tree_mask, interpret=interpret, block_k=block_k, block_m=block_m,
                                        num_splits=num_splits, scale=d**-0.5)
        return out[..., :d]
    block_m = min(_pow2(block_m), _pow2(t * g))
    rows = -(-(t * g) // block_m) * block_m
    row_blocks = rows // block_m
    new_cols = _pow2(t)
    block_k, num_splits, chunk = plan(b, s, hkv, row_blocks, block_k, num_splits)
    qg, mask = group_queries(q, tree_mask, hkv, rows, new_cols)
    kn, vn = pad_new(k_new.astype(k_cache.dtype), new_cols), pad_new(v_new.astype(v_cache.dtype), new_cols)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, block_k=block_k, chunk=chunk, num_splits=num_splits, seq_len=s,
                               scale=d**-0.5 if scale is None else scale,
                               precision=precision)
    grid = (b, hkv, row_blocks, num_splits)
    rows_spec = pl.BlockSpec((None, None, block_m, d), lambda i, h, r, p: (i, h, r, 0))
    o, m, den = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None,), lambda i, h, r, p: (i,)),
            rows_spec,
            pl.BlockSpec((None, s, None, d), lambda i, h, r, p: (i, 0, h, 0)),
            pl.BlockSpec((None, s, None, d), lambda i, h, r, p: (i, 0, h, 0)),
            pl.BlockSpec((None, new_cols, None, d), lambda i, h, r, p: (i, 0, h, 0)),
            pl.BlockSpec((None, new_cols, None, d), lambda i, h, r, p: (i, 0, h, 0)),
            pl.BlockSpec((None, block_m, new_cols), lambda i, h, r, p: (i, r, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_m, d), lambda i, h, r, p: (i, h, p, r, 0)),
            pl.BlockSpec((None, None, None, block_m), lambda i, h, r, p: (i, h, p, r)),
            pl.BlockSpec((None, None, None, block_m), lambda i, h, r, p: (i, h, p, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, num_splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, num_splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, num_splits, rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="tree_attention",
    )(prefix_len.astype(jnp.int32), qg, k_cache, v_cache, kn, vn, mask)
    return merge_splits(o, m, den, t, g, q.dtype)
