"""Rule-based math rewards: GSM8K answer extraction and exact-match scoring, run in parallel worker processes."""

from tlt_jax.rewards.math_answer import extract_answer, parse_number, score_gsm8k
from tlt_jax.rewards.parallel import BatchScores, ParallelScorer, score_batch

__all__ = ["BatchScores", "ParallelScorer", "extract_answer", "parse_number", "score_batch", "score_gsm8k"]
