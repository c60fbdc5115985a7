"""The run's state without its weights: model shape, train state, reference parameters, rollout engine and drafter
trainer as ``jax.ShapeDtypeStruct`` pytrees with their shardings. Nothing of model size is allocated.

What mirrors another module (keep them in step; ``tests/test_plan.py`` compares each with the real object built on a
tiny config): the train state's shardings (``rl.train_step.init_train_state``), the reference copy and the loss
settings (``rl.learner.GRPOLearner``), the engine's arguments (``builders.engine_kwargs``, shared with
``builders.build_engine``) and the drafter trainer (``drafter.spot.SpotTrainer``). The engine itself is
the real ``RolloutEngine``, constructed while tracing over the abstract policy, so its rollout layout, its compiled
steps and their shardings are the engine's own.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tlt_jax.builders import engine_kwargs, fresh_eagle_drafter, tiny_model_config
from tlt_jax.builders import longest_prompt as prompt_length
from tlt_jax.config import Config, ConfigError
from tlt_jax.distributed import LogicalRules, engine_meshes, state_shardings
from tlt_jax.models import ModelConfig
from tlt_jax.models.weights import abstract_model
from tlt_jax.rl.learner import bucket_length
from tlt_jax.rl.train_step import BATCH_KEYS, LossConfig, TrainState, make_optimizer, optimizer_shardings

__all__ = [
    "SHAPES",
    "AbstractEngine",
    "AbstractPolicy",
    "abstract_engine",
    "abstract_policy",
    "abstract_train_state",
    "batch_sds",
    "device_bytes",
    "drafter_trainer",
    "eagle_drafter",
    "engine_kwargs",
    "loss_config",
    "model_config",
    "on_mesh",
    "optimizer",
    "prompt_length",
    "reference_params",
    "sequence_length",
    "train_batch",
]

# Model shapes the plan knows without a checkpoint (``--shape``): the HF configs' sizes.
SHAPES = {
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, tie_word_embeddings=True),
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                              num_heads=28, num_kv_heads=4, rope_theta=1e6, attention_bias=True, architecture="qwen2"),
    "qwen2.5-32b": ModelConfig(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
                               num_heads=40, num_kv_heads=8, rope_theta=1e6, attention_bias=True, architecture="qwen2"),
    "llama3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                             num_heads=32, num_kv_heads=8, rope_theta=5e5),
}


def model_config(cfg: Config, shape: str | None = None) -> ModelConfig:
    """The policy's shape: ``shape`` (a name in SHAPES) if given, else read from the config without weights: the
    tiny model's fields, the embedded SmolLM2's shape, an HF directory's config.json or a GGUF file's metadata."""
    if shape:
        if shape not in SHAPES:
            raise ConfigError(f"--shape={shape}: unknown model shape; known: {sorted(SHAPES)}")
        return SHAPES[shape]
    source, path = cfg.model.source, cfg.model.path
    if source == "tiny":
        return tiny_model_config(cfg)
    if source == "smollm2":
        return SHAPES["smollm2-135m"]
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        from tlt_jax.models.hf_io import load_hf_config

        return load_hf_config(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from tlt_jax.models.gguf_io import config_from_gguf, open_gguf

        return config_from_gguf(open_gguf(path), path)
    raise ConfigError(
        f"config.model.path: {path or '(empty)'} is neither an HF directory with config.json nor a .gguf file; the "
        f"plan needs only the model's shape: give the directory, or --shape=NAME (one of {sorted(SHAPES)})"
    )


def sequence_length(cfg: Config) -> int:
    """The update's padded sequence length for the longest prompt and response (``rl.learner.build_sequences``)."""
    return bucket_length(prompt_length(cfg) + cfg.rollout.max_new_tokens)


