"""Checkpointer: full round trip (sharded train state, drafter, data iterator, controller, RNG), retention, and a
corrupt latest step falling back to the previous one with a warning."""

import logging
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.checkpoint import (
    Checkpointer,
    IncompatibleCheckpointError,
    UnreadableCheckpointError,
    abstract_like,
    save_in_flight_bytes,
)
from tlt_jax.config import OptimConfig
from tlt_jax.data import prompt_dataset
from tlt_jax.distributed import MeshConfig, init_sharded, make_mesh
from tlt_jax.models import CausalLM, tiny_config
from tlt_jax.rl.train_step import init_train_state, make_optimizer

EXAMPLES = [{"prompt_ids": [i, i + 1], "ground_truth": str(i)} for i in range(40)]


def _state(seed=0, mesh=None, optim=OptimConfig(), **model_kw):
    cfg = tiny_config(**{"num_heads": 8, "num_kv_heads": 4, **model_kw})
    make = lambda: CausalLM(cfg, rngs=nnx.Rngs(seed))
    model = make() if mesh is None else init_sharded(make, mesh)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    return init_train_state(params, make_optimizer(optim, 10))


def _iter():
    return iter(prompt_dataset(EXAMPLES, 4, seed=3, num_epochs=None, shard_index=0, shard_count=1))


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _ckpt(tmp_path, **kw):
    return Checkpointer(
        tmp_path / "checkpoints", every_steps=kw.pop("every_steps", 1), max_to_keep=kw.pop("keep", 3), **kw
    )


def test_settle_waits_for_the_pending_save_without_raising(tmp_path):
    """The main loop calls ``settle`` before the next update donates the state a save may still read: afterwards no
    save is pending and the step is on disk; with no save pending it returns at once."""
    ck = _ckpt(tmp_path, async_save=True)
    try:
        ck.settle()  # nothing pending
        assert ck.save(1, _state(), rng=np.zeros(2, np.uint32), data_iter=_iter(), controller={"step": 1})
        ck.settle()
        assert ck._pending is None and ck.poll() is None and ck.latest_step() == 1
    finally:
        ck.close()


