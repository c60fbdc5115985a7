"""Drafter data buffer: the policy's hidden states and tokens of finished rollout samples, for spot training.

Each sample is the window the rollout engine captured (``HiddenCapture``): hidden states ``h_t`` at w consecutive
positions and the tokens at those positions, so the drafter trains on pairs (h_t, x_{t+1}) -> h_{t+1} with no extra
policy forward. A window that reaches back into the prompt (``HiddenCapture.prompt``) keeps those positions as
context only: the drafter attends to them, as it does when drafting, but is not trained to predict them. Samples of
the current RL step and the previous one are kept ("one-step offset": the previous
step's long responses make up for the short ones that finish first in the current step). Memory is bounded in bytes:
when a new sample does not fit, the oldest samples are dropped first (and counted), so the previous step's early,
short finishers go before its late, long ones.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from tlt_jax.drafter.train import DrafterBatch, pack_sequences


@dataclasses.dataclass(frozen=True)
class BufferSample:
    step: int
    ids: np.ndarray  # [w] int32: token at each captured position
    hidden: np.ndarray  # [w, H] float32: h at each captured position
    response_start: int = 1  # index in ids of the first generated token (earlier entries: prompt context)

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.hidden.nbytes


class DrafterBuffer:
    """Bounded FIFO of captured windows tagged with their RL step; keeps steps ``> current - keep_steps``."""

    def __init__(self, max_bytes: int, keep_steps: int = 2):
        if max_bytes <= 0:
            raise ValueError(f"DrafterBuffer.max_bytes must be > 0, got {max_bytes}")
        if keep_steps < 1:
            raise ValueError(f"DrafterBuffer.keep_steps must be >= 1 (1 = current step only), got {keep_steps}")
        self.max_bytes, self.keep_steps = int(max_bytes), int(keep_steps)
        self.samples: collections.deque[BufferSample] = collections.deque()
        self.nbytes = 0
        self.step: int | None = None
        self.dropped = 0  # samples dropped to respect max_bytes (incl. ones larger than max_bytes)
        self.expired = 0  # samples dropped because their step left the window
        self.skipped = 0  # windows with fewer than 2 positions (no training pair) or no capture

    def start_step(self, step: int) -> None:
        """Begin RL step ``step``: samples older than the kept window expire."""
        if self.step is not None and step < self.step:
            raise ValueError(f"DrafterBuffer.start_step({step}) after step {self.step}: steps must not go back")
        self.step = int(step)
        while self.samples and self.samples[0].step <= step - self.keep_steps:
            self._pop()
            self.expired += 1  # samples are in step order (add tags them with the current step)

    def _pop(self) -> None:
        s = self.samples.popleft()
        self.nbytes -= s.nbytes

    def add(self, prompt: Sequence[int], tokens: Sequence[int], hidden: np.ndarray | None, hidden_start: int) -> bool:
        """Add one finished sample's captured window (``RolloutResult.hidden[i][j]`` and ``hidden_start[i][j]``,
        negative when the window starts in the prompt). Returns whether it was kept."""
        if self.step is None:
            raise ValueError("DrafterBuffer.add before start_step: call start_step(rl_step) first")
        if hidden is None:
            self.skipped += 1
            return False
        hidden = np.asarray(hidden, np.float32)
        w = hidden.shape[0]
        p, m = len(prompt), len(tokens)
        if hidden.ndim != 2 or hidden_start < 1 - p or hidden_start + w > m:
            raise ValueError(
                f"DrafterBuffer.add: hidden window of shape {hidden.shape} starting at generated token "
                f"{hidden_start} does not fit {p} prompt and {m} generated tokens (pass RolloutResult.hidden / "
                "hidden_start)"
            )
        if w + min(hidden_start, 0) < 2:  # no training pair: fewer than 2 positions from the prompt's last on
            self.skipped += 1
            return False
        # Window entry i is h at position p - 1 + start + i; the token there is the previous one in the sequence.
        seq = np.asarray(list(prompt) + list(tokens), np.int32)
        lo = p - 1 + hidden_start
        sample = BufferSample(self.step, seq[lo:lo + w].copy(), hidden, 1 - min(hidden_start, 0))
        if sample.nbytes > self.max_bytes:
            self.dropped += 1
            return False
        while self.nbytes + sample.nbytes > self.max_bytes:
            self._pop()
            self.dropped += 1
        self.samples.append(sample)
        self.nbytes += sample.nbytes
        return True

    def add_result(self, prompts: Sequence[Sequence[int]], result) -> int:
        """Add every captured sample of a RolloutResult (prompts as given to generate); returns how many were kept."""
        if result.hidden is None:
            raise ValueError("DrafterBuffer.add_result: the rollout captured no hidden states; build the engine "
                             "with capture=HiddenCapture(...)")
        kept = 0
        for i, prompt in enumerate(prompts):
            for j, toks in enumerate(result.tokens[i]):
                kept += self.add(prompt, toks, result.hidden[i][j], result.hidden_start[i][j])
        return kept

    def __len__(self) -> int:
        return len(self.samples)

    def ready(self) -> bool:
        return bool(self.samples)

    def batch(self, row_len: int, num_rows: int, seed: int) -> DrafterBatch:
        """A packed batch of fixed shape [num_rows, row_len]: samples in a ``seed``-determined random order, first-fit
        packed (samples that no longer fit are left out of this batch)."""
        if not self.samples:
            raise ValueError("DrafterBuffer.batch: the buffer is empty (check ready() before asking for a batch)")
        order = np.random.default_rng(seed).permutation(len(self.samples))
        order = order[: num_rows * row_len]  # each sample takes >= 1 slot: no more can fit (keeps packing cheap)
        samples = list(self.samples)  # deque indexing is O(n)
        return _pack([samples[k] for k in order], row_len, num_rows)

    def step_batch(self, step: int, row_len: int, num_rows: int) -> DrafterBatch | None:
        """RL step ``step``'s samples in the order they were added, packed like ``batch`` (None if it has none): the
        held-out data of a drafter that has not trained on that step."""
        chosen = [s for s in self.samples if s.step == step][: num_rows * row_len]
        return _pack(chosen, row_len, num_rows) if chosen else None

    def stats(self) -> dict[str, float]:
        cur = sum(s.step == self.step for s in self.samples)
        return {
            "buffer/samples": float(len(self.samples)),
            "buffer/current_step_samples": float(cur),
            "buffer/previous_step_samples": float(len(self.samples) - cur),
            "buffer/bytes": float(self.nbytes),
            "buffer/dropped": float(self.dropped),
            "buffer/expired": float(self.expired),
            "buffer/skipped": float(self.skipped),
        }


def _pack(samples: Sequence[BufferSample], row_len: int, num_rows: int) -> DrafterBatch:
    """First-fit packed rows; the loss starts at each sample's first generated token (prompt entries are context)."""
    return pack_sequences([(s.ids, s.hidden, s.response_start) for s in samples], row_len, num_rows)
