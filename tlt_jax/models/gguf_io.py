"""GGUF files (llama.cpp): config from metadata, de-quantised tensors under HF names, the embedded tokenizer spec.

llama.cpp stores Llama's Q/K projection rows permuted for its interleaved RoPE; ``GGUFSource`` undoes that so the
tensors match HF (and our non-interleaved RoPE). Qwen2 files are written unpermuted.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import CausalLM
from tlt_jax.models.weights import ModelLoadError, model_from_hf_tensors

ARCHITECTURES = ("llama", "qwen2")
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor, or None if it has none."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    return None


def open_gguf(path: str | os.PathLike):
    """A GGUFReader (memory-mapped), with a clear error for files that are not GGUF."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError / struct errors on bad magic or truncation
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def metadata(reader, key: str, default=None):
    """A scalar, string or array metadata value (arrays of strings as lists)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def config_from_gguf(reader, where: str) -> ModelConfig:
    """ModelConfig from ``general.architecture`` and the ``<arch>.*`` metadata keys."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{where}: unknown general.architecture {arch!r}; supported: {list(ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}

    def key(name, default=None, required=False):
        v = metadata(reader, f"{arch}.{name}", default)
        if v is None and required:
            raise ModelLoadError(f"{where}: metadata key {arch}.{name!r} missing")
        return v

    if key("rope.scaling.type") not in (None, "none") or "rope_freqs.weight" in tensors:
        raise ModelLoadError(
            f"{where}: RoPE scaling stored in GGUF ({key('rope.scaling.type') or 'rope_freqs.weight'})"
            " is not supported; load the HF checkpoint instead"
        )
    heads = int(key("attention.head_count", required=True))
    hidden = int(key("embedding_length", required=True))
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"{where}: missing tensor 'token_embd.weight'")
    vocab = int(key("vocab_size") or embd.shape[-1])
    eos = [metadata(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", required=True)),
        num_layers=int(key("block_count", required=True)),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv") or heads),
        head_dim=int(key("attention.key_length") or key("rope.dimension_count") or 0),
        rope_theta=_f32(key("rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        attention_bias="blk.0.attn_q.bias" in tensors,
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=int(key("context_length", 4096)),
        architecture=arch,
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(t) for t in eos if t is not None)),
    )


def _f32(v) -> float:
    """A float32 metadata value as its shortest decimal (1e-5 rather than 9.99999974e-06)."""
    return float(str(np.float32(v)))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its convert script's ``permute``) on [out, in] or [out]."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource:
    """De-quantised float32 tensors of a GGUF under HF names and [out, in] layout."""

    def __init__(self, reader, cfg: ModelConfig, where: str):
        self.reader, self.cfg, self.where_file = reader, cfg, where
        self._tensors = {}
        self.unmapped = []
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is None:
                self.unmapped.append(t.name)
            else:
                self._tensors[name] = t

    def names(self):
        return self._tensors.keys()

    def where(self, name: str) -> str:
        t = self._tensors.get(name)
        return f"{self.where_file} (GGUF tensor {t.name!r})" if t is not None else self.where_file

    def get(self, name: str) -> np.ndarray:
        import gguf

        t = self._tensors[name]
        qtype = t.tensor_type
        try:
            if qtype == gguf.GGMLQuantizationType.F64:
                x = np.asarray(t.data).view(np.float64).astype(np.float32)
            else:
                x = gguf.quants.dequantize(t.data, qtype)
        except NotImplementedError:
            raise ModelLoadError(
                f"{self.where(name)}: unsupported GGUF quantisation type {qtype.name} (the gguf package cannot "
                f"de-quantise it); supported include F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K"
            ) from None
        x = np.asarray(x, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        if self.cfg.architecture == "llama" and ".self_attn.q_proj." in name:
            x = _unpermute(x, self.cfg.num_heads)
        elif self.cfg.architecture == "llama" and ".self_attn.k_proj." in name:
            x = _unpermute(x, self.cfg.num_kv_heads)
        return x


def read_gguf(path: str | os.PathLike) -> tuple[ModelConfig, GGUFSource]:
    reader = open_gguf(path)
    cfg = config_from_gguf(reader, str(path))
    return cfg, GGUFSource(reader, cfg, str(path))


def load_gguf(path: str | os.PathLike, dtype=jnp.float32, param_dtype=None) -> CausalLM:
    """CausalLM from a GGUF file, de-quantised to float32 and cast to ``param_dtype``."""
    cfg, source = read_gguf(path)
    if source.unmapped and set(source.unmapped) - {"rope_freqs.weight"}:
        first = source.unmapped[0]
        raise ModelLoadError(
            f"{path}: unexpected GGUF tensor {first!r} ({len(source.unmapped)} without a mapping: "
            f"{source.unmapped[:5]})"
        )
    return model_from_hf_tensors(cfg, source, dtype=dtype, param_dtype=param_dtype, origin=str(path))
