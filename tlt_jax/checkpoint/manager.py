"""Run checkpoints: one orbax Composite per saved step, written asynchronously and published atomically.

Items: ``train_state`` (policy params, optimizer state, update counters), ``rng`` (the run's key data: it seeds the
rest of a resumed run), ``data`` (the grain iterator, through grain's orbax handler), ``controller`` (JSON: the host
loop's counters), and any ``extra`` pytrees (e.g. ``drafter`` = drafter params + optimizer state) when present.
Orbax writes into a temporary directory and renames it on success, so a killed process never leaves a half-written
step behind.

Restore tells an incompatible checkpoint from a corrupt one. Before reading arrays it compares the saved tree
metadata (keys, shapes, dtypes) with the restore target: a difference means another model / optimizer wrote it, and
:class:`IncompatibleCheckpointError` names the differing keys and touches nothing. A step whose metadata matches but
which cannot be read (damaged files) is corrupt: the newest readable step is restored and the newer corrupt ones are
moved to ``<dir>_unreadable`` (kept, so the step can be written again). If no step is readable nothing is moved and
:class:`UnreadableCheckpointError` is raised: silently starting over from step 0 is never safe.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

__all__ = [
    "Checkpointer",
    "IncompatibleCheckpointError",
    "Restored",
    "UnreadableCheckpointError",
    "abstract_like",
    "tree_differences",
]

log = logging.getLogger(__name__)


class IncompatibleCheckpointError(ValueError):
    """The checkpoint was written for another model or optimizer (keys, shapes or dtypes differ)."""


class UnreadableCheckpointError(RuntimeError):
    """Every saved step is unreadable; nothing was moved or deleted."""


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
            items = dict(
                train_state=ocp.args.StandardRestore(abstract_state),
                rng=ocp.args.StandardRestore(),
                data=grain.checkpoint.CheckpointRestore(data_iter),
                controller=ocp.args.JsonRestore(),
            )
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
