"""Host-side helpers for a job spread over several processes (all are no-ops or plain copies in one process).

The main job runs one SPMD program: every process holds the same global prompt batch and makes the same host-side
decisions (compaction, speculative arm, drafter dispatch), because everything those decisions read is either
gathered here or replicated on device. Each process reads only its shard of the prompts and scores only its own
rows; these helpers assemble the global view. Every helper is a collective: all processes call it in the same order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

__all__ = [
    "NullWriter",
    "ProcessShardedReward",
    "allgather_objects",
    "gather_global_batch",
    "is_primary",
    "local_rows",
    "reduce_metrics",
    "to_host",
]


def is_primary() -> bool:
    """Process 0 prints, writes metrics.jsonl / TensorBoard / config.json."""
    return jax.process_index() == 0


def _bucket(n: int) -> int:
    """Padded byte length: powers of two from 256, so the gather compiles for few shapes."""
    b = 256
    while b < n:
        b *= 2
    return b


def _plain(x):
    """JSON for numpy values inside gathered objects (e.g. token ids as numpy ints)."""
    if isinstance(x, np.generic | np.ndarray):
        return x.tolist()
    raise TypeError(f"cannot send a {type(x).__name__} between processes; use JSON types or numpy values")


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's JSON-serialisable ``obj``, in process order (``[obj]`` in one process)."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj, default=_plain).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32))).reshape(-1)
    buf = np.zeros((_bucket(int(sizes.max())),), np.uint8)
    buf[: data.size] = data
    out = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
    return [json.loads(out[p, : sizes[p]].tobytes().decode()) for p in range(len(sizes))]


def gather_global_batch(local: Sequence[dict]) -> list[dict]:
    """The global step batch from each process's share, in the order of an unsharded pipeline.

    ``prompt_dataset`` gives process p the elements p, p + N, p + 2N, ... of the global batch (stride sharding), so
    element j of the global batch is element j // N of process j % N."""
    parts = allgather_objects(list(local))
    n = len(parts)
    if len({len(p) for p in parts}) != 1:
        raise ValueError(f"processes hold different numbers of prompts this step: {[len(p) for p in parts]}")
    return [parts[j % n][j // n] for j in range(n * len(parts[0]))]


def local_rows(num: int) -> np.ndarray:
    """Indices of the global batch's prompts that this process read (see :func:`gather_global_batch`)."""
    return np.arange(jax.process_index(), num, jax.process_count())


def to_host(x) -> np.ndarray:
    """A (possibly multi-process sharded) array as one numpy array, the same on every process."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def reduce_metrics(
    metrics: Mapping[str, float], must_agree: tuple[str, ...] = ("reward/", "response/", "train/")
) -> dict[str, float]:
    """The same metrics on every process: ``time/*`` (wall-clock, differs per host) is the slowest process's,
    ``memory/*`` the largest, everything else the mean. Metrics under ``must_agree`` come from the gathered rollout and
    the shared update, so they must be bitwise equal everywhere; a difference means the processes' host-side decisions
    diverged."""
    if jax.process_count() == 1:
        return dict(metrics)
    keys = sorted(metrics)
    all_keys = allgather_objects(keys)
    if any(k != keys for k in all_keys):
        raise RuntimeError(f"processes report different metric names: {[sorted(set(k) ^ set(keys)) for k in all_keys]}")
    from jax.experimental import multihost_utils

    # float64 bits as uint32 pairs: without jax_enable_x64 a float64 array would be gathered as float32.
    bits = np.array([metrics[k] for k in keys], np.float64).view(np.uint32)
    vals = np.asarray(multihost_utils.process_allgather(bits)).reshape(jax.process_count(), -1)
    vals = np.ascontiguousarray(vals).view(np.float64)
    for i, k in enumerate(keys):
        col = vals[:, i]
        if k.startswith(must_agree) and not np.array_equal(col, np.full_like(col, col[0]), equal_nan=True):
            raise RuntimeError(
                f"processes diverged: metric {k!r} is {col.tolist()} on processes 0..{len(col) - 1}; every process "
                "must run the same rollout and update (same global batch, same host-side decisions)"
            )
    largest = ("time/", "memory/")
    return {k: float(vals[:, i].max() if k.startswith(largest) else vals[:, i].mean()) for i, k in enumerate(keys)}


class ProcessShardedReward:
    """Wraps a reward function so each process scores only the rows of the prompts it read; the scores are then
    gathered so every process holds the whole batch's. Counters in ``info`` are summed over processes."""

    def __init__(self, reward_fn: Callable):
        self.reward_fn = reward_fn

    def __call__(self, examples, completions):
        from tlt_jax.rewards import RewardOutput

        if jax.process_count() == 1:
            return self.reward_fn(examples, completions)
        mine = local_rows(len(examples))
        part = dict(rows=[], scores=[], correct=[], info={})
        if mine.size:  # fewer prompts than processes: some score nothing
            out = self.reward_fn([examples[i] for i in mine], [completions[i] for i in mine])
            part = dict(rows=mine.tolist(), scores=out.scores.tolist(), correct=out.correct.tolist(), info=out.info)
        parts = allgather_objects(part)
        n = len(completions[0]) if completions else 0
        scores = np.zeros((len(examples), n), np.float32)
        correct = np.zeros((len(examples), n), bool)
        info: dict[str, float] = {}
        for p in parts:
            if p["rows"]:
                scores[p["rows"]] = np.asarray(p["scores"], np.float32)
                correct[p["rows"]] = np.asarray(p["correct"], bool)
            for k, v in p["info"].items():
                info[k] = info.get(k, 0.0) + float(v)
        return RewardOutput(scores, correct, info)

    def close(self) -> None:
        if hasattr(self.reward_fn, "close"):
            self.reward_fn.close()


class NullWriter:
    """The metrics writer of processes other than 0: they compute the same metrics but write nothing."""

    def write(self, step: int, metrics: Mapping[str, float], kind: str = "train") -> None:
        pass

    def write_config(self, config_json: str) -> None:
        pass

    def close(self) -> None:
        pass
