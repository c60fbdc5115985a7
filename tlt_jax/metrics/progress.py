"""Run progress: tqdm bars on a terminal; plain, periodic lines in a log file (a scheduler's stdout / stderr).

On a terminal there is one bar for the run (RL steps), and per step a rollout bar (finished samples, live requests)
and a training bar (updates). When the bars' stream is not a terminal (``> run.log 2>&1``, SLURM's ``--output``)
bars would fill the log with control sequences, so none is drawn: the step table gives one line per RL step and a
long rollout or update phase adds a plain line at most every ``interval_s`` seconds, e.g.
``step 5 rollout: 24/32 samples done, 8 decoding (40 s)``.
"""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm

__all__ = ["Progress"]

DEFAULT_INTERVAL_S = 30.0


def _is_terminal(stream) -> bool:
    """A terminal, or a notebook (tqdm.auto draws widgets there, not control sequences)."""
    if "ipykernel" in sys.modules and stream in (sys.stdout, sys.stderr):
        return True
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """One bar for the run, and per step a rollout bar and a training bar (cleared when the step ends).

    ``enabled=False``: every method is a no-op and ``write`` prints plainly. ``bars`` (default: whether ``file`` is a
    terminal) chooses tqdm bars or, with bars off, plain progress lines (to stdout, with the step table) at most
    every ``interval_s`` seconds within a step's rollout or update phase.
    """

    def __init__(
        self,
        total_steps: int,
        initial_step: int = 0,
        enabled: bool = True,
        file=None,
        *,
        bars: bool | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock=time.monotonic,
    ):
        self.enabled = enabled
        self.file = file or sys.stderr
        self.bars = enabled and (_is_terminal(self.file) if bars is None else bars)
        self.interval_s = float(interval_s)
        self.clock = clock
        self.step = initial_step + 1  # the RL step in flight
        self._phase: str | None = None  # "rollout" / "train" while plain lines are due
        self._phase_start = self._last_line = 0.0
        self._total = self._updates = 0
        self._run = (
            tqdm(total=total_steps, initial=initial_step, desc="steps", position=0, file=self.file, dynamic_ncols=True)
            if self.bars
            else None
        )
        self._rollout = self._train = None

    # ---- plain lines (no terminal) ----------------------------------------------------------------------------

    def _begin_phase(self, phase: str, total: int) -> None:
        if self.enabled and not self.bars:
            self._phase, self._total = phase, int(total)
            self._phase_start = self._last_line = self.clock()

    def _maybe_line(self, what: str) -> None:
        if self._phase is None:
            return
        now = self.clock()
        if now - self._last_line >= self.interval_s:
            self._last_line = now
            print(f"step {self.step} {self._phase}: {what} ({now - self._phase_start:.0f} s)", flush=True)

    # ---- the hooks of the RL loop -----------------------------------------------------------------------------

    def start_rollout(self, total_samples: int) -> None:
        self._begin_phase("rollout", total_samples)
        if self.bars:
            self._rollout = tqdm(
                total=total_samples, desc="rollout", unit="seq", position=1, leave=False, file=self.file
            )

    def rollout_update(self, finished: int, active: int) -> None:
        """Samples finished so far and requests still decoding."""
        if self._rollout is not None:
            self._rollout.n = finished
            self._rollout.set_postfix(active=active, refresh=True)
        self._maybe_line(f"{finished}/{self._total} samples done, {active} decoding")

    def start_train(self, total_updates: int) -> None:
        if self._rollout is not None:
            self._rollout.close()
            self._rollout = None
        self._begin_phase("train", total_updates)
        self._updates = 0
        if self.bars:
            self._train = tqdm(total=total_updates, desc="train", unit="upd", position=1, leave=False, file=self.file)

    def train_update(self, loss: float) -> None:
        if self._train is not None:
            self._train.update(1)
            self._train.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self._updates += 1
        self._maybe_line(f"{self._updates}/{self._total} updates, loss {loss:.4f}")

    def end_step(self) -> None:
        for bar in (self._rollout, self._train):
            if bar is not None:
                bar.close()
        self._rollout = self._train = None
        self._phase = None
        self.step += 1
        if self._run is not None:
            self._run.update(1)

    def write(self, line: str) -> None:
        """Print a line (the step table) above the bars."""
        if self.bars:
            tqdm.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        for bar in (self._rollout, self._train, self._run):
            if bar is not None:
                bar.close()
        self._rollout = self._train = self._run = None
        self._phase = None
