"""EAGLE drafter: module, loss and train step, save/load and EAGLE/SGLang export, offline acceptance profile,
offline warm-up (``warmup``)."""

from tlt_jax.drafter.eagle import DraftVocab, EagleDrafter, draft_head, frequent_tokens, num_trainable_params
from tlt_jax.drafter.evaluate import ChainProfile, chain_acceptance
from tlt_jax.drafter.export import eagle_config, export_eagle, import_eagle, load_drafter, save_drafter
from tlt_jax.drafter.train import (
    DrafterBatch,
    DrafterLossConfig,
    DrafterOptimConfig,
    DrafterTrainState,
    LossMetrics,
    batch_sharding,
    drafter_loss,
    init_drafter_train_state,
    make_drafter_optimizer,
    make_drafter_train_step,
    pack_sequences,
    smooth_l1,
    train_drafter,
)

__all__ = [
    "ChainProfile",
    "DraftVocab",
    "DrafterBatch",
    "EagleDrafter",
    "DrafterLossConfig",
    "LossMetrics",
    "DrafterOptimConfig",
    "DrafterTrainState",
    "batch_sharding",
    "chain_acceptance",
    "draft_head",
    "drafter_loss",
    "eagle_config",
    "export_eagle",
    "frequent_tokens",
    "import_eagle",
    "init_drafter_train_state",
    "load_drafter",
    "make_drafter_optimizer",
    "make_drafter_train_step",
    "num_trainable_params",
    "pack_sequences",
    "save_drafter",
    "smooth_l1",
    "train_drafter",
]
