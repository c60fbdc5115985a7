"""Which of this process's work overlapped a timed chunk: the bandit keeps disturbed timings out of its medians.

Rollout slices of one process share its host (and on a CPU its cores). A drafter step or a step compile running for
one slice slows another slice's decode chunk, and that chunk's tokens/s would then say little about its arm. A
``SlicedRollout`` gives its engines, their step pools and the spot trainer one ``Activity``: work that disturbs is
registered there while it runs (``busy``); an engine takes a ``mark`` before a chunk and asks ``quiet_since`` after
it: false when anyone else's registered work ran at any moment in between. Owners are any hashable value (an
engine's step pool, ``("drafter", slice)``), so an engine leaves its own work out. An engine alone has none.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator

__all__ = ["Activity", "busy"]


class Activity:
    """Work in flight by owner, and how often each owner started some (the marks compare those counts)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active: dict[Hashable, int] = {}
        self._started: dict[Hashable, int] = {}

    @contextlib.contextmanager
    def busy(self, owner: Hashable) -> Iterator[None]:
        """Register ``owner``'s work for the duration of the block."""
        with self._lock:
            self._active[owner] = self._active.get(owner, 0) + 1
            self._started[owner] = self._started.get(owner, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._active[owner] -= 1

    def mark(self, own: Hashable = None) -> tuple[int, bool]:
        """Before a timed chunk: (work started by others so far, whether some of it runs now)."""
        with self._lock:
            return self._others(own)

    def quiet_since(self, mark: tuple[int, bool], own: Hashable = None) -> bool:
        """After the chunk: true when nobody but ``own`` had work running at any moment since ``mark``."""
        started, running = mark
        with self._lock:
            now_started, now_running = self._others(own)
        return not running and not now_running and now_started == started

    def _others(self, own: Hashable) -> tuple[int, bool]:
        started = sum(n for o, n in self._started.items() if o != own)
        running = any(n > 0 for o, n in self._active.items() if o != own)
        return started, running


def busy(activity: Activity | None, owner: Hashable):
    """``activity.busy(owner)``, or nothing to register when there is no ``activity``."""
    return contextlib.nullcontext() if activity is None else activity.busy(owner)
