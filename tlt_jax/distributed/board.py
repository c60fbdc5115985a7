"""Notices between the processes of a job, read without a collective: the coordinator's key-value store.

The sliced rollout across processes (``tlt_jax.controller``) needs to know, while its own slices train the drafter,
whether slices of other processes still decode. A collective cannot answer that (the others are busy decoding), so
each process posts a key when one of its slices finishes and polls for the others' keys: the key-value store that
``jax.distributed`` runs on the coordinator (the store orbax uses for its barriers). In one process the board is a
plain set.
"""

from __future__ import annotations

import threading

import jax

__all__ = ["Board"]


class Board:
    """Keys posted by any process, under ``namespace``. ``post`` is seen by every process's ``keys`` soon after."""

    def __init__(self, namespace: str = "tlt_jax"):
        self.namespace = namespace.strip("/")
        self._client = _client() if jax.process_count() > 1 else None
        self._local: set[str] = set()
        self._lock = threading.Lock()

    def _full(self, key: str) -> str:
        return f"{self.namespace}/{key.strip('/')}"

    def post(self, key: str) -> None:
        """Make ``key`` visible to every process (posting it twice is allowed)."""
        if self._client is None:
            with self._lock:
                self._local.add(self._full(key))
            return
        self._client.key_value_set(self._full(key), "1", allow_overwrite=True)

    def keys(self, prefix: str) -> set[str]:
        """The keys posted so far under ``prefix`` (relative to the prefix, as posted after it)."""
        root = self._full(prefix) + "/"
        if self._client is None:
            with self._lock:
                return {k[len(root):] for k in self._local if k.startswith(root)}
        return {k[len(root):] for k, _ in self._client.key_value_dir_get(root)}


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
