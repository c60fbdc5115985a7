"""The GRPO policy update: one jitted, sharded step = one optimizer update over a mini-batch of sequences.

The mini-batch is split into micro-batches whose gradients are accumulated in a ``lax.scan``; each micro-batch's
loss is weighted so the sum equals the loss aggregated over the whole mini-batch (token-mean weighs by response
tokens, seq-mean modes by sequences), so results do not depend on the micro-batch size. A step whose loss, gradient
norm or updated parameters are non-finite leaves parameters and optimizer state unchanged and is counted in
``TrainState.skipped``. Parameters and optimizer state are donated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tlt_jax.config import OptimConfig
from tlt_jax.distributed import LogicalRules, with_activations
from tlt_jax.rl.logprobs import sequence_logprobs, split_rows
from tlt_jax.rl.losses import grpo_loss, masked_mean

__all__ = [
    "BATCH_KEYS",
    "LossConfig",
    "TrainState",
    "clip_by_global_norm",
    "init_train_state",
    "lr_schedule",
    "make_optimizer",
    "make_train_step",
    "optimizer_shardings",
    "train_step",
]

# [B, T] arrays, except advantages [B]; loss_scale is a scalar (1.0, or NaN to inject a non-finite step in tests).
BATCH_KEYS = ("input_ids", "attention_mask", "response_mask", "advantages", "old_logp", "ref_logp", "loss_scale")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Static (hashable) settings of the policy loss; part of the compiled step."""

    micro_batch_size: int
    temperature: float = 1.0
    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    agg_mode: str = "token-mean"
    # Dr. GRPO's constant normaliser (seq-mean-token-sum-norm): the rollout's max_new_tokens, so the loss of a batch
    # does not depend on the length bucket it was padded to. Unused by the other modes.
    norm_len: int | None = None
    kl_coef: float = 0.0
    kl_kind: str = "low_var_kl"
    # The update is the only one on its rollouts (one epoch, one mini-batch): the old policy is the current one, so
    # its log-probs are the forward's own (stop-gradient) and the batch's ``old_logp`` is not read; no extra pass.
    on_policy: bool = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """Everything the update changes: parameters, optimizer state, update count and skipped (non-finite) count."""

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array  # int32: updates attempted
    skipped: jax.Array  # int32: updates skipped because something was non-finite


