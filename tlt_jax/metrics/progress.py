"""tqdm progress bars: the run (RL steps), each step's rollout (finished samples, live requests) and its updates."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

__all__ = ["Progress"]


class Progress:
    """One bar for the run, and per step a rollout bar and a training bar (cleared when the step ends).

    Disabled (``enabled=False``) every method is a no-op and ``write`` prints plainly, so logs stay clean.
    """

    def __init__(self, total_steps: int, initial_step: int = 0, enabled: bool = True, file=None):
        self.enabled = enabled
        self.file = file or sys.stderr
        self._run = (
            tqdm(total=total_steps, initial=initial_step, desc="steps", position=0, file=self.file, dynamic_ncols=True)
            if enabled
            else None
        )
        self._rollout = self._train = None

    def start_rollout(self, total_samples: int) -> None:
        if self.enabled:
            self._rollout = tqdm(
                total=total_samples, desc="rollout", unit="seq", position=1, leave=False, file=self.file
            )

    def rollout_update(self, finished: int, active: int) -> None:
        """Samples finished so far and requests still decoding."""
        if self._rollout is not None:
            self._rollout.n = finished
            self._rollout.set_postfix(active=active, refresh=True)

    def start_train(self, total_updates: int) -> None:
        if self._rollout is not None:
            self._rollout.close()
            self._rollout = None
        if self.enabled:
            self._train = tqdm(total=total_updates, desc="train", unit="upd", position=1, leave=False, file=self.file)

    def train_update(self, loss: float) -> None:
        if self._train is not None:
            self._train.update(1)
            self._train.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def end_step(self) -> None:
        for bar in (self._rollout, self._train):
            if bar is not None:
                bar.close()
        self._rollout = self._train = None
        if self._run is not None:
            self._run.update(1)

    def write(self, line: str) -> None:
        """Print a line (the step table) above the bars."""
        if self.enabled:
            tqdm.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        for bar in (self._rollout, self._train, self._run):
            if bar is not None:
                bar.close()
        self._rollout = self._train = self._run = None
