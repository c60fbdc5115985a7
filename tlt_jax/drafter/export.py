"""Drafter weights on disk: our own format (safetensors in our layouts + json config) and the EAGLE/SGLang layout
(HF-style config.json with architectures ["LlamaForCausalLMEagle"], tensors ``fc.weight``, ``fc.bias``,
``layers.0.self_attn.{q,k,v,o}_proj.weight`` ..., ``layers.0.post_attention_layernorm.weight`` in [out, in] layout).
Both round-trip exactly. The shared embedding / LM head are not written (SGLang takes them from the target).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from tlt_jax.drafter.eagle import EagleDrafter
from tlt_jax.models.config import ModelConfig, RopeScaling

CONFIG_FILE = "tlt_drafter.json"
WEIGHTS_FILE = "drafter.safetensors"
VOCAB_FILE = "draft_vocab.npy"  # optional: the draft vocabulary (EagleDrafter.set_draft_vocab)
EAGLE_WEIGHTS_FILE = "model.safetensors"
_ARCH = {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}


def config_to_dict(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    return ModelConfig(**d)


def _flat(drafter: EagleDrafter) -> dict[str, np.ndarray]:  # trainable tensors only (not the draft vocab)
    return {".".join(map(str, p)): np.asarray(jax.device_get(v.get_value()))
            for p, v in nnx.to_flat_state(nnx.state(drafter, nnx.Param))}


def _build(cfg: ModelConfig, arrays: dict[str, np.ndarray], origin: str, dtype=jnp.float32) -> EagleDrafter:
    abstract = nnx.eval_shape(lambda: EagleDrafter(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = []
    expected = set()
    for path, var in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        expected.add(name)
        if name not in arrays:
            raise ValueError(f"{origin}: missing drafter tensor {name!r}")
        want = var.get_value()
        x = np.asarray(arrays[name])
        if tuple(x.shape) != tuple(want.shape):
            raise ValueError(f"{origin}: tensor {name!r} has shape {x.shape}, expected {tuple(want.shape)}")
        flat.append((path, var.replace(jnp.asarray(x.astype(want.dtype)))))
    extra = sorted(set(arrays) - expected)
    if extra:
        raise ValueError(f"{origin}: unexpected drafter tensors {extra[:5]}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def save_drafter(drafter: EagleDrafter, path) -> None:
    """Write ``drafter.safetensors`` (our layouts, float32 as stored) and ``tlt_drafter.json``."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in _flat(drafter).items()}, str(path / WEIGHTS_FILE))
    (path / CONFIG_FILE).write_text(json.dumps({"policy_config": config_to_dict(drafter.config)}, indent=1))
    vocab = drafter.vocab_ids()
    if vocab is not None:
        np.save(path / VOCAB_FILE, np.asarray(vocab, np.int32))
    elif (path / VOCAB_FILE).exists():
        (path / VOCAB_FILE).unlink()


def load_drafter(path, dtype=jnp.float32) -> EagleDrafter:
    path = pathlib.Path(path)
    cfg = config_from_dict(json.loads((path / CONFIG_FILE).read_text())["policy_config"])
    drafter = _build(cfg, load_file(str(path / WEIGHTS_FILE)), str(path), dtype)
    if (path / VOCAB_FILE).exists():
        drafter.set_draft_vocab(np.load(path / VOCAB_FILE))
    return drafter


# --------------------------------------------------------------------------------------------- EAGLE / SGLang layout

