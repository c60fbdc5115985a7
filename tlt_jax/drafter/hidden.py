"""The policy's final-normed features of whole sequences, computed offline in batches: what the drafter is trained
on (warm-up) and evaluated with (``chain_acceptance``)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def pad_prompts(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ids [B, max len] and lengths [B] of non-empty token lists."""
    lens = np.array([len(p) for p in seqs], np.int32)
    if lens.min() < 1:
        raise ValueError("every sequence needs at least one token")
    ids = np.zeros((len(seqs), int(lens.max())), np.int32)
    for i, p in enumerate(seqs):
        ids[i, : len(p)] = p
    return ids, lens


@jax.jit
def _hidden(policy, ids, lengths):
    valid = jnp.arange(ids.shape[1])[None, :] < lengths[:, None]
    return policy(ids, attention_mask=valid, return_logits=False).hidden


def policy_hidden_states(policy, sequences: Sequence[Sequence[int]], batch_size: int = 8) -> list[np.ndarray]:
    """Final-normed policy features [T, H] of each full sequence (prompt + response), one forward per batch of
    similar lengths (sorted by length, padded to a multiple of 64: little padding, few compiled shapes)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[np.ndarray | None] = [None] * len(sequences)
    for i in range(0, len(order), batch_size):
        idx = order[i: i + batch_size]
        chunk = [list(sequences[k]) for k in idx]
        ids, lens = pad_prompts(chunk)
        pad_to = -(-ids.shape[1] // 64) * 64
        ids = np.pad(ids, ((0, batch_size - len(chunk)), (0, pad_to - ids.shape[1])))
        lens = np.pad(lens, (0, batch_size - len(chunk)), constant_values=1)
        h = np.asarray(_hidden(policy, jnp.asarray(ids), jnp.asarray(lens)))
        for j, k in enumerate(idx):
            out[k] = h[j, : len(chunk[j])]
    return out
