"""Dense, slot-major KV cache plus a committed length per slot, in one of two layouts:

- stacked: k, v [layers, slots, max_len, kv_heads, head_dim], for models whose layers are stacked and scanned;
- per layer: k, v tuples of ``layers`` arrays [slots, max_len, kv_heads, head_dim], for unstacked models (their
  layers run unrolled, each reading and updating its own array: nothing is sliced out of a stack and copied).

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
    k: jax.Array | tuple[jax.Array, ...]  # [L, B, S, KV, D], or L arrays [B, S, KV, D]
    v: jax.Array | tuple[jax.Array, ...]
    lengths: jax.Array  # [B] int32: committed tokens per slot

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, per_layer: bool = False) -> KVCache:
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        lengths = jnp.zeros((batch,), jnp.int32)
        if per_layer:
            layers = range(cfg.num_layers)
            return cls(tuple(jnp.zeros(shape, dtype) for _ in layers), tuple(jnp.zeros(shape, dtype) for _ in layers),
                       lengths)
        shape = (cfg.num_layers, *shape)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), lengths)

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def batch(self) -> int:
        return self.k[0].shape[0] if self.per_layer else self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1] if self.per_layer else self.k.shape[2]

    def _map(self, fn) -> tuple:
        """(k, v) with ``fn(x, axis)`` applied to each array; ``axis`` is where the slot axis is (1 when stacked)."""
        if self.per_layer:
            return tuple(fn(x, 0) for x in self.k), tuple(fn(x, 0) for x in self.v)
        return fn(self.k, 1), fn(self.v, 1)

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        """Layer ``i``'s keys and values [B, S, KV, D] (a static index: the unrolled layer loop's per-layer read)."""
        return self.k[i], self.v[i]

    def view(self, length: int) -> KVCache:
        """The first ``length`` positions (a cache-length bucket): attention then reads no further. This slices
        (copies) every layer at once; a model forward reads a prefix cheaper with ``attend_len`` (per layer, fused)."""
        return KVCache(*self._map(lambda x, a: jax.lax.slice_in_dim(x, 0, length, axis=a + 1)), self.lengths)

    def pad_to(self, max_len: int) -> KVCache:
        """The same entries in a cache of capacity ``max_len`` (>= the current one), the new positions zero."""
        def pad(x, a):
            widths = [(0, 0)] * x.ndim
            widths[a + 1] = (0, max_len - self.max_len)
            return jnp.pad(x, widths)

        return KVCache(*self._map(pad), self.lengths)

    def attention_mask(self, num_queries: int, length: int | None = None) -> jax.Array:
        """[B, T, S] bool (S = ``length`` or the capacity): every query of a row sees that row's committed keys."""
        s = self.max_len if length is None else length
        visible = jnp.arange(s)[None, :] < self.lengths[:, None]
        return jnp.broadcast_to(visible[:, None, :], (self.batch, num_queries, s))

    def write(self, k_new: jax.Array, v_new: jax.Array, src: jax.Array, count: jax.Array) -> KVCache:
        """Append rows of a forward's new keys/values: row b gets ``new[:, b, src[b, i]]`` for ``i < count[b]``.

        k_new/v_new [L, B, T, KV, D]; src [B, P] int32 indices into T; count [B]. Plain decoding passes
        src = arange(T); tree verification passes the accepted path. Out-of-range positions are dropped.
        """
        p = src.shape[1]
        dtype = self.k[0].dtype if self.per_layer else self.k.dtype
        steps = jnp.arange(p, dtype=jnp.int32)[None, :]
        pos = jnp.where(steps < count[:, None], self.lengths[:, None] + steps, self.max_len)
        rows = jnp.arange(self.batch)[:, None]
        idx = src[None, :, :, None, None]
        kg = jnp.take_along_axis(k_new, idx, axis=2).astype(dtype)
        vg = jnp.take_along_axis(v_new, idx, axis=2).astype(dtype)
        if self.per_layer:  # the picked rows made once (a barrier): fused into each layer's scatter, the gather
            # from the stacked new keys would read every layer's keys 2 x L times (XLA:GPU, batch 64)
            kg, vg = jax.lax.optimization_barrier((kg, vg))
            k = tuple(x.at[rows, pos].set(kg[i], mode="drop") for i, x in enumerate(self.k))
            v = tuple(x.at[rows, pos].set(vg[i], mode="drop") for i, x in enumerate(self.v))
        else:
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
        return KVCache(*self._map(lambda x, a: x[(slice(None),) * a + (rows,)]), self.lengths[rows])