def on_mesh(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of ``tree`` (arrays or ShapeDtypeStructs) placed by ``shardings`` (a matching pytree)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs (the largest shard where shards differ)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


@dataclasses.dataclass
class AbstractPolicy:
    """The policy split as the learner splits it (``nnx.split(model, nnx.Param, ...)``), abstract and placed."""

    config: ModelConfig
    graphdef: Any
    params: nnx.State
    rest: nnx.State


def abstract_policy(cfg: Config, mcfg: ModelConfig, mesh: Mesh, rules: LogicalRules = LogicalRules()) -> AbstractPolicy:
    """The policy as ``builders.build_model`` makes it (compute dtype model.dtype, float32 parameters, remat), in the
    training layout on ``mesh``."""
    model = abstract_model(mcfg, jnp.dtype(cfg.model.dtype), jnp.float32)
    model.remat = cfg.model.remat
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, on_mesh(state, state_shardings(state, mesh, rules)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return AbstractPolicy(mcfg, graphdef, params, rest)


def abstract_train_state(params: nnx.State, tx: optax.GradientTransformation) -> TrainState:
    """``init_train_state(params, tx)`` abstractly: moments placed like the parameters, scalars replicated."""
    opt, shardings, replicated = optimizer_shardings(params, tx)
    opt = on_mesh(opt, shardings)
    counter = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    return TrainState(params, opt, counter, counter)


def reference_params(cfg: Config, params: nnx.State) -> nnx.State | None:
    """The frozen reference the learner keeps when ``rl.kl_coef > 0``: a bfloat16 copy of the parameters (other
    dtypes kept), placed alike."""
    if cfg.rl.kl_coef <= 0:
        return None

    def ref(x):
        dtype = jnp.bfloat16 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)

    return jax.tree.map(ref, params)


def loss_config(cfg: Config) -> LossConfig:
    """The learner's LossConfig for this run."""
    rl = cfg.rl
    return LossConfig(
        micro_batch_size=rl.micro_batch_size, temperature=cfg.rollout.temperature, policy_loss=rl.policy_loss,
        clip_low=rl.clip_low, clip_high=rl.clip_high, agg_mode=rl.loss_agg_mode, norm_len=cfg.rollout.max_new_tokens,
        kl_coef=rl.kl_coef, kl_kind=rl.kl_kind, on_policy=cfg.updates_per_step == 1,
    )


def optimizer(cfg: Config) -> optax.GradientTransformation:
    return make_optimizer(cfg.optim, cfg.train.num_steps * cfg.updates_per_step)


def batch_sds(shape: tuple[int, ...], dtype, mesh: Mesh, rules: LogicalRules) -> jax.ShapeDtypeStruct:
    """An input split over the batch axes as the learner places it (``GRPOLearner._put``)."""
    logical = ("batch",) + (None,) * (len(shape) - 1)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, rules.spec(logical, mesh, shape)))


def train_batch(cfg: Config, mesh: Mesh, rules: LogicalRules = LogicalRules()) -> dict:
    """One update's mini-batch (``mini_batch_prompts x samples_per_prompt`` rows of the longest sequence)."""
    rows = (cfg.rl.mini_batch_prompts or cfg.data.prompts_per_step) * cfg.rollout.samples_per_prompt
    t = sequence_length(cfg)
    dtypes = {"input_ids": jnp.int32, "attention_mask": jnp.int32}
    batch = {k: batch_sds((rows,) if k == "advantages" else (rows, t), dtypes.get(k, jnp.float32), mesh, rules)
             for k in BATCH_KEYS if k != "loss_scale"}
    batch["loss_scale"] = jax.ShapeDtypeStruct((), jnp.float32)
    return batch


def _same_placement(a: Any, b: Any) -> bool:
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype and x.sharding.is_equivalent_to(y.sharding, len(x.shape))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@dataclasses.dataclass
class AbstractEngine:
    """A RolloutEngine whose policy (and drafter) parameters are ShapeDtypeStructs: its ``abstract_args`` and pool
    compile every step ahead of time. ``holds_copy``: its policy is a copy of the training parameters (another dtype,
    layer layout or placement), resident beside them; otherwise it decodes on the training arrays themselves."""

    engine: Any
    mesh: Mesh
    holds_copy: bool


def eagle_drafter(cfg: Config, mcfg: ModelConfig) -> tuple[Any, tuple[int, ...] | None]:
    """(a callable making the EAGLE drafter the run starts from, its draft vocabulary or None). The drafter of
    ``rollout.drafter_path`` when it exists there (its saved shape and draft vocabulary; weights are not read),
    else a fresh one of the policy's shape (``drafter.online`` with an empty path, or a path the plan cannot read:
    the shapes are the policy's either way)."""
    import json

    import numpy as np

    from tlt_jax.assets import resolve_drafter_path
    from tlt_jax.drafter.eagle import EagleDrafter
    from tlt_jax.drafter.export import CONFIG_FILE, VOCAB_FILE, config_from_dict

    path = resolve_drafter_path(cfg.rollout.drafter_path) if cfg.rollout.drafter_path else ""
    if not path or not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        return (lambda: fresh_eagle_drafter(cfg, mcfg)), None
    with open(os.path.join(path, CONFIG_FILE)) as f:
        dcfg = config_from_dict(json.load(f)["policy_config"])
    vocab_file = os.path.join(path, VOCAB_FILE)
    vocab = tuple(int(t) for t in np.unique(np.load(vocab_file))) if os.path.isfile(vocab_file) else None

    def make():
        d = EagleDrafter(dcfg, dtype=jnp.dtype(cfg.model.dtype), rngs=nnx.Rngs(0))
        d.set_draft_vocab(None if vocab is None else np.asarray(vocab))
        return d

    return make, vocab


