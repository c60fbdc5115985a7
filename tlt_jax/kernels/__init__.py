"""Pallas kernels: tree attention for decode and tree verification, with the dense XLA reference."""

from tlt_jax.kernels.api import ATTENTION_IMPLS, prefix_tree_attention, tree_attention
from tlt_jax.kernels.reference import tree_attention_reference, tree_visibility

__all__ = [
    "ATTENTION_IMPLS",
    "prefix_tree_attention",
    "tree_attention",
    "tree_attention_reference",
    "tree_visibility",
]
