"""Tokenizers from an HF directory (tokenizer.json) or a GGUF's embedded GPT-2-style BPE, plus the ChatML template.

The chat template is our own function, not a Jinja engine: SmolLM2-Instruct and Qwen2.5 both use ChatML
(``<|im_start|>role\\ncontent<|im_end|>\\n``) with a default system prompt inserted when the conversation has none;
that prompt is read from the model's own template so the result matches transformers' rendering.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from tlt_jax.models.weights import ModelLoadError

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Default system prompt inside a ChatML Jinja template: '<|im_start|>system\n' + literal text + '<|im_end|>'
# (the newline may be a real one or a Jinja '\n' escape).
_DEFAULT_SYSTEM_RE = re.compile(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}+]*?)<\|im_end\|>")
# Pre-tokenizer splits per tokenizer.ggml.pre (llama.cpp's names); the Qwen2 one is Qwen2's own regex.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def default_system_prompt(chat_template: str | None) -> str | None:
    """The system prompt a ChatML template inserts when the conversation has none (None if it inserts none)."""
    if not chat_template:
        return None
    m = _DEFAULT_SYSTEM_RE.search(chat_template)
    return None if m is None else m.group(1).replace("\\n", "\n")


class Tokenizer:
    """Text <-> ids with a model's special tokens and ChatML chat template."""

    def __init__(
        self,
        backend: _Backend,
        *,
        eos_token_ids: tuple[int, ...] = (),
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        source: str = "",
    ):
        self.backend = backend
        self.eos_token_ids = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.default_system_prompt = default_system_prompt(chat_template)
        self.source = source
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (e.g. ``<|im_start|>``) map to their ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatML text of ``messages`` ({'role', 'content'} dicts), as transformers renders the model's template."""
        if self.token_to_id(IM_START) is None or self.token_to_id(IM_END) is None:
            raise ValueError(f"tokenizer {self.source!r} has no {IM_START}/{IM_END} tokens: not a ChatML model")
        parts = []
        if messages and messages[0]["role"] != "system" and self.default_system_prompt is not None:
            parts.append(f"{IM_START}system\n{self.default_system_prompt}{IM_END}\n")
        parts += [f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages]
        if add_generation_prompt:
            parts.append(f"{IM_START}assistant\n")
        return "".join(parts)

    def to_json(self) -> str:
        """Serialised form (the weight cache keeps GGUF tokenizers this way)."""
        return json.dumps(
            {
                "backend": self.backend.to_str(),
                "eos_token_ids": list(self.eos_token_ids),
                "bos_token_id": self.bos_token_id,
                "chat_template": self.chat_template,
                "source": self.source,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        d = json.loads(text)
        return cls(
            _Backend.from_str(d["backend"]),
            eos_token_ids=tuple(d["eos_token_ids"]),
            bos_token_id=d["bos_token_id"],
            chat_template=d["chat_template"],
            source=d["source"],
        )

    def __repr__(self):
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, eos={self.eos_token_ids})"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies are spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def tokenizer_from_gguf_reader(reader, where: str) -> Tokenizer:
    """Byte-level BPE from ``tokenizer.ggml.*`` metadata (tokens, merges, token types, special ids, pre type)."""
    from tlt_jax.models.gguf_io import metadata

    kind = metadata(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{where}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    merges = metadata(reader, "tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ModelLoadError(f"{where}: GGUF has no tokenizer.ggml.tokens / tokenizer.ggml.merges")
    types = metadata(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet (mislabelled specials) are respelled, as transformers' GGUF converter does.
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)
    }
    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ", 1)) for m in merges],
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    backend = _Backend(bpe)
    pre = metadata(reader, "tokenizer.ggml.pre")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLITS)
    if pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_SPLITS[pre]), "isolated"), byte_level]
        )
    elif pre == "smollm":  # llama.cpp: single digits first, then the GPT-2 regex (as SmolLM2's tokenizer.json)
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _CONTROL and set(t) <= alphabet
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _USER_DEFINED and t in vocab
        ]
    )
    eos = [metadata(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return Tokenizer(
        backend,
        eos_token_ids=tuple(int(t) for t in eos if t is not None),
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        chat_template=metadata(reader, "tokenizer.chat_template"),
        source=where,
    )


def _token_content(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def tokenizer_from_hf_dir(path: str | os.PathLike) -> Tokenizer:
    """tokenizer.json (+ tokenizer_config.json / chat_template.jinja / generation_config.json for specials)."""
    path = Path(path)
    tj = path / "tokenizer.json"
    if not tj.exists():
        raise ModelLoadError(f"{tj}: file not found (only fast tokenizers, tokenizer.json, are supported)")
    try:
        backend = _Backend.from_file(str(tj))
    except Exception as e:
        raise ModelLoadError(f"{tj}: cannot parse ({e})") from None
    tc = _read_json(path / "tokenizer_config.json")
    template = tc.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    eos = []
    if (tok := _token_content(tc.get("eos_token"))) is not None and backend.token_to_id(tok) is not None:
        eos.append(backend.token_to_id(tok))
    for name in ("generation_config.json", "config.json"):
        v = _read_json(path / name).get("eos_token_id")
        eos += v if isinstance(v, list) else [] if v is None else [v]
    bos = _token_content(tc.get("bos_token"))
    bos_id = backend.token_to_id(bos) if bos else _read_json(path / "config.json").get("bos_token_id")
    return Tokenizer(backend, eos_token_ids=tuple(eos), bos_token_id=bos_id, chat_template=template, source=str(path))
