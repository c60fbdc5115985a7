"""The board between processes (tlt_jax.distributed.board) on a stand-in for the coordinator's key-value store:
a wait ends at the key, at a stop, at another process's failure notice (PeerFailedError) or at the timeout."""

import threading
import time

import pytest

from tlt_jax.distributed.board import ENV_BOARD_TIMEOUT, Board, BoardTimeoutError, PeerFailedError


class FakeStore:
    """jax.distributed's key-value client as the board uses it (shared by the Boards of two 'processes')."""

    def __init__(self):
        self.kv, self.cond = {}, threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cond:
            self.kv[key] = value
            self.cond.notify_all()

    def key_value_dir_get(self, root):
        with self.cond:
            return [(k, v) for k, v in self.kv.items() if k.startswith(root)]

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.kv, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.kv[key]


def test_wait_returns_at_the_key_and_at_a_stop():
    store = FakeStore()
    a, b = Board("t", client=store), Board("t", client=store)
    threading.Timer(0.2, b.post, ("3/1",)).start()
    assert a.wait("3/1", threading.Event(), check_s=0.1) and a.keys("3") == {"1"}
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    t = time.monotonic()
    assert not a.wait("3/never", stop, check_s=0.1) and time.monotonic() - t < 2


def test_a_peers_failure_notice_ends_the_wait_with_its_reason():
    """Before: a process whose partner failed waited for the partner's key until the heartbeat killed it."""
    store = FakeStore()
    waiting, failing = Board("t", client=store), Board("t", client=store)
    threading.Timer(0.3, failing.post_failure, ("slice 1's rollout: OOM",)).start()
    t = time.monotonic()
    with pytest.raises(PeerFailedError, match=r"process 0 failed \(slice 1's rollout: OOM\)"):
        waiting.wait("5/1", threading.Event(), check_s=0.1)
    assert time.monotonic() - t < 2


def test_a_key_that_never_comes_times_out_naming_the_bound(monkeypatch):
    for board in (Board("t", client=FakeStore(), timeout_s=0.3), Board("t", timeout_s=0.3)):  # across / in one process
        t = time.monotonic()
        with pytest.raises(BoardTimeoutError, match=ENV_BOARD_TIMEOUT):
            board.wait("5/1", threading.Event(), check_s=0.1)
        assert 0.3 <= time.monotonic() - t < 2
    monkeypatch.setenv(ENV_BOARD_TIMEOUT, "12.5")
    assert Board("t").timeout_s == 12.5
    monkeypatch.setenv(ENV_BOARD_TIMEOUT, "soon")
    with pytest.raises(ValueError, match=ENV_BOARD_TIMEOUT):
        Board("t")
