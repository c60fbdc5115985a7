"""tlt_jax: GRPO training with lossless, adaptive tree speculative rollouts in pure JAX."""

__version__ = "0.1.0"
