"""Prompt construction (chat template supplied by the model package, or plain text) and prompt-length filtering."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

__all__ = [
    "ANSWER_IS_INSTRUCTION",
    "DEFAULT_INSTRUCTION",
    "INSTRUCTIONS",
    "PromptFormatter",
    "filter_by_prompt_length",
    "instruction_for",
    "instruction_name",
]

DEFAULT_INSTRUCTION = (
    "Solve the math problem step by step. "
    "At the end, write the final answer as a single number on its own line after '####', e.g. '#### 42'."
)

# The arithmetic source's instruction: a plain closing sentence that a 135M model already writes ~40 % of the time
# (a format it can learn to give every time; see the format reward in tlt_jax.rewards).
ANSWER_IS_INSTRUCTION = "Think step by step. End your reply with the sentence 'The answer is N.' where N is a number."

# data.instruction -> text; "auto" picks by data.source (instruction_for)
INSTRUCTIONS = {"gsm8k": DEFAULT_INSTRUCTION, "answer_is": ANSWER_IS_INSTRUCTION}


def instruction_name(source: str, name: str = "auto") -> str:
    """data.instruction ``name`` resolved: "auto" is "answer_is" for the arithmetic source, "gsm8k" (the '#### N'
    final line) for every other (a GSM8K file of arithmetic problems takes "answer_is")."""
    if name == "auto":
        return "answer_is" if source == "arithmetic" else "gsm8k"
    return name


def instruction_for(source: str, name: str = "auto") -> str:
    """The instruction text of data.instruction ``name`` for data.source ``source``."""
    return INSTRUCTIONS[instruction_name(source, name)]


ChatTemplate = Callable[[list[dict]], str]


@dataclasses.dataclass(frozen=True)
class PromptFormatter:
    """Turns a question into prompt text.

    With ``chat_template`` (e.g. the model's ``apply_chat_template(messages) -> str``, which should add the
    generation prompt) the instruction goes in a system message, or is prepended to the user message when
    ``use_system_role`` is False (for templates without a system role). Without one, plain text is produced.
    """

    chat_template: ChatTemplate | None = None
    instruction: str = DEFAULT_INSTRUCTION
    use_system_role: bool = True

    def messages(self, question: str) -> list[dict]:
        """The chat messages for ``question``."""
        if self.use_system_role:
            return [{"role": "system", "content": self.instruction}, {"role": "user", "content": question}]
        return [{"role": "user", "content": f"{self.instruction}\n\n{question}"}]

    def __call__(self, question: str) -> str:
        if self.chat_template is None:
            return f"{self.instruction}\n\nQuestion: {question}\nAnswer:"
        return self.chat_template(self.messages(question))


def filter_by_prompt_length(
    examples: Sequence[dict], encode: Callable[[str], Sequence[int]], max_prompt_len: int
) -> tuple[list[dict], int]:
    """Keep examples whose ``prompt_text`` encodes to at most ``max_prompt_len`` tokens; also return how many
    were dropped (a metric)."""
    kept = [ex for ex in examples if len(encode(ex["prompt_text"])) <= max_prompt_len]
    return kept, len(examples) - len(kept)
