"""Model-free n-gram drafter: trees from suffix matches in the row's own context and its GRPO group's other samples.

For n from ``max_ngram`` down to ``min_ngram`` the last n tokens (ending with the root) are looked up in every source
(the row's prompt + output, then the other samples of its group); the tokens following each match (at most
``max_depth``, cut after the first stop token so nothing is proposed across it) are merged into a trie, so siblings
are distinct. Each continuation weighs its match length n, and nodes are chosen best-first by the summed weight of
the continuations through them (a path's empirical probability, longer matches counting more: EAGLE-2's choice by
path probability, with counts for the drafter's probabilities; ties: shallower, then found first) until the verify
budget N is filled; the rest is invalid padding. Host-side numpy: the tree depends only on tokens already committed,
never on verification randomness.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass
class _Node:
    token: int
    parent: int
    order: int
    depth: int = 0
    weight: int = 0
    children: dict = dataclasses.field(default_factory=dict)


def _matches(source: np.ndarray, suffix: np.ndarray) -> np.ndarray:
    """Start indices i (most recent first) with source[i:i+n] == suffix and at least one token after the match."""
    n = len(suffix)
    if len(source) <= n:
        return np.zeros(0, np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(source[:-1], n)
    hits = np.flatnonzero(np.all(windows == suffix[None, :], axis=1))
    return hits[::-1]


@dataclasses.dataclass
class NgramDrafter:
    """Prompt/group lookup drafter producing fixed-size trees (``num_nodes`` incl. the root, depth <= max_depth).

    ``group_ids[b]``: the GRPO group of row b (rows with the same id share sources); None = each row alone.
    """

    num_nodes: int
    max_depth: int
    max_ngram: int = 4
    min_ngram: int = 1
    max_matches: int = 8
    stop_tokens: tuple[int, ...] = ()
    group_ids: Sequence[int] | None = None

    def _continuations(self, b: int, contexts: list[np.ndarray]):
        ctx = contexts[b]
        groups = self.group_ids
        others = [j for j in range(len(contexts)) if j != b and groups is not None and groups[j] == groups[b]]
        stops = set(self.stop_tokens)
        for n in range(min(self.max_ngram, len(ctx)), self.min_ngram - 1, -1):
            suffix = ctx[-n:]
            for src in [ctx] + [contexts[j] for j in others]:
                for i in _matches(src, suffix)[: self.max_matches]:
                    cont = []
                    for t in src[i + n: i + n + self.max_depth]:
                        cont.append(int(t))
                        if int(t) in stops:
                            break
                    yield n, cont

    def propose_one(self, b: int, contexts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, parent, valid) [N] for row b."""
        n_nodes = self.num_nodes
        tokens = np.zeros(n_nodes, np.int32)
        parent = np.zeros(n_nodes, np.int32)
        valid = np.zeros(n_nodes, bool)
        tokens[0], parent[0], valid[0] = contexts[b][-1], -1, True
        trie = [_Node(int(contexts[b][-1]), -1, 0)]
        for n, cont in self._continuations(b, contexts):
            u = 0
            for t in cont:
                if t not in trie[u].children:
                    trie[u].children[t] = len(trie)
                    trie.append(_Node(t, u, len(trie), trie[u].depth + 1))
                u = trie[u].children[t]
                trie[u].weight += n
            if len(trie) > 4 * n_nodes:
                break
        heap = []

        def push(u):
            for v in trie[u].children.values():
                nd = trie[v]
                heapq.heappush(heap, (-nd.weight, nd.depth, nd.order, v))

        push(0)
        slot_of = {0: 0}
        k = 1
        while heap and k < n_nodes:
            _, _, _, v = heapq.heappop(heap)
            slot_of[v] = k
            tokens[k], parent[k], valid[k] = trie[v].token, slot_of[trie[v].parent], True
            k += 1
            push(v)
        return tokens, parent, valid

    def propose(self, contexts: Sequence[Sequence[int]], active=None):
        """Trees [B, N] (tokens, parent, valid) for every row; inactive rows get a root-only tree."""
        arrays = [np.asarray(c, np.int64) for c in contexts]
        b = len(arrays)
        active = np.ones(b, bool) if active is None else np.asarray(active)
        out = [self.propose_one(i, arrays) if active[i] else self._root_only(arrays[i]) for i in range(b)]
        return tuple(np.stack([o[j] for o in out]) for j in range(3))

    __call__ = propose

    def _root_only(self, ctx):
        tokens = np.zeros(self.num_nodes, np.int32)
        tokens[0] = ctx[-1] if len(ctx) else 0
        parent = np.zeros(self.num_nodes, np.int32)
        parent[0] = -1
        valid = np.zeros(self.num_nodes, bool)
        valid[0] = True
        return tokens, parent, valid
