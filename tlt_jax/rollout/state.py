"""Per-row decode state: one pytree that every compiled step takes (donated) and returns.

Layout (B = batch bucket, S = cache capacity max_len, M = output capacity = max_len, L/KV/D/H = model shape,
NS = stop-token slots, W = hidden-capture window). Every field has the batch on axis 0, except the KV cache (axis 1):

  cache          KVCache k, v [L, B, S, KV, D] (an unstacked policy: L arrays [B, S, KV, D]); lengths [B] int32 =
                 committed tokens (prompt + generated - 1: the last emitted token is fed, and committed, by the next
                 step)
  last_token     [B] int32   last emitted token (the next step's input), at position cache.lengths
  num_generated  [B] int32   tokens emitted so far (also the write index into tokens / logprobs)
  done           [B] bool    finished (stop token or max_new reached) or padding; done rows are frozen: no emit,
                             no cache write, no counter change
  max_new        [B] int32   per-row limit of generated tokens
  temperature    [B] f32, top_k [B] int32, top_p [B] f32     per-row sampling parameters
  seed           [B] uint32, request_id [B] int32, sample_id [B] int32   counter-based key inputs (with position)
  stop_ids       [B, NS] int32  stop tokens, -1 padded (all -1 with ignore_eos)
  tokens         [B, M] int32   emitted tokens, index i = i-th generated token
  logprobs       [B, M] f32     log_softmax of the raw policy logits at each emitted token
  hidden         [B, W, H] f32 or None   final-normed hidden state that produced generated token i, at slot
                             i % W (side "last", a ring) or i (side "first", i < W)
  aux            None, or an extension pytree: leaves with the batch on axis 0, or KVCache instances (batch on axis 1);
                 compaction gathers it like the rest. With an EAGLE drafter: a LazyDraft = its DraftState (1-layer
                 KV cache [1, B, S + tree scratch, KV, D] with lengths <= cache.lengths, and the feature [B, H] that
                 ranks the next root's children) and the drafter's input pair at every committed position
                 (hidden [B, S, H], next_token [B, S]); only EAGLE verify steps run the drafter, first catching it
                 up over the pairs the prefill, plain and n-gram steps recorded

A token's position in its sequence is prompt_len + i for generated token i; its random key is
token_keys(seed, request_id, sample_id, position).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from tlt_jax.distributed import LogicalRules
from tlt_jax.models import KVCache, ModelConfig

CACHE_AXES = ("layers", "batch", None, "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    cache: KVCache
    last_token: jax.Array
    num_generated: jax.Array
    done: jax.Array
    max_new: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    request_id: jax.Array
    sample_id: jax.Array
    stop_ids: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    hidden: jax.Array | None = None
    aux: Any = None

    def replace(self, **kw) -> DecodeState:
        return dataclasses.replace(self, **kw)

    @property
    def batch(self) -> int:
        return self.done.shape[0]

    @property
    def active(self) -> jax.Array:
        return ~self.done



class StepInfo(NamedTuple):
    """What the host reads back after every compiled step, by name. On device it travels packed into one int32 array
    [rows, B] (``pack``: a single device-to-host transfer per round trip); the host rebuilds it with ``unpack``.

    done [B]: finished or padding. num_generated [B]: tokens emitted so far. verifies [B]: verify steps the row took
    part in, accepted [B]: accepted draft tokens (both only after speculative steps, else None). tokens [R, B]: the
    tokens the call emitted, -1 padded (only when the host drafts, n-gram; else None).
    """

    done: Any
    num_generated: Any
    verifies: Any = None
    accepted: Any = None
    tokens: Any = None

    def pack(self) -> jax.Array:
        rows = [self.done.astype(jnp.int32)[None], self.num_generated.astype(jnp.int32)[None]]
        if self.verifies is not None:
            rows += [self.verifies.astype(jnp.int32)[None], self.accepted.astype(jnp.int32)[None]]
        if self.tokens is not None:
            rows.append(self.tokens.astype(jnp.int32))
        return jnp.concatenate(rows, axis=0)

    @classmethod
    def unpack(cls, packed: np.ndarray, speculative: bool) -> StepInfo:
        """Host view of a packed array (``speculative``: it came from a verify step)."""
        a = np.asarray(packed)
        base = 4 if speculative else 2
        return cls(
            done=a[0].astype(bool),
            num_generated=a[1].astype(np.int64),
            verifies=a[2].astype(np.int64) if speculative else None,
            accepted=a[3].astype(np.int64) if speculative else None,
            tokens=a[base:] if a.shape[0] > base else None,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowInit:
    """Per-row inputs of the prefill/fork step (host-built numpy arrays, [B] or [B, NS])."""

    src: jax.Array  # [B] int32: index of the row's prompt in the prefill batch
    valid: jax.Array  # [B] bool: a real sample (False = padding row)
    max_new: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    request_id: jax.Array
    sample_id: jax.Array
    stop_ids: jax.Array


def gather_rows(tree: Any, rows: jax.Array) -> Any:
    """Rows ``rows`` of a state-like pytree (KVCache leaves: batch axis 1; everything else: axis 0)."""

    def one(x):
        if isinstance(x, KVCache):
            return x.gather(rows)
        return None if x is None else x[rows]

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, KVCache))


def _batch_logical(x) -> tuple:
    return ("batch",) + (None,) * (len(x.shape) - 1)


def tree_shardings(tree: Any, mesh: Mesh, rules: LogicalRules) -> Any:
    """NamedShardings for a state-like pytree: batch on ('data', 'fsdp') where divisible, KV heads on 'tensor'."""

    def one(x):
        if isinstance(x, KVCache):
            if isinstance(x.k, tuple):  # per layer: each [B, S, KV, D]
                per = tuple(NamedSharding(mesh, rules.spec(CACHE_AXES[1:], mesh, a.shape)) for a in x.k)
                return KVCache(per, per, one(x.lengths))
            ax = rules.spec(CACHE_AXES, mesh, x.k.shape)
            return KVCache(NamedSharding(mesh, ax), NamedSharding(mesh, ax), one(x.lengths))
        return NamedSharding(mesh, rules.spec(_batch_logical(x), mesh, x.shape))

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, KVCache))


def empty_state(
    cfg: ModelConfig, batch: int, max_len: int, *, num_stop: int, capture_window: int = 0, dtype=jnp.float32,
    per_layer_cache: bool = False,
) -> DecodeState:
    """An all-padding state (every row done). Used for shapes (jax.eval_shape) when compiling ahead of time."""
    b = batch
    hidden = jnp.zeros((b, capture_window, cfg.hidden_size), jnp.float32) if capture_window else None
    return DecodeState(
        cache=KVCache.zeros(cfg, b, max_len, dtype, per_layer_cache),
        last_token=jnp.zeros((b,), jnp.int32),
        num_generated=jnp.zeros((b,), jnp.int32),
        done=jnp.ones((b,), bool),
        max_new=jnp.ones((b,), jnp.int32),
        temperature=jnp.zeros((b,), jnp.float32),
        top_k=jnp.zeros((b,), jnp.int32),
        top_p=jnp.ones((b,), jnp.float32),
        seed=jnp.zeros((b,), jnp.uint32),
        request_id=jnp.zeros((b,), jnp.int32),
        sample_id=jnp.zeros((b,), jnp.int32),
        stop_ids=jnp.full((b, num_stop), -1, jnp.int32),
        tokens=jnp.zeros((b, max_len), jnp.int32),
        logprobs=jnp.zeros((b, max_len), jnp.float32),
        hidden=hidden,
    )
