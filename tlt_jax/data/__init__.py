"""Prompt data: GSM8K files and reasoning-gym generated problems (GSM-style, arithmetic), prompt formatting, and the
grain pipeline."""

from tlt_jax.data.pipeline import prompt_dataset
from tlt_jax.data.prompts import (
    ANSWER_IS_INSTRUCTION,
    DEFAULT_INSTRUCTION,
    INSTRUCTIONS,
    PromptFormatter,
    filter_by_prompt_length,
    instruction_for,
)
from tlt_jax.data.sources import (
    GENERATED_TASKS,
    GSM8KFile,
    Splits,
    generated_splits,
    gsm_symbolic_examples,
    gsm_symbolic_splits,
    load_gsm8k_file,
)

__all__ = [
    "ANSWER_IS_INSTRUCTION",
    "DEFAULT_INSTRUCTION",
    "GENERATED_TASKS",
    "GSM8KFile",
    "INSTRUCTIONS",
    "PromptFormatter",
    "Splits",
    "filter_by_prompt_length",
    "generated_splits",
    "gsm_symbolic_examples",
    "gsm_symbolic_splits",
    "instruction_for",
    "load_gsm8k_file",
    "prompt_dataset",
]
