"""The host-side controller of one RL step's rollout: slice workers, drafter dispatch and preemption, the timeline.

``Controller.run_step`` starts every slice's share of the rollout on its worker thread, then reacts to completions
on the calling thread (the only thread that touches the state machine and the data buffer): a finished shard's
captured hidden states go into the buffer and the scheduler decides whether that slice (and other idle ones) start
drafter steps (the first slice to finish while others decode also scores the current drafter on the step's
responses, held out since it never trained on them, after its first step); a finished drafter step is followed by
another one while any slice is still decoding. When the last slice anywhere finishes, drafter work not yet started
on a slice's thread is dropped, so only the work in flight (one step or one scoring per slice) delays the step.
Batches are packed here, before a step is handed to the slice's thread, so they depend only on the dispatch order.
At the end the spot trainer averages its replicas, the timeline is appended to ``timeline.jsonl`` and the merged
rollout result comes back in the original prompt order with per-step metrics.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from tlt_jax.controller.scheduler import BUSY, ControllerConfig, SliceScheduler
from tlt_jax.controller.slices import SlicedRollout, merge_results, progress_hooks
from tlt_jax.distributed.board import Board, BoardError
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
        if trainer is not None and trainer.slices != rollout.local_slices:
            raise ValueError(f"Controller: the trainer has slices {trainer.slices}, the rollout runs "
                             f"{rollout.local_slices} here; build the SpotTrainer from the rollout's meshes")
        if buffer is not None and any(e.capture is None for e in rollout.engines.values()):
            raise ValueError("Controller: the drafter buffer needs the rollout's hidden states; build the "
                             "SlicedRollout with capture=HiddenCapture(...)")
        if trainer is not None:
            need = max(trainer.batch_multiple)
            if cfg.rows % need:
                raise ValueError(f"ControllerConfig.rows={cfg.rows} must be a multiple of {need} (the batch-parallel "
                                 "devices of a slice) so every drafter batch splits evenly")
        self.rollout, self.trainer, self.buffer, self.cfg = rollout, trainer, buffer, cfg
        self.workdir = None if workdir is None else os.fspath(workdir)
        self.scheduler = SliceScheduler(rollout.num_slices, cfg, local=rollout.local_slices)
        self.drafter_critical_s = 0.0  # the last run_step's drafter work after its last shard ended (anywhere)
        # Across processes: finished slices are posted on the coordinator's board; call numbers keep steps apart.
        self.board = Board("tlt_jax/rollout_done") if rollout.across_processes else None
        self.calls = 0

    def _batch(self, step: int, s: int, k: int):
        seed = (step * 1_000_003 + s * 7_919 + k) % 2**32
        return self.buffer.batch(self.cfg.row_len, self.cfg.rows, seed)

    def _heldout_batch(self, step: int, first: bool, last: bool):
        """The batch (this step's responses buffered so far) on which a slice that just finished its share evaluates
        the current drafter (``SpotTrainer.evaluate``, after its first drafter step), or None. It does so when it is
        not the last slice anywhere to finish (it costs the step at most its remainder: a scoring not yet started when
        the rollout ends is dropped), or when it is the first as well (a single slice, or the only one with prompts).
        first / last: as far as this process knows (its view of other processes' slices may lag, which only makes a
        slice look early)."""
        if self.trainer is None or not self.cfg.train_drafter or (last and not first):
            return None
        return self.buffer.step_batch(step, self.cfg.row_len, self.cfg.rows)

    def run_step(self, step: int, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 request_ids: Sequence[int] | None = None,
                 on_chunk: Callable[[int, int], None] | None = None) -> tuple[RolloutResult, dict[str, float]]:
        """Roll out ``prompts`` over all slices, training the drafter on idle ones; returns (result, metrics).
        on_chunk(finished, active): rollout progress summed over this process's slices (see SlicedRollout.generate).
        The drafter replicas' average comes last, and is waited for (its figures are in the metrics): only then do
        this process's deferred compiles start, so they slow neither the drafter work in flight nor the average.
        Across processes every process calls it with the same arguments; each runs its own slices and learns from the
        board when the others' finish, so its idle slices train while any slice anywhere decodes."""
        jobs = self.rollout.jobs(prompts, params, request_ids)
        mine = [j for j in jobs if j.slice in self.rollout.engines]
        hooks = dict(zip((j.slice for j in mine), progress_hooks(mine, on_chunk), strict=True))
        training = self.trainer is not None and self.cfg.train_drafter
        if self.buffer is not None:
            self.buffer.start_step(step)
        if training:
            self.trainer.begin_step(step)
        call, self.calls = self.calls, self.calls + 1
        run = _StepRun(self, step, call, jobs, mine, training)
        run.watch_remote()
        # Released once every slice anywhere has finished its share and the drafter's average is done: their tracing
        # holds the GIL and the host's cores, which drafter steps, the notices of other processes' ends and the average
        # need.
        held = self.rollout.hold_compiles()
        for j in mine:
            run.submit("rollout", j.slice, self.rollout.run_job, j, hooks[j.slice])
        run.dispatch(run.sched.poll(0.0, training and self.buffer.ready()))  # slices with no prompt, previous-step data
        run.loop()
        run.stop_watching.set()
        if run.error is not None:
            self.rollout.release(held)
            if training:
                self.trainer.replicas.clear()
            raise run.error
        results, metrics = self._finish_step(run, held)
        result = merge_results(len(prompts), jobs, [results[j.slice] for j in jobs])
        return result, metrics

    def _finish_step(self, run: _StepRun, held) -> tuple[dict[int, RolloutResult], dict[str, float]]:
        """After the loop: the step's metrics and timeline, merged over processes, the drafter replicas' average, then
        the compiles' release; returns (every slice's result, metrics)."""
        sched, now, training = run.sched, run.now, run.training
        metrics = sched.finish(now())  # the drafter work in flight at the rollout's end has ended
        if self.cfg.hot_swap:
            metrics["controller/hot_swaps"] = float(run.swaps)
        timeline = [dict(iv, process=jax.process_index()) for iv in sched.timeline]
        if self.buffer is not None:  # each process's own buffer (summed over processes below)
            metrics.update(self.buffer.stats())
            metrics["drafter/buffer_tokens"] = float(sum(s.ids.size for s in self.buffer.samples))
            metrics["drafter/dropped"] = float(self.buffer.dropped)
        try:  # (the compiles go even if the exchange or the average fails: a pool left held would never compile)
            # The rollout's results and the controller's metrics and timeline from every process: one exchange.
            results, parts = self.rollout.exchange(run.results,
                                                   dict(metrics=metrics, timeline=timeline, t0=run.t0_unix))
            if self.rollout.across_processes:
                metrics, timeline = merge_processes(metrics, parts)
            averaging = now()
            if training:  # every process's replicas averaged on the devices (one collective), waited for
                self.trainer.average()
                metrics.update(self.trainer.step_metrics())
        finally:
            self.rollout.release(held)
        released = now()
        # When this process let its deferred compiles go, after the last shard anywhere ended (on the first process's
        # clock, as the merged rollout_s; >= 0: none compiled while a slice anywhere still decoded).
        metrics["controller/compile_release_s"] = (released + run.t0_unix - parts[0]["t0"]
                                                   - metrics["controller/rollout_s"])
        # Drafter work after the last shard anywhere ended: the work in flight on any process (the merged
        # ``controller/overhang_s``: the latest end of a process's loop after the last shard, so a step still running on
        # a process whose own slices ended early counts too), then the average (not the exchange, which is the
        # rollout's). ControlledRollout adds publishing.
        self.drafter_critical_s = metrics["controller/overhang_s"] + released - averaging
        self._write_timeline(run.step, run.t0_unix, timeline)
        return results, metrics

    def _write_timeline(self, step: int, t0_unix: float, timeline: list[dict[str, Any]]) -> None:
        """One line per interval: step, slice, state, start / end (seconds since the step began), step_start
        (unix time)."""
        if self.workdir is None:
            return
        os.makedirs(self.workdir, exist_ok=True)
        with open(os.path.join(self.workdir, TIMELINE_FILE), "a") as f:
            for iv in timeline:
                f.write(json.dumps(dict(step=int(step), **iv, step_start=t0_unix)) + "\n")


class _StepRun:
    """One ``run_step``'s loop state: the work in flight on the slices' threads, the events that report its ends (the
    only thread that reacts to them is the caller's), other processes' slices still decoding, and the results."""

    def __init__(self, ctl: Controller, step: int, call: int, jobs: list, mine: list, training: bool):
        self.ctl, self.step, self.call, self.training = ctl, step, call, training
        self.sched = sched = ctl.scheduler
        self.events: queue.Queue = queue.Queue()
        self.t0, self.t0_unix = time.perf_counter(), time.time()
        self.with_work = {j.slice for j in jobs}
        sched.start(0.0, [s in self.with_work for s in range(ctl.rollout.num_slices)])
        self.job_of = {j.slice: j for j in mine}
        # other processes' slices still decoding (as far as known)
        self.remote = {j.slice for j in jobs} - set(self.job_of)
        self.results: dict[int, RolloutResult] = {}
        self.local = [0] * ctl.rollout.num_slices
        self.inflight: set[concurrent.futures.Future] = set()
        self.swaps, self.evaluated = 0, False
        self.error: BaseException | None = None
        self.stop_watching = threading.Event()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def submit(self, kind: str, s: int, fn, *args) -> None:
        fut = self.ctl.rollout.workers[s].submit(fn, *args)
        self.inflight.add(fut)
        fut.add_done_callback(lambda f: self.events.put((kind, s, f)))

    def dispatch(self, slices: list[int]) -> None:
        for s in slices:
            self.submit("train", s, self.ctl.trainer.train_step, s, self.ctl._batch(self.step, s, self.local[s]))
            self.local[s] += 1

    def preempt(self) -> None:
        """The rollout is over everywhere (so all that is left in flight is drafter work): what still waits for its
        slice's thread (a scoring queued behind a drafter step, or a step behind a scoring) is not started, so at
        most the work in flight ends."""
        if not self.sched.busy():
            for fut in list(self.inflight):
                fut.cancel()

    def watch_remote(self) -> None:
        """A watcher thread for each other process's slice (``watch``)."""
        for s in sorted(self.remote):
            threading.Thread(target=self.watch, args=(s,), name=f"board-slice{s}", daemon=True).start()

    def watch(self, s: int) -> None:
        """Another process's slice ``s``: an event as soon as its end is posted on the board, or a failed one (as
        a failed future's) once another process posted its failure or the board's timeout passed."""
        try:
            if self.ctl.board.wait(f"{self.call}/{s}", self.stop_watching):
                self.events.put(("remote", s, None))
        except BoardError as e:
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(e)
            self.events.put(("peer", s, failed))

    def loop(self) -> None:
        """React to completions until nothing is in flight and no other process's slice decodes; the first failure
        goes to ``error`` (work in flight still ends, nothing new starts)."""
        sched, board = self.sched, self.ctl.board
        while self.inflight or self.remote:
            kind, s, fut = self.events.get()
            t = self.now()
            if kind == "remote":  # another process's slice finished: idle now (its drafter steps are its own)
                if self.error is None and s in self.remote:
                    self.remote.discard(s)
                    starts = sched.rollout_done(s, t, can_train=self.training and self.ctl.buffer.ready())
                    self.preempt()
                    self.dispatch(starts)
                continue
            self.inflight.discard(fut)
            if fut.cancelled():  # preempted drafter work (``preempt``)
                if kind == "train" and self.error is None and sched.train_step_dropped(s, t):
                    self.dispatch([s])
                continue
            if fut.exception() is not None and self.error is None:
                self.error = fut.exception()
                if board is not None:  # the other processes' watchers raise it within a second
                    board.post_failure(f"slice {s}'s {kind}: {self.error!r}")
            if self.error is not None:
                # stop waiting for the others: this process raises, and its peers' waits for its slices raise
                # PeerFailedError at the notice just posted (or BoardTimeoutError, or the heartbeat if it died)
                self.remote.clear()
                continue  # let in-flight work finish, dispatch nothing new, then raise
            if kind == "rollout":
                self.rollout_done(s, t, fut.result())
            elif kind == "train":
                self.train_done(s, t)

    def rollout_done(self, s: int, t: float, result: RolloutResult) -> None:
        """Slice ``s`` finished its share: its samples go into the buffer, then its (and idle slices') drafter work."""
        ctl, sched = self.ctl, self.sched
        self.results[s] = result
        if ctl.board is not None:  # first: other processes' slices stop training on this notice
            ctl.board.post(f"{self.call}/{s}")
        if ctl.buffer is not None:
            ctl.buffer.add_result(self.job_of[s].prompts, self.results[s])
        decoding = len(sched.busy())  # slice s included
        heldout = (None if self.evaluated
                   else ctl._heldout_batch(self.step, decoding == len(self.with_work), decoding == 1))
        ready = self.training and ctl.buffer.ready()
        starts = sched.rollout_done(s, t, can_train=ready)
        self.preempt()  # before the steps_without_idle steps the rollout's end may start
        self.dispatch(starts)
        if heldout is not None:  # on this slice's thread, after its first drafter step (training first)
            self.submit("heldout", s, ctl.trainer.evaluate, s, heldout)
            self.evaluated = True

    def train_done(self, s: int, t: float) -> None:
        """A drafter step on slice ``s`` ended: hot-swap its replica into the busy slices, then maybe another step."""
        ctl = self.ctl
        busy = [b for b in self.sched.busy() if b in ctl.rollout.engines] if ctl.cfg.hot_swap else []
        if busy:  # engines read their drafter at every chunk: the swap lands at the next chunk boundary
            drafter = ctl.trainer.replica_drafter(s)
            for b in busy:
                ctl.rollout.engines[b].set_drafter(drafter)
            self.swaps += len(busy)
        if self.sched.train_step_done(s, t):
            self.dispatch([s])


def merge_processes(metrics: dict[str, float], parts: list[dict]) -> tuple[dict[str, float], list[dict]]:
    """Every process's controller metrics and timeline (``parts``, in process order) as one: slice-seconds, step
    counts and the buffers' figures summed, the rollout's end the latest; timelines moved onto the first process's
    clock (``step_start``) and concatenated. Other metrics (the drafter's, already over every process) are this
    process's."""
    base = parts[0]["t0"]
    summed = ("controller/", "buffer/", "drafter/buffer_tokens", "drafter/dropped")
    out = {k: sum(p["metrics"][k] for p in parts) for k in metrics if k.startswith(summed)}
    moved = [dict(iv, start=iv["start"] + p["t0"] - base, end=iv["end"] + p["t0"] - base)
             for p in parts for iv in p["timeline"]]
    # The rollout ends with the last shard anywhere (a process learns of others' ends a little late).
    rollout_end = max((iv["end"] for iv in moved if iv["state"] == BUSY), default=0.0)
    end = max(p["metrics"]["controller/rollout_s"] + p["metrics"]["controller/overhang_s"] + p["t0"] - base
              for p in parts)
    out["controller/rollout_s"], out["controller/overhang_s"] = rollout_end, max(0.0, end - rollout_end)
    out.update({k: v for k, v in metrics.items() if not k.startswith(summed)})
    return out, moved
