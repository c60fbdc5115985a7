"""The one mapping between HF-named tensors ([out, in] Linear weights, one tensor per layer) and our parameters.

Every loader (safetensors, GGUF) first presents its tensors under HF names through a ``TensorSource``; this module
checks names and shapes, converts to our layouts (3-D attention kernels, [in, out] MLP kernels, layers stacked on
axis 0) and builds the model from an abstract one, so parameters are materialised once. ``hf_tensors`` is the
inverse, used by ``save_pretrained``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.models.config import ModelConfig, RopeScaling
from tlt_jax.models.transformer import CausalLM


class ModelLoadError(ValueError):
    """A checkpoint, config or tokenizer that cannot be loaded; the message names the file and what was expected."""


class TensorSource(Protocol):
    """HF-named tensors of one checkpoint, read lazily."""

    def names(self) -> Iterable[str]: ...

    def get(self, name: str) -> np.ndarray: ...

    def where(self, name: str) -> str:
        """Where a tensor lives, for error messages (file, and the file's own tensor name if it differs)."""
        ...


@dataclasses.dataclass(frozen=True)
class _Spec:
    """One of our parameters: its HF name (``{i}`` = layer index), HF shape and the layout conversions."""

    path: tuple[str, ...]
    hf_name: str
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf_name


def _same(x, c):
    return x


def _t(x, c):
    return x.T


_L = "model.layers.{i}."
_SPECS = (
    _Spec(("embed_tokens",), "model.embed_tokens.weight", lambda c: (c.vocab_size, c.hidden_size), _same, _same),
    _Spec(("norm", "weight"), "model.norm.weight", lambda c: (c.hidden_size,), _same, _same),
    _Spec(("lm_head",), "lm_head.weight", lambda c: (c.vocab_size, c.hidden_size), _t, _t),
    _Spec(
        ("layers", "input_layernorm", "weight"), _L + "input_layernorm.weight", lambda c: (c.hidden_size,), _same, _same
    ),
    _Spec(
        ("layers", "post_attention_layernorm", "weight"),
        _L + "post_attention_layernorm.weight",
        lambda c: (c.hidden_size,),
        _same,
        _same,
    ),
    _Spec(
        ("layers", "self_attn", "q_proj"),
        _L + "self_attn.q_proj.weight",
        lambda c: (c.num_heads * c.head_dim, c.hidden_size),
        lambda x, c: x.T.reshape(c.hidden_size, c.num_heads, c.head_dim),
        lambda y, c: y.reshape(c.hidden_size, -1).T,
    ),
    _Spec(
        ("layers", "self_attn", "k_proj"),
        _L + "self_attn.k_proj.weight",
        lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
        lambda x, c: x.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim),
        lambda y, c: y.reshape(c.hidden_size, -1).T,
    ),
    _Spec(
        ("layers", "self_attn", "v_proj"),
        _L + "self_attn.v_proj.weight",
        lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
        lambda x, c: x.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim),
        lambda y, c: y.reshape(c.hidden_size, -1).T,
    ),
    _Spec(
        ("layers", "self_attn", "o_proj"),
        _L + "self_attn.o_proj.weight",
        lambda c: (c.hidden_size, c.num_heads * c.head_dim),
        lambda x, c: x.T.reshape(c.num_heads, c.head_dim, c.hidden_size),
        lambda y, c: y.reshape(-1, c.hidden_size).T,
    ),
    _Spec(
        ("layers", "self_attn", "q_bias"),
        _L + "self_attn.q_proj.bias",
        lambda c: (c.num_heads * c.head_dim,),
        lambda x, c: x.reshape(c.num_heads, c.head_dim),
        lambda y, c: y.reshape(-1),
    ),
    _Spec(
        ("layers", "self_attn", "k_bias"),
        _L + "self_attn.k_proj.bias",
        lambda c: (c.num_kv_heads * c.head_dim,),
        lambda x, c: x.reshape(c.num_kv_heads, c.head_dim),
        lambda y, c: y.reshape(-1),
    ),
    _Spec(
        ("layers", "self_attn", "v_bias"),
        _L + "self_attn.v_proj.bias",
        lambda c: (c.num_kv_heads * c.head_dim,),
        lambda x, c: x.reshape(c.num_kv_heads, c.head_dim),
        lambda y, c: y.reshape(-1),
    ),
    _Spec(
        ("layers", "mlp", "gate_proj"),
        _L + "mlp.gate_proj.weight",
        lambda c: (c.intermediate_size, c.hidden_size),
        _t,
        _t,
    ),
    _Spec(
        ("layers", "mlp", "up_proj"), _L + "mlp.up_proj.weight", lambda c: (c.intermediate_size, c.hidden_size), _t, _t
    ),
    _Spec(
        ("layers", "mlp", "down_proj"),
        _L + "mlp.down_proj.weight",
        lambda c: (c.hidden_size, c.intermediate_size),
        _t,
        _t,
    ),
)
_BY_PATH = {s.path: s for s in _SPECS}
# Tensors some checkpoints carry that hold nothing we need (RoPE tables are recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def abstract_model(cfg: ModelConfig, dtype=jnp.float32, param_dtype=None) -> CausalLM:
    """The model with ShapeDtypeStruct leaves: structure and shapes without allocating parameters."""
    param_dtype = dtype if param_dtype is None else param_dtype
    return nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))


