"""Offline acceptance profile of an EAGLE drafter: exact chain-draft accept lengths on given sequences.

At every response position L of a sequence (root = token L, committed = the tokens before it) the drafter state is
built as the engine holds it (extended over the true pairs (h_t, x_{t+1}), t < L), a top-1 chain of ``depth`` tokens
is drafted and compared with the sequence's next tokens. On the policy's own greedy outputs that match count is the
accept length greedy chain verification gets at that position, so one pass predicts the engine's acceptance for every
chain depth up to ``depth`` (and what a deeper draft would buy) without a policy forward per draft: the measure to
compare drafters (learned vs n-gram, before vs after an update) and to pick a chain depth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.drafter.hidden import policy_hidden_states
from tlt_jax.speculative.tree import drafter_prefill, eagle_draft, init_draft_state


@dataclasses.dataclass(frozen=True)
class ChainProfile:
    """accepted[i]: draft tokens matched at the i-th evaluated position (0..depth; fewer where the sequence ends)."""

    accepted: np.ndarray
    depth: int

    @property
    def positions(self) -> int:
        return int(self.accepted.size)

    def conditional(self) -> list[float]:
        """P(draft token d matches | tokens 1..d-1 matched), d = 1..depth (NaN where no position got that far)."""
        a = self.accepted
        return [float(np.mean(a[a >= d - 1] >= d)) if np.any(a >= d - 1) else float("nan")
                for d in range(1, self.depth + 1)]

    def expected_accept(self, depth: int | None = None) -> float:
        """Mean tokens per greedy verify of a top-1 chain of ``depth`` drafts (bonus token included)."""
        d = self.depth if depth is None else depth
        if not 0 <= d <= self.depth:
            raise ValueError(f"depth must be in [0, {self.depth}], got {d}")
        return 1.0 + float(np.minimum(self.accepted, d).mean()) if self.positions else float("nan")

    def summary(self) -> dict:
        return dict(positions=self.positions, depth=self.depth, conditional=self.conditional(),
                    expected_accept=[self.expected_accept(d) for d in range(1, self.depth + 1)])


@partial(jax.jit, static_argnames=("depth",))
def _chains(policy, drafter, ids, hidden, roots_at, *, depth: int):
    """[R, depth] top-1 drafts for rows that share one sequence (ids [R, P], hidden [R, P, H]) with roots at
    ``roots_at`` [R] (each row's drafter cache holds the pairs before its root)."""
    r, p = ids.shape
    state = drafter_prefill(policy, drafter, init_draft_state(policy.config, r, p + depth, hidden.dtype), hidden, ids,
                            roots_at)
    root = jnp.take_along_axis(ids, roots_at[:, None], axis=1)[:, 0]
    tree, _ = eagle_draft(policy, drafter, state, root, depth=depth, topk=1, num_nodes=depth + 1)
    return tree.tokens[:, 1:]


def chain_acceptance(policy, drafter, sequences: Sequence[Sequence[int]], starts: Sequence[int], *, depth: int = 6,
                     hidden: Sequence[np.ndarray] | None = None, rows: int = 32) -> ChainProfile:
    """Chain-draft accept lengths at every position L with starts[i] <= L < len(sequences[i]) - 1.

    sequences: prompt + response token ids (the policy's greedy outputs, for the accept lengths to be greedy
    verification's); starts: the first root of each (its prompt length: roots are response tokens). hidden: the
    policy's final-normed features [T, H] of each sequence (computed with one forward per batch when None).
    rows: positions drafted per compiled call (each row re-extends the drafter over its prefix).
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    if len(starts) != len(sequences):
        raise ValueError(f"{len(starts)} starts for {len(sequences)} sequences")
    if hidden is None:
        hidden = policy_hidden_states(policy, sequences)
    out = []
    for seq, start, h in zip(sequences, starts, hidden, strict=True):
        ids = np.asarray(seq, np.int32)
        n = len(ids)
        if not 1 <= start <= n:
            raise ValueError(f"start {start} outside [1, {n}] for a sequence of {n} tokens")
        roots = np.arange(start, n - 1)
        if roots.size == 0:
            continue
        p = -(-(n + depth) // 64) * 64  # padded length: few compiled shapes
        ids_p = np.zeros((p,), np.int32)
        ids_p[:n] = ids
        hid_p = np.zeros((p, h.shape[-1]), np.float32)
        hid_p[: min(len(h), n)] = np.asarray(h)[:n]  # features may stop before the last token
        for i in range(0, roots.size, rows):
            at = roots[i: i + rows]
            at_p = np.pad(at, (0, rows - at.size), mode="edge")
            drafts = np.asarray(_chains(policy, drafter, jnp.asarray(np.broadcast_to(ids_p, (rows, p))),
                                        jnp.asarray(np.broadcast_to(hid_p, (rows, p, hid_p.shape[-1]))),
                                        jnp.asarray(at_p, jnp.int32), depth=depth))[: at.size]
            for L, d in zip(at, drafts, strict=True):
                truth = ids[L + 1: L + 1 + depth]
                miss = np.nonzero(d[: truth.size] != truth)[0]
                out.append(int(miss[0]) if miss.size else int(truth.size))
    return ChainProfile(np.asarray(out, np.int64), depth)
