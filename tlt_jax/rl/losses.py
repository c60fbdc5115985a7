"""Token-level RL losses: PPO-clip policy loss, KL-to-reference estimators, loss aggregation, entropy.

All inputs are ``[B, T]`` per-token arrays with a 0/1 response ``mask`` (advantages may be per sample ``[B]``);
math is done in float32. Aggregation modes, KL estimators and policy losses are registered by name
(:data:`LOSS_AGG_FNS`, :data:`KL_ESTIMATORS`, :data:`POLICY_LOSS_FNS`) so that a config string picks them; the
definitions and clamps follow VeRL (``verl/trainer/ppo/core_algos.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_FNS",
    "POLICY_LOSS_FNS",
    "agg_loss",
    "entropy_from_logits",
    "grpo_loss",
    "kl_penalty",
    "masked_mean",
    "ppo_clip_loss",
    "token_entropy",
]

Metrics = dict[str, jax.Array]


def _lookup(registry: dict, name: str, what: str):
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; choose from {sorted(registry)}")
    return registry[name]


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den`` where ``den > 0``, else 0 (an all-padding batch contributes no loss instead of NaN)."""
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of ``x`` over positions where ``mask`` is 1."""
    mask = jnp.asarray(mask, jnp.float32)
    return _safe_div(jnp.sum(x * mask), jnp.sum(mask))


# ----- loss aggregation -----------------------------------------------------------------------------------------


def _token_mean(loss_mat: jax.Array, mask: jax.Array, norm_len: int | None = None) -> jax.Array:
    """Every response token weighs the same: ``sum(loss * mask) / sum(mask)``."""
    return masked_mean(loss_mat, mask)


def _seq_stats(loss_mat: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    seq_sum = jnp.sum(loss_mat * mask, axis=-1)
    seq_len = jnp.sum(mask, axis=-1)
    return seq_sum, seq_len, (seq_len > 0).astype(jnp.float32)


def _seq_mean_token_sum(loss_mat: jax.Array, mask: jax.Array, norm_len: int | None = None) -> jax.Array:
    """Mean over sequences of each sequence's token sum (rows with no response token are padding, not counted)."""
    seq_sum, _, valid = _seq_stats(loss_mat, mask)
    return masked_mean(seq_sum, valid)


def _seq_mean_token_mean(loss_mat: jax.Array, mask: jax.Array, norm_len: int | None = None) -> jax.Array:
    """Mean over sequences of each sequence's token mean: every sequence weighs the same."""
    seq_sum, seq_len, valid = _seq_stats(loss_mat, mask)
    return masked_mean(_safe_div(seq_sum, seq_len), valid)


def _seq_mean_token_sum_norm(loss_mat: jax.Array, mask: jax.Array, norm_len: int | None = None) -> jax.Array:
    """Dr. GRPO: ``sum(loss * mask) / norm_len`` with ``norm_len`` a constant of the run (the rollout's
    ``max_new_tokens``), never the padded length of a batch, which changes with the step's length bucket."""
    if norm_len is None or norm_len < 1:
        raise ValueError(
            "loss aggregation 'seq-mean-token-sum-norm' needs norm_len >= 1, a constant of the run (e.g. the "
            f"rollout's max_new_tokens), got {norm_len!r}"
        )
    return jnp.sum(loss_mat * mask) / norm_len


