"""The EAGLE drafter's state inside ``DecodeState.aux``, kept current lazily.

Plain decode chunks and n-gram verify steps do not run the drafter: they only record the policy hidden state that
produced each generated token (``history``). The drafter's KV cache is caught up over the recorded pairs
(hidden of the fed token, emitted token) at the start of the next EAGLE verify step, in pieces of a fixed size. Rows
that finish, or whose wave never speculates, never pay for the drafter; an EAGLE verify extends the drafter over its
own emitted tokens as before, so its rows stay current. Drafts only propose, so the timing of the catch-up cannot
change an emitted token (the verification is exact); it changes no draft either beyond rounding, since the same
pairs reach the same cache positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tlt_jax.speculative.tree import DraftState, drafter_extend


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LazyDraft:
    """draft: the drafter's DraftState, its cache length at most the policy's (the difference is the pending
    pairs); history [B, M, H]: the policy's final-normed hidden state that produced generated token i, at index i
    (written by the steps that do not extend the drafter)."""

    draft: DraftState
    history: jax.Array

    def replace(self, **kw) -> LazyDraft:
        return dataclasses.replace(self, **kw)


def record_history(sync: LazyDraft, start: jax.Array, hidden: jax.Array, count: jax.Array) -> LazyDraft:
    """Write hidden [B, T, H] at history indices start[b] + j for j < count[b] (the tokens a step emitted)."""
    b, t = hidden.shape[:2]
    m = sync.history.shape[1]
    j = jnp.arange(t, dtype=jnp.int32)[None, :]
    idx = jnp.where(j < count[:, None], start[:, None] + j, m)
    history = sync.history.at[jnp.arange(b)[:, None], idx].set(hidden.astype(sync.history.dtype), mode="drop")
    return sync.replace(history=history)


def pending_pairs(sync: LazyDraft, policy_lengths: jax.Array, done: jax.Array) -> jax.Array:
    """[B] pairs the drafter cache lags behind the policy cache (0 for finished rows: they never draft again)."""
    return jnp.where(done, 0, policy_lengths - sync.draft.cache.lengths)


def catch_up(policy, drafter, sync: LazyDraft, tokens: jax.Array, num_generated: jax.Array, pending: jax.Array,
             *, piece: int, attend_len: int) -> LazyDraft:
    """Extend the drafter over each row's ``pending`` last pairs (history[i], tokens[i]) for the generated indices
    i in [num_generated - pending, num_generated), ``piece`` pairs per extend, until no row has any left."""
    b, m = tokens.shape
    rows = jnp.arange(b)[:, None]
    offsets = jnp.arange(piece, dtype=jnp.int32)[None, :]

    def cond(c):
        return jnp.any(c[1] > 0)

    def body(c):
        ds, left = c
        idx = jnp.clip((num_generated - left)[:, None] + offsets, 0, m - 1)
        count = jnp.minimum(left, piece)
        ds = drafter_extend(policy, drafter, ds, sync.history[rows, idx], tokens[rows, idx], count,
                            attend_len=attend_len)
        return ds, left - count

    draft, _ = jax.lax.while_loop(cond, body, (sync.draft, pending.astype(jnp.int32)))
    return sync.replace(draft=draft)
