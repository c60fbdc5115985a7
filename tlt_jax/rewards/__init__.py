"""Rewards: GSM8K answer extraction and exact-match scoring in parallel worker processes, and the RL loop's reward
functions. Imports neither tlt_jax.rl nor tlt_jax.config (both depend on this package, never the reverse)."""

from tlt_jax.rewards.math_answer import extract_answer, has_answer_statement, parse_number, score_gsm8k
from tlt_jax.rewards.parallel import BatchScores, ParallelScorer, score_batch
from tlt_jax.rewards.tasks import GSM8KReward, RewardFn, RewardOutput, TargetTokenReward, example_max_new_tokens

__all__ = [
    "BatchScores",
    "GSM8KReward",
    "ParallelScorer",
    "RewardFn",
    "RewardOutput",
    "TargetTokenReward",
    "extract_answer",
    "has_answer_statement",
    "parse_number",
    "score_batch",
    "score_gsm8k",
    "example_max_new_tokens",
]