def model_from_arrays(
    cfg: ModelConfig, arrays: Callable[[tuple[str, ...], jax.ShapeDtypeStruct], np.ndarray], dtype, param_dtype
) -> CausalLM:
    """Build the model by asking ``arrays(path, abstract)`` for each parameter (numpy, any float dtype)."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype, param_dtype))
    filled = []
    for path, var in nnx.to_flat_state(state):
        abstract = var.get_value()
        value = arrays(tuple(str(p) for p in path), abstract)
        if tuple(value.shape) != tuple(abstract.shape):
            raise ModelLoadError(
                f"parameter {'.'.join(map(str, path))}: got shape {value.shape}, expected {tuple(abstract.shape)}"
            )
        filled.append((path, var.replace(jnp.asarray(np.asarray(value).astype(abstract.dtype, copy=False)))))
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def _expected_hf_names(cfg: ModelConfig) -> Iterator[tuple[_Spec, int | None, str]]:
    for path, spec in _BY_PATH.items():
        if path == ("lm_head",) and cfg.tie_word_embeddings:
            continue
        if path[-1].endswith("_bias") and not cfg.attention_bias:
            continue
        if spec.per_layer:
            for i in range(cfg.num_layers):
                yield spec, i, spec.hf_name.format(i=i)
        else:
            yield spec, None, spec.hf_name


def model_from_hf_tensors(
    cfg: ModelConfig,
    source: TensorSource,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    origin: str = "checkpoint",
    allowed_extra: Callable[[str, np.ndarray | None], bool] | None = None,
) -> CausalLM:
    """Check every HF-named tensor of ``source`` (present, right shape, nothing unexpected) and build the model.

    ``allowed_extra(name)`` may accept tensors the model does not use (e.g. an all-zero o_proj bias).
    """
    present = set(source.names())
    expected = {name for _, _, name in _expected_hf_names(cfg)}
    missing = sorted(expected - present)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(
            f"{origin}: missing tensor {missing[0]!r}{more}; the config "
            f"(architecture={cfg.architecture}, layers={cfg.num_layers}, "
            f"attention_bias={cfg.attention_bias}, tie_word_embeddings={cfg.tie_word_embeddings}) "
            f"needs it"
        )
    extra = sorted(
        n
        for n in present - expected
        if not n.endswith(_IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
        and not (allowed_extra is not None and allowed_extra(n))
    )
    if extra:
        raise ModelLoadError(
            f"{origin}: unexpected tensor {source.where(extra[0])} ({len(extra)} unexpected in all: "
            f"{extra[:5]}); the config (architecture={cfg.architecture}, "
            f"attention_bias={cfg.attention_bias}) has no parameter for it"
        )

    def fetch(spec: _Spec, name: str) -> np.ndarray:
        x = source.get(name)
        want = spec.hf_shape(cfg)
        if tuple(x.shape) != want:
            raise ModelLoadError(
                f"{source.where(name)}: tensor {name!r} has shape {tuple(x.shape)}, expected {want} from the config"
            )
        if not np.issubdtype(x.dtype, np.floating) and x.dtype != np.dtype(jnp.bfloat16):
            raise ModelLoadError(f"{source.where(name)}: tensor {name!r} has dtype {x.dtype}, expected a float type")
        return spec.to_ours(x, cfg)

    def arrays(path, abstract):
        spec = _BY_PATH[path]
        if spec.per_layer:
            out = np.empty(abstract.shape, abstract.dtype)
            for i in range(cfg.num_layers):
                out[i] = fetch(spec, spec.hf_name.format(i=i))
            return out
        return fetch(spec, spec.hf_name)

    return model_from_arrays(cfg, arrays, dtype, param_dtype)


def hf_tensors(model: CausalLM, dtype=None) -> dict[str, np.ndarray]:
    """The model's parameters under HF names and layouts (contiguous numpy, cast to ``dtype`` if given)."""
    cfg = model.config
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        path = tuple(str(p) for p in path)
        spec = _BY_PATH.get(path)
        if spec is None:
            raise ModelLoadError(f"parameter {'.'.join(path)} has no HF name")
        value = np.asarray(jax.device_get(var.get_value()))
        if dtype is not None:
            value = value.astype(np.dtype(dtype))
        layers = (
            [(spec.hf_name.format(i=i), value[i]) for i in range(cfg.num_layers)]
            if spec.per_layer
            else [(spec.hf_name, value)]
        )
        for name, v in layers:
            out[name] = np.ascontiguousarray(spec.to_hf(v, cfg))
    return out


def flat_params(model: CausalLM) -> dict[str, np.ndarray]:
    """Parameters in our own layout keyed by dotted path (the weight-cache format)."""
    return {
        ".".join(map(str, path)): np.asarray(jax.device_get(var.get_value()))
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def config_to_json(cfg: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


def config_from_json(text: str) -> ModelConfig:
    d = json.loads(text)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    return ModelConfig(**d)
