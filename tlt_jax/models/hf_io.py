"""HF directories: config.json <-> ModelConfig, (sharded) safetensors loading, and ``save_pretrained``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from tlt_jax.models.config import ModelConfig, RopeScaling
from tlt_jax.models.transformer import CausalLM
from tlt_jax.models.weights import ModelLoadError, hf_tensors, model_from_hf_tensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_DTYPE_NAMES = {"float32": np.float32, "float16": np.float16, "bfloat16": jnp.bfloat16}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def _rope_scaling(block: dict | None, where: str) -> RopeScaling | None:
    """llama3 scaling from a transformers-5 ``rope_parameters`` block or an older ``rope_scaling`` dict."""
    if not block:
        return None
    kind = block.get("rope_type", block.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelLoadError(f"{where}: rope type {kind!r} is not supported (only 'default' and 'llama3')")
    try:
        return RopeScaling(
            factor=float(block["factor"]),
            low_freq_factor=float(block["low_freq_factor"]),
            high_freq_factor=float(block["high_freq_factor"]),
            original_max_position_embeddings=int(block["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}: llama3 rope scaling lacks {e.args[0]!r}") from None


def config_from_hf(d: dict, where: str = CONFIG_FILE, generation_config: dict | None = None) -> ModelConfig:
    """ModelConfig from a transformers config dict (llama / qwen2; transformers 4 or 5 style RoPE keys)."""
    model_type = d.get("model_type")
    if model_type not in _ARCH_CLASSES:
        archs = d.get("architectures")
        raise ModelLoadError(
            f"{where}: unknown model_type {model_type!r} (architectures={archs}); supported: {sorted(_ARCH_CLASSES)}"
        )
    if d.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{where}: hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
    if d.get("mlp_bias"):
        raise ModelLoadError(f"{where}: mlp_bias=true is not supported")
    if model_type == "qwen2" and d.get("use_sliding_window"):
        raise ModelLoadError(f"{where}: use_sliding_window=true is not supported")
    rope = d.get("rope_parameters") or {}
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    scaling = _rope_scaling(rope if "rope_type" in rope or "type" in rope else d.get("rope_scaling"), where)

    def ids(v) -> tuple[int, ...]:
        return () if v is None else tuple(v) if isinstance(v, list | tuple) else (int(v),)

    eos = ids(d.get("eos_token_id"))
    if generation_config:
        eos += tuple(t for t in ids(generation_config.get("eos_token_id")) if t not in eos)
    try:
        heads = int(d["num_attention_heads"])
        return ModelConfig(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or 0),
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            # Qwen2 always has q/k/v biases; Llama has them (and an o_proj bias) when attention_bias is set.
            attention_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            architecture=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}: missing key {e.args[0]!r}") from None
    except ValueError as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{where}: {e}") from None


def config_to_hf(cfg: ModelConfig, torch_dtype: str = "float32") -> dict:
    """transformers config.json dict (top-level rope_theta, as transformers 4 writes and 5 still reads)."""
    eos = list(cfg.eos_token_ids)
    d = {
        "architectures": [_ARCH_CLASSES[cfg.architecture]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": torch_dtype,
        "use_cache": True,
    }
    if cfg.architecture == "llama":
        d["attention_bias"] = cfg.attention_bias
        d["mlp_bias"] = False
    else:
        d["use_sliding_window"] = False
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        d["rope_scaling"] = {
            "rope_type": s.rope_type,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return d


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """ModelConfig of an HF directory (eos ids from generation_config.json are added when present)."""
    path = Path(path)
    gen = path / "generation_config.json"
    return config_from_hf(
        _read_json(path / CONFIG_FILE), str(path / CONFIG_FILE), _read_json(gen) if gen.exists() else None
    )


class SafetensorsSource:
    """Tensors of a single or sharded safetensors checkpoint, read one at a time."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / INDEX_FILE
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index}: no 'weight_map' dict")
            self._file = dict(weight_map)
        elif (directory / WEIGHTS_FILE).exists():
            with safe_open(directory / WEIGHTS_FILE, framework="numpy") as f:
                self._file = dict.fromkeys(f.keys(), WEIGHTS_FILE)
        else:
            raise ModelLoadError(f"{directory}: neither {WEIGHTS_FILE} nor {INDEX_FILE} found")
        self._open = {}

    def names(self):
        return self._file.keys()

    def where(self, name: str) -> str:
        return str(self.directory / self._file.get(name, WEIGHTS_FILE))

    def _handle(self, name: str):
        fname = self._file[name]
        if fname not in self._open:
            fpath = self.directory / fname
            if not fpath.exists():
                raise ModelLoadError(f"{fpath}: shard listed in {INDEX_FILE} (for tensor {name!r}) not found")
            self._open[fname] = safe_open(fpath, framework="numpy")
        return self._open[fname]

    def get(self, name: str) -> np.ndarray:
        f = self._handle(name)
        try:
            return f.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"{self.where(name)}: cannot read tensor {name!r} ({e})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Only the bytes of ``tensor[index]`` are read (contiguous slices)."""
        try:
            return self._handle(name).get_slice(name)[index]
        except Exception as e:
            raise ModelLoadError(f"{self.where(name)}: cannot read {index} of tensor {name!r} ({e})") from None


