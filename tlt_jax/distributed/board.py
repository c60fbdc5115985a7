"""Notices between the processes of a job, read without a collective: the coordinator's key-value store.

The sliced rollout across processes (``tlt_jax.controller``) needs to know, while its own slices train the drafter,
whether slices of other processes still decode. A collective cannot answer that (the others are busy decoding), so
each process posts a key when one of its slices finishes and waits for the others' keys (``wait``: a blocking read
of the key-value store that ``jax.distributed`` runs on the coordinator, the store orbax uses for its barriers). A
process whose rollout fails posts a failure notice (``post_failure``); a process waiting for its keys raises
:class:`PeerFailedError` within ``check_s`` of it, and :class:`BoardTimeoutError` after ``timeout_s``
(``TLT_JAX_BOARD_TIMEOUT_S``) without the key (a peer stuck, or failed without posting). A peer that dies is the
heartbeat's (``TLT_JAX_HEARTBEAT_TIMEOUT_S``). In one process the board is a plain set.
"""

from __future__ import annotations

import os
import threading
import time

import jax

__all__ = ["ENV_BOARD_TIMEOUT", "Board", "BoardError", "BoardTimeoutError", "PeerFailedError"]

ENV_BOARD_TIMEOUT = "TLT_JAX_BOARD_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 3600.0  # longer than any rollout's share should take; a stuck peer's bound
_FAILED = "failed"  # the failure notices' folder, under the namespace


class BoardError(RuntimeError):
    """A key this process waits for will not come."""


class PeerFailedError(BoardError):
    """Another process posted a failure notice."""


class BoardTimeoutError(BoardError):
    """A key was not posted within the board's timeout."""


def _timeout_from_env() -> float:
    value = os.environ.get(ENV_BOARD_TIMEOUT, "")
    try:
        timeout = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{ENV_BOARD_TIMEOUT} must be a number of seconds, got {value!r}") from None
    if not timeout > 0:
        raise ValueError(f"{ENV_BOARD_TIMEOUT} must be > 0 seconds, got {value!r}")
    return timeout


class Board:
    """Keys posted by any process, under ``namespace``. ``post`` is seen by every process's ``keys`` soon after.
    ``client``: a key-value client (tests); default the jax.distributed one when the job has several processes."""

    def __init__(self, namespace: str = "tlt_jax", *, timeout_s: float | None = None, client=None):
        self.namespace = namespace.strip("/")
        self.timeout_s = _timeout_from_env() if timeout_s is None else float(timeout_s)
        self._client = client if client is not None else (_client() if jax.process_count() > 1 else None)
        self._local: dict[str, str] = {}
        self._cond = threading.Condition()  # guards _local; notified on every post

    def _full(self, key: str) -> str:
        return f"{self.namespace}/{key.strip('/')}"

    def post(self, key: str, value: str = "1") -> None:
        """Make ``key`` visible to every process (posting it twice is allowed)."""
        if self._client is None:
            with self._cond:
                self._local[self._full(key)] = value
                self._cond.notify_all()
            return
        self._client.key_value_set(self._full(key), value, allow_overwrite=True)

    def post_failure(self, reason: str) -> None:
        """Tell every process that this one failed (``reason``: its error), so that their waits raise at once; an
        error posting it is only logged (the heartbeat still ends the job)."""
        try:
            self.post(f"{_FAILED}/{jax.process_index()}", reason)
        except Exception as e:  # the coordinator may be gone already
            import logging

            logging.getLogger("tlt_jax").warning("could not post this process's failure on the board: %r", e)

    def _items(self, prefix: str) -> dict[str, str]:
        root = self._full(prefix) + "/"
        if self._client is None:
            with self._cond:
                return {k[len(root):]: v for k, v in self._local.items() if k.startswith(root)}
        return {k[len(root):]: v for k, v in self._client.key_value_dir_get(root)}

    def keys(self, prefix: str) -> set[str]:
        """The keys posted so far under ``prefix`` (relative to the prefix, as posted after it)."""
        return set(self._items(prefix))

    def _raise_on_failure(self) -> None:
        failed = self._items(_FAILED)
        if failed:
            process, reason = min(failed.items())
            raise PeerFailedError(
                f"process {process} failed ({reason}); this process stops too. The cause is in process {process}'s "
                "log; fix it and resume the run from its last checkpoint"
            )

    def wait(self, key: str, stop: threading.Event, check_s: float = 0.5) -> bool:
        """Block until ``key`` is posted (True, as soon as it is) or ``stop`` is set (False, within ``check_s``).
        Raises PeerFailedError once another process posted a failure, BoardTimeoutError after ``timeout_s``."""
        full, deadline = self._full(key), time.monotonic() + self.timeout_s
        while not stop.is_set():
            if self._client is None:
                with self._cond:
                    if full in self._local or self._cond.wait_for(lambda: full in self._local, check_s):
                        return True
            else:
                t = time.monotonic()
                try:
                    self._client.blocking_key_value_get(full, int(check_s * 1000))
                    return True
                except Exception:  # not posted within check_s (a deadline error): look at stop, then wait again
                    if time.monotonic() - t < check_s / 2:  # failed at once (the coordinator is going away)
                        stop.wait(check_s)  # no busy loop
            self._raise_on_failure()
            if time.monotonic() > deadline:
                raise BoardTimeoutError(
                    f"{full!r} was not posted within {self.timeout_s:.0f} s: the process that should post it is stuck "
                    f"or failed without saying so (see its log). If its rollout share is legitimately that long, "
                    f"raise {ENV_BOARD_TIMEOUT}"
                )
        return self._client is None and full in self._local


def _client():
    """The jax.distributed client (its key-value store); an error naming the fix when the job was not started so.

    jax 0.10 / 0.11 have no public API for the coordinator's key-value store (jax.experimental.multihost_utils
    reads this same private attribute), so it is read here and nowhere else."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "several JAX processes but no jax.distributed client: start the job with tlt_jax.distributed.initialize "
            "(launch/local.sh or launch/slurm/train.sbatch do)"
        )
    return client
