"""Notices between the processes of a job, read without a collective: the coordinator's key-value store.

The sliced rollout across processes (``tlt_jax.controller``) needs to know, while its own slices train the drafter,
whether slices of other processes still decode. A collective cannot answer that (the others are busy decoding), so
each process posts a key when one of its slices finishes and waits for the others' keys (``wait``: a blocking read
of the key-value store that ``jax.distributed`` runs on the coordinator, the store orbax uses for its barriers). In
one process the board is a plain set.
"""

from __future__ import annotations

import threading
import time

import jax

__all__ = ["Board"]


class Board:
    """Keys posted by any process, under ``namespace``. ``post`` is seen by every process's ``keys`` soon after."""

    def __init__(self, namespace: str = "tlt_jax"):
        self.namespace = namespace.strip("/")
        self._client = _client() if jax.process_count() > 1 else None
        self._local: set[str] = set()
        self._cond = threading.Condition()  # guards _local; notified on every post

    def _full(self, key: str) -> str:
        return f"{self.namespace}/{key.strip('/')}"

    def post(self, key: str) -> None:
        """Make ``key`` visible to every process (posting it twice is allowed)."""
        if self._client is None:
            with self._cond:
                self._local.add(self._full(key))
                self._cond.notify_all()
            return
        self._client.key_value_set(self._full(key), "1", allow_overwrite=True)

    def keys(self, prefix: str) -> set[str]:
        """The keys posted so far under ``prefix`` (relative to the prefix, as posted after it)."""
        root = self._full(prefix) + "/"
        if self._client is None:
            with self._cond:
                return {k[len(root):] for k in self._local if k.startswith(root)}
        return {k[len(root):] for k, _ in self._client.key_value_dir_get(root)}

    def wait(self, key: str, stop: threading.Event, check_s: float = 0.5) -> bool:
        """Block until ``key`` is posted (True, as soon as it is) or ``stop`` is set (False, within ``check_s``)."""
        full = self._full(key)
        if self._client is None:
            with self._cond:
                while full not in self._local and not stop.is_set():
                    self._cond.wait(check_s)
                return full in self._local
        while not stop.is_set():
            t = time.monotonic()
            try:
                self._client.blocking_key_value_get(full, int(check_s * 1000))
                return True
            except Exception:  # not posted within check_s (a deadline error): look at stop, then wait again
                if time.monotonic() - t < check_s / 2:  # failed at once (the coordinator is going away): no busy loop
                    stop.wait(check_s)
        return False


def _client():
    """The jax.distributed client (its key-value store); an error naming the fix when the job was not started so."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "several JAX processes but no jax.distributed client: start the job with tlt_jax.distributed.initialize "
            "(launch/local.sh or launch/slurm/train.sbatch do)"
        )
    return client
