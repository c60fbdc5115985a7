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


class SliceSource(TensorSource, Protocol):
    """A source that can read part of a tensor without the rest (safetensors: only the bytes of the slice)."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class _Spec:
    """One of our parameters: its HF name (``{i}`` = layer index), HF shape and the layout conversions."""

    path: tuple[str, ...]
    hf_name: str
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]
    # The same conversion for slices: ours = hf.transpose(perm), with axis ``split`` of that (if any) reshaped into
    # (heads, head_dim). Sharded loading reads only the HF slice behind each device's shard.
    perm: tuple[int, ...] = (0,)
    split: int | None = None

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf_name


def _same(x, c):
    return x


def _t(x, c):
    return x.T


_L = "model.layers.{i}."
_SPECS = (
    _Spec(
        ("embed_tokens",),
        "model.embed_tokens.weight",
        lambda c: (c.vocab_size, c.hidden_size),
        _same,
        _same,
        perm=(0, 1),
    ),
    _Spec(("norm", "weight"), "model.norm.weight", lambda c: (c.hidden_size,), _same, _same),
    _Spec(("lm_head",), "lm_head.weight", lambda c: (c.vocab_size, c.hidden_size), _t, _t, perm=(1, 0)),
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
        perm=(1, 0),
        split=1,
    ),
    _Spec(
        ("layers", "self_attn", "k_proj"),
        _L + "self_attn.k_proj.weight",
        lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
        lambda x, c: x.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim),
        lambda y, c: y.reshape(c.hidden_size, -1).T,
        perm=(1, 0),
        split=1,
    ),
    _Spec(
        ("layers", "self_attn", "v_proj"),
        _L + "self_attn.v_proj.weight",
        lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
        lambda x, c: x.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim),
        lambda y, c: y.reshape(c.hidden_size, -1).T,
        perm=(1, 0),
        split=1,
    ),
    _Spec(
        ("layers", "self_attn", "o_proj"),
        _L + "self_attn.o_proj.weight",
        lambda c: (c.hidden_size, c.num_heads * c.head_dim),
        lambda x, c: x.T.reshape(c.num_heads, c.head_dim, c.hidden_size),
        lambda y, c: y.reshape(-1, c.hidden_size).T,
        perm=(1, 0),
        split=0,
    ),
    _Spec(
        ("layers", "self_attn", "q_bias"),
        _L + "self_attn.q_proj.bias",
        lambda c: (c.num_heads * c.head_dim,),
        lambda x, c: x.reshape(c.num_heads, c.head_dim),
        lambda y, c: y.reshape(-1),
        split=0,
    ),
    _Spec(
        ("layers", "self_attn", "k_bias"),
        _L + "self_attn.k_proj.bias",
        lambda c: (c.num_kv_heads * c.head_dim,),
        lambda x, c: x.reshape(c.num_kv_heads, c.head_dim),
        lambda y, c: y.reshape(-1),
        split=0,
    ),
    _Spec(
        ("layers", "self_attn", "v_bias"),
        _L + "self_attn.v_proj.bias",
        lambda c: (c.num_kv_heads * c.head_dim,),
        lambda x, c: x.reshape(c.num_kv_heads, c.head_dim),
        lambda y, c: y.reshape(-1),
        split=0,
    ),
    _Spec(
        ("layers", "mlp", "gate_proj"),
        _L + "mlp.gate_proj.weight",
        lambda c: (c.intermediate_size, c.hidden_size),
        _t,
        _t,
        perm=(1, 0),
    ),
    _Spec(
        ("layers", "mlp", "up_proj"),
        _L + "mlp.up_proj.weight",
        lambda c: (c.intermediate_size, c.hidden_size),
        _t,
        _t,
        perm=(1, 0),
    ),
    _Spec(
        ("layers", "mlp", "down_proj"),
        _L + "mlp.down_proj.weight",
        lambda c: (c.hidden_size, c.intermediate_size),
        _t,
        _t,
        perm=(1, 0),
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


def model_from_shards(
    cfg: ModelConfig,
    read: Callable[[tuple[str, ...], jax.ShapeDtypeStruct, tuple[slice, ...]], np.ndarray],
    shardings: nnx.State,
    dtype,
    param_dtype,
) -> CausalLM:
    """Build the model with every parameter created in its sharding from per-shard reads: ``read(path, abstract,
    index)`` gives the block at ``index`` of one parameter, for the devices of this process only, so no process
    ever holds more of a parameter than its own devices' shards (plus one block in flight)."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype, param_dtype))
    target = {tuple(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(shardings)}
    filled = []
    for path, var in nnx.to_flat_state(state):
        abstract, key = var.get_value(), tuple(str(p) for p in path)
        if key not in target:
            raise ModelLoadError(f"parameter {'.'.join(key)}: no sharding given for it")
        done: dict[str, np.ndarray] = {}  # replicated shards: read a block once per parameter

        def block(index, key=key, abstract=abstract, done=done):
            k = repr(index)
            if k not in done:
                value = np.asarray(read(key, abstract, index))
                want = tuple(len(range(*sl.indices(n))) for sl, n in zip(index, abstract.shape, strict=True))
                if value.shape != want:
                    raise ModelLoadError(f"parameter {'.'.join(key)}: shard {index} read as {value.shape}, not {want}")
                done[k] = value.astype(abstract.dtype, copy=False)
            return done[k]

        filled.append((path, var.replace(jax.make_array_from_callback(abstract.shape, target[key], block))))
        done.clear()
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def _hf_index(
    spec: _Spec, index: tuple[slice, ...], ours: tuple[int, ...]
) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """The HF-layout slice behind ``index`` (a block of our per-layer layout ``ours``) and that block's shape."""
    rng = [range(*sl.indices(n)) for sl, n in zip(index, ours, strict=True)]
    if any(r.step != 1 for r in rng):
        raise ModelLoadError(f"{spec.hf_name}: strided shard {index} cannot be read")
    t = [slice(r.start, r.stop) for r in rng]
    if spec.split is not None:
        a, hd = spec.split, ours[spec.split + 1]
        if len(rng[a + 1]) != hd:
            raise ModelLoadError(
                f"{spec.hf_name}: a shard splits head_dim ({index}); shard heads, not head_dim (rule head_dim -> None)"
            )
        t[a : a + 2] = [slice(rng[a].start * hd, rng[a].stop * hd)]
    hf: list[slice] = [slice(None)] * len(t)
    for k, p in enumerate(spec.perm):
        hf[p] = t[k]
    return tuple(hf), tuple(len(r) for r in rng)


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


def _check_names(cfg: ModelConfig, source: TensorSource, origin: str,
                 allowed_extra: Callable[[str, np.ndarray | None], bool] | None) -> None:
    """Raise ``ModelLoadError`` unless ``source`` has every tensor the config needs and none it has no parameter for
    (``allowed_extra`` may accept some)."""
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


def _fetch(cfg: ModelConfig, source: TensorSource, spec: _Spec, name: str) -> np.ndarray:
    """The whole tensor ``name`` in our layout, after checking its shape and dtype."""
    x = source.get(name)
    want = spec.hf_shape(cfg)
    if tuple(x.shape) != want:
        raise ModelLoadError(
            f"{source.where(name)}: tensor {name!r} has shape {tuple(x.shape)}, expected {want} from the config"
        )
    if not np.issubdtype(x.dtype, np.floating) and x.dtype != np.dtype(jnp.bfloat16):
        raise ModelLoadError(f"{source.where(name)}: tensor {name!r} has dtype {x.dtype}, expected a float type")
    return spec.to_ours(x, cfg)


def _fetch_block(cfg: ModelConfig, source: TensorSource, spec: _Spec, name: str, index: tuple[slice, ...],
                 ours: tuple[int, ...]) -> np.ndarray:
    """The block ``index`` (of shape ``ours``) of tensor ``name`` in our layout, reading only its slice where the
    source can."""
    if not hasattr(source, "get_slice"):  # e.g. GGUF: de-quantised whole, then cut
        return _fetch(cfg, source, spec, name)[index]
    want = spec.hf_shape(cfg)
    if tuple(source.shape(name)) != want:
        raise ModelLoadError(
            f"{source.where(name)}: tensor {name!r} has shape {tuple(source.shape(name))}, expected {want} from "
            "the config"
        )
    hf_index, shape = _hf_index(spec, index, ours)
    return source.get_slice(name, hf_index).transpose(spec.perm).reshape(shape)


def model_from_hf_tensors(
    cfg: ModelConfig,
    source: TensorSource,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    origin: str = "checkpoint",
    allowed_extra: Callable[[str, np.ndarray | None], bool] | None = None,
    shardings: nnx.State | None = None,
) -> CausalLM:
    """Check every HF-named tensor of ``source`` (present, right shape, nothing unexpected) and build the model.

    ``allowed_extra(name)`` may accept tensors the model does not use (e.g. an all-zero o_proj bias). With
    ``shardings`` (an NNX state of NamedShardings, e.g. ``distributed.state_shardings``) each parameter is created
    sharded and this process reads only its devices' slices (whole tensors from sources without ``get_slice``).
    """
    _check_names(cfg, source, origin, allowed_extra)

    def read(path, abstract, index):
        spec = _BY_PATH[path]
        if not spec.per_layer:
            return _fetch_block(cfg, source, spec, spec.hf_name, index, abstract.shape)
        layers = range(*index[0].indices(cfg.num_layers))
        out = None
        for k, i in enumerate(layers):
            x = _fetch_block(cfg, source, spec, spec.hf_name.format(i=i), index[1:], abstract.shape[1:])
            if out is None:
                out = np.empty((len(layers), *x.shape), abstract.dtype)
            out[k] = x
        return out

    if shardings is not None:
        return model_from_shards(cfg, read, shardings, dtype, param_dtype)

    def arrays(path, abstract):
        spec = _BY_PATH[path]
        if spec.per_layer:
            out = np.empty(abstract.shape, abstract.dtype)
            for i in range(cfg.num_layers):
                out[i] = _fetch(cfg, source, spec, spec.hf_name.format(i=i))
            return out
        return _fetch(cfg, source, spec, spec.hf_name)

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
