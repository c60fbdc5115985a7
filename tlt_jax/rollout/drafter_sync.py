"""The EAGLE drafter's state inside ``DecodeState.aux``, kept current lazily.

No step but an EAGLE verify runs the drafter. Prefill, plain decode chunks and n-gram verify steps only record each
committed position's drafter pair: the policy's final-normed hidden state there and the token one ahead (the prompt's
next token, or the token sampled from it). The drafter's KV cache is caught up over the recorded pairs at the start
of the next EAGLE verify step, in pieces of a fixed size, and an EAGLE verify extends it over its own emitted tokens
(recording their pairs too), so its rows stay current. Rows that finish, or whose wave never speculates, never pay for
the drafter, not even over their prompt. Drafts only propose, so the timing of the catch-up cannot change an emitted
token (the verification is exact); nor does it change a draft beyond rounding, since the same pairs reach the same
cache positions. New drafter weights in the middle of a wave (a hot swap) ``forget`` the cache: every pair of every
position is recorded, so the next catch-up rebuilds it with the new weights from position 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.speculative.tree import DraftState, drafter_extend


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LazyDraft:
    """draft: the drafter's DraftState, its cache length at most the policy's (the difference is the pending pairs).
    Per position t of the sequence, the drafter's pair (h_t, x_{t+1}): hidden [B, S, H] the policy's final-normed
    hidden state at t, next_token [B, S] the token at t + 1."""

    draft: DraftState
    hidden: jax.Array
    next_token: jax.Array

    def replace(self, **kw) -> LazyDraft:
        return dataclasses.replace(self, **kw)


def record_pairs(sync: LazyDraft, start: jax.Array, hidden: jax.Array, next_token: jax.Array,
                 count: jax.Array) -> LazyDraft:
    """Record the pairs (hidden [B, T, H], next_token [B, T]) at positions start[b] + j for j < count[b]."""
    b, t = next_token.shape
    s = sync.next_token.shape[1]
    j = jnp.arange(t, dtype=jnp.int32)[None, :]
    pos = jnp.where(j < count[:, None], start[:, None] + j, s)
    rows = jnp.arange(b)[:, None]
    return sync.replace(
        hidden=sync.hidden.at[rows, pos].set(hidden.astype(sync.hidden.dtype), mode="drop"),
        next_token=sync.next_token.at[rows, pos].set(next_token.astype(jnp.int32), mode="drop"),
    )


def forget(sync: LazyDraft) -> LazyDraft:
    """The drafter's cache emptied on every row (host side, no compile: only its lengths change, to 0): the next
    ``catch_up`` re-extends the drafter over every recorded pair, so no key, value or feature of earlier weights is
    read again. For a hot swap: a cache built by one drafter is not the cache of another."""
    cache = sync.draft.cache
    zero = jax.device_put(np.zeros(cache.lengths.shape, np.int32), cache.lengths.sharding)
    return sync.replace(draft=DraftState(dataclasses.replace(cache, lengths=zero), sync.draft.feature))


def catch_up(policy, drafter, sync: LazyDraft, policy_lengths: jax.Array, done: jax.Array, *, piece: int,
             attend_len: int) -> LazyDraft:
    """Extend the drafter over each live row's recorded pairs from its own cache length up to the policy's,
    ``piece`` pairs per extend, until no live row has any left (finished rows never draft again)."""
    b, s = sync.next_token.shape
    rows = jnp.arange(b)[:, None]
    offsets = jnp.arange(piece, dtype=jnp.int32)[None, :]

    def left(ds):
        return jnp.where(done, 0, policy_lengths - ds.cache.lengths)

    def body(ds):
        idx = jnp.clip(ds.cache.lengths[:, None] + offsets, 0, s - 1)
        count = jnp.minimum(left(ds), piece)
        return drafter_extend(policy, drafter, ds, sync.hidden[rows, idx], sync.next_token[rows, idx], count,
                              attend_len=attend_len)

    draft = jax.lax.while_loop(lambda ds: jnp.any(left(ds) > 0), body, sync.draft)
    return sync.replace(draft=draft)
