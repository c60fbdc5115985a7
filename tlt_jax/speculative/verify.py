"""Lossless tree verification: one policy forward over the tree, a sample per node, the deepest matching path, commit.

Rule S (docs/architecture.md, §4.3): at every node draw a token from exactly the distribution plain decoding
would use there (``processed_logprobs`` + Gumbel-max ``sample_from_logprobs``); a node is accepted iff it is valid,
its token equals its parent's sample and all its ancestors are accepted. The emitted tokens are the samples along the
deepest accepted path: the path's draft tokens and the bonus sample at its end. Greedy is temperature 0 (argmax).

Randomness: the sample that would produce the token at absolute position q uses the key plain decoding uses for q
(``token_keys(seed, request, sample, q)``), so all nodes of one depth share a key. By induction along the walk, the
accepted prefix is plain decoding's, so each sample is the token plain sampling draws at that position (up to
floating point): speculative sampling reproduces plain sampling token for token, whatever the tree holds. That is
why the EAGLE drafter may build sampled rows' trees from these very keys (``coupled_scores``) and stay exact.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tlt_jax.models.kv_cache import KVCache
from tlt_jax.sampling import processed_logprobs, sample_from_logprobs, sample_tokens, token_keys
from tlt_jax.speculative.tree import Tree, _gather, ancestor_matrix, tree_positions


class Acceptance(NamedTuple):
    accepted: jax.Array  # [B, N] bool
    deepest: jax.Array  # [B] node index of the deepest accepted node
    accept_len: jax.Array  # [B] accepted draft tokens (depth of the deepest accepted node)
    path: jax.Array  # [B, D+1] node ids root..deepest, padded with 0 past accept_len


class VerifyOutput(NamedTuple):
    tokens: jax.Array  # [B, D+1] emitted tokens, the first num_emitted valid, -1 after
    logprobs: jax.Array  # [B, D+1] raw log_softmax of the policy logits at the parent node, 0 after
    num_emitted: jax.Array  # [B] after stop-token / budget truncation (0 for inactive rows)
    accept_len: jax.Array  # [B] accepted draft tokens before truncation (the acceptance metric)
    finished: jax.Array  # [B] bool: a stop token was emitted or the budget is used up
    root: jax.Array  # [B] the last emitted token: the next root (no KV yet)
    path: jax.Array  # [B, D+1] node ids of the accepted path
    hidden: jax.Array  # [B, D+1, H] policy features at the path nodes (the drafter's extend input)
    cache: KVCache  # the policy cache with root + accepted path committed (num_emitted rows)


def depth_keys(seed, request_ids, sample_ids, first_position, max_depth: int) -> jax.Array:
    """[B, D+1] keys: entry d samples the token at absolute position first_position + d (the root's sample is d=0).

    ``first_position`` [B] is the position plain decoding would key the next token by (committed length + 1 with
    the convention that a token's key is its own position).
    """
    pos = jnp.asarray(first_position, jnp.int32)[:, None] + jnp.arange(max_depth + 1, dtype=jnp.int32)[None, :]
    return token_keys(seed, jnp.asarray(request_ids)[:, None], jnp.asarray(sample_ids)[:, None], pos)


def tree_forward(policy, cache: KVCache, tree: Tree, max_depth: int, attend_len: int | None = None):
    """One policy forward over the B x N tree tokens (committed prefix visible, tree mask, positions = len + depth);
    attention reads only the first attend_len cache positions (static; None = all)."""
    mask = ancestor_matrix(tree, max_depth)
    positions = tree_positions(tree, cache.lengths)
    return policy(tree.tokens, positions=positions, tree_mask=mask, cache=cache, attend_len=attend_len)


def sample_tree(logits: jax.Array, tree: Tree, keys: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """[B, N] one sample per node from the processed distribution of its logits, keyed by the node's depth."""
    b, n, _ = logits.shape
    bcast = lambda x: jnp.broadcast_to(jnp.asarray(x).reshape(-1, 1) if jnp.ndim(x) else x, (b, n))
    temperature, top_k, top_p = (None if x is None else bcast(x) for x in (temperature, top_k, top_p))
    node_keys = jnp.take_along_axis(keys, jnp.clip(tree.depth, 0, keys.shape[1] - 1), axis=1)
    return sample_tokens(logits, node_keys, temperature, top_k, top_p)


def accept_tree(tree: Tree, samples: jax.Array, max_depth: int) -> Acceptance:
    """Vectorised acceptance: node v accepted iff valid and tokens[v] == samples[parent(v)] along its whole path."""
    parent_sample = _gather(samples, jnp.maximum(tree.parent, 0))
    is_root = jnp.arange(tree.num_nodes)[None, :] == 0
    match = is_root | (tree.valid & (tree.tokens == parent_sample))
    anc = ancestor_matrix(tree, max_depth)
    accepted = ~jnp.any(anc & ~match[:, None, :], axis=-1)
    deepest = jnp.argmax(jnp.where(accepted, tree.depth, -1), axis=1).astype(jnp.int32)
    accept_len = jnp.take_along_axis(tree.depth, deepest[:, None], axis=1)[:, 0]
    on_path = _gather(anc, deepest[:, None])[:, 0]  # [B, N]
    levels = jnp.arange(max_depth + 1, dtype=jnp.int32)
    hit = on_path[:, None, :] & (tree.depth[:, None, :] == levels[None, :, None])
    path = jnp.argmax(hit, axis=-1).astype(jnp.int32)  # [B, D+1]; 0 (root) where no node on that level
    return Acceptance(accepted, deepest, accept_len, path)


def _walk(logits, tree: Tree, keys, temperature, top_k, top_p, active, max_depth: int):
    """Rule S as the walk it describes: from the root, sample the current node with its depth's key; descend into the
    child carrying that token; stop at the first miss. Only the nodes on the realised path are ever sampled, so the
    per-node transform (a full-vocabulary sort for top-k / top-p) runs accept_len + 1 times per row instead of N, and
    the loop exits as soon as every row has missed. The samples are exactly those ``sample_tree`` + ``accept_tree``
    would give on the path (same logits row, same key, same transform). Returns (path, accept_len, emitted)."""
    b, n, _ = logits.shape
    width = max_depth + 1
    rows = jnp.arange(b)
    not_root = jnp.arange(n)[None, :] > 0

    def cond(c):
        d, _, alive, _, _ = c
        return (d < width) & jnp.any(alive)

    def body(c):
        d, node, alive, path, emitted = c
        row_logits = logits[rows, node]  # [B, V]
        logp = processed_logprobs(row_logits, temperature, top_k, top_p)
        s = sample_from_logprobs(jax.lax.dynamic_index_in_dim(keys, d, axis=1, keepdims=False), logp)
        emitted = jax.lax.dynamic_update_index_in_dim(emitted, jnp.where(alive, s, 0), d, axis=1)
        child = tree.valid & not_root & (tree.parent == node[:, None]) & (tree.tokens == s[:, None])
        found = alive & jnp.any(child, axis=1) & (d < max_depth)
        nxt = jnp.where(found, jnp.argmax(child, axis=1).astype(jnp.int32), 0)
        path = jax.lax.dynamic_update_index_in_dim(path, nxt, jnp.minimum(d + 1, max_depth), axis=1)
        path = jnp.where((d < max_depth), path, c[3])
        return d + 1, jnp.where(found, nxt, node), found, path, emitted

    init = (jnp.int32(0), jnp.zeros((b,), jnp.int32), active, jnp.zeros((b, width), jnp.int32),
            jnp.zeros((b, width), jnp.int32))
    _, last, _, path, emitted = jax.lax.while_loop(cond, body, init)
    accept_len = jnp.take_along_axis(tree.depth, last[:, None], axis=1)[:, 0]
    return path, accept_len, emitted


def truncate(tokens, n, stop_tokens, remaining, active):
    """Emitted count after stopping exactly as plain decoding: up to and including the first stop token, at most
    ``remaining`` tokens, 0 for inactive rows. stop_tokens: [S] for every row, or [B, S] per row (-1 pads).
    Returns (count, finished)."""
    width = tokens.shape[1]
    pos = jnp.arange(width, dtype=jnp.int32)[None, :]
    stop_tokens = jnp.asarray(stop_tokens, jnp.int32)
    stop_tokens = stop_tokens[:, None, :] if stop_tokens.ndim == 2 else stop_tokens.reshape(-1)[None, None, :]
    is_stop = jnp.any(tokens[..., None] == stop_tokens, axis=-1) & (pos < n[:, None])
    first_stop = jnp.min(jnp.where(is_stop, pos, width), axis=1)
    count = jnp.minimum(jnp.minimum(n, first_stop + 1), remaining)
    count = jnp.where(active, jnp.maximum(count, 0), 0).astype(jnp.int32)
    finished = active & ((first_stop < count) | (count >= remaining))
    return count, finished


def verify_tree(policy, cache: KVCache, tree: Tree, keys, temperature, top_k, top_p, stop_tokens, remaining,
                active, *, max_depth: int, attend_len: int | None = None) -> VerifyOutput:
    """Verify a tree for every row and commit the accepted path's KV (root + accepted nodes that precede the last
    emitted token: the last emitted token is the next root and gets its KV when it is fed, as in plain decoding).

    keys [B, D+1] from ``depth_keys``; temperature/top_k/top_p [B] (top_k and top_p None: no row filters, no sort
    compiled); stop_tokens [S] or [B, S] (-1 pads); remaining
    [B] tokens left in each row's budget (>= 1 for active rows); active [B] bool. The commit writes at most
    ``remaining`` rows past the committed length. attend_len (static): the forward reads only the first attend_len
    cache positions (a length bucket >= every committed length); the commit still goes to the full cache.
    """
    out = tree_forward(policy, cache, tree, max_depth, attend_len)
    b = tree.tokens.shape[0]
    active = jnp.broadcast_to(jnp.asarray(active, bool), (b,))
    temperature, top_k, top_p = (None if x is None else jnp.broadcast_to(jnp.asarray(x, dt), (b,)) for x, dt in
                                 ((temperature, jnp.float32), (top_k, jnp.int32), (top_p, jnp.float32)))

    def greedy(_):  # all-greedy batch: argmax at every node (what the processed one-hot gives), no sort or noise
        samples = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
        acc = accept_tree(tree, samples, max_depth)
        return acc.path, acc.accept_len, _gather(samples, acc.path)

    def sampled(_):
        return _walk(out.logits, tree, keys, temperature, top_k, top_p, active, max_depth)

    path, accept_len, emitted = jax.lax.cond(jnp.all(temperature <= 0.0), greedy, sampled, None)
    width = max_depth + 1
    count, finished = truncate(emitted, accept_len + 1, stop_tokens, jnp.asarray(remaining), active)
    keep = jnp.arange(width)[None, :] < count[:, None]
    path_logits = _gather(out.logits, path).astype(jnp.float32)
    logprobs = (jnp.take_along_axis(path_logits, jnp.maximum(emitted, 0)[..., None], axis=-1)[..., 0]
                - jax.nn.logsumexp(path_logits, axis=-1))
    root = jnp.take_along_axis(emitted, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    root = jnp.where(count > 0, root, tree.tokens[:, 0])
    new_cache = cache.write(out.k_new, out.v_new, path, count)
    return VerifyOutput(
        tokens=jnp.where(keep, emitted, -1),
        logprobs=jnp.where(keep, logprobs, 0.0),
        num_emitted=count,
        accept_len=accept_len,
        finished=finished,
        root=root,
        path=path,
        hidden=_gather(out.hidden, path),
        cache=new_cache,
    )