LOSS_AGG_FNS: dict[str, Callable[[jax.Array, jax.Array, int | None], jax.Array]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def agg_loss(
    loss_mat: jax.Array, mask: jax.Array, mode: str = "token-mean", *, norm_len: int | None = None
) -> jax.Array:
    """Reduce a ``[B, T]`` per-token loss to a scalar with aggregation ``mode`` (one of :data:`LOSS_AGG_FNS`).
    ``norm_len`` is Dr. GRPO's constant normaliser (needed by ``seq-mean-token-sum-norm`` only)."""
    fn = _lookup(LOSS_AGG_FNS, mode, "loss aggregation mode")
    return fn(jnp.asarray(loss_mat, jnp.float32), jnp.asarray(mask, jnp.float32), norm_len)


# ----- KL estimators --------------------------------------------------------------------------------------------


def _kl_k1(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    return logp - ref_logp


def _kl_abs(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    return jnp.abs(logp - ref_logp)


def _kl_k2(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    return 0.5 * jnp.square(logp - ref_logp)


def _kl_k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Schulman's low-variance, always >= 0 estimator ``exp(d) - d - 1`` with ``d = ref - logp`` (VeRL clamps)."""
    d = jnp.clip(ref_logp - logp, -20.0, 20.0)
    return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "k1": _kl_k1,
    "kl": _kl_k1,
    "abs": _kl_abs,
    "k2": _kl_k2,
    "mse": _kl_k2,
    "k3": _kl_k3,
    "low_var_kl": _kl_k3,
}


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str = "k3") -> jax.Array:
    """Per-token estimate of KL(pi || ref) from tokens sampled by pi; ``kind`` is one of :data:`KL_ESTIMATORS`."""
    fn = _lookup(KL_ESTIMATORS, kind, "KL estimator")
    return fn(jnp.asarray(logp, jnp.float32), jnp.asarray(ref_logp, jnp.float32))


# ----- policy losses --------------------------------------------------------------------------------------------


def ppo_clip_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    agg_mode: str = "token-mean",
    norm_len: int | None = None,
) -> tuple[jax.Array, Metrics]:
    """PPO clipped surrogate with the ratio clipped to ``[1 - clip_low, 1 + clip_high]`` (DAPO clip-higher).

    ``dual_clip_c`` (> 1, VeRL uses 3) additionally caps the loss of negative-advantage tokens at ``-A * c``.
    Returns the aggregated loss and metrics: ``clip_frac`` (tokens whose clipped term is active) and ``approx_kl``
    (k3 estimate of KL(old || new) over response tokens).
    """
    logp = jnp.asarray(logp, jnp.float32)
    old_logp = jnp.asarray(old_logp, jnp.float32)
    mask = jnp.asarray(mask, jnp.float32)
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == logp.ndim - 1:
        adv = adv[..., None]
    adv = jnp.broadcast_to(adv, logp.shape)

    ratio = jnp.exp(jnp.clip(logp - old_logp, -20.0, 20.0))
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = jnp.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
        pg = jnp.where(adv < 0, jnp.minimum(pg, -adv * dual_clip_c), pg)

    metrics = {
        "clip_frac": masked_mean((clipped > unclipped).astype(jnp.float32), mask),
        "approx_kl": masked_mean(_kl_k3(old_logp, logp), mask),
    }
    return agg_loss(pg, mask, agg_mode, norm_len=norm_len), jax.lax.stop_gradient(metrics)


POLICY_LOSS_FNS: dict[str, Callable[..., tuple[jax.Array, Metrics]]] = {"ppo_clip": ppo_clip_loss}


def grpo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    ref_logp: jax.Array | None = None,
    policy_loss: str = "ppo_clip",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    agg_mode: str = "token-mean",
    norm_len: int | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
) -> tuple[jax.Array, Metrics]:
    """Policy loss plus ``kl_coef`` times the aggregated KL to the reference policy (VeRL's ``use_kl_loss``).

    Metrics add ``pg_loss`` and, when ``kl_coef > 0``, ``kl_loss``.
    """
    fn = _lookup(POLICY_LOSS_FNS, policy_loss, "policy loss")
    pg_loss, metrics = fn(
        logp,
        old_logp,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=dual_clip_c,
        agg_mode=agg_mode,
        norm_len=norm_len,
    )
    metrics = {**metrics, "pg_loss": jax.lax.stop_gradient(pg_loss)}
    loss = pg_loss
    if kl_coef > 0.0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        kl = agg_loss(kl_penalty(logp, ref_logp, kl_kind), mask, agg_mode, norm_len=norm_len)
        loss = loss + kl_coef * kl
        metrics["kl_loss"] = jax.lax.stop_gradient(kl)
    return loss, metrics


# ----- entropy --------------------------------------------------------------------------------------------------


def token_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of the softmax over the last axis, per position: ``[..., V] -> [...]`` (``-inf`` logits allowed)."""
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    p = jnp.exp(logp)
    return -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)


def entropy_from_logits(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean token entropy over response positions (a metric; ``logits`` is ``[B, T, V]``, ``mask`` ``[B, T]``)."""
    return masked_mean(token_entropy(logits), mask)
