"""Run checkpoints: one orbax Composite per saved step, written asynchronously and published atomically.

Items: ``train_state`` (policy params, optimizer state, update counters), ``rng`` (the run's key data: it seeds the
rest of a resumed run), ``data`` (the grain iterator, through grain's orbax handler), ``controller`` (JSON: the host
loop's counters), and any ``extra`` pytrees (e.g. ``drafter`` = drafter params + optimizer state) when present.
Orbax writes into a temporary directory and renames it on success, so a killed process never leaves a half-written
step behind; leftover temporary directories are never restored and are removed when the next run opens the
directory. A save that fails (disk full, directory not writable) raises :class:`CheckpointWriteError` naming the
directory, the step and the OS error; the steps saved before it stay as they were and resume. An asynchronous save
fails in the background: :meth:`Checkpointer.poll` (cheap, once per step) reports it as soon as it is known.

Restore tells an incompatible checkpoint from a corrupt one. Before reading arrays it compares the saved tree
metadata (keys, shapes, dtypes) with the restore target: a difference means another model / optimizer wrote it, and
:class:`IncompatibleCheckpointError` names the differing keys and touches nothing. A step whose metadata matches but
which cannot be read (damaged files) is corrupt: the newest readable step is restored and the newer corrupt ones are
moved to ``<dir>_unreadable`` (kept, so the step can be written again). If no step is readable nothing is moved and
:class:`UnreadableCheckpointError` is raised: silently starting over from step 0 is never safe.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

__all__ = [
    "CheckpointWriteError",
    "Checkpointer",
    "IncompatibleCheckpointError",
    "Restored",
    "UnreadableCheckpointError",
    "abstract_like",
    "save_in_flight_bytes",
    "tree_differences",
]

log = logging.getLogger(__name__)


class IncompatibleCheckpointError(ValueError):
    """The checkpoint was written for another model or optimizer (keys, shapes or dtypes differ)."""


class UnreadableCheckpointError(RuntimeError):
    """Every saved step is unreadable; nothing was moved or deleted."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, directory not writable); the earlier steps are intact."""


def _any_process(flag: bool) -> int | None:
    """The first process whose ``flag`` is set (None when none is); a collective in a multi-process job."""
    if jax.process_count() == 1:
        return 0 if flag else None
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(np.asarray([int(flag)], np.int32))).reshape(-1)
    hits = np.flatnonzero(flags)
    return int(hits[0]) if hits.size else None


