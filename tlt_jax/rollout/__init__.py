"""Rollout engine: prompt once / fork n, K-step decode chunks, compaction into batch buckets, compiled-step pool,
tree speculative decoding (EAGLE or n-gram drafter) once the batch is small."""

from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.params import HiddenCapture, RolloutResult, SamplingParams
from tlt_jax.rollout.pool import StepKey, StepPool
from tlt_jax.rollout.run import arm_share_metrics
from tlt_jax.rollout.spec_steps import SpecConfig
from tlt_jax.rollout.state import DecodeState

__all__ = [
    "DecodeState",
    "HiddenCapture",
    "RolloutEngine",
    "RolloutResult",
    "SamplingParams",
    "SpecConfig",
    "StepKey",
    "StepPool",
    "arm_share_metrics",
]