def _eagle_specs(cfg: ModelConfig):
    """(our dotted name, EAGLE name, ours -> [out, in], [out, in] -> ours)."""
    e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    t = lambda x: x.T
    specs = [
        ("fc_kernel", "fc.weight", t, t),
        ("fc_bias", "fc.bias", lambda x: x, lambda x: x),
        ("layer.post_attention_layernorm.weight", "layers.0.post_attention_layernorm.weight", lambda x: x,
         lambda x: x),
        ("layer.self_attn.q_proj", "layers.0.self_attn.q_proj.weight", lambda x: x.reshape(e, -1).T,
         lambda y: y.T.reshape(e, h, d)),
        ("layer.self_attn.k_proj", "layers.0.self_attn.k_proj.weight", lambda x: x.reshape(e, -1).T,
         lambda y: y.T.reshape(e, kv, d)),
        ("layer.self_attn.v_proj", "layers.0.self_attn.v_proj.weight", lambda x: x.reshape(e, -1).T,
         lambda y: y.T.reshape(e, kv, d)),
        ("layer.self_attn.o_proj", "layers.0.self_attn.o_proj.weight", lambda x: x.reshape(-1, e).T,
         lambda y: y.T.reshape(h, d, e)),
        ("layer.mlp.gate_proj", "layers.0.mlp.gate_proj.weight", t, t),
        ("layer.mlp.up_proj", "layers.0.mlp.up_proj.weight", t, t),
        ("layer.mlp.down_proj", "layers.0.mlp.down_proj.weight", t, t),
    ]
    if cfg.attention_bias:
        specs += [
            ("layer.self_attn.q_bias", "layers.0.self_attn.q_proj.bias", lambda x: x.reshape(-1),
             lambda y: y.reshape(h, d)),
            ("layer.self_attn.k_bias", "layers.0.self_attn.k_proj.bias", lambda x: x.reshape(-1),
             lambda y: y.reshape(kv, d)),
            ("layer.self_attn.v_bias", "layers.0.self_attn.v_proj.bias", lambda x: x.reshape(-1),
             lambda y: y.reshape(kv, d)),
        ]
    return specs


def eagle_config(cfg: ModelConfig, torch_dtype: str = "float32") -> dict:
    """HF-style config of the EAGLE draft model: the target's shape with one layer, fc bias on."""
    rs = None if cfg.rope_scaling is None else dataclasses.asdict(cfg.rope_scaling)
    eos = list(cfg.eos_token_ids)
    return {
        "architectures": [_ARCH[cfg.architecture]],
        "model_type": cfg.architecture,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rs,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "bias": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "torch_dtype": torch_dtype,
        "tlt_target_num_layers": cfg.num_layers,
    }


def export_eagle(drafter: EagleDrafter, path, dtype=np.float32) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the EAGLE/SGLang drafter layout."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config
    ours = _flat(drafter)
    tensors = {name: np.ascontiguousarray(to_hf(ours[o]).astype(dtype)) for o, name, to_hf, _ in _eagle_specs(cfg)}
    save_file(tensors, str(path / EAGLE_WEIGHTS_FILE), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(eagle_config(cfg, np.dtype(dtype).name), indent=1))


def import_eagle(path, dtype=jnp.float32) -> EagleDrafter:
    """Read an EAGLE/SGLang-layout drafter (ours or a compatible EAGLE-1/2 checkpoint with fc bias)."""
    path = pathlib.Path(path)
    c = json.loads((path / "config.json").read_text())
    arch = c.get("model_type", "llama")
    if arch not in _ARCH:
        raise ValueError(f"{path}/config.json: model_type {arch!r} unsupported (expected one of {list(_ARCH)})")
    eos = c.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    rs = c.get("rope_scaling")
    cfg = ModelConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_layers=c.get("tlt_target_num_layers", 1), num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]), head_dim=c.get("head_dim") or 0,
        rope_theta=c.get("rope_theta", 10000.0), rope_scaling=None if rs is None else RopeScaling(**rs),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), attention_bias=c.get("attention_bias", arch == "qwen2"),
        tie_word_embeddings=c.get("tie_word_embeddings", False),
        max_position_embeddings=c.get("max_position_embeddings", 4096), architecture=arch,
        bos_token_id=c.get("bos_token_id"), eos_token_ids=eos,
    )
    hf = load_file(str(path / EAGLE_WEIGHTS_FILE))
    arrays = {}
    for o, name, _, to_ours in _eagle_specs(cfg):
        if name not in hf:
            raise ValueError(f"{path}: missing tensor {name!r} in {EAGLE_WEIGHTS_FILE}")
        arrays[o] = to_ours(np.asarray(hf[name], np.float32))
    shared = {"embed_tokens.weight", "lm_head.weight"}  # some EAGLE checkpoints carry the target's copies
    extra = sorted(set(hf) - {n for _, n, _, _ in _eagle_specs(cfg)} - shared)
    if extra:
        raise ValueError(f"{path}: unexpected tensors {extra[:5]} (EAGLE-3 checkpoints are not supported)")
    return _build(cfg, arrays, str(path), dtype)