def os_error_text(error: BaseException) -> str | None:
    """The operating-system cause of ``error`` in a few words (``No space left on device (errno 28)``), from an
    OSError in its chain or tensorstore's ``[os_error_code='28']``; None when it names none."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return f"{e.strerror or os.strerror(e.errno)} (errno {e.errno})" + (f": {e.filename}" if e.filename else "")
        m = re.search(r"os_error_code='?(\d+)", str(e))
        if m:
            code = int(m.group(1))
            return f"{os.strerror(code)} (errno {code})"
        e = e.__cause__ or e.__context__
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text[:300]}"


def _not_writable(directory: str) -> str | None:
    """Why new files cannot be made in ``directory`` (read-only file system, permissions), or None; touches
    nothing (a full disk shows only when writing)."""
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    code = errno.EROFS if os.statvfs(directory).f_flag & os.ST_RDONLY else errno.EACCES
    return f"{os.strerror(code)} (errno {code})"


def _probe_write(directory: str, sync: bool = True) -> str | None:
    """Why ``directory`` cannot take a new 4 KiB file (its OS error, e.g. read-only), or None when it can."""
    import tempfile

    path = None
    try:
        fd, path = tempfile.mkstemp(dir=directory, prefix=".write_probe.")
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        return None
    except OSError as e:
        return f"{e.strerror or os.strerror(e.errno)} (errno {e.errno})" if e.errno else _first_line(e)
    finally:
        if path is not None:
            try:
                os.remove(path)
            except OSError:
                pass


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _leaf_specs(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{"params.embed_tokens.value": (shape, dtype)}`` for every array leaf (orbax's own naming)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(_key_name(k) for k in path): (tuple(x.shape), str(np.dtype(x.dtype))) for path, x in leaves}


def tree_differences(saved: Any, target: Any) -> list[str]:
    """Why ``saved`` (orbax tree metadata) cannot be restored into ``target`` (arrays or ShapeDtypeStructs): one
    line per missing / unexpected key and per shape or dtype mismatch (parameters first); empty when they match."""
    a, b = _leaf_specs(saved), _leaf_specs(target)
    order = lambda keys: sorted(keys, key=lambda k: (not k.startswith("params."), k))
    return (
        [
            f"{k}: checkpoint {a[k][0]} {a[k][1]}, this run {b[k][0]} {b[k][1]}"
            for k in order(a.keys() & b.keys())
            if a[k] != b[k]
        ]
        + [f"{k}: only in the checkpoint" for k in order(a.keys() - b.keys())]
        + [f"{k}: only in this run's state" for k in order(b.keys() - a.keys())]
    )


def _summary(diff: list[str], per_kind: int = 3) -> str:
    """The first few differences of each kind (mismatch, only saved, only here) and how many more there are."""
    kinds: dict[str, list[str]] = {}
    for d in diff:
        kinds.setdefault(d.rsplit(": ", 1)[1] if ": only in" in d else "mismatch", []).append(d)
    shown = [d for group in kinds.values() for d in group[:per_kind]]
    more = f" (and {len(diff) - len(shown)} more)" if len(diff) > len(shown) else ""
    return "; ".join(shown) + more


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays: the restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


@dataclasses.dataclass
class Restored:
    """What a restore gives back (the data iterator is restored in place)."""

    step: int
    train_state: Any
    rng: np.ndarray
    controller: dict
    extra: dict[str, Any]
    skipped_steps: list[int]  # newer steps that could not be read


# Bytes a save may buffer at once, at least (save_in_flight_bytes). tests/test_checkpoint.py prints what a save adds
# to the process while it writes: 0.6-0.9 x the state with orbax's default, 0.0-0.4 x with a limit of 1/16 of it.
SAVE_IN_FLIGHT_FLOOR = 256 * 2**20


def save_in_flight_bytes(*trees: Any, floor: int = SAVE_IN_FLIGHT_FLOOR) -> int:
    """Checkpointer's ``in_flight_bytes`` for saves of ``trees``: ``floor``, or more than the largest array shard
    this process holds (orbax's limiter refuses a shard larger than its limit)."""
    shards = [math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
              for t in trees for x in jax.tree.leaves(t) if isinstance(x, jax.Array)]
    return max(floor, max(shards, default=0) + 2**20)


class Checkpointer:
    """Saves every ``every_steps`` RL steps (and when forced, e.g. at the end); keeps ``max_to_keep`` steps."""

    def __init__(self, directory: str | os.PathLike, *, every_steps: int, max_to_keep: int, async_save: bool = True,
                 in_flight_bytes: int | None = None):
        """in_flight_bytes: how many bytes of the train state a save may hold in its write buffers at once (orbax's
        byte limiter; it must exceed the largest array shard this process writes: :func:`save_in_flight_bytes`).
        None: orbax's default, which buffers nearly the whole state, while the next step's rollout runs beside an
        asynchronous save (the default run's peak memory, issue 42)."""
        self.directory = os.path.abspath(os.fspath(directory))
        self.every_steps = int(every_steps)
        self._pending: int | None = None  # the step an asynchronous save is writing
        self.error: CheckpointWriteError | None = None  # the first failed save (later calls re-raise it)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True, cleanup_tmp_directories=True
        )
        registry = None
        if in_flight_bytes is not None:
            handler = ocp.StandardCheckpointHandler(save_concurrent_gb=in_flight_bytes / 10**9)
            registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
            registry.add("train_state", ocp.args.StandardSave, handler)
            registry.add("train_state", ocp.args.StandardRestore, handler)
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        except OSError as e:
            raise CheckpointWriteError(
                f"cannot use the checkpoint directory {self.directory}: {os_error_text(e) or _first_line(e)}. Fix "
                "it (space, permissions) and start again with the same --workdir."
            ) from e
        why = _not_writable(self.directory)
        if why:  # found now, not after the first steps' work
            self.manager.close()
            raise CheckpointWriteError(
                f"cannot write to the checkpoint directory {self.directory}: {why}. Fix it (space, permissions) and "
                "start again with the same --workdir."
            )

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        return step % self.every_steps == 0 and step not in self.manager.all_steps()

    def save(
        self,
        step: int,
        train_state: Any,
        *,
        rng: jax.Array | np.ndarray,
        data_iter: Any,
        controller: Mapping[str, Any],
        extra: Mapping[str, Any] | None = None,
    ) -> bool:
        """Start saving ``step`` (returns at once when async); False if that step is already saved."""
        if step in self.manager.all_steps():
            return False
        items = dict(
            train_state=ocp.args.StandardSave(train_state),
            rng=ocp.args.StandardSave({"key": np.asarray(rng)}),
            data=grain.checkpoint.CheckpointSave(data_iter),
            controller=ocp.args.JsonSave(dict(controller)),
        )
        for name, tree in (extra or {}).items():
            items[f"extra_{name}"] = ocp.args.StandardSave(tree)
        self.wait()  # a failed earlier save is reported as itself, not as this step's
        # A directory that became read-only (or lost its permissions) makes orbax wait out its coordination timeout
        # (300 s) for a step directory it cannot create: look first (a 4 KiB file, made and removed).
        why = _probe_write(self.directory, sync=False)
        failed = _any_process(why is not None)  # all processes fail together, not some inside orbax's barriers
        if why or failed is not None:
            self._failed(step, None, why or f"process {failed} cannot write there (its log line says why)")
        try:
            saved = bool(self.manager.save(step, args=ocp.args.Composite(**items), force=True))
        except Exception as e:
            self._failed(step, e)
        self._pending = step if saved else None
        return saved

    def _failed(self, step: int | None, error: BaseException | None, why: str | None = None):
        """Record and raise the CheckpointWriteError of ``step`` (``why``: its cause, else found from ``error``)."""
        self._pending = None
        steps = [s for s in self._committed_steps() if s != step]
        kept = (
            f"the previous checkpoint (step {steps[-1]}) is intact and resumes"
            if steps
            else "no earlier checkpoint exists"
        )
        # Some failures reach here without their OS error (orbax times out waiting for a step directory that could
        # not be made): then the directory itself says why.
        why = why or os_error_text(error) or _probe_write(self.directory) or _first_line(error)
        self.error = CheckpointWriteError(
            f"cannot write checkpoint{'' if step is None else f' step {step}'} to {self.directory}: "
            f"{why}; {kept}. Nothing "
            "half-written is ever restored. Free space (or fix the directory) and resume with the same --workdir."
        )
        raise self.error from error

    def _committed_steps(self) -> list[int]:
        """The steps on disk (a save in progress or failed is a temporary directory, never a step); no collective."""
        try:
            return sorted(int(p) for p in os.listdir(self.directory) if p.isdigit())
        except OSError:
            return []

    def poll(self) -> CheckpointWriteError | None:
        """Without blocking: the error of an asynchronous save that has failed (None while it runs or when it
        succeeded). Cheap enough to call every step."""
        if self.error is not None:
            return self.error
        if self._pending is None or not self._save_finished():
            return None
        try:
            self.wait()
        except CheckpointWriteError as e:
            return e
        return None

    def _save_finished(self) -> bool:
        """Whether the background save has ended (success or failure), from orbax's finalize thread."""
        thread = getattr(self.manager, "_finalize_thread", None)
        try:
            return bool(thread.map(lambda t: t is None or not t.is_alive()))
        except Exception:  # another orbax version: the failure shows at the next save or wait instead
            return False

    def _check_compatible(self, step: int, name: str, target: Any) -> None:
        """Raise IncompatibleCheckpointError if item ``name`` of ``step`` has other keys / shapes / dtypes than
        ``target``; unreadable metadata is left to the restore (it is then corrupt, not incompatible)."""
        try:
            saved = ocp.StandardCheckpointHandler().metadata(epath.Path(self.directory) / str(step) / name)
            saved = getattr(saved, "tree", saved)
        except Exception:
            return
        diff = tree_differences(saved, target)
        if diff:
            raise IncompatibleCheckpointError(
                f"checkpoint step {step} in {self.directory} does not fit this run: its {name!r} was written for "
                f"another model or optimizer: {_summary(diff)}. Nothing was changed on disk. Resume with "
                "the configuration that wrote it (the workdir's config.json), or start this one in a new --workdir."
            )

    def restore(
        self, abstract_state: Any, *, data_iter: Any, abstract_extra: Mapping[str, Any] | None = None
    ) -> Restored | None:
        """Restore the newest readable step (None if the directory holds none). ``data_iter`` is set to its saved
        position. Raises IncompatibleCheckpointError (wrong model / optimizer) or UnreadableCheckpointError (no
        step readable) without touching any file; newer corrupt steps are moved aside once an older one is read."""
        unreadable: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            self._check_compatible(step, "train_state", abstract_state)
            for name, tree in (abstract_extra or {}).items():
                self._check_compatible(step, f"extra_{name}", tree)
            data_state = self._data_state_from_other_process_count(step)
            items = dict(
                train_state=ocp.args.StandardRestore(abstract_state),
                rng=ocp.args.StandardRestore(),
                controller=ocp.args.JsonRestore(),
            )
            if data_state is None:
                items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
            for name, tree in (abstract_extra or {}).items():
                items[f"extra_{name}"] = ocp.args.StandardRestore(tree)
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(**items))
            except Exception as e:  # corrupt or partial step: try the previous one
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                log.warning(
                    "checkpoint step %d in %s is unreadable (%s); falling back to the previous checkpoint",
                    step,
                    self.directory,
                    reason,
                )
                unreadable.append((step, reason))
                continue
            for bad, _ in unreadable:
                self._set_aside(bad)
            if data_state is not None:
                data_iter.set_state(data_state)
            extra = {name: out[f"extra_{name}"] for name in (abstract_extra or {})}
            return Restored(
                step,
                out["train_state"],
                np.asarray(out["rng"]["key"]),
                dict(out["controller"]),
                extra,
                [bad for bad, _ in unreadable],
            )
        if unreadable:
            raise UnreadableCheckpointError(
                f"no checkpoint in {self.directory} is readable ("
                + "; ".join(f"step {st}: {why}" for st, why in unreadable)
                + "). Nothing was moved or deleted. Repair or remove them, or start the run in a new --workdir."
            )
        return None

    def _data_state_from_other_process_count(self, step: int) -> dict | None:
        """The data iterator state when ``step`` was saved by a different number of processes (None otherwise).

        grain writes one state per process. The prompt pipeline's per-process states are equal (the number of
        global batches consumed), so any of them resumes any process count; unequal states cannot be mapped."""
        own = os.path.join(
            self.directory, str(step), "data", f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        )
        files = sorted(glob.glob(os.path.join(self.directory, str(step), "data", "process_*-of-*.json")))
        if os.path.exists(own) or not files:
            return None
        states = {json.dumps(json.load(open(f)), sort_keys=True) for f in files}
        if len(states) != 1:
            raise ValueError(
                f"checkpoint step {step} in {self.directory} was saved by {len(files)} processes whose data iterator "
                f"states differ ({sorted(states)}); resume it with {len(files)} processes"
            )
        log.info(
            "step %d was saved by %d processes; resuming its data position on %d", step, len(files), jax.process_count()
        )
        return json.loads(states.pop())

    def _set_aside(self, step: int) -> None:
        """Move an unreadable step out of the way (kept for inspection) so that step can be saved again. Only process
        0 moves files (the directory is shared); every process waits for it before reloading the step list."""
        if jax.process_index() == 0:
            src = os.path.join(self.directory, str(step))
            dst_root = self.directory.rstrip("/") + "_unreadable"
            os.makedirs(dst_root, exist_ok=True)
            dst = os.path.join(dst_root, str(step))
            i = 0
            while os.path.exists(dst):
                i += 1
                dst = os.path.join(dst_root, f"{step}.{i}")
            if os.path.isdir(src):
                os.rename(src, dst)
                log.warning("moved unreadable checkpoint step %d to %s", step, dst)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"tlt_jax_set_aside_{step}")
        self.manager.reload()

    def settle(self) -> None:
        """Block until a pending asynchronous save has ended, without raising: a failure is kept for ``poll`` /
        ``wait`` to report. Call it before the saved train state is donated (the next update): on a CPU backend the
        save reads the arrays in place, so a donation while it runs copies the whole state instead (1.5 GiB for
        SmolLM2-135M with AdamW, issue 42)."""
        if self._pending is None or self.error is not None:
            return
        try:
            self.wait()
        except CheckpointWriteError:  # recorded in self.error: poll / wait / close report it
            pass

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk; CheckpointWriteError if one failed."""
        if self.error is not None:
            raise self.error
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            self._failed(self._pending, e)
        self._pending = None

    def close(self) -> None:
        """Wait for pending saves and release orbax's threads; a save failure is raised (once: a failure already
        reported by save / poll / wait is not raised again)."""
        reported = self.error is not None
        try:
            if not reported:
                self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:
                if not (reported or self.error is not None):
                    raise
