"""The controller's state machine: each slice is busy (rolling out), idle, or training the drafter.

Pure host logic driven by events with explicit times, so it runs the same under real threads (``Controller``) and
under scripted timings (``simulate``, used by tests and pod simulations):

- ``start``: every slice with work is busy (a slice with no prompt is idle from the start; ``poll`` dispatches it
  when there is data from the previous step).
- ``rollout_done(s)``: s becomes idle; while some slice is still busy and at least ``min_idle_slices`` slices are
  idle (and there is data), every idle slice is dispatched to train.
- ``train_step_done(s)``: s trains on while a slice is busy; once none is, it stops (an in-flight drafter step
  always finishes, so nothing waits longer than one drafter step; one dispatched but not yet started, queued
  behind the slice's scoring of the drafter, is dropped: ``train_step_dropped``). ``steps_without_idle`` = N > 0:
  after the last rollout ends, slice 0 trains N more steps (the single-slice path, where no slice is ever idle
  mid-rollout).
- ``finish``: closes every interval; the timeline is a list of {slice, state, start, end} covering [0, end] for
  every slice without gaps or overlaps.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

BUSY, IDLE, TRAINING = "busy", "idle", "training"


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """min_idle_slices: idle slices needed before drafter steps are dispatched. steps_without_idle: drafter steps on
    slice 0 after the rollout ends. train_drafter: False = never dispatch (slices just idle). row_len / rows:
    the packed batch shape of every drafter step (fixed: no recompiles). hot_swap: after every drafter step, the
    slice's replica goes to the engines still decoding (used from their next chunk; lossless, so samples stay)."""

    train_drafter: bool = True
    min_idle_slices: int = 1
    steps_without_idle: int = 0
    row_len: int = 256
    rows: int = 4
    hot_swap: bool = False

    def __post_init__(self):
        if self.min_idle_slices < 1:
            raise ValueError(f"ControllerConfig.min_idle_slices must be >= 1, got {self.min_idle_slices}")
        if self.steps_without_idle < 0:
            raise ValueError(f"ControllerConfig.steps_without_idle must be >= 0, got {self.steps_without_idle}")
        if self.row_len < 2 or self.rows < 1:
            raise ValueError(f"ControllerConfig.row_len must be >= 2 and rows >= 1, got {self.row_len}, {self.rows}")


