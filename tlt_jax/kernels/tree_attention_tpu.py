"""Mosaic (TPU) variant of the tree-attention kernel.

Why a variant: the Triton kernel relies on masked loads at arbitrary offsets and a data-dependent in-kernel loop
over a whole [S, D] row of the cache, neither of which Mosaic offers; and a Mosaic block's last two dimensions must be
(8, 128)-tiled or whole, so a block cannot pick one KV head out of [B, S, Hkv, D]. Here the cache is viewed as
[B, S, Hkv * D] (a free reshape) and the grid (B, KV blocks) walks it with the sequential KV axis innermost: the
block index is clamped to the row's last prefix block, so blocks at or beyond prefix_len are neither fetched (same
block index = no new DMA) nor computed (``pl.when``). Each step handles every KV head and all T * G query rows, so
the prefix is read once; the T new keys are folded in at the last step. Scratch (max, sum, output) is VMEM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tlt_jax.kernels.tree_attention import check_shapes, group_queries, merge_splits, pad_new

_LANES = 128


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _update(h, s, visible, v, m_ref, l_ref, acc_ref, precision):
    """Online-softmax step for KV head h: scores s [R, K], visible bool [R, K], values v [K, D]."""
    s = jnp.where(visible, s, -jnp.inf)
    m_prev = m_ref[h]  # [R, 128], lanes equal
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.where(visible, jnp.exp(s - m_safe[:, :1]), 0.0)
    alpha = jnp.exp(m_prev - m_safe)
    l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
    m_ref[h] = m_new
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
    acc_ref[h] = alpha[:, :1] * acc_ref[h] + pv


def _qk(q, k, scale, precision):
    return jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32) * scale


def _kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, o_ref, m_ref, l_ref, acc_ref, *, block_k,
            num_kv, head_dim, scale, precision):
    b, j = pl.program_id(0), pl.program_id(1)
    length = len_ref[b]
    hkv, rows = q_ref.shape[0], q_ref.shape[1]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j * block_k < length)
    def _prefix_block():
        pos = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        visible = pos < length
        row_ok = (j * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k, head_dim), 0)) < length
        for h in range(hkv):
            cols = pl.ds(h * head_dim, head_dim)
            k = k_ref[:, cols]
            v = jnp.where(row_ok, v_ref[:, cols], 0)  # a partial last block holds undefined rows
            _update(h, _qk(q_ref[h], k, scale, precision), visible, v, m_ref, l_ref, acc_ref, precision)

    @pl.when(j == num_kv - 1)
    def _new_tokens_and_write():
        visible = mask_ref[...] != 0
        for h in range(hkv):
            cols = pl.ds(h * head_dim, head_dim)
            s = _qk(q_ref[h], kn_ref[:, cols], scale, precision)
            _update(h, s, visible, vn_ref[:, cols], m_ref, l_ref, acc_ref, precision)
        den = l_ref[...][:, :, :1]
        o_ref[...] = jnp.where(den > 0, acc_ref[...] / jnp.where(den > 0, den, 1.0), 0.0)


@functools.partial(jax.jit, static_argnames=("interpret", "block_k"))
def prefix_tree_attention_tpu(q, k_cache, v_cache, prefix_len, k_new, v_new, tree_mask, *, interpret=False,
                              block_k=512):
    """Same contract as ``prefix_tree_attention_gpu`` (Mosaic lowering). block_k: a multiple of 128 (KV positions
    per grid step); caches shorter than it are one block."""
    check_shapes(q, k_cache, v_cache, prefix_len, k_new, v_new, tree_mask)
    if block_k % _LANES:
        raise ValueError(f"tree attention (Mosaic): block_k must be a multiple of {_LANES}, got {block_k}")
    b, t, hq, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    rows = _round_up(t * g, 8)
    new_cols = _round_up(t, _LANES)
    block_k = s if s <= block_k else block_k
    num_kv = -(-s // block_k)
    qg, mask = group_queries(q, tree_mask, hkv, rows, new_cols)
    flat = lambda x: x.reshape(x.shape[0], x.shape[1], hkv * d)  # noqa: E731 (free: contiguous)
    kc, vc = flat(k_cache), flat(v_cache)
    kn = flat(pad_new(k_new.astype(k_cache.dtype), new_cols))
    vn = flat(pad_new(v_new.astype(v_cache.dtype), new_cols))
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def kv_map(i, j, lens):  # clamp to the last prefix block: skipped blocks cost no DMA
        last = jnp.maximum(pl.cdiv(lens[i], block_k) - 1, 0)
        return i, jnp.minimum(j, last), 0

    kernel = functools.partial(_kernel, block_k=block_k, num_kv=num_kv, head_dim=d, scale=d**-0.5,
                               precision=precision)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, num_kv),
            in_specs=[
                pl.BlockSpec((None, hkv, rows, d), lambda i, j, lens: (i, 0, 0, 0)),
                pl.BlockSpec((None, block_k, hkv * d), kv_map),
                pl.BlockSpec((None, block_k, hkv * d), kv_map),
                pl.BlockSpec((None, new_cols, hkv * d), lambda i, j, lens: (i, 0, 0)),
                pl.BlockSpec((None, new_cols, hkv * d), lambda i, j, lens: (i, 0, 0)),
                pl.BlockSpec((None, rows, new_cols), lambda i, j, lens: (i, 0, 0)),
            ],
            out_specs=pl.BlockSpec((None, hkv, rows, d), lambda i, j, lens: (i, 0, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((hkv, rows, _LANES), jnp.float32),
                pltpu.VMEM((hkv, rows, _LANES), jnp.float32),
                pltpu.VMEM((hkv, rows, d), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((b, hkv, rows, d), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="tree_attention_tpu",
    )(prefix_len.astype(jnp.int32), qg, kc, vc, kn, vn, mask)
    ones = jnp.ones(out.shape[:3], jnp.float32)  # already normalised: one split with weight 1
    return merge_splits(out[:, :, None], jnp.zeros_like(ones)[:, :, None], ones[:, :, None], t, g, q.dtype)
