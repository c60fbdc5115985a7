"""Tokenizers against transformers' ids and chat-template strings (fixtures from tests/fixtures/make_fixtures.py)."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from tlt_jax.models import DEFAULT_MODEL, load_tokenizer
from tlt_jax.models.tokenizer import default_system_prompt, tokenizer_from_hf_dir

FIXTURES = Path(__file__).parent / "fixtures"
SMOL = json.loads((FIXTURES / "smollm2_gguf_reference.json").read_text())
TINY = json.loads((FIXTURES / "tiny_qwen2" / "tokenizer_reference.json").read_text())


@pytest.fixture(scope="module")
def smol_tok():
    return load_tokenizer(DEFAULT_MODEL)


def test_smollm2_gguf_tokenizer_ids_match_transformers(smol_tok):
    assert [smol_tok.encode(s) for s in SMOL["tokenizer_strings"]] == SMOL["tokenizer_ids"]
    assert smol_tok.encode(SMOL["prompt_text"]) == SMOL["prompt_ids"]
    assert smol_tok.vocab_size == 49152 and smol_tok.bos_token_id == 1
    assert smol_tok.eos_token_ids == (SMOL["eos_token_id"],) == (2,)


def test_smollm2_decode(smol_tok):
    for s in SMOL["tokenizer_strings"]:
        assert smol_tok.decode(smol_tok.encode(s)) == s
    assert smol_tok.decode(SMOL["prompt_ids"]) == SMOL["prompt_text"]
    assert smol_tok.decode([1, 4093, 2], skip_special_tokens=True) == "user"


def test_smollm2_chat_template_matches_transformers(smol_tok):
    assert smol_tok.default_system_prompt == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert smol_tok.apply_chat_template(SMOL["messages"]) == SMOL["prompt_text"]
    for chat, want, want_open in zip(
        SMOL["chats"], SMOL["chat_texts"], SMOL["chat_texts_no_generation_prompt"], strict=True
    ):
        assert smol_tok.apply_chat_template(chat) == want
        assert smol_tok.apply_chat_template(chat, add_generation_prompt=False) == want_open


def test_hf_dir_tokenizer_matches_transformers():
    tok = load_tokenizer(FIXTURES / "tiny_qwen2")
    assert [tok.encode(s) for s in TINY["strings"]] == TINY["ids"]
    assert all(tok.decode(tok.encode(s)) == s for s in TINY["strings"])
    assert [tok.apply_chat_template(c) for c in TINY["chats"]] == TINY["chat_texts"]
    assert tok.default_system_prompt == "You are a tiny test model."
    assert tok.eos_token_ids == (TINY["eos_token_id"],) and tok.vocab_size == 512 and tok.bos_token_id is None


def test_default_system_prompt_forms():
    qwen25 = (
        "{%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\\n' }}\n    {%- endif %}"
    )
    assert default_system_prompt(qwen25) == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    no_default = "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    assert default_system_prompt(no_default) is None and default_system_prompt(None) is None


def test_non_chatml_tokenizer_refuses_chat_template(tmp_path):
    (tmp_path / "tokenizer.json").write_text(Tokenizer(models.BPE(vocab={"a": 0}, merges=[])).to_str())
    tok = tokenizer_from_hf_dir(tmp_path)
    with pytest.raises(ValueError, match="not a ChatML model"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
