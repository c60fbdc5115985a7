"""Group-relative outcome advantages (GRPO, Dr. GRPO, RLOO), picked by name from :data:`ADVANTAGE_FNS`.

Rewards come either as ``[P, n]`` (one row per prompt) or flat ``[P * n]`` with the ``n`` samples of a prompt
contiguous (VeRL's interleaved repeat); the output has the input's shape. Every estimator needs ``n >= 2``: with a
single sample there is no group to compare against, so a ValueError is raised at trace time.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = [
    "ADVANTAGE_FNS",
    "compute_advantages",
    "drgrpo_advantages",
    "grpo_advantages",
    "rloo_advantages",
]


def _groups(rewards: jax.Array, group_size: int | None) -> jax.Array:
    """Rewards as float32 ``[P, n]``, validating the group size."""
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim == 2:
        if group_size is not None and group_size != r.shape[1]:
            raise ValueError(f"group_size={group_size} but rewards have shape {r.shape}")
        group_size = r.shape[1]
    elif r.ndim == 1:
        if group_size is None:
            raise ValueError("flat rewards need group_size")
        if group_size < 1 or r.shape[0] % group_size:
            raise ValueError(f"{r.shape[0]} rewards do not split into groups of {group_size}")
    else:
        raise ValueError(f"rewards must be [P*n] or [P, n], got shape {r.shape}")
    if group_size < 2:
        raise ValueError(f"group-relative advantages need group_size >= 2, got {group_size}")
    return r.reshape(-1, group_size)


def grpo_advantages(
    rewards: jax.Array, group_size: int | None = None, *, eps: float = 1e-6, norm_by_std: bool = True
) -> jax.Array:
    """GRPO: ``(r - group mean) / (group std + eps)``; std is unbiased (ddof=1) as in VeRL's ``torch.std``."""
    g = _groups(rewards, group_size)
    adv = g - g.mean(axis=1, keepdims=True)
    if norm_by_std:
        adv = adv / (g.std(axis=1, ddof=1, keepdims=True) + eps)
    return adv.reshape(jnp.shape(rewards))


def drgrpo_advantages(rewards: jax.Array, group_size: int | None = None) -> jax.Array:
    """Dr. GRPO: ``r - group mean`` (no std normalisation, which biases towards easy/hard prompts)."""
    return grpo_advantages(rewards, group_size, norm_by_std=False)


def rloo_advantages(rewards: jax.Array, group_size: int | None = None) -> jax.Array:
    """RLOO: ``r_i - mean_{j != i} r_j``, i.e. ``n / (n - 1) * (r_i - group mean)``."""
    g = _groups(rewards, group_size)
    n = g.shape[1]
    baseline = (g.sum(axis=1, keepdims=True) - g) / (n - 1)
    return (g - baseline).reshape(jnp.shape(rewards))


ADVANTAGE_FNS: dict[str, Callable[..., jax.Array]] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
}


def compute_advantages(name: str, rewards: jax.Array, group_size: int | None = None) -> jax.Array:
    """Advantages by estimator name (a config string): one of :data:`ADVANTAGE_FNS`."""
    if name not in ADVANTAGE_FNS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose from {sorted(ADVANTAGE_FNS)}")
    return ADVANTAGE_FNS[name](rewards, group_size)
