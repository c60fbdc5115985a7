"""Orbax checkpoints of a run: policy + optimizer, drafter (when present), data iterator, controller state, RNG."""

from tlt_jax.checkpoint.manager import Checkpointer, Restored, abstract_like

__all__ = ["Checkpointer", "Restored", "abstract_like"]
