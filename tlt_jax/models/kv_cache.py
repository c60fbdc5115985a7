"""Dense, slot-major KV cache: [layers, slots, max_len, kv_heads, head_dim] plus a committed length per slot.

The model never writes into the cache: a forward returns the keys/values of its new tokens and the caller commits
the ones it keeps (all of them in plain decoding; the accepted path after tree verification).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tlt_jax.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, B, S, KV, D]
    v: jax.Array  # [L, B, S, KV, D]
    lengths: jax.Array  # [B] int32: committed tokens per slot

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def view(self, length: int) -> KVCache:
        """The first ``length`` positions (a cache-length bucket): attention then reads no further. This slices
        (copies) every layer at once; a model forward reads a prefix cheaper with ``attend_len`` (per layer, fused)."""
        return KVCache(self.k[:, :, :length], self.v[:, :, :length], self.lengths)

    def attention_mask(self, num_queries: int, length: int | None = None) -> jax.Array:
        """[B, T, S] bool (S = ``length`` or the capacity): every query of a row sees that row's committed keys."""
        s = self.k.shape[2] if length is None else length
        visible = jnp.arange(s)[None, :] < self.lengths[:, None]
        return jnp.broadcast_to(visible[:, None, :], (self.batch, num_queries, s))

    def write(self, k_new: jax.Array, v_new: jax.Array, src: jax.Array, count: jax.Array) -> KVCache:
        """Append rows of a forward's new keys/values: row b gets ``new[:, b, src[b, i]]`` for ``i < count[b]``.

        k_new/v_new [L, B, T, KV, D]; src [B, P] int32 indices into T; count [B]. Plain decoding passes
        src = arange(T); tree verification passes the accepted path. Out-of-range positions are dropped.
        """
        p = src.shape[1]
        idx = src[None, :, :, None, None]
        kg = jnp.take_along_axis(k_new, idx, axis=2).astype(self.k.dtype)
        vg = jnp.take_along_axis(v_new, idx, axis=2).astype(self.v.dtype)
        steps = jnp.arange(p, dtype=jnp.int32)[None, :]
        pos = jnp.where(steps < count[:, None], self.lengths[:, None] + steps, self.max_len)
        rows = jnp.arange(self.batch)[:, None]
        k = self.k.at[:, rows, pos].set(kg, mode="drop")
        v = self.v.at[:, rows, pos].set(vg, mode="drop")
        return KVCache(k, v, self.lengths + count.astype(jnp.int32))

    def append(self, k_new: jax.Array, v_new: jax.Array, count: jax.Array | None = None) -> KVCache:
        """Append the first ``count[b]`` new tokens of each row (all T when count is None)."""
        b, t = k_new.shape[1], k_new.shape[2]
        src = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if count is None:
            count = jnp.full((b,), t, jnp.int32)
        return self.write(k_new, v_new, src, count)

    def gather(self, rows: jax.Array) -> KVCache:
        """Slots ``rows`` (compaction into a smaller batch bucket, or forking a prompt into n samples)."""
        return KVCache(self.k[:, rows], self.v[:, rows], self.lengths[rows])
