"""Causal LMs (Llama / Qwen2 / SmolLM2), their KV cache, loaders and tokenizers."""

from tlt_jax.models.config import ModelConfig, RopeScaling, tiny_config
from tlt_jax.models.hf_io import save_pretrained
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.loading import check_tokenizer_matches, from_pretrained, load_model_and_tokenizer, load_tokenizer
from tlt_jax.models.presets import DEFAULT_MODEL, default_model_path
from tlt_jax.models.tokenizer import Tokenizer
from tlt_jax.models.transformer import LAYER_LAYOUTS, CausalLM, ModelOutput, rollout_copy, unstack_layers
from tlt_jax.models.weights import ModelLoadError

__all__ = [
    "DEFAULT_MODEL",
    "CausalLM",
    "KVCache",
    "ModelConfig",
    "ModelLoadError",
    "ModelOutput",
    "RopeScaling",
    "Tokenizer",
    "check_tokenizer_matches",
    "default_model_path",
    "from_pretrained",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "rollout_copy",
    "unstack_layers",
    "LAYER_LAYOUTS",
    "save_pretrained",
    "tiny_config",
]