@pytest.mark.parametrize("async_save,limited", [(True, False), (False, False), (True, True)])
def test_round_trip_restores_everything(tmp_path, async_save, limited):
    """limited: the train state's writes go through orbax's byte limiter, set just above the largest shard."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    state = _state(mesh=mesh)
    state = jax.tree.map(lambda x: x + 1 if x.dtype == jnp.float32 else x, state)  # not the fresh init
    drafter = {"params": {"w": jnp.arange(6.0).reshape(2, 3)}, "opt": {"count": jnp.array(7, jnp.int32)}}
    it = _iter()
    for _ in range(3):
        next(it)
    rng = jax.random.key_data(jax.random.key(42))
    limit = save_in_flight_bytes(state, floor=1) if limited else None
    ck = _ckpt(tmp_path, async_save=async_save, in_flight_bytes=limit)
    assert ck.save(
        3, state, rng=rng, data_iter=it, controller={"step": 3, "consecutive_nonfinite": 1}, extra={"drafter": drafter}
    )
    expected_next = next(it)
    ck.close()

    fresh = _state(seed=1, mesh=mesh)
    it2 = _iter()
    ck2 = _ckpt(tmp_path, in_flight_bytes=limit)
    out = ck2.restore(abstract_like(fresh), data_iter=it2, abstract_extra={"drafter": abstract_like(drafter)})
    ck2.close()
    assert out.step == 3 and out.skipped_steps == []
    for a, b in zip(_leaves(state), _leaves(out.train_state), strict=True):
        np.testing.assert_array_equal(a, b)
    # Shardings are those of the restore target (FSDP x tensor), not replicated.
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(out.train_state), strict=True):
        assert a.sharding == b.sharding
    np.testing.assert_array_equal(out.rng, np.asarray(rng))
    assert out.controller == {"step": 3, "consecutive_nonfinite": 1}
    for a, b in zip(_leaves(drafter), _leaves(out.extra["drafter"]), strict=True):
        np.testing.assert_array_equal(a, b)
    assert next(it2) == expected_next  # the data pipeline continues where it was


def test_retention_and_should_save(tmp_path):
    ck = _ckpt(tmp_path, every_steps=2, keep=2)
    state, it = _state(), _iter()
    assert not ck.should_save(1) and ck.should_save(2)
    for step in (2, 4, 6):
        ck.save(step, state, rng=np.zeros(2, np.uint32), data_iter=it, controller={})
    ck.wait()
    assert ck.all_steps() == [4, 6] and not ck.should_save(6)
    assert not ck.save(6, state, rng=np.zeros(2, np.uint32), data_iter=it, controller={})  # already saved
    ck.close()
    assert _ckpt(tmp_path).restore(abstract_like(state), data_iter=_iter()).step == 6


def _corrupt(step_dir: pathlib.Path):
    """Damage a written step the way a bad disk / partial copy would: truncate every array data file."""
    files = [p for p in (step_dir / "train_state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for p in files:
        p.write_bytes(b"\0garbage")


def test_corrupt_latest_falls_back_to_previous_with_warning(tmp_path, caplog):
    ck = _ckpt(tmp_path)
    s1, s2 = _state(seed=1), _state(seed=2)
    it = _iter()
    ck.save(1, s1, rng=np.zeros(2, np.uint32), data_iter=it, controller={"step": 1})
    next(it)
    ck.save(2, s2, rng=np.zeros(2, np.uint32), data_iter=it, controller={"step": 2})
    ck.close()
    _corrupt(tmp_path / "checkpoints" / "2")

    ck2 = _ckpt(tmp_path)
    with caplog.at_level(logging.WARNING):
        out = ck2.restore(abstract_like(s1), data_iter=_iter())
    assert out.step == 1 and out.skipped_steps == [2] and out.controller == {"step": 1}
    for a, b in zip(_leaves(s1), _leaves(out.train_state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert any("step 2" in r.message and "falling back" in r.message for r in caplog.records)
    # The unreadable step is set aside (kept for inspection) and step 2 can be written again.
    assert os.path.isdir(tmp_path / "checkpoints_unreadable" / "2")
    assert ck2.all_steps() == [1] and ck2.should_save(2)
    assert ck2.save(2, s2, rng=np.zeros(2, np.uint32), data_iter=_iter(), controller={"step": 2})
    ck2.close()


def test_missing_item_is_unreadable_too(tmp_path, caplog):
    ck = _ckpt(tmp_path)
    s = _state()
    for step in (1, 2):
        ck.save(step, s, rng=np.zeros(2, np.uint32), data_iter=_iter(), controller={"step": step})
    ck.close()
    import shutil

    shutil.rmtree(tmp_path / "checkpoints" / "2" / "controller")
    with caplog.at_level(logging.WARNING):
        out = _ckpt(tmp_path).restore(abstract_like(s), data_iter=_iter())
    assert out.step == 1 and out.skipped_steps == [2]


def test_empty_directory_restores_nothing(tmp_path):
    assert _ckpt(tmp_path).restore(abstract_like(_state()), data_iter=_iter()) is None


def _snapshot(root: pathlib.Path) -> dict:
    """Every file and folder under ``root`` with its size, mtime and bytes: equal snapshots = nothing touched."""
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def _two_steps(tmp_path, state):
    ck = _ckpt(tmp_path)
    for step in (1, 2):
        ck.save(step, state, rng=np.zeros(2, np.uint32), data_iter=_iter(), controller={"step": step})
    ck.close()


def test_incompatible_checkpoint_names_the_difference_and_touches_nothing(tmp_path):
    """Another model shape or another optimizer: an error naming keys and shapes and the fix; no file moves."""
    _two_steps(tmp_path, _state())
    before = _snapshot(tmp_path)
    smaller = _state(hidden_size=32)
    ck = _ckpt(tmp_path)
    with pytest.raises(IncompatibleCheckpointError) as e:
        ck.restore(abstract_like(smaller), data_iter=_iter())
    msg = str(e.value)
    assert "step 2" in msg and "params.embed_tokens.value: checkpoint (256, 64) float32, this run (256, 32)" in msg
    assert "Nothing was changed on disk" in msg and "config.json" in msg and "new --workdir" in msg
    other_opt = _state(optim=OptimConfig(max_grad_norm=0))  # no clipping: another optimizer state tree
    with pytest.raises(
        IncompatibleCheckpointError, match=r"opt_state\.1\.0\.count: only in the checkpoint.*only in this run"
    ):
        ck.restore(abstract_like(other_opt), data_iter=_iter())
    ck.close()
    assert _snapshot(tmp_path) == before and not (tmp_path / "checkpoints_unreadable").exists()


def test_no_readable_step_is_an_error_and_moves_nothing(tmp_path):
    """Every step corrupt: starting over from step 0 would be silent data loss, so it is an error; nothing moves."""
    state = _state()
    _two_steps(tmp_path, state)
    for step in (1, 2):
        _corrupt(tmp_path / "checkpoints" / str(step))
    before = _snapshot(tmp_path)
    ck = _ckpt(tmp_path)
    with pytest.raises(
        UnreadableCheckpointError, match=r"no checkpoint .* is readable \(step 2: .*step 1: .*new --workdir"
    ):
        ck.restore(abstract_like(state), data_iter=_iter())
    ck.close()
    assert _snapshot(tmp_path) == before and not (tmp_path / "checkpoints_unreadable").exists()



# Saves a 512 MiB train state asynchronously with orbax's default and with in_flight_bytes just above its largest
# shard (32 MiB), in a fresh process (no other test's threads or heap), and reports what each save added to the
# process's anonymous resident memory while it wrote, as a fraction of the state, and whether each read back bitwise.
SAVER = r"""
import ctypes, json, sys, threading, time
import jax.numpy as jnp, numpy as np
from tlt_jax.checkpoint import Checkpointer, abstract_like, save_in_flight_bytes
from tlt_jax.data import prompt_dataset

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

