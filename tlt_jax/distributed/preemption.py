"""Stopping a run when the scheduler asks: SIGTERM / SIGINT finish the step, save one checkpoint, exit 128 + signal.

A scheduler stops a run far more often than it crashes: SLURM sends SIGTERM ahead of the time limit (``#SBATCH
--signal``) or on preemption, ``launch/local.sh`` forwards the TERM / INT it gets, and a person presses Ctrl-C.
:class:`StopSignal` turns the first of these signals into a request: the main loop finishes the RL step in flight,
every process agrees on the step to stop after (:func:`agree_max`, one tiny collective per step, so all of them save
the same step), the checkpoint of that step is saved and the process exits with status 128 + the signal (143 for
SIGTERM, 130 for SIGINT). A second signal ends the process at once, without saving, after one line saying so. A
repeat within ``repeat_after_s`` (2 s) of the first is the same request: a scheduler may deliver one stop twice
(SLURM signals a job step's tasks directly and through ``srun``, which forwards what it gets).

Python runs signal handlers only between bytecodes of the main thread, which can sit for minutes inside one XLA
compile, a device wait or a collective. So the C-level handler writes each signal to a wake-up pipe
(``signal.set_wakeup_fd``) read by a daemon thread, which acts at once whatever the main thread is doing. The
Python handler acts only if something else has taken the wake-up fd since (it then hands it back and counts the
signals itself).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

__all__ = ["StopSignal", "agree_max", "exit_status", "signal_name"]


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_status(signum: int) -> int:
    """The shell's status for a process ended by ``signum``: 128 + signum (143 for SIGTERM, 130 for SIGINT)."""
    return 128 + int(signum)


def agree_max(*values: int) -> tuple[int, ...]:
    """Each of ``values`` max-reduced over all JAX processes: one small collective for all of them, none in one
    process. Every process must call it at the same point of the program."""
    import jax

    if jax.process_count() == 1:
        return tuple(int(v) for v in values)
    from jax.experimental import multihost_utils

    gathered = np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int32)))
    return tuple(int(v) for v in gathered.reshape(-1, len(values)).max(axis=0))


class StopSignal:
    """The first of ``signals`` sets :attr:`signum` (the main loop polls it); another one, ``repeat_after_s`` or more
    after it, exits the process at once (status 128 + that signal).

    ``install()`` must run in the main thread (Python's rule for signal handlers); ``uninstall()`` puts the previous
    handlers back. Not installed, it only changes through :meth:`request`.
    """

    def __init__(
        self, signals=(signal.SIGTERM, signal.SIGINT), *, repeat_after_s: float = 2.0, prefix: str = "tlt_jax"
    ):
        self.signals = tuple(int(s) for s in signals)
        self.repeat_after_s = float(repeat_after_s)
        self.prefix = prefix
        self.signum = 0  # the first signal received (0: none)
        self._first_at = 0.0
        self._lock = threading.Lock()
        self._pipe_ok = False  # the watcher thread sees every signal (nobody took the wake-up fd)
        self._old_handlers: dict[int, object] = {}
        self._old_wakeup: int | None = None
        self._fds: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    @property
    def requested(self) -> bool:
        return self.signum != 0

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Act as if ``signum`` had been received (first: set the request; again: exit at once)."""
        self._deliver(int(signum))

    # ---- handlers -------------------------------------------------------------------------------------------------

    def install(self) -> StopSignal:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignal.install() must run in the main thread")
        if self._old_handlers:
            return self
        try:
            r, w = os.pipe()
            os.set_blocking(w, False)  # set_wakeup_fd needs a non-blocking fd
            self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            self._fds = (r, w)
            self._thread = threading.Thread(target=self._watch, args=(r,), name="tlt-stop-signal", daemon=True)
            self._thread.start()
            self._pipe_ok = True
        except (OSError, ValueError):  # no wake-up fd (e.g. not allowed here): the Python handler alone acts
            self._fds = self._thread = None
        for s in self.signals:
            self._old_handlers[s] = signal.signal(s, self._handler)
        return self

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s, old in self._old_handlers.items():
            signal.signal(s, old)
        self._old_handlers = {}
        if self._fds is not None:
            try:
                signal.set_wakeup_fd(-1 if self._old_wakeup is None else self._old_wakeup)
            except ValueError:
                pass
            self._pipe_ok = False
            for fd in reversed(self._fds):
                os.close(fd)  # the write end first: the watcher reads EOF and ends
            self._fds = None

    def __enter__(self) -> StopSignal:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _handler(self, signum, frame) -> None:
        if self._pipe_ok:
            mine = self._fds[1]
            try:
                current = signal.set_wakeup_fd(mine, warn_on_full_buffer=False)
            except ValueError:
                current = mine
            if current == mine:
                return  # the watcher thread has (or had) this signal
            signal.set_wakeup_fd(current)  # someone else's now: give it back, and count the signals here
            self._pipe_ok = False
        self._deliver(signum)

    def _watch(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in self.signals and self._pipe_ok:
                    self._deliver(signum)

    def _deliver(self, signum: int) -> None:
        with self._lock:
            now = time.monotonic()
            if not self.signum:
                self.signum, self._first_at = signum, now
                self._say(
                    f"got {signal_name(signum)}: finishing the step in flight, then saving a checkpoint and exiting "
                    f"with status {exit_status(signum)} (send it again to exit at once without saving)"
                )
                return
            if now - self._first_at < self.repeat_after_s:
                self._say(
                    f"got {signal_name(signum)} again within {self.repeat_after_s:g} s: the same stop request "
                    "(send it again later to exit at once)"
                )
                return
        self._say(f"second {signal_name(signum)}: exiting now without saving (the last checkpoint is kept)")
        os._exit(exit_status(signum))

    def _say(self, line: str) -> None:
        """One line on stderr, written with os.write (safe from any thread, unbuffered)."""
        try:
            sys.stderr.flush()
        except Exception:
            pass
        try:
            os.write(2, f"{self.prefix}: {line}\n".encode())
        except OSError:
            pass