class SliceScheduler:
    """Slice states, dispatch decisions and the timeline of one RL step.

    local: the slices this process runs (default: all). The others' states are followed (their ``rollout_done``
    comes from another process's notice) so that local slices train while any slice anywhere decodes, but only local
    slices are dispatched and only their intervals go into the timeline."""

    def __init__(self, num_slices: int, cfg: ControllerConfig = ControllerConfig(), local: Sequence[int] | None = None):
        if num_slices < 1:
            raise ValueError(f"num_slices must be >= 1, got {num_slices}")
        self.n, self.cfg = int(num_slices), cfg
        self.local = sorted(range(self.n) if local is None else {int(s) for s in local})
        if not set(self.local) <= set(range(self.n)):
            raise ValueError(f"local slices {self.local} out of range [0, {self.n})")
        self.state: list[str] = []
        self.since: list[float] = []
        self.timeline: list[dict] = []
        self.train_steps = [0] * self.n
        self.extra = 0
        self.rollout_over, self.rollout_end = False, 0.0
        self.clock = 0.0

    def _tick(self, t: float) -> None:
        if t < self.clock:
            raise ValueError(f"event at t={t} before the previous event at t={self.clock}: times must not go back")
        self.clock = float(t)

    def _set(self, s: int, state: str, t: float) -> None:
        if self.state[s] != state:
            if t > self.since[s] and s in self.local:
                self.timeline.append(dict(slice=s, state=self.state[s], start=self.since[s], end=t))
            self.state[s], self.since[s] = state, t

    def start(self, t: float, busy: Sequence[bool] | None = None) -> None:
        busy = [True] * self.n if busy is None else list(busy)
        self.state = [BUSY if b else IDLE for b in busy]
        self.since = [float(t)] * self.n
        self.clock = float(t)
        self.timeline, self.train_steps = [], [0] * self.n
        self.rollout_over, self.rollout_end, self.extra = not any(busy), float(t), 0

    def busy(self) -> list[int]:
        return [s for s in range(self.n) if self.state[s] == BUSY]

    def training(self) -> list[int]:
        return [s for s in range(self.n) if self.state[s] == TRAINING]

    def done(self) -> bool:
        return not self.busy() and not self.training()

    def rollout_done(self, s: int, t: float, can_train: bool = True) -> list[int]:
        """Slice s finished its shard at t. Returns the slices to start a drafter step on now."""
        if self.state[s] != BUSY:
            raise ValueError(f"rollout_done: slice {s} is {self.state[s]}, not busy")
        self._tick(t)
        self._set(s, IDLE, t)
        can = self.cfg.train_drafter and can_train
        if self.busy():
            return self.poll(t, can)
        self.rollout_over, self.rollout_end = True, float(t)
        self.extra = self.cfg.steps_without_idle if can and 0 in self.local else 0
        if self.extra and self.state[0] == IDLE:
            self.extra -= 1
            self._set(0, TRAINING, t)
            return [0]
        return []

    def poll(self, t: float, can_train: bool = True) -> list[int]:
        """While the rollout runs: if at least ``min_idle_slices`` slices are idle (and there is data), dispatch them
        all. Also called right after ``start`` (a slice with no prompt can train on the previous step's data)."""
        self._tick(t)
        idle = [i for i in self.local if self.state[i] == IDLE]
        if not self.busy() or not (self.cfg.train_drafter and can_train) or len(idle) < self.cfg.min_idle_slices:
            return []
        for i in idle:
            self._set(i, TRAINING, t)
        return idle

    def train_step_done(self, s: int, t: float) -> bool:
        """A drafter step on s ended at t. True: start another one on s; False: s is idle now."""
        if self.state[s] != TRAINING:
            raise ValueError(f"train_step_done: slice {s} is {self.state[s]}, not training")
        self._tick(t)
        self.train_steps[s] += 1
        return True if self.busy() else self._extra_step_or_idle(s, t)

    def train_step_dropped(self, s: int, t: float) -> bool:
        """The drafter step dispatched on s never started (preempted at the rollout's end). True: start another one
        on s (a ``steps_without_idle`` step); False: s is idle now."""
        if self.state[s] != TRAINING:
            raise ValueError(f"train_step_dropped: slice {s} is {self.state[s]}, not training")
        self._tick(t)
        return self._extra_step_or_idle(s, t)

    def _extra_step_or_idle(self, s: int, t: float) -> bool:
        """No slice decodes any more: slice 0 runs what is left of its ``steps_without_idle`` steps, any other goes
        idle at t."""
        if s == 0 and self.extra > 0:
            self.extra -= 1
            return True
        self._set(s, IDLE, t)
        return False

    def finish(self, t: float) -> dict[str, float]:
        """Close the step at t (nothing may still run); per-step metrics summed over slices."""
        if not self.done():
            raise ValueError(f"finish: slices {self.busy() + self.training()} still running")
        self._tick(t)
        for s in range(self.n):
            if t > self.since[s] and s in self.local:
                self.timeline.append(dict(slice=s, state=self.state[s], start=self.since[s], end=float(t)))
            self.since[s] = float(t)
        total = {BUSY: 0.0, IDLE: 0.0, TRAINING: 0.0}
        for iv in self.timeline:
            total[iv["state"]] += iv["end"] - iv["start"]
        return {
            "controller/busy_s": total[BUSY],
            "controller/idle_s": total[IDLE],
            "controller/train_s": total[TRAINING],
            "controller/rollout_s": self.rollout_end,  # when the last shard ended
            "controller/overhang_s": float(t) - self.rollout_end,  # drafter steps finishing after it
            "controller/train_steps": float(sum(self.train_steps)),
            "controller/train_slices": float(sum(k > 0 for k in self.train_steps)),
            **{f"controller/train_steps/slice_{s}": float(k) for s, k in enumerate(self.train_steps)},
        }


def simulate(rollout_s: Sequence[float | None], train_step_s: float, cfg: ControllerConfig = ControllerConfig(),
             can_train: bool = True) -> tuple[SliceScheduler, dict[str, float]]:
    """Run the state machine on scripted timings: slice s's rollout ends at ``rollout_s[s]`` (None: no work) and
    every drafter step takes ``train_step_s``. Returns the scheduler (timeline, counts) and the step's metrics."""
    if train_step_s <= 0:
        raise ValueError(f"train_step_s must be > 0, got {train_step_s}")
    sched = SliceScheduler(len(rollout_s), cfg)
    sched.start(0.0, [r is not None for r in rollout_s])
    events = [(float(r), 0, s) for s, r in enumerate(rollout_s) if r is not None]  # (time, kind, slice); 0 = rollout
    events += [(train_step_s, 1, s) for s in sched.poll(0.0, can_train)]
    heapq.heapify(events)
    end = 0.0
    while events:
        t, kind, s = heapq.heappop(events)
        end = max(end, t)
        starts = sched.rollout_done(s, t, can_train) if kind == 0 else ([s] if sched.train_step_done(s, t) else [])
        for i in starts:
            heapq.heappush(events, (t + train_step_s, 1, i))
    return sched, sched.finish(end)
