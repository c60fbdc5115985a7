"""Adaptive speculation: the arms (off / n-gram / EAGLE tree shapes), the BEG-MAB bandit choosing one per batch
bucket from measured tokens/s, the hysteresis gate that switches speculation on, and multi-process agreement."""

from tlt_jax.adaptive.arms import Arm, max_verify_tokens, parse_arm, parse_arms
from tlt_jax.adaptive.bandit import Bandit, make_bandit
from tlt_jax.adaptive.config import BanditConfig
from tlt_jax.adaptive.estimates import Estimate
from tlt_jax.adaptive.gate import SpecGate
from tlt_jax.adaptive.sync import agreed_all, agreed_seconds

__all__ = [
    "Arm",
    "Bandit",
    "BanditConfig",
    "Estimate",
    "SpecGate",
    "agreed_all",
    "agreed_seconds",
    "make_bandit",
    "max_verify_tokens",
    "parse_arm",
    "parse_arms",
]
