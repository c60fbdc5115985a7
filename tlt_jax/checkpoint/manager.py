"""Run checkpoints: one orbax Composite per saved step, written asynchronously and published atomically.

Items: ``train_state`` (policy params, optimizer state, update counters), ``rng`` (the run's key data), ``data``
(the grain iterator, through grain's orbax handler), ``controller`` (JSON: the host loop's counters), and any
``extra`` pytrees (e.g. ``drafter`` = drafter params + optimizer state) when present. Orbax writes into a temporary
directory and renames it on success, so a killed process never leaves a half-written step behind; a step that is
listed but unreadable (a corrupted file) is skipped with a warning and the previous one is restored.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["Checkpointer", "Restored", "abstract_like"]

log = logging.getLogger(__name__)


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


class Checkpointer:
    """Saves every ``every_steps`` RL steps (and when forced, e.g. at the end); keeps ``max_to_keep`` steps."""

    def __init__(self, directory: str | os.PathLike, *, every_steps: int, max_to_keep: int, async_save: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        self.every_steps = int(every_steps)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

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
        return bool(self.manager.save(step, args=ocp.args.Composite(**items), force=True))

    def restore(
        self, abstract_state: Any, *, data_iter: Any, abstract_extra: Mapping[str, Any] | None = None
    ) -> Restored | None:
        """Restore the newest readable step (None if there is none). ``data_iter`` is set to its saved position."""
        skipped = []
        for step in reversed(self.all_steps()):
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
            except Exception as e:  # corrupt or partial step: fall back to the previous one
                log.warning(
                    "checkpoint step %d in %s is unreadable (%s: %s); falling back to the previous checkpoint",
                    step,
                    self.directory,
                    type(e).__name__,
                    str(e).splitlines()[0][:300] if str(e) else "",
                )
                skipped.append(step)
                self._set_aside(step)
                continue
            if data_state is not None:
                data_iter.set_state(data_state)
            extra = {name: out[f"extra_{name}"] for name in (abstract_extra or {})}
            return Restored(
                step, out["train_state"], np.asarray(out["rng"]["key"]), dict(out["controller"]), extra, skipped
            )
        if skipped:
            log.warning("no readable checkpoint in %s (unreadable steps: %s); starting fresh", self.directory, skipped)
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
        """Move an unreadable step out of the way (kept for inspection) so that step can be saved again."""
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
        self.manager.reload()

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
