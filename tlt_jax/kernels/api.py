"""Entry points: pick the Triton kernel or its Mosaic (TPU) variant, and the cache-holds-the-tree form."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax.kernels.tree_attention import prefix_tree_attention_gpu

ATTENTION_IMPLS = ("xla", "pallas")


def _backend(backend: str | None) -> str:
    """'gpu' or 'tpu': explicit, else the default device's platform (CPU runs the Triton kernel interpreted)."""
    if backend is None:
        backend = "tpu" if jax.default_backend() == "tpu" else "gpu"
    if backend not in ("gpu", "tpu"):
        raise ValueError(f"tree attention: backend must be 'gpu' (Triton) or 'tpu' (Mosaic), got {backend!r}")
    return backend


def prefix_tree_attention(q, k_cache, v_cache, prefix_len, k_new, v_new, tree_mask, *, interpret=False,
                          backend=None, **tuning):
    """Attention of T new queries over a cache prefix (positions < prefix_len[b]) plus the T new keys/values kept
    apart from the cache, among which ``tree_mask`` [B, T, T] decides visibility. See ``prefix_tree_attention_gpu``."""
    if _backend(backend) == "tpu":
        from tlt_jax.kernels.tree_attention_tpu import prefix_tree_attention_tpu

        return prefix_tree_attention_tpu(q, k_cache, v_cache, prefix_len, k_new, v_new, tree_mask,
                                         interpret=interpret, **tuning)
    return prefix_tree_attention_gpu(q, k_cache, v_cache, prefix_len, k_new, v_new, tree_mask, interpret=interpret,
                                     **tuning)


def tree_attention(q, k, v, cache_len, tree_mask, *, interpret=False, backend=None, **tuning):
    """Tree attention where the cache already holds the T new tokens at positions cache_len[b] .. + T - 1.

    q [B, T, Hq, D]; k, v [B, S, Hkv, D]; cache_len [B] int32; tree_mask [B, T, T] bool. Query i sees every cache
    position before cache_len[b] and tree position j where tree_mask[b, i, j]; scale 1/sqrt(D). Returns
    [B, T, Hq, D]. The T tree keys are gathered (a [B, T, Hkv, D] read); the prefix is read once by the kernel.
    Requires cache_len[b] + T <= S (positions past S would be clamped).
    """
    t = q.shape[1]
    if k.ndim != 4 or t > k.shape[1]:
        raise ValueError(f"tree_attention: k, v must be [B, S, Hkv, D] with S >= T = {t}, got {k.shape}")
    idx = cache_len.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    idx = jnp.clip(idx, 0, k.shape[1] - 1)[:, :, None, None]
    k_new = jnp.take_along_axis(k, idx, axis=1)
    v_new = jnp.take_along_axis(v, idx, axis=1)
    return prefix_tree_attention(q, k, v, cache_len, k_new, v_new, tree_mask, interpret=interpret,
                                 backend=backend, **tuning)
