"""The host-side controller of one RL step's rollout: slice workers, drafter dispatch and preemption, the timeline.

``Controller.run_step`` starts every slice's share of the rollout on its worker thread, then reacts to completions
on the calling thread (the only thread that touches the state machine and the data buffer): a finished shard's
captured hidden states go into the buffer and the scheduler decides whether that slice (and other idle ones) start
drafter steps; a finished drafter step is followed by another one while any slice is still decoding. Batches are
packed here, before a step is handed to the slice's thread, so they depend only on the dispatch order. At the end
the spot trainer averages its replicas, the timeline is appended to ``timeline.jsonl`` and the merged rollout
result comes back in the original prompt order with per-step metrics.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any

from tlt_jax.controller.scheduler import ControllerConfig, SliceScheduler
from tlt_jax.controller.slices import SlicedRollout, merge_results, progress_hooks
from tlt_jax.drafter.buffer import DrafterBuffer
from tlt_jax.drafter.spot import SpotTrainer
from tlt_jax.rollout import RolloutResult, SamplingParams

TIMELINE_FILE = "timeline.jsonl"


class Controller:
    """Owns the orchestration state of the rollout phase (slices, buffer, spot trainer, timeline).

    trainer / buffer: None = no drafter training (slices that finish early stay idle). workdir: where
    ``timeline.jsonl`` is appended (None = not written). Publishing the averaged drafter to the engines
    (``rollout.set_drafter(trainer.drafter())``) is the caller's decision, between steps.
    """

    def __init__(self, rollout: SlicedRollout, *, trainer: SpotTrainer | None = None,
                 buffer: DrafterBuffer | None = None, cfg: ControllerConfig = ControllerConfig(),
                 workdir: str | os.PathLike | None = None):
        if (trainer is None) != (buffer is None):
            raise ValueError("Controller: give both trainer and buffer (drafter training) or neither")
        if trainer is not None and trainer.num_slices != rollout.num_slices:
            raise ValueError(f"Controller: the trainer has {trainer.num_slices} slices, the rollout "
                             f"{rollout.num_slices}; build the SpotTrainer from rollout.meshes")
        if buffer is not None and any(e.capture is None for e in rollout.engines):
            raise ValueError("Controller: the drafter buffer needs the rollout's hidden states; build the "
                             "SlicedRollout with capture=HiddenCapture(...)")
        if trainer is not None:
            need = max(trainer.batch_multiple)
            if cfg.rows % need:
                raise ValueError(f"ControllerConfig.rows={cfg.rows} must be a multiple of {need} (the batch-parallel "
                                 "devices of a slice) so every drafter batch splits evenly")
        self.rollout, self.trainer, self.buffer, self.cfg = rollout, trainer, buffer, cfg
        self.workdir = None if workdir is None else os.fspath(workdir)
        self.scheduler = SliceScheduler(rollout.num_slices, cfg)
        self.rollout_ended_at = 0.0  # time.perf_counter() when the last run_step's last shard ended

    def _batch(self, step: int, s: int, k: int):
        seed = (step * 1_000_003 + s * 7_919 + k) % 2**32
        return self.buffer.batch(self.cfg.row_len, self.cfg.rows, seed)

    def run_step(self, step: int, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 request_ids: Sequence[int] | None = None,
                 on_chunk: Callable[[int, int], None] | None = None) -> tuple[RolloutResult, dict[str, float]]:
        """Roll out ``prompts`` over all slices, training the drafter on idle ones; returns (result, metrics).
        on_chunk(finished, active): rollout progress summed over slices (see SlicedRollout.generate)."""
        jobs = self.rollout.jobs(prompts, params, request_ids)
        hooks = dict(zip((j.slice for j in jobs), progress_hooks(jobs, on_chunk), strict=True))
        training = self.trainer is not None and self.cfg.train_drafter
        if self.buffer is not None:
            self.buffer.start_step(step)
        if training:
            self.trainer.begin_step(step)
        sched = self.scheduler
        events: queue.Queue = queue.Queue()
        t0, t0_unix = time.perf_counter(), time.time()
        now = lambda: time.perf_counter() - t0
        with_work = {j.slice for j in jobs}
        sched.start(0.0, [s in with_work for s in range(self.rollout.num_slices)])
        job_of = {j.slice: j for j in jobs}
        results: dict[int, RolloutResult] = {}
        local = [0] * self.rollout.num_slices
        inflight: set[concurrent.futures.Future] = set()
        train_metrics: list[dict[str, float]] = []
        swaps = 0

        def submit(kind: str, s: int, fn, *args) -> None:
            fut = self.rollout.workers[s].submit(fn, *args)
            inflight.add(fut)
            fut.add_done_callback(lambda f: events.put((kind, s, f)))

        def dispatch(slices: list[int]) -> None:
            for s in slices:
                submit("train", s, self.trainer.train_step, s, self._batch(step, s, local[s]))
                local[s] += 1

        for j in jobs:
            submit("rollout", j.slice, self.rollout.run_job, j, hooks[j.slice])
        dispatch(sched.poll(0.0, training and self.buffer.ready()))  # slices with no prompt, previous-step data
        error: BaseException | None = None
        while inflight:
            kind, s, fut = events.get()
            inflight.discard(fut)
            t = now()
            if fut.exception() is not None:
                error = error or fut.exception()
            if error is not None:
                continue  # let in-flight work finish, dispatch nothing new, then raise
            if kind == "rollout":
                results[s] = fut.result()
                if self.buffer is not None:
                    self.buffer.add_result(job_of[s].prompts, results[s])
                ready = training and self.buffer.ready()
                dispatch(sched.rollout_done(s, t, can_train=ready))
            else:
                train_metrics.append(fut.result())
                busy = sched.busy() if self.cfg.hot_swap else []
                if busy:  # engines read their drafter at every chunk: the swap lands at the next chunk boundary
                    drafter = self.trainer.replica_drafter(s)
                    for b in busy:
                        self.rollout.engines[b].set_drafter(drafter)
                    swaps += len(busy)
                if sched.train_step_done(s, t):
                    dispatch([s])
        if error is not None:
            if training:
                self.trainer.replicas.clear()
            raise error
        metrics = sched.finish(now())
        self.rollout_ended_at = t0 + sched.rollout_end
        if self.cfg.hot_swap:
            metrics["controller/hot_swaps"] = float(swaps)
        if training:
            metrics.update(self.trainer.end_step())
            for name in ("drafter/loss", "drafter/top1"):
                vals = [m[name] for m in train_metrics]
                if vals:
                    metrics[name] = sum(vals) / len(vals)
        if self.buffer is not None:
            metrics.update(self.buffer.stats())
        self._write_timeline(step, t0_unix, sched.timeline)
        result = merge_results(len(prompts), jobs, [results[j.slice] for j in jobs])
        return result, metrics

    def _write_timeline(self, step: int, t0_unix: float, timeline: list[dict[str, Any]]) -> None:
        """One line per interval: step, slice, state, start / end (seconds since the step began), step_start
        (unix time)."""
        if self.workdir is None:
            return
        os.makedirs(self.workdir, exist_ok=True)
        with open(os.path.join(self.workdir, TIMELINE_FILE), "a") as f:
            for iv in timeline:
                f.write(json.dumps(dict(step=int(step), **iv, step_start=t0_unix)) + "\n")