def lr_schedule(cfg: OptimConfig, total_updates: int) -> optax.Schedule:
    """Linear warm-up from 0 to ``cfg.lr``, then constant, cosine or linear decay to ``lr * final_lr_ratio``."""
    decay_steps = max(1, total_updates - cfg.warmup_steps)
    end = cfg.lr * cfg.final_lr_ratio
    if cfg.schedule == "constant":
        main = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "cosine":
        main = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.final_lr_ratio)
    elif cfg.schedule == "linear":
        main = optax.linear_schedule(cfg.lr, end, decay_steps)
    else:
        raise ValueError(f"unknown schedule {cfg.schedule!r}")
    if cfg.warmup_steps == 0:
        return main
    warm = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warm, main], [cfg.warmup_steps])


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` as one multiplication by a scalar: updates * min(1, max_norm / global norm).

    optax divides every element by the norm where it clips. XLA counts a division as expensive, so it materialises
    the clipped gradients once for the two Adam moments that read them (a parameter-sized temporary beside the
    gradients: 0.54 GB for SmolLM2-135M); a multiplication it recomputes inside each moment's update. Same state
    (empty) as optax's, so optimizer states and checkpoints are interchangeable; results differ in rounding only."""

    def update(updates, state, params=None):
        del params
        norm = optax.tree.norm(updates)
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda t: t * scale.astype(t.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def make_optimizer(cfg: OptimConfig, total_updates: int) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW on the schedule (decoupled weight decay on every parameter, as VeRL)."""
    adamw = optax.adamw(
        lr_schedule(cfg, total_updates), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    if cfg.max_grad_norm > 0:
        return optax.chain(clip_by_global_norm(cfg.max_grad_norm), adamw)
    return adamw


def init_train_state(params: nnx.State, tx: optax.GradientTransformation) -> TrainState:
    """Fresh optimizer state and zero counters. Moment trees are sharded like the parameters, scalars replicated."""
    step, skipped = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)  # two buffers: both are donated
    sharding = jax.tree.leaves(params)[0].sharding
    if not isinstance(sharding, NamedSharding):
        return TrainState(params, jax.jit(tx.init)(params), step, skipped)
    _, out, replicated = optimizer_shardings(params, tx)
    opt_state = jax.jit(tx.init, out_shardings=out)(params)
    # Made by a program, not device_put: across processes with one device each, device_put of a host scalar to the
    # replicated sharding gave arrays whose shards cannot be listed (addressable_shards raised).
    counters = jax.jit(lambda: (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)), out_shardings=(replicated,) * 2)
    return TrainState(params, opt_state, *counters())


def optimizer_shardings(params: nnx.State, tx: optax.GradientTransformation) -> tuple[Any, Any, NamedSharding]:
    """(abstract optimizer state, its shardings, the replicated sharding) for parameters placed on a mesh: moment
    trees (structured like the parameters) sharded like them, every other leaf (counters) replicated."""
    replicated = NamedSharding(jax.tree.leaves(params)[0].sharding.mesh, PartitionSpec())
    params_def = jax.tree.structure(params)
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    like_params = lambda x: jax.tree.structure(x) == params_def

    def shardings_of(sub):
        return param_shardings if like_params(sub) else jax.tree.map(lambda _: replicated, sub)

    abstract = jax.eval_shape(tx.init, params)
    return abstract, jax.tree.map(shardings_of, abstract, is_leaf=like_params), replicated


def _micro_weight(mode: str, mask: jax.Array, total_tokens: jax.Array, total_rows: jax.Array) -> jax.Array:
    """Weight of one micro-batch's aggregated loss so that the weighted sum is the mini-batch aggregate."""
    if mode == "token-mean":
        return jnp.sum(mask) / jnp.maximum(total_tokens, 1.0)
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return jnp.sum(jnp.any(mask > 0, axis=-1)) / jnp.maximum(total_rows, 1.0)
    if mode == "seq-mean-token-sum-norm":
        return jnp.ones((), jnp.float32)
    raise ValueError(f"unknown loss aggregation mode {mode!r}")


def _micro_loss(params, rest, graphdef, cfg: LossConfig, micro: dict, weight: jax.Array, grads_into=None):
    model = nnx.merge(graphdef, params, rest)
    layers, head = (None, None) if grads_into is None else grads_into
    logp, entropy = sequence_logprobs(model, micro["input_ids"], micro["attention_mask"], cfg.temperature,
                                      layer_grads_into=layers, head_grad_into=head)
    mask = micro["response_mask"]
    old = jax.lax.stop_gradient(logp) if cfg.on_policy else micro["old_logp"]
    loss, m = grpo_loss(
        logp,
        old,
        micro["advantages"],
        mask,
        ref_logp=micro["ref_logp"] if cfg.kl_coef > 0 else None,
        policy_loss=cfg.policy_loss,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        agg_mode=cfg.agg_mode,
        norm_len=cfg.norm_len,
        kl_coef=cfg.kl_coef,
        kl_kind=cfg.kl_kind,
    )
    m = {**m, "entropy": masked_mean(entropy, mask)}
    return loss * weight, m


def _update_if_finite(tx, params, opt_state, grads, loss, grad_norm):
    """(parameters, optimizer state, finite): the optimizer's update, computed once, applied only when the loss, the
    gradient norm and every updated parameter are finite; otherwise the old parameters and optimizer state.

    The new trees exist beside the old ones until the check is known (a cond between them: XLA may write neither into
    the donated buffers before then), which costs temporaries of up to the moments' size; a first pass that only
    reduced the update (no temporaries) computed the whole update twice."""
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    finite &= jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(new_params)]))
    new_params, new_opt = jax.lax.cond(finite, lambda new, _: new, lambda _, old: old,
                                       (new_params, new_opt), (params, opt_state))
    return new_params, new_opt, finite


def train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    cfg: LossConfig,
    state: TrainState,
    rest: nnx.State,
    batch: dict,
    *,
    micro_sharding=None,
    param_sharding=None,
) -> tuple[TrainState, dict]:
    """One optimizer update on ``batch`` (see :data:`BATCH_KEYS`); returns the new state and scalar metrics.
    ``param_sharding`` (the parameters' shardings): each micro-batch's gradients and their sum are pinned to it, so
    every gradient is summed into the parameters' own shards (not kept in a layout a layer computed it in, such as
    the vocabulary-split LM head's) and the optimizer updates each shard where it lies."""
    mask = batch["response_mask"].astype(jnp.float32)
    total_tokens = jnp.sum(mask)
    total_rows = jnp.sum(jnp.any(mask > 0, axis=-1)).astype(jnp.float32)
    per_row = {k: v for k, v in batch.items() if k != "loss_scale"}
    micros = {k: split_rows(v, cfg.micro_batch_size) for k, v in per_row.items()}
    if micro_sharding is not None:
        micros = {k: jax.lax.with_sharding_constraint(v, micro_sharding(v.shape)) for k, v in micros.items()}
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)
    like_params = (lambda t: t) if param_sharding is None else (
        lambda t: jax.lax.with_sharding_constraint(t, param_sharding))

    # A rematerialised model adds its layers' and its LM head parameter's gradients into the accumulator in the
    # backward pass (one gradient buffer, not the accumulator beside each micro-batch's gradients); the other
    # parameters' gradients (final norm, an untied input embedding) are added here.
    model = nnx.merge(graphdef, state.params, rest)
    in_place = ("layers", "embed_tokens" if model.lm_head is None else "lm_head") if model.remat else ()

    def add(path, acc, g):
        return g if path[0] in tuple(jax.tree_util.DictKey(k) for k in in_place) else acc + g

    def body(carry, micro):
        grads, loss, metrics = carry
        micro = {**micro, "response_mask": micro["response_mask"].astype(jnp.float32)}
        w = _micro_weight(cfg.agg_mode, micro["response_mask"], total_tokens, total_rows)
        into = (grads[in_place[0]], grads[in_place[1]][...]) if in_place else None
        (lm, m), g = grad_fn(state.params, rest, graphdef, cfg, micro, w * batch["loss_scale"], into)
        # Metrics are averaged with token weights (they are per-token quantities).
        tw = jnp.sum(micro["response_mask"]) / jnp.maximum(total_tokens, 1.0)
        metrics = jax.tree.map(lambda a, b: a + tw * b, metrics, m)
        return (like_params(jax.tree_util.tree_map_with_path(add, grads, like_params(g))), loss + lm, metrics), None

    zeros = like_params(jax.tree.map(jnp.zeros_like, state.params))
    zero_metrics = {k: jnp.zeros((), jnp.float32) for k in ("clip_frac", "approx_kl", "pg_loss", "entropy")}
    if cfg.kl_coef > 0:
        zero_metrics["kl_loss"] = jnp.zeros((), jnp.float32)
    (grads, loss, metrics), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32), zero_metrics), micros)

    grad_norm = optax.tree.norm(grads)

    new_params, new_opt, finite = _update_if_finite(tx, state.params, state.opt_state, grads, loss, grad_norm)
    new_state = TrainState(
        params=new_params,
        opt_state=new_opt,
        step=state.step + 1,
        skipped=state.skipped + (~finite).astype(jnp.int32),
    )
    metrics = {
        **metrics,
        "loss": loss,
        "grad_norm": grad_norm,
        "finite": finite.astype(jnp.float32),
        "response_tokens": total_tokens,
    }
    return new_state, metrics


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    cfg: LossConfig,
    state: TrainState,
    *,
    mesh: Mesh | None = None,
    rules: LogicalRules = LogicalRules(),
):
    """Jitted ``fn(state, rest, batch) -> (state, metrics)``; ``state`` is donated and keeps its shardings.

    With a mesh, micro-batches and every layer's activations are constrained to be split over the batch axes (data x
    fsdp); the parameters are sharded as ``state`` already is (FSDP x tensor via the logical rules).
    """
    micro_sharding = None
    if mesh is not None:

        def micro_sharding(shape):
            logical = (None, "batch", *([None] * (len(shape) - 2)))
            return NamedSharding(mesh, rules.spec(logical, mesh, shape))

    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    param_sharding = state_shardings.params if mesh is not None else None
    fn = functools.partial(train_step, graphdef, tx, cfg, micro_sharding=micro_sharding, param_sharding=param_sharding)
    # Activations split by batch through every layer (FSDP: XLA gathers each layer's weights, never activations).
    return jax.jit(with_activations(fn, mesh, rules), donate_argnums=(0,), out_shardings=(state_shardings, None))
