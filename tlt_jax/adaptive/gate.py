"""Speculation gate with hysteresis: tree decoding turns on only once a wave's live rows have stayed at or under the
threshold for ``patience`` further chunks, and off as soon as they go back above it.

A bare threshold flips on at the first chunk that dips under it, so a wave that hovers around the threshold (rows
finishing while a new wave refills, or a threshold inside a batch bucket) would alternate arms every round trip. The
gate is host state of one wave: ``reset()`` at a wave's start, ``update(live)`` once per round trip before choosing
the arm.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecGate:
    """threshold: speculate only with at most this many live rows (0 = never). patience: consecutive chunks at or
    under the threshold that must pass before speculation turns on (0 = on at the first such chunk)."""

    threshold: int
    patience: int = 0
    _streak: int = 0
    _on: bool = False
    switches: int = 0  # off -> on transitions since construction

    def __post_init__(self):
        if int(self.threshold) != self.threshold or self.threshold < 0:
            raise ValueError(f"SpecGate.threshold must be an integer >= 0 (0 = never speculate), got {self.threshold}")
        if int(self.patience) != self.patience or self.patience < 0:
            raise ValueError(f"SpecGate.patience must be an integer >= 0 (chunks to wait), got {self.patience}")

    @property
    def on(self) -> bool:
        return self._on

    def update(self, live: int) -> bool:
        """Feed the live-row count of the chunk about to run; returns whether it may speculate."""
        if int(live) != live or live < 0:
            raise ValueError(f"SpecGate.update: live must be a row count >= 0, got {live}")
        if self.threshold == 0 or live > self.threshold:
            self._streak, self._on = 0, False
            return False
        self._streak += 1
        was, self._on = self._on, self._streak > self.patience
        self.switches += int(self._on and not was)
        return self._on

    def reset(self) -> None:
        """A new wave: forget the streak (the switch count stays)."""
        self._streak, self._on = 0, False
