"""User-facing rollout types: sampling parameters, hidden-state capture settings, and the result of a rollout."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one ``generate`` call. Values are validated here, before any compute.

    temperature: 0 = greedy. top_k: 0 = off. top_p: 1 = off. max_new_tokens: one int for every prompt, or one per
    prompt. n: samples per prompt (the GRPO group). stop_token_ids: None = the model config's eos_token_ids.
    ignore_eos: never stop on a stop token (forced lengths, for benchmarks). seed: with (prompt index, sample index,
    position) it fixes every random draw, whatever the batch composition.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int | Sequence[int] = 128
    n: int = 1
    stop_token_ids: Sequence[int] | None = None
    seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self):
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if int(self.n) != self.n or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n}")
        if not (0 <= int(self.seed) < 2**32):
            raise ValueError(f"SamplingParams.seed must be in [0, 2**32), got {self.seed}")
        mnt = self.max_new_tokens
        values = [mnt] if isinstance(mnt, int | np.integer) else list(mnt)
        if not values:
            raise ValueError("SamplingParams.max_new_tokens is an empty list; give an int or one value per prompt")
        for v in values:
            if int(v) != v or v < 1:
                raise ValueError(f"SamplingParams.max_new_tokens must be integers >= 1, got {v}")
        if not isinstance(mnt, int | np.integer):
            object.__setattr__(self, "max_new_tokens", tuple(int(v) for v in values))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def max_new_for(self, num_prompts: int) -> list[int]:
        """Per-prompt max_new_tokens (checks the length of a per-prompt list)."""
        if isinstance(self.max_new_tokens, int | np.integer):
            return [int(self.max_new_tokens)] * num_prompts
        if len(self.max_new_tokens) != num_prompts:
            raise ValueError(
                f"SamplingParams.max_new_tokens has {len(self.max_new_tokens)} values for {num_prompts} prompts"
            )
        return list(self.max_new_tokens)


@dataclasses.dataclass(frozen=True)
class HiddenCapture:
    """Keep the policy's final-normed hidden states of a window of each finished sample (drafter training data).

    Entry i of a sample's window is the hidden state whose logits produced generated token ``start + i`` (the
    feature at sequence position prompt_len - 1 + start + i). side="last": the last ``window`` generated tokens;
    side="first": the first ``window``. ``prompt``: when a window starts at the first generated token, it is also
    extended back over up to ``prompt`` positions of the prompt (their hidden states come from the prefill's forward),
    so a drafter trains with the prompt as context, as it sees it when drafting. Samples are kept in completion order
    until ``max_bytes`` (float32 bytes returned) would be exceeded; later ones are dropped (None) and counted in
    stats["hidden_dropped"].
    """

    window: int = 64
    side: str = "last"
    max_bytes: int = 256 * 2**20
    prompt: int = 0

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"HiddenCapture.window must be >= 1, got {self.window}")
        if self.side not in ("last", "first"):
            raise ValueError(f"HiddenCapture.side must be 'last' or 'first', got {self.side!r}")
        if self.max_bytes < 0:
            raise ValueError(f"HiddenCapture.max_bytes must be >= 0, got {self.max_bytes}")
        if self.prompt < 0:
            raise ValueError(f"HiddenCapture.prompt must be >= 0 prompt positions, got {self.prompt}")


@dataclasses.dataclass
class RolloutResult:
    """Outputs of ``RolloutEngine.generate``, nested [prompt][sample].

    tokens: generated ids (a stop token included when hit). logprobs: log_softmax of the raw policy logits at each
    emitted token (not the processed distribution). finish_reason: "stop" | "length". hidden: with capture on, a
    float32 array [w, H] per sample (None when dropped by the cap) and hidden_start its first generated-token index
    (negative: the window begins -hidden_start positions before the response, in the prompt; see HiddenCapture.prompt).
    """

    tokens: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    finish_reason: list[list[str]]
    stats: dict[str, Any]
    hidden: list[list[np.ndarray | None]] | None = None
    hidden_start: list[list[int]] | None = None
