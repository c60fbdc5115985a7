"""Orbax checkpoints of a run: policy + optimizer, drafter (when present), data iterator, controller state, RNG."""

from tlt_jax.checkpoint.manager import (
    Checkpointer,
    CheckpointWriteError,
    IncompatibleCheckpointError,
    Restored,
    UnreadableCheckpointError,
    abstract_like,
    save_in_flight_bytes,
    tree_differences,
)

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
