"""Parallel reward scoring in worker processes, with a per-item timeout, so a slow reward never stalls an RL step.

Each item runs under a ``SIGALRM`` interval timer inside its worker (POSIX only); an item that times out or raises
scores 0.0 and is counted. A worker that dies or hangs in uninterruptible code is caught by a whole-batch deadline:
its items score 0.0 and the pool is rebuilt on the next call. Workers are started with ``spawn`` (safe next to JAX's
threads), once, and reused across calls.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import math
import multiprocessing
import signal
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from tlt_jax.rewards.math_answer import score_gsm8k

__all__ = ["BatchScores", "ParallelScorer", "score_batch"]

ScoreFn = Callable[[str, str], float]
_OK, _TIMEOUT, _ERROR = 0, 1, 2


class BatchScores(NamedTuple):
    """Scores of one batch (float32, 0.0 for failed items) and how many items timed out or raised."""

    scores: np.ndarray
    num_timeouts: int
    num_errors: int


class _ItemTimeout(Exception):
    pass


def _raise_timeout(signum, frame):
    raise _ItemTimeout


def _init_worker() -> None:
    signal.signal(signal.SIGALRM, _raise_timeout)
    # A scheduler's SIGTERM (SLURM signals every process of the step) or a terminal's Ctrl-C (the whole process group)
    # must not kill the workers mid-step: the main process finishes the step, saves, and shuts the pool down.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _score_chunk(score_fn: ScoreFn, pairs: list[tuple[str, str]], timeout_s: float) -> list[tuple[float, int]]:
    """Worker side: score each pair under its own timer; never raises for a bad item."""
    out = []
    for completion, ground_truth in pairs:
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            try:
                score = float(score_fn(completion, ground_truth))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            out.append((score, _OK) if math.isfinite(score) else (0.0, _ERROR))
        except _ItemTimeout:
            out.append((0.0, _TIMEOUT))
        except Exception:
            out.append((0.0, _ERROR))
    return out


class ParallelScorer:
    """A reusable pool of scoring processes; call it on a batch, ``close()`` it (or use ``with``) when done.

    ``score_fn(completion, ground_truth) -> float`` must be picklable (a module-level function).
    """

    def __init__(
        self,
        score_fn: ScoreFn = score_gsm8k,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        grace_s: float = 30.0,
        mp_context: str = "spawn",
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.score_fn, self.num_workers, self.timeout_s = score_fn, num_workers, timeout_s
        self.grace_s = grace_s  # slack on the whole-batch deadline (covers worker start-up)
        self._context = multiprocessing.get_context(mp_context)
        self._executor: cf.ProcessPoolExecutor | None = None

    def _pool(self) -> cf.ProcessPoolExecutor:
        if self._executor is None:
            self._executor = cf.ProcessPoolExecutor(
                self.num_workers, mp_context=self._context, initializer=_init_worker
            )
        return self._executor

    def __call__(
        self, completions: Sequence[str], ground_truths: Sequence[str], timeout_s: float | None = None
    ) -> BatchScores:
        """Score ``completions[i]`` against ``ground_truths[i]``; ``timeout_s`` overrides the per-item limit."""
        if len(completions) != len(ground_truths):
            raise ValueError(f"{len(completions)} completions but {len(ground_truths)} ground truths")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        n = len(completions)
        scores = np.zeros(n, np.float32)
        status = np.full(n, _OK, np.int8)
        if n == 0:
            return BatchScores(scores, 0, 0)
        chunk = max(1, math.ceil(n / (4 * self.num_workers)))
        starts = range(0, n, chunk)
        pool = self._pool()
        futures = {
            pool.submit(
                _score_chunk,
                self.score_fn,
                list(zip(completions[s : s + chunk], ground_truths[s : s + chunk], strict=True)),
                timeout_s,
            ): s
            for s in starts
        }
        # Worst case every item of a worker's share runs into its own timeout.
        deadline = time.monotonic() + math.ceil(n / self.num_workers) * timeout_s + self.grace_s
        _, not_done = cf.wait(futures, timeout=max(0.0, deadline - time.monotonic()))
        broken = bool(not_done)
        for fut, s in futures.items():
            stop = min(s + chunk, n)
            if fut in not_done:
                status[s:stop] = _TIMEOUT
                continue
            try:
                result = fut.result()
            except Exception:  # BrokenProcessPool (a worker died) or an unpicklable score_fn
                status[s:stop] = _ERROR
                broken = True
                continue
            scores[s:stop] = [r[0] for r in result]
            status[s:stop] = [r[1] for r in result]
        if broken:
            self._kill()
        return BatchScores(scores, int((status == _TIMEOUT).sum()), int((status == _ERROR).sum()))

    def _kill(self) -> None:
        """Drop a broken or stuck pool; the next call starts a fresh one."""
        if self._executor is None:
            return
        for proc in list(getattr(self._executor, "_processes", {}).values()):  # no public kill before Python 3.14
            proc.kill()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor = None

    def close(self) -> None:
        """Stop the worker processes; the scorer can still be called afterwards (it restarts them)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> ParallelScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_default: ParallelScorer | None = None


def score_batch(
    completions: Sequence[str],
    ground_truths: Sequence[str],
    num_workers: int = 2,
    timeout_s: float = 5.0,
    score_fn: ScoreFn = score_gsm8k,
) -> BatchScores:
    """Score a batch with a shared, lazily started :class:`ParallelScorer` (closed at interpreter exit)."""
    global _default
    if _default is None or (_default.num_workers, _default.score_fn) != (num_workers, score_fn):
        if _default is not None:
            _default.close()
        _default = ParallelScorer(score_fn, num_workers=num_workers, timeout_s=timeout_s)
    return _default(completions, ground_truths, timeout_s=timeout_s)


@atexit.register
def _close_default() -> None:
    if _default is not None:
        _default.close()
