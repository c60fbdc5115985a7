"""Drafter training: EAGLE loss over packed sequences and a pure, jitted (optionally sharded) AdamW step.

loss = value_weight * SmoothL1(ĥ_{t+1}, h_{t+1}) + prob_weight * CE(softmax(lm_head(h_{t+1})), log_softmax(lm_head(ĥ)))
masked to pairs whose input token x_{t+1} is a response token, normalised by the number of such pairs. Samples are
packed into rows with segment ids: no attention across samples, positions are each sample's own positions.

Options (``DrafterLossConfig``): ``vocab`` restricts the token loss to the drafter's draft vocabulary (target
renormalised over it, as EAGLE-3 does; the LM head then costs |vocab| / V of the full one), ``unroll`` > 1 adds
EAGLE-3's "training-time test": pass j feeds the drafter its own predicted features from pass j-1 (shifted one
position, as at tree depth j) and is weighted ``unroll_decay ** (j - 1)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tlt_jax.distributed.sharding import LogicalRules, state_shardings


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DrafterBatch:
    """Packed training pairs, row-aligned: entry t of a row is the pair (h_t, x_{t+1}) with target h_{t+1}."""

    next_tokens: jax.Array  # [B, T] int32: x_{t+1}
    features: jax.Array  # [B, T, H]: h_t (policy final-normed hidden)
    targets: jax.Array  # [B, T, H]: h_{t+1}
    positions: jax.Array  # [B, T] int32
    segment_ids: jax.Array  # [B, T] int32, 0 = padding
    loss_mask: jax.Array  # [B, T] float32


@dataclasses.dataclass(frozen=True)
class DrafterLossConfig:
    value_weight: float = 1.0
    prob_weight: float = 0.1
    noise_std: float = 0.0  # EAGLE's uniform feature noise: (U(0,1) - 0.5) * noise_std * 512 / H
    vocab: tuple[int, ...] | None = None  # token loss over these ids only (the drafter's draft vocabulary)
    unroll: int = 1  # training-time test: passes fed with the drafter's own features
    unroll_decay: float = 0.8
    # Positions per LM-head chunk of the token loss: target and drafter logits [B, chunk, V] exist one chunk at a time
    # (each chunk's gradient made in the forward pass, nothing recomputed), not [B, T, V] whole. SmolLM2 (V = 49152),
    # 4 x 256 positions: the step's temporaries are 1.10 GB whole, 0.36 GB in chunks of 64, at the same CPU time per
    # step (0.98x, A/A 0.99x; benchmarks/drafter_step.py at commit e2afc2d, since removed). 0: the whole row at once.
    logit_chunk: int = 64

    def __post_init__(self):
        if self.value_weight < 0 or self.prob_weight < 0 or self.value_weight + self.prob_weight == 0:
            raise ValueError(f"value_weight={self.value_weight}, prob_weight={self.prob_weight}: the loss weights "
                             "must be >= 0 and not both 0")


@dataclasses.dataclass(frozen=True)
class DrafterOptimConfig:
    learning_rate: float = 3e-4
    warmup_steps: int = 0
    decay_steps: int = 0  # > 0: cosine decay to 10% of the peak over this many steps (after the warm-up)
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 0.5


def make_drafter_optimizer(cfg: DrafterOptimConfig = DrafterOptimConfig()) -> optax.GradientTransformation:
    lr = cfg.learning_rate
    if cfg.decay_steps > 0:
        lr = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1),
                                                cfg.warmup_steps + cfg.decay_steps, 0.1 * cfg.learning_rate)
    elif cfg.warmup_steps > 0:
        lr = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


def pack_sequences(samples: Sequence[tuple[np.ndarray, np.ndarray, int]], row_len: int,
                   num_rows: int | None = None) -> DrafterBatch:
    """First-fit pack ``(token_ids [T], hidden [T, H], response_start)`` samples into rows of ``row_len`` pairs.

    A sample gives T-1 pairs; a longer one is cropped to a ``row_len`` window starting just before its response.
    Rows are padded (segment 0, no loss); ``num_rows`` fixes the row count (extra samples are dropped).
    """
    h = samples[0][1].shape[-1]
    rows: list[list[tuple]] = []
    fill: list[int] = []
    for ids, hid, start in samples:
        n = len(ids) - 1
        if n < 1:
            continue
        s = int(np.clip(start - 1, 0, max(n - row_len, 0)))
        e = min(n, s + row_len)
        r = next((i for i, used in enumerate(fill) if used + e - s <= row_len), None)
        if r is None:
            if num_rows is not None and len(rows) >= num_rows:
                continue
            rows.append([])
            fill.append(0)
            r = len(rows) - 1
        rows[r].append((np.asarray(ids), np.asarray(hid), int(start), s, e))
        fill[r] += e - s
    b = len(rows) if num_rows is None else num_rows
    out = dict(
        next_tokens=np.zeros((b, row_len), np.int32), features=np.zeros((b, row_len, h), np.float32),
        targets=np.zeros((b, row_len, h), np.float32), positions=np.zeros((b, row_len), np.int32),
        segment_ids=np.zeros((b, row_len), np.int32), loss_mask=np.zeros((b, row_len), np.float32),
    )
    for r, segs in enumerate(rows):
        off = 0
        for seg, (ids, hid, start, s, e) in enumerate(segs, start=1):
            t = np.arange(s, e)
            sl = slice(off, off + e - s)
            out["next_tokens"][r, sl] = ids[t + 1]
            out["features"][r, sl] = hid[t]
            out["targets"][r, sl] = hid[t + 1]
            out["positions"][r, sl] = t
            out["segment_ids"][r, sl] = seg
            out["loss_mask"][r, sl] = (t + 1 >= start).astype(np.float32)
            off += e - s
    return DrafterBatch(**out)


class LossMetrics(NamedTuple):
    loss: jax.Array
    value_loss: jax.Array
    prob_loss: jax.Array
    top1: jax.Array  # draft argmax == policy argmax on masked pairs
    tokens: jax.Array


def smooth_l1(x: jax.Array) -> jax.Array:
    """PyTorch SmoothL1Loss (beta 1) elementwise: 0.5 x^2 where |x| < 1, |x| - 0.5 elsewhere."""
    a = jnp.abs(x)
    return jnp.where(a < 1.0, 0.5 * x * x, a - 0.5)


def token_loss_sums(head, targets: jax.Array, h_hat: jax.Array, mask: jax.Array, chunk: int = 0):
    """(sum of the masked cross-entropies CE(softmax(head(targets)), log_softmax(head(h_hat))), count of masked
    positions whose top-1 tokens agree) over [B, T] positions, ``chunk`` positions at a time (0: all at once).

    In chunks, each chunk's gradient with respect to ``h_hat`` (head's VJP of (q - p) * mask) is computed in the
    forward pass beside its loss, so [B, chunk, V] logits never outlive their chunk and nothing is recomputed: the
    same three LM-head matmuls as whole rows. Only ``h_hat`` receives a gradient: ``head`` and ``targets`` are
    treated as constants (the drafter's frozen policy head and its feature targets)."""

    def terms(tg, z, m):  # target probabilities p and log q from the drafter's logits z; the two sums
        tgt = jax.nn.softmax(head(tg).astype(jnp.float32), axis=-1)
        logq = jax.nn.log_softmax(z.astype(jnp.float32), axis=-1)
        hit = jnp.argmax(logq, -1) == jnp.argmax(tgt, -1)
        return (-(tgt * logq).sum(-1) * m).sum(), (hit * m).sum(), tgt, logq

    def sums_and_grad(xs):
        tg, hh, m = xs
        z, head_vjp = jax.vjp(head, hh)
        cross, hits, tgt, logq = terms(tg, z, m)
        # d/dz of -sum(p * log_softmax(z)) * m is (softmax(z) * sum(p) - p) * m, and sum(p) = 1.
        return cross, hits, head_vjp(((jnp.exp(logq) - tgt) * m[..., None]).astype(z.dtype))[0]

    b, t = mask.shape
    if chunk <= 0 or t <= chunk:
        return terms(targets, head(h_hat), mask)[:2]
    n = -(-t // chunk)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    split = lambda x: jnp.swapaxes(pad(x).reshape(b, n, chunk, *x.shape[2:]), 0, 1)  # noqa: E731
    consts = jax.lax.stop_gradient((targets, h_hat, mask))
    cross, hits, grad = jax.lax.map(sums_and_grad, tuple(split(x) for x in consts))
    grad = jax.lax.stop_gradient(jnp.swapaxes(grad, 0, 1).reshape(b, n * chunk, -1)[:, :t])
    # The value is cross's; the gradient with respect to h_hat is ``grad`` (a linear term that is zero in value).
    linear = (h_hat * grad).sum()
    return jax.lax.stop_gradient(cross.sum()) + (linear - jax.lax.stop_gradient(linear)), hits.sum()


def drafter_loss(drafter, policy, batch: DrafterBatch, cfg: DrafterLossConfig = DrafterLossConfig(), key=None):
    """Scalar loss and LossMetrics (of the first pass). The policy (embedding, LM head) is frozen: no gradient
    flows into it."""
    policy = jax.lax.stop_gradient(policy)
    feats = batch.features
    if cfg.noise_std > 0 and key is not None:
        u = jax.random.uniform(key, feats.shape, feats.dtype)
        feats = feats + (u - 0.5) * cfg.noise_std * 512.0 / feats.shape[-1]
    if cfg.vocab is None:
        head = policy.logits_from_hidden
    else:
        w = jnp.take(policy.embed_tokens[...] if policy.lm_head is None else policy.lm_head[...].T,
                     jnp.asarray(cfg.vocab, jnp.int32), axis=0)
        head = lambda h: jnp.einsum("...e,ve->...v", h, w.astype(h.dtype))
    mask = batch.loss_mask.astype(jnp.float32)
    denom = jnp.maximum(mask.sum(), 1.0)
    same_seg = jnp.concatenate([jnp.zeros_like(batch.segment_ids[:, :1], bool),
                                batch.segment_ids[:, 1:] == batch.segment_ids[:, :-1]], axis=1)
    total, first = 0.0, None
    for j in range(max(cfg.unroll, 1)):
        h_hat = drafter(policy, batch.next_tokens, feats, positions=batch.positions, segment_ids=batch.segment_ids)
        vloss = (smooth_l1(h_hat.astype(jnp.float32) - batch.targets.astype(jnp.float32)).mean(-1) * mask).sum() / denom
        cross, hits = token_loss_sums(head, batch.targets, h_hat, mask, cfg.logit_chunk)
        ploss = cross / denom
        loss = cfg.value_weight * vloss + cfg.prob_weight * ploss
        total = total + cfg.unroll_decay**j * loss
        if first is None:
            first = (loss, vloss, ploss, hits / denom)
        # Next pass: entry t sees the feature this pass predicted for position t (made at entry t - 1).
        prev = jnp.concatenate([feats[:, :1], h_hat[:, :-1].astype(feats.dtype)], axis=1)
        feats = jnp.where(same_seg[..., None], prev, batch.features)
    loss, vloss, ploss, top1 = first
    return total, LossMetrics(loss, vloss, ploss, top1, mask.sum())


def _without_vocab(drafter):
    """The drafter's trainable graph: the (non-trainable) draft vocabulary is detached; ``train_drafter`` re-attaches
    it to the trained module."""
    if getattr(drafter, "draft_vocab", None) is None:
        return drafter
    drafter = nnx.clone(drafter)
    drafter.set_draft_vocab(None)
    return drafter


class DrafterTrainState(NamedTuple):
    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array


def init_drafter_train_state(drafter, optimizer: optax.GradientTransformation, mesh: Mesh | None = None,
                     rules: LogicalRules = LogicalRules()) -> tuple[nnx.GraphDef, DrafterTrainState]:
    """Split the drafter into (graphdef, params) and build the optimizer state. With a mesh, params are placed by
    their logical axes, Adam moments follow their params, scalars are replicated."""
    drafter = _without_vocab(drafter)
    graphdef, params = nnx.split(drafter, nnx.Param)
    params = jax.tree.map(jnp.copy, params)  # the step donates its state: never donate the caller's module
    step = jnp.zeros((), jnp.int32)
    if mesh is not None:
        params = jax.device_put(params, state_shardings(params, mesh, rules))
    opt_state = optimizer.init(params)
    if mesh is not None:
        rep = NamedSharding(mesh, PartitionSpec())
        on_mesh = lambda x: isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
        opt_state = jax.tree.map(lambda x: x if on_mesh(x) else jax.device_put(x, rep), opt_state)
        step = jax.device_put(step, rep)
    return graphdef, DrafterTrainState(params, opt_state, step)


def batch_sharding(mesh: Mesh, rules: LogicalRules = LogicalRules()) -> NamedSharding:
    """Leading (batch) dimension on the data axes of the rules' 'batch' entry."""
    return NamedSharding(mesh, PartitionSpec(rules.lookup("batch") or None))


def make_drafter_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    loss_cfg: DrafterLossConfig = DrafterLossConfig(), mesh: Mesh | None = None,
                    rules: LogicalRules = LogicalRules()):
    """A jitted ``step(state, policy, batch, key) -> (state, LossMetrics)``; with a mesh the batch is constrained
    to the data axes and the state keeps its sharding."""

    def step(state: DrafterTrainState, policy, batch: DrafterBatch, key):
        if mesh is not None:
            batch = jax.lax.with_sharding_constraint(batch, batch_sharding(mesh, rules))

        def loss_fn(params):
            return drafter_loss(nnx.merge(graphdef, params), policy, batch, loss_cfg, key)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return DrafterTrainState(params, opt_state, state.step + 1), metrics

    return jax.jit(step, donate_argnums=(0,))


def train_drafter(drafter, policy, batches: Sequence[DrafterBatch], steps: int, *,
                  optim: DrafterOptimConfig = DrafterOptimConfig(),
                  loss_cfg: DrafterLossConfig = DrafterLossConfig(), seed: int = 0, mesh: Mesh | None = None,
                  log_every: int = 0, log=print):
    """Run ``steps`` steps cycling over ``batches``; returns (trained drafter, list of LossMetrics as floats)."""
    optimizer = make_drafter_optimizer(optim)
    graphdef, state = init_drafter_train_state(drafter, optimizer, mesh)
    if mesh is not None:
        batches = [jax.device_put(b, batch_sharding(mesh)) for b in batches]
    step_fn = make_drafter_train_step(graphdef, optimizer, loss_cfg, mesh)
    key = jax.random.key(seed)
    history = []
    for i in range(steps):
        state, m = step_fn(state, policy, batches[i % len(batches)], jax.random.fold_in(key, i))
        history.append({k: float(v) for k, v in m._asdict().items()})
        if log_every and (i % log_every == 0 or i == steps - 1):
            h = history[-1]
            log(f"step {i}: loss {h['loss']:.4f} value {h['value_loss']:.4f} prob {h['prob_loss']:.4f} "
                f"top1 {h['top1']:.3f}")
    trained = nnx.merge(graphdef, jax.device_get(state.params))
    if getattr(drafter, "draft_vocab", None) is not None:
        trained.set_draft_vocab(np.asarray(drafter.vocab_ids()))
    return trained, history