def abstract_engine(cfg: Config, policy: AbstractPolicy, mesh: Mesh, backend: str,
                    rules: LogicalRules = LogicalRules()) -> AbstractEngine:
    """The run's rollout engine (slice 0's with ``rollout.num_slices`` > 1), built by tracing its construction over
    the abstract policy: its copy's shapes come from the trace, their placement from the engine's ``param_rules``
    (as its ``shard_module`` places them; a ``device_put`` inside a trace leaves no sharding to read back)."""
    from tlt_jax.rollout import RolloutEngine

    r = cfg.rollout
    needs_drafter = r.needs_eagle
    drafter = nnx.eval_shape(eagle_drafter(cfg, policy.config)[0]) if needs_drafter else None
    d_graphdef, d_state = nnx.split(drafter) if needs_drafter else (None, None)
    try:
        engine_mesh = engine_meshes(mesh, r.num_slices)[0] if r.num_slices != 1 else mesh  # as SlicedRollout
    except ValueError as e:
        raise ConfigError(f"config.rollout.num_slices: {e}") from e
    built = []

    def construct(params, rest, d_params):
        model = nnx.merge(policy.graphdef, params, rest)
        d = nnx.merge(d_graphdef, d_params) if needs_drafter else None
        engine = RolloutEngine(model, engine_mesh, rules=rules, **engine_kwargs(cfg, backend, d))
        built.append(engine)
        return engine.params, engine.drafter_params

    params, d_params = jax.eval_shape(construct, policy.params, policy.rest, d_state)
    engine = built[-1]
    place = lambda state: on_mesh(state, state_shardings(state, engine.mesh, engine.param_rules))
    engine.params = place(params)  # placed as shard_module places them, by the engine's own rules
    if needs_drafter:
        engine.drafter_params = place(d_params)
    whole = nnx.merge(policy.graphdef, policy.params, policy.rest)
    holds_copy = not _same_placement(engine.params, nnx.state(whole))
    return AbstractEngine(engine, engine_mesh, holds_copy)


def drafter_trainer(cfg: Config, eng: AbstractEngine, rules: LogicalRules = LogicalRules()) -> tuple[Any, tuple]:
    """(jitted step, abstract arguments) of the online drafter's train step on slice 0 (``SpotTrainer``)."""
    from tlt_jax.drafter.spot import keyed_step
    from tlt_jax.drafter.train import (
        DrafterBatch,
        DrafterLossConfig,
        DrafterOptimConfig,
        batch_sharding,
        init_drafter_train_state,
        make_drafter_optimizer,
        make_drafter_train_step,
    )

    mesh, engine = eng.mesh, eng.engine
    opt = make_drafter_optimizer(DrafterOptimConfig(learning_rate=cfg.drafter.lr))
    make, vocab = eagle_drafter(cfg, engine.config)
    graphdefs = []

    def init():
        graphdef, state = init_drafter_train_state(make(), opt)
        graphdefs.append(graphdef)
        return state

    state = jax.eval_shape(init)
    params = on_mesh(state.params, state_shardings(state.params, mesh, rules))
    placed = abstract_train_state(params, opt)
    state = type(state)(placed.params, placed.opt_state, placed.step)
    rows, t, h = cfg.drafter.rows, cfg.drafter.row_len, engine.config.hidden_size
    sh = batch_sharding(mesh, rules)
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    batch = DrafterBatch(next_tokens=sds((rows, t), jnp.int32), features=sds((rows, t, h), jnp.float32),
                         targets=sds((rows, t, h), jnp.float32), positions=sds((rows, t), jnp.int32),
                         segment_ids=sds((rows, t), jnp.int32), loss_mask=sds((rows, t), jnp.float32))
    ids = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, PartitionSpec()))  # ``step_ids``
    policy = nnx.merge(engine.graphdef, engine.params)
    loss = DrafterLossConfig(vocab=vocab)  # SpotTrainer: the token loss over the draft vocabulary when there is one
    step = keyed_step(make_drafter_train_step(graphdefs[-1], opt, loss, mesh, rules), cfg.train.seed)
    return step, (state, policy, batch, ids)