examples = [{"prompt_ids": [1, 2], "ground_truth": "1"}] * 8
data = lambda: iter(prompt_dataset(examples, 4, seed=0, num_epochs=None, shard_index=0, shard_count=1))
rng = np.random.default_rng(0)
state = {f"w{i}": jnp.asarray(rng.normal(size=(2**21, 4)).astype(np.float32)) for i in range(16)}
size = sum(x.nbytes for x in state.values())
out = {}
for name, limit in (("default", None), ("limited", save_in_flight_bytes(state, floor=1))):
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base, peak, done = anon(), [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)
    watcher = threading.Thread(target=sample)
    watcher.start()
    ck = Checkpointer(sys.argv[1] + "/" + name, every_steps=1, max_to_keep=1, in_flight_bytes=limit)
    ck.save(1, state, rng=np.zeros(2, np.uint32), data_iter=data(), controller={})
    ck.wait()
    done.set()
    watcher.join()
    ck.close()
    growth = (max(peak[0], anon()) - base) / size
    back = Checkpointer(sys.argv[1] + "/" + name, every_steps=1, max_to_keep=1, in_flight_bytes=limit)
    restored = back.restore(abstract_like(state), data_iter=data()).train_state
    back.close()
    out[name] = dict(growth=growth, same=all(np.array_equal(np.asarray(restored[k]), np.asarray(v))
                                             for k, v in state.items()))
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_a_save_buffers_at_most_its_in_flight_bytes(tmp_path):
    """An asynchronous save of a 512 MiB train state with in_flight_bytes = 33 MiB adds less to the process while it
    writes than orbax's default (which buffers most of the state) and under 0.6 x the state; both read back bitwise."""
    import json
    import subprocess
    import sys

    repo = pathlib.Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", SAVER, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    out = json.loads(p.stdout.split("RESULT ", 1)[1])
    print(f"resident growth while saving, x the state: {out}")
    assert out["default"]["same"] and out["limited"]["same"]
    # Seen on the 2-core VM beside a second pytest worker: default 0.58-0.93, limited 0.0-0.40 (3.11 and 3.12 sets).
    assert out["limited"]["growth"] < min(0.6, out["default"]["growth"]), out


def test_main_job_checkpoints_on_the_wall_clock_interval(tmp_path, monkeypatch):
    """checkpoint.every_minutes: the main job (configs/tiny.py) saves after the first step that ends that long after
    the last save, besides every_steps and the end. A clock that advances 35 s per reading: 70 s after the start
    (step 1) and after the save at step 1 (step 3) a save is due; step 5 is the end."""
    import itertools

    from test_main import _cfg

    import tlt_jax.main as main_job
    from tlt_jax.config import ConfigError

    ticks = itertools.count()
    monkeypatch.setattr(main_job, "_clock", lambda: 35.0 * next(ticks))
    overrides = ("--config.train.num_steps=5", "--config.checkpoint.every_steps=100", "--config.eval.at_start=False",
                 "--config.checkpoint.max_to_keep=3")
    main_job.run(_cfg("tiny.py", *overrides, "--config.checkpoint.every_minutes=1"), str(tmp_path / "clock"))
    main_job.run(_cfg("tiny.py", *overrides), str(tmp_path / "steps"))  # every_minutes = 0: off
    steps = lambda d: sorted(int(p.name) for p in (tmp_path / d / "checkpoints").iterdir() if p.name.isdigit())
    assert (steps("clock"), steps("steps")) == ([1, 3, 5], [5])
    with pytest.raises(ConfigError, match="every_minutes"):
        _cfg("tiny.py", "--config.checkpoint.every_minutes=-1")
