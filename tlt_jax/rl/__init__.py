"""GRPO-family RL math: group advantages, PPO-clip policy loss, KL-to-reference estimators, loss aggregation."""

from tlt_jax.rl.advantages import (
    ADVANTAGE_FNS,
    compute_advantages,
    drgrpo_advantages,
    grpo_advantages,
    rloo_advantages,
)
from tlt_jax.rl.losses import (
    KL_ESTIMATORS,
    LOSS_AGG_FNS,
    POLICY_LOSS_FNS,
    agg_loss,
    entropy_from_logits,
    grpo_loss,
    kl_penalty,
    masked_mean,
    ppo_clip_loss,
    token_entropy,
)

__all__ = [
    "ADVANTAGE_FNS",
    "KL_ESTIMATORS",
    "LOSS_AGG_FNS",
    "POLICY_LOSS_FNS",
    "agg_loss",
    "compute_advantages",
    "drgrpo_advantages",
    "entropy_from_logits",
    "grpo_advantages",
    "grpo_loss",
    "kl_penalty",
    "masked_mean",
    "ppo_clip_loss",
    "rloo_advantages",
    "token_entropy",
]
