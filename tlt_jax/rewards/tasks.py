"""The RL loop's reward functions: ``reward_fn(examples, completions) -> RewardOutput``.

Kept in the rewards package (which imports neither ``tlt_jax.rl`` nor ``tlt_jax.config``) so the learner, the main
job and tests can use them without an import cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from tlt_jax.rewards.math_answer import has_answer_statement, score_gsm8k
from tlt_jax.rewards.parallel import ParallelScorer

__all__ = ["GSM8KReward", "RewardFn", "RewardOutput", "TargetTokenReward", "example_max_new_tokens"]


@dataclasses.dataclass
class RewardOutput:
    """Scores [P, n] (the RL reward), whether each response is correct [P, n], and counters (timeouts...)."""

    scores: np.ndarray
    correct: np.ndarray
    info: dict[str, float] = dataclasses.field(default_factory=dict)


class RewardFn(Protocol):
    """Scores the ``n`` completions (token ids) of each example (dicts with ``ground_truth``)."""

    def __call__(self, examples: Sequence[dict], completions: Sequence[Sequence[Sequence[int]]]) -> RewardOutput: ...


class TargetTokenReward:
    """The tiny task: reward = fraction of the answer's positions that hold the example's target token
    (``ground_truth``); the answer is the example's ``max_new_tokens`` long when it has one (capped at
    ``max_new_tokens``), else ``max_new_tokens``. Stopping early scores the missing positions as 0. Correct = every
    position is the target."""

    def __init__(self, max_new_tokens: int):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.max_new_tokens = max_new_tokens

    def __call__(self, examples, completions) -> RewardOutput:
        scores = np.array(
            [
                [sum(int(t) == int(ex["ground_truth"]) for t in c[:n]) / n for c in comps]
                for ex, comps in zip(examples, completions, strict=True)
                for n in [example_max_new_tokens(ex, self.max_new_tokens)]
            ],
            np.float32,
        )
        return RewardOutput(scores, scores >= 1.0 - 1e-6)

    def close(self) -> None:
        pass


def example_max_new_tokens(example: dict, cap: int) -> int:
    """An example's own response-length cap (its ``max_new_tokens`` key, e.g. the tiny task's answer length),
    at most ``cap``; ``cap`` when it has none."""
    return min(int(example.get("max_new_tokens", cap)), cap)


class GSM8KReward:
    """GSM8K exact match of the final number, scored in worker processes with a per-item timeout.

    format_weight > 0 adds a format reward, as common GRPO recipes pair with correctness: reward = correct +
    format_weight * (the response states its final answer explicitly, ``has_answer_statement``). ``correct`` (the
    accuracy metric) stays exact match alone; ``reward/format`` is the share of responses with the statement."""

    def __init__(self, tokenizer, num_workers: int = 2, timeout_s: float = 5.0, format_weight: float = 0.0):
        if not format_weight >= 0:
            raise ValueError(f"format_weight must be >= 0, got {format_weight}")
        self.tokenizer = tokenizer
        self.format_weight = float(format_weight)
        self.scorer = ParallelScorer(score_gsm8k, num_workers=num_workers, timeout_s=timeout_s)

    def __call__(self, examples, completions) -> RewardOutput:
        n = len(completions[0])
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for comps in completions for c in comps]
        truths = [ex["ground_truth"] for ex in examples for _ in range(n)]
        out = self.scorer(texts, truths)
        correct = out.scores.reshape(len(examples), n) >= 1.0
        stated = np.array([has_answer_statement(t) for t in texts], bool).reshape(len(examples), n)
        scores = correct.astype(np.float32) + np.float32(self.format_weight) * stated
        info = {"reward/timeouts": float(out.num_timeouts), "reward/errors": float(out.num_errors)}
        if self.format_weight > 0:
            info["reward/format"] = float(stated.mean())
        return RewardOutput(scores, correct, info)

    def close(self) -> None:
        self.scorer.close()
