"""Causal LMs (Llama / Qwen2 / SmolLM2), their KV cache, loaders and tokenizers."""

from tlt_jax.models.config import ModelConfig, RopeScaling, tiny_config
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.transformer import CausalLM, ModelOutput

__all__ = ["CausalLM", "KVCache", "ModelConfig", "ModelOutput", "RopeScaling", "tiny_config"]
