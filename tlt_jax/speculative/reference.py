"""Slow, obviously-correct oracles for the tree kernels (tests only): loops over nodes, no vectorisation tricks.

* ``ref_ancestors`` / ``ref_depths``: parent chains walked one node at a time.
* ``ref_accept``: the SGLang-style walk (from the root, descend into the child whose token equals the current
  node's sample, children in index order) instead of the ancestor-matrix formulation.
* ``ref_select``: EAGLE-2's final re-rank with Python sorting.
* ``ref_truncate``: stop-token / budget truncation as a plain loop.
* ``ref_eagle_draft``: EAGLE-2 drafting where every drafter evaluation is a full causal forward over the
  committed pairs plus the node's own path (no KV cache, no tree mask, no scratch slots).
"""

from __future__ import annotations

import numpy as np


def ref_ancestors(parent: np.ndarray) -> np.ndarray:
    n = len(parent)
    anc = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = int(parent[j])
    return anc


def ref_depths(parent: np.ndarray) -> np.ndarray:
    return ref_ancestors(parent).sum(1) - 1


def ref_accept(tokens, parent, valid, samples) -> tuple[list[int], int]:
    """(path node ids root..deepest, accept_len) for one row."""
    n = len(tokens)
    path = [0]
    cur = 0
    while True:
        nxt = [c for c in range(n) if valid[c] and parent[c] == cur and tokens[c] == samples[cur]]
        if not nxt:
            return path, len(path) - 1
        cur = nxt[0]
        path.append(cur)


def ref_truncate(emitted: list[int], stop_tokens, remaining: int) -> list[int]:
    out = []
    for t in emitted:
        if len(out) >= remaining:
            break
        out.append(t)
        if t in stop_tokens:
            break
    return out


def ref_select(scores, tokens, parents, root, num_nodes):
    """One row: (tokens [N], parent [N], valid [N]) keeping the best N-1 candidates (ties: lower index first).

    Selected non-finite candidates (NaN, or -inf padding when there are fewer than N-1) and nodes whose parent is not
    a valid selected node stay in their sorted slot as invalid nodes.
    """
    scores = np.where(np.isnan(scores), -np.inf, np.asarray(scores, np.float64))
    pad = max(num_nodes - 1 - len(scores), 0)
    scores = np.concatenate([scores, np.full(pad, -np.inf)])
    tokens = np.concatenate([tokens, np.zeros(pad, np.int64)])
    parents = np.concatenate([parents, np.full(pad, -1, np.int64)])
    sel = sorted(sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: num_nodes - 1])
    node_of = {cand: k + 1 for k, cand in enumerate(sel)}
    out_t = np.zeros(num_nodes, np.int32)
    out_p = np.zeros(num_nodes, np.int32)
    out_v = np.zeros(num_nodes, bool)
    out_t[0], out_p[0], out_v[0] = root, -1, True
    for k, cand in enumerate(sel):
        p = parents[cand]
        parent_node = 0 if p < 0 else node_of.get(p, -1)
        if not np.isfinite(scores[cand]) or parent_node < 0 or not out_v[parent_node]:
            continue
        out_t[k + 1], out_p[k + 1], out_v[k + 1] = tokens[cand], parent_node, True
    return out_t, out_p, out_v


def ref_eagle_draft(feature_fn, logits_fn, root_feature, depth: int, topk: int, num_nodes: int, root: int):
    """One row. ``feature_fn(path_tokens, path_features)`` -> drafter output after the committed pairs followed by
    the pairs (path_features[i], path_tokens[i]) (a full forward); ``logits_fn(feature)`` -> logits [V]."""

    def logsoftmax(x):
        x = np.asarray(x, np.float64)
        m = x.max()
        return x - m - np.log(np.exp(x - m).sum())

    def top(lp):
        idx = sorted(range(len(lp)), key=lambda i: (-lp[i], i))[:topk]
        return [(float(lp[i]), i) for i in idx]

    # candidate: (score, token, parent candidate, path tokens, path features)
    cands = []
    frontier = []
    for s, t in top(logsoftmax(logits_fn(root_feature))):
        cands.append((s, t, -1))
        frontier.append((s, len(cands) - 1, [t], [root_feature]))
    for _ in range(1, depth):
        children = []
        for s, ci, toks, feats in frontier:
            h = feature_fn(toks, feats)
            for cs, ct in top(logsoftmax(logits_fn(h))):
                children.append((s + cs, ct, ci, toks + [ct], feats + [h]))
        base = len(cands)
        for s, t, ci, _, _ in children:
            cands.append((s, t, ci))
        best = sorted(range(len(children)), key=lambda i: (-children[i][0], i))[:topk]
        frontier = [(children[i][0], base + i, children[i][3], children[i][4]) for i in best]
    scores = np.array([c[0] for c in cands])
    tokens = np.array([c[1] for c in cands])
    parents = np.array([c[2] for c in cands])
    return ref_select(scores, tokens, parents, root, num_nodes), scores
