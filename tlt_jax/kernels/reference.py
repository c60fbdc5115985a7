"""Dense XLA tree attention: the reference every Pallas kernel is tested against (and the CPU/XLA path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_visibility(cache_len: jax.Array, tree_mask: jax.Array, seq_len: int) -> jax.Array:
    """[B, T, S] bool: query i of row b sees cache positions < cache_len[b] and the tree positions
    cache_len[b] + j with tree_mask[b, i, j]."""
    t = tree_mask.shape[1]
    pos = jnp.arange(seq_len, dtype=jnp.int32)[None, None, :]
    start = cache_len.astype(jnp.int32)[:, None, None]
    rel = pos - start
    in_tree = (rel >= 0) & (rel < t)
    tree_cols = jnp.take_along_axis(
        tree_mask.astype(bool), jnp.broadcast_to(jnp.clip(rel, 0, t - 1), (*tree_mask.shape[:2], seq_len)), axis=2
    )
    return (pos < start) | (in_tree & tree_cols)


def tree_attention_reference(q, k, v, cache_len, tree_mask):
    """Dense grouped-query tree attention with the kernels' contract, softmax in float32.

    q [B, T, Hq, D] (the T new tokens); k, v [B, S, Hkv, D] (the cache, holding the new tokens at positions
    cache_len[b] .. cache_len[b] + T - 1); cache_len [B] int32; tree_mask [B, T, T] bool. Returns [B, T, Hq, D].
    """
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    visible = tree_visibility(cache_len, tree_mask, s)
    qg = q.reshape(b, t, hkv, hq // hkv, d).astype(jnp.float32) * (d**-0.5)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32), precision="highest")
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None, None], probs, 0.0)  # a query that sees nothing gets zeros, as in the kernels
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32), precision="highest")
    return out.reshape(b, t, hq, d).astype(q.dtype)
