"""Tree speculative decoding kernels: tree format, EAGLE-2 drafting (any ``TreeDrafter``), n-gram drafting, lossless
verification, KV commit. Generation loops live in the rollout engine (``tlt_jax.rollout``); ``reference`` holds the
numpy oracles. Imports only ``tlt_jax.models`` and ``tlt_jax.sampling``."""

from tlt_jax.speculative.ngram import NgramDrafter
from tlt_jax.speculative.tree import (
    DraftState,
    Tree,
    TreeDrafter,
    ancestor_matrix,
    chain_tree,
    check_tree,
    draft_head,
    drafter_extend,
    drafter_prefill,
    eagle_draft,
    from_first_child_next_sibling,
    init_draft_state,
    make_tree,
    select_tree,
    tree_positions,
)
from tlt_jax.speculative.verify import (
    Acceptance,
    VerifyOutput,
    accept_tree,
    depth_keys,
    sample_tree,
    tree_forward,
    truncate,
    verify_tree,
)

__all__ = [
    "Acceptance",
    "DraftState",
    "NgramDrafter",
    "Tree",
    "TreeDrafter",
    "VerifyOutput",
    "accept_tree",
    "ancestor_matrix",
    "chain_tree",
    "check_tree",
    "depth_keys",
    "draft_head",
    "drafter_extend",
    "drafter_prefill",
    "eagle_draft",
    "from_first_child_next_sibling",
    "init_draft_state",
    "make_tree",
    "sample_tree",
    "select_tree",
    "tree_forward",
    "tree_positions",
    "truncate",
    "verify_tree",
]
