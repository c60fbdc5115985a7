"""EAGLE(-2) drafter: fc([embed(x_{t+1}); h_t]) -> one decoder layer (no input norm, no final norm) -> ĥ_{t+1}.

The policy's embedding and LM head are shared and frozen: the drafter holds neither; callers pass the policy (its
``embed`` / ``logits_from_hidden``) at call time, so only fc + the layer are trainable drafter state.

Optional draft vocabulary (FR-Spec / EAGLE-3 style): ``set_draft_vocab(ids)`` restricts the tokens the drafter can
*propose* to a frequent subset. Tree drafting then runs the LM head over those rows of the policy's head only (the
head is the largest matrix the drafter touches: 49k x 576 for SmolLM2, read once per tree depth). Verification is
unchanged, so this affects acceptance, never losslessness. The ids are not trainable and are saved next to the
weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.models.config import ModelConfig, rope_inv_freq
from tlt_jax.models.layers import DecoderLayer, param, rope_cos_sin
from tlt_jax.models.transformer import build_new_token_mask
from tlt_jax.speculative.tree import draft_head

__all__ = ["DraftVocab", "EagleDrafter", "draft_head", "frequent_tokens", "num_trainable_params"]


class DraftVocab(nnx.Variable):
    """Sorted int32 token ids the drafter may propose (not trained)."""


class EagleDrafter(nnx.Module):
    """Single-layer EAGLE drafter of the policy's shape (``cfg`` is the policy's config); a
    ``tlt_jax.speculative.TreeDrafter``, so tree drafting and the rollout engine take it without importing it."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.config = cfg
        self.dtype = dtype
        self.fc_kernel = param(rngs, (2 * h, h), (None, "embed"), param_dtype)
        self.fc_bias = param(rngs, (h,), ("norm",), param_dtype, nnx.initializers.zeros)
        self.layer = DecoderLayer(cfg, input_norm=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.draft_vocab = nnx.data(None)

    def set_draft_vocab(self, ids) -> None:
        """Restrict proposals to ``ids`` (any order, duplicates dropped); None = the full vocabulary."""
        if ids is None:
            self.draft_vocab = nnx.data(None)
            return
        ids = np.unique(np.asarray(ids, np.int64))
        if ids.size == 0 or ids[0] < 0 or ids[-1] >= self.config.vocab_size:
            raise ValueError(f"draft vocab ids must be non-empty and in [0, {self.config.vocab_size})")
        self.draft_vocab = DraftVocab(jnp.asarray(ids, jnp.int32))

    def vocab_ids(self) -> jax.Array | None:
        """The draft vocabulary [Vd] int32, or None (full vocabulary)."""
        v = self.draft_vocab
        return None if v is None else v[...]

    def fuse(self, token_emb: jax.Array, feature: jax.Array) -> jax.Array:
        """fc over [embed(x_{t+1}); h_t] (embedding first, as EAGLE does)."""
        x = jnp.concatenate([token_emb.astype(self.dtype), feature.astype(self.dtype)], axis=-1)
        return x @ self.fc_kernel[...].astype(self.dtype) + self.fc_bias[...].astype(self.dtype)

    def layer_forward(self, x, positions, new_mask, k_cache=None, v_cache=None, cache_mask=None):
        """The decoder layer on fused inputs; returns (predicted features, (k, v) of the new tokens)."""
        inv = jnp.asarray(rope_inv_freq(self.config).astype(np.float32))
        cos, sin = rope_cos_sin(positions, inv)
        return self.layer(x, cos, sin, new_mask, k_cache, v_cache, cache_mask)

    def __call__(self, policy, next_tokens, features, *, positions=None, segment_ids=None, attention_mask=None):
        """Full-sequence (training) forward: pairs (features[t] = h_t, next_tokens[t] = x_{t+1}) -> ĥ_{t+1} [B, T, H].

        ``segment_ids`` keep packed samples apart (no attention across them); positions restart per segment.
        """
        b, t = next_tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = build_new_token_mask(b, t, attention_mask, segment_ids)
        x = self.fuse(policy.embed(next_tokens), features)
        h, _ = self.layer_forward(x, positions, mask)
        return h


def frequent_tokens(sequences, size: int, always=()) -> np.ndarray:
    """The ``size`` most frequent token ids over ``sequences`` (ties: lower id first), plus ``always``."""
    counts = np.bincount(np.concatenate([np.asarray(s, np.int64).ravel() for s in sequences]))
    order = np.lexsort((np.arange(len(counts)), -counts))
    top = order[counts[order] > 0][:size]
    return np.unique(np.concatenate([top, np.asarray(list(always), np.int64)]))


def num_trainable_params(drafter: EagleDrafter) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(drafter, nnx.Param))))
