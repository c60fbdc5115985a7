"""Prompt data: GSM8K files and reasoning-gym GSM-style problems, prompt formatting, and the grain pipeline."""

from tlt_jax.data.pipeline import prompt_dataset
from tlt_jax.data.prompts import DEFAULT_INSTRUCTION, PromptFormatter, filter_by_prompt_length
from tlt_jax.data.sources import GSM8KFile, Splits, gsm_symbolic_examples, gsm_symbolic_splits, load_gsm8k_file

__all__ = [
    "DEFAULT_INSTRUCTION",
    "GSM8KFile",
    "PromptFormatter",
    "Splits",
    "filter_by_prompt_length",
    "gsm_symbolic_examples",
    "gsm_symbolic_splits",
    "load_gsm8k_file",
    "prompt_dataset",
]