def _zero_o_proj_bias(source: SafetensorsSource):
    """Llama with attention_bias also has an o_proj bias, which our model lacks: accept it only if all zero."""

    def allowed(name: str, _=None) -> bool:
        if not name.endswith("self_attn.o_proj.bias"):
            return False
        if np.any(source.get(name).astype(np.float32) != 0):
            raise ModelLoadError(f"{source.where(name)}: tensor {name!r} is non-zero; an o_proj bias is not supported")
        return True

    return allowed


def load_hf(path: str | os.PathLike, dtype=jnp.float32, param_dtype=None, *, mesh=None, rules=None) -> CausalLM:
    """CausalLM from an HF directory (config.json + model.safetensors or a sharded index).

    With ``mesh`` the parameters are created in their sharding (``rules``, default the project's) and each process
    reads from the files only the slices its devices hold: a large model is never whole in one host's memory."""
    path = Path(path)
    cfg = load_hf_config(path)
    source = SafetensorsSource(path)
    shardings = None
    if mesh is not None:
        from flax import nnx

        from tlt_jax.distributed.sharding import LogicalRules, state_shardings
        from tlt_jax.models.weights import abstract_model

        _, abstract = nnx.split(abstract_model(cfg, dtype, param_dtype))
        shardings = state_shardings(abstract, mesh, rules or LogicalRules())
    return model_from_hf_tensors(
        cfg,
        source,
        dtype=dtype,
        param_dtype=param_dtype,
        origin=str(path),
        allowed_extra=_zero_o_proj_bias(source),
        shardings=shardings,
    )


def save_pretrained(model: CausalLM, out_dir: str | os.PathLike, dtype=None) -> Path:
    """Write config.json + model.safetensors that transformers' AutoModelForCausalLM and ``from_pretrained`` load.

    ``dtype`` (e.g. jnp.bfloat16) casts the saved tensors; default: the parameters' own dtype.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    tensors = hf_tensors(model, dtype)
    if cfg.architecture == "qwen2" and not cfg.attention_bias:
        raise ModelLoadError("cannot save a qwen2 model without attention biases: transformers' Qwen2 always has them")
    if cfg.architecture == "llama" and cfg.attention_bias:
        ref = tensors["model.layers.0.self_attn.q_proj.bias"]
        for i in range(cfg.num_layers):
            tensors[f"model.layers.{i}.self_attn.o_proj.bias"] = np.zeros((cfg.hidden_size,), ref.dtype)
    dtype_name = {np.dtype(v): k for k, v in _DTYPE_NAMES.items()}.get(next(iter(tensors.values())).dtype)
    if dtype_name is None:
        raise ModelLoadError(f"cannot save dtype {next(iter(tensors.values())).dtype}; use one of {list(_DTYPE_NAMES)}")
    (out / CONFIG_FILE).write_text(json.dumps(config_to_hf(cfg, dtype_name), indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out
