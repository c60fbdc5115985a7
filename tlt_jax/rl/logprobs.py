"""Per-token log-probabilities of sampled responses, recomputed by a policy (or the frozen reference).

GRPO never takes log-probs from the rollout: the engine may have decoded speculatively, in another batch layout or
precision, so the old and reference log-probs (where the update needs them: several updates per step, a KL term)
are recomputed here by one teacher-forced forward pass. Sequences are ``prompt ++ response`` right-padded to ``T``;
``logp[:, t]`` is ``log p(ids[:, t] | ids[:, :t])`` at temperature ``temperature`` (VeRL divides the logits by the
rollout temperature), 0 at ``t = 0`` and at padding.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tlt_jax.distributed import LogicalRules, with_activations
from tlt_jax.distributed.sharding import activation_context

__all__ = [
    "GB",
    "batch_logprobs",
    "cast_to_compute",
    "choose_chunk_rows",
    "chunked_token_logprobs",
    "logprob_row_bytes",
    "logprob_chunk_rows",
    "make_logprob_fn",
    "sequence_logprobs",
    "split_rows",
    "token_logprobs",
    "unsplit_rows",
    "vocab_parallel_head",
]


def split_rows(x: jax.Array, rows: int) -> jax.Array:
    """[B, ...] -> [B // rows, rows, ...] with chunk j holding rows j, j + B/rows, ... (strided).

    Strided chunks keep a batch sharded contiguously over devices sharded inside every chunk, so a scan over
    chunks runs on all devices at once.
    """
    b = x.shape[0]
    if b % rows:
        raise ValueError(f"batch of {b} rows does not split into chunks of {rows}")
    return jnp.swapaxes(x.reshape(rows, b // rows, *x.shape[1:]), 0, 1)


def unsplit_rows(x: jax.Array) -> jax.Array:
    """Inverse of :func:`split_rows`."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0,
                   select: bool = False) -> tuple[jax.Array, jax.Array]:
    """Log-prob of ``targets`` [B, T] under ``logits`` [B, T, V] / temperature, and the entropy there (float32).
    ``select``: pick the targets' entries by comparison with the vocabulary's indices (the same values), an
    elementwise op and a sum that stay local when the vocabulary is split over devices (a gather would gather it)."""
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    if select:
        hit = targets[..., None].astype(jnp.int32) == jnp.arange(logits.shape[-1], dtype=jnp.int32)
        logp = jnp.sum(jnp.where(hit, logp_all, 0.0), axis=-1)
    else:
        logp = jnp.take_along_axis(logp_all, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


# Tokens per LM-head chunk: longer sequences take their log-probs chunk by chunk (rematerialised in the backward
# pass), so float32 logits [B, T, V] never exist whole, only [B, LOGIT_CHUNK, V]. The train step holds several
# such buffers at once (logits, log-softmax, their cotangents): at 512 a micro-batch of 4 rows of SmolLM2 (V = 49152)
# took 1.5 GiB of the step's temporaries, at 128 it takes 0.4 GiB (the log-probs are the same; only the order in
# which the LM head's gradient sums over positions changes).
LOGIT_CHUNK = 128


def vocab_parallel_head(model, weight: jax.Array | None = None
                        ) -> tuple[jax.Array, NamedSharding, NamedSharding] | None:
    """Inside a sharded trace: (the LM head's weight split by vocabulary over every mesh axis of "batch" and
    "vocab", the sharding that makes a chunk's hidden states whole on every device, its logits' sharding: split by
    vocabulary); None outside one, or when those axes do not divide the vocabulary.

    FSDP splits the LM head by its embedding dimension, so a batch-split matmul would gather the whole weight
    ([E, V] float32: 2.2 GB for Qwen2.5-7B) and sum a whole-size weight gradient over devices for every chunk of
    positions. Split by vocabulary instead (one all-to-all of the weight per call), each device computes every row's
    logits over its share of the vocabulary from the chunk's hidden states (a few MB, gathered): its share of the
    weight gradient is local, and only the hidden states' gradient is summed over devices. Log-softmax and entropy
    then sum over the split vocabulary (the same values, summed in another order). ``weight``: the LM head's
    parameter as stored, default ``model.lm_head_weight()``."""
    ctx = activation_context()
    if ctx is None:
        return None
    mesh, rules = ctx
    axes: list[str] = []
    for a in (*rules.lookup("batch"), *rules.lookup("vocab")):
        if a not in axes and mesh.shape[a] > 1:
            axes.append(a)
    if not axes or model.config.vocab_size % math.prod(mesh.shape[a] for a in axes):
        return None
    vocab = axes[0] if len(axes) == 1 else tuple(axes)
    spec = PartitionSpec(vocab, None) if model.lm_head is None else PartitionSpec(None, vocab)  # tied: [V, E]
    weight = model.lm_head_weight() if weight is None else weight
    weight = jax.lax.with_sharding_constraint(weight, NamedSharding(mesh, spec))
    return weight, NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(None, None, vocab))


def chunked_token_logprobs(model, hidden: jax.Array, targets: jax.Array, temperature: float = 1.0,
                           chunk: int = LOGIT_CHUNK, head_grad_into: jax.Array | None = None
                           ) -> tuple[jax.Array, jax.Array]:
    """:func:`token_logprobs` of ``model.logits_from_hidden(hidden)`` [B, T, H], ``chunk`` positions at a time.

    Inside a sharded trace (``activation_sharding``) the LM head runs vocabulary-parallel (:func:`vocab_parallel_head`).
    ``head_grad_into`` (training): a gradient accumulator for the LM head's parameter as stored (the tied embedding or
    ``lm_head``). Differentiated, that parameter's cotangent from the head is the accumulator plus this call's
    gradient; outside a vocabulary-parallel trace the sum is made in place (:func:`_head_logprobs_into`).
    """
    b, t, h = hidden.shape
    # Vocabulary-parallel, the accumulator joins the head's cotangent through _plus_into; else _head_logprobs_into.
    weight = None if head_grad_into is None else _plus_into(model.lm_head_weight(), head_grad_into)
    split = vocab_parallel_head(model, weight)
    n = -(-t // chunk) if t > chunk else 1
    size = chunk if t > chunk else t
    pad = n * size - t
    hs = jnp.swapaxes(jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, size, h), 0, 1)
    ts = jnp.swapaxes(jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, size), 0, 1)

    def unchunk(x):
        return jnp.swapaxes(x, 0, 1).reshape(b, n * size)[:, :t]

    if head_grad_into is not None and split is None:
        logp, ent = _head_logprobs_into(model, hs, ts, temperature, head_grad_into)
        return unchunk(logp), unchunk(ent)

    def chunk_logprobs(hc, tc):
        if split is None:
            return token_logprobs(model.logits_from_hidden(hc), tc, temperature)
        w, rows, logits_sharding = split
        logits = model.logits_from_hidden(jax.lax.with_sharding_constraint(hc, rows), w)
        return token_logprobs(jax.lax.with_sharding_constraint(logits, logits_sharding), tc, temperature, select=True)

    if n == 1:
        return chunk_logprobs(hidden, targets)
    one = jax.checkpoint(chunk_logprobs)
    logp, ent = jax.lax.map(lambda xs: one(*xs), (hs, ts))
    return unchunk(logp), unchunk(ent)


GB = 10**9  # decimal, as device memory is quoted (rl.logprob_max_gb)
# Queries per attention block of a full-sequence forward: tlt_jax.models.layers.ATTENTION_BLOCK (equal by test; not
# imported, so rl does not depend on models' internals).
ATTENTION_BLOCK = 512


def logprob_row_bytes(mcfg, seq_len: int, *, tensor: int = 1, compute_bytes: int = 2) -> int:
    """Estimated temporaries one sequence of ``seq_len`` tokens adds to a log-prob pass's chunk, on a device that
    holds it (the chunk's rows split over the batch axes; heads, MLP and vocabulary over ``tensor``): the residual
    stream and its projections (6 x T x H, compute dtype) plus the largest of one attention block's float32 scores and
    weights (2 x heads x ATTENTION_BLOCK x T), the MLP's three [T, I] intermediates and one LM-head chunk's float32
    logits, log-softmax and exp (3 x LOGIT_CHUNK x V); a forward without gradients holds one at a time. Not counted:
    a gathered layer and the compute-dtype copy (:func:`cast_to_compute`). XLA:GPU needs less: Qwen2.5-7B, T = 3072,
    8 H100s, FSDP 8: 0.36 GB a row against 0.48 GB estimated (the reference pass's temporaries at 1 and 16 rows per
    device, benchmarks/results/logprob_gather_qwen7b_h100x8_fsdp8_*.json)."""
    t = seq_len
    local = 6 * t * mcfg.hidden_size * compute_bytes
    split = max(2 * mcfg.num_heads * min(t, ATTENTION_BLOCK) * t * 4, 3 * t * mcfg.intermediate_size * compute_bytes,
                3 * min(t, LOGIT_CHUNK) * mcfg.vocab_size * 4)
    return local + -(-split // tensor)


def choose_chunk_rows(rows: int, row_bytes: int, *, batch_devices: int, budget_bytes: int) -> int:
    """The most rows per chunk that divide ``rows``, split evenly over ``batch_devices``, and whose estimated
    temporaries per device (rows per device x ``row_bytes``) stay within ``budget_bytes``; the smallest such chunk
    when none does. A ValueError when no multiple of ``batch_devices`` divides ``rows``."""
    cands = [r for r in range(batch_devices, rows + 1, batch_devices) if rows % r == 0]
    if not cands:
        raise ValueError(f"{rows} rows do not split into chunks over {batch_devices} batch devices")
    fit = [r for r in cands if r // batch_devices * row_bytes <= budget_bytes]
    return max(fit) if fit else cands[0]


def logprob_chunk_rows(cfg, mesh, mcfg, rows: int, seq_len: int, rules: LogicalRules = LogicalRules()) -> int:
    """Rows per chunk of the old-policy and reference passes over ``rows`` sequences of ``seq_len`` tokens of the
    model ``mcfg`` on ``mesh``: ``rl.logprob_chunk_rows`` when set, else (0, auto) the largest chunk whose estimated
    temporaries (:func:`logprob_row_bytes`) fit ``rl.logprob_max_gb`` per device. Not ``rl.micro_batch_size``: with
    FSDP each chunk gathers the whole model once (64 chunks of 8 rows: 857 GB per device for Qwen2.5-7B on 8 GPUs)."""
    if cfg.rl.logprob_chunk_rows:
        return cfg.rl.logprob_chunk_rows
    batch = math.prod(mesh.shape[a] for a in rules.lookup("batch") if a in mesh.shape)
    row = logprob_row_bytes(mcfg, seq_len, tensor=mesh.shape.get("tensor", 1),
                            compute_bytes=jnp.dtype(cfg.model.dtype).itemsize)
    return choose_chunk_rows(rows, row, batch_devices=batch, budget_bytes=int(cfg.rl.logprob_max_gb * GB))


@jax.custom_vjp
def _plus_into(weight: jax.Array, acc: jax.Array) -> jax.Array:
    """``weight`` itself; differentiated, its cotangent plus ``acc`` (which gets none)."""
    return weight


_plus_into.defvjp(lambda w, acc: (w, acc), lambda acc, ct: (ct + acc, None))

# Rows (vocabulary entries) of the LM head's gradient formed at a time in :func:`_head_logprobs_into`'s backward pass:
# a [block, E] product added into the accumulator, not a whole [V, E] one beside it.
HEAD_GRAD_BLOCK = 8192


def _logit_cotangent(z: jax.Array, targets: jax.Array, temperature: float, g_logp: jax.Array,
                     g_ent: jax.Array) -> jax.Array:
    """The cotangent of the logits ``z`` [..., V] for :func:`token_logprobs` (cotangents ``g_logp``, ``g_ent``),
    written out so one [..., V] buffer is formed: with p = softmax(z / τ), d logp / dz = (onehot - p) / τ and
    d entropy / dz = -p (log p + entropy) / τ."""
    y = z.astype(jnp.float32) / temperature
    lse = jax.nn.logsumexp(y, axis=-1, keepdims=True)
    p = jnp.exp(y - lse)
    ent = -jnp.sum(p * (y - lse), axis=-1, keepdims=True)
    hit = targets[..., None].astype(jnp.int32) == jnp.arange(z.shape[-1], dtype=jnp.int32)
    dz = g_logp[..., None] * (hit - p) - g_ent[..., None] * p * (y - lse + ent)
    return (dz / temperature).astype(z.dtype)


def _add_head_grad(acc: jax.Array, dz: jax.Array, h: jax.Array, tied: bool) -> jax.Array:
    """``acc`` plus the LM head's gradient for logits cotangent ``dz`` [..., V] at hidden states ``h`` [..., E],
    HEAD_GRAD_BLOCK vocabulary entries at a time in a loop (so one block's product exists at once), each added into
    ``acc`` in place ([V, E] tied, [E, V] otherwise)."""
    v = dz.shape[-1]
    dz, h = dz.reshape(-1, v), h.reshape(-1, h.shape[-1])
    block, axis = min(HEAD_GRAD_BLOCK, v), 0 if tied else 1

    def add(acc, start, size):
        d = jax.lax.dynamic_slice_in_dim(dz, start, size, axis=1)
        g = (d.T @ h if tied else h.T @ d).astype(acc.dtype)
        return jax.lax.dynamic_update_slice_in_dim(
            acc, jax.lax.dynamic_slice_in_dim(acc, start, size, axis) + g, start, axis)

    acc = jax.lax.fori_loop(0, v // block, lambda i, acc: add(acc, i * block, block), acc)
    return add(acc, v - v % block, v % block) if v % block else acc


def _head_logprobs_into(model, hs: jax.Array, ts: jax.Array, temperature: float, acc: jax.Array):
    """(logp, entropy) [n, B, c] of the chunks ``hs`` [n, B, c, E] / ``ts`` [n, B, c]; differentiated, the LM head
    parameter's cotangent is ``acc`` plus this call's gradient, summed in place.

    Under autodiff each chunk's weight gradient is a fresh [V, E] product, summed over the chunks into a second [V, E]
    buffer and only then into the accumulator (two weight-sized buffers beside it). Here a ``custom_vjp`` scans the
    chunks in reverse carrying the accumulator: each chunk's logits are recomputed (as ``jax.checkpoint`` would), its
    logits cotangent formed in one pass (:func:`_logit_cotangent`) and its weight gradient added into the accumulator
    a block of rows at a time."""
    tied = model.lm_head is None

    def chunk(w, h, t):
        return token_logprobs(model.logits_from_hidden(h, w), t, temperature)

    @jax.custom_vjp
    def run(w, acc, hs, ts):
        return jax.lax.map(lambda x: chunk(w, *x), (hs, ts))

    def fwd(w, acc, hs, ts):
        return run(w, acc, hs, ts), (w, acc, hs, ts)

    def bwd(res, ct):
        w, acc, hs, ts = res

        def body(acc, xs):
            h, t, g_logp, g_ent = xs
            z, head_vjp = jax.vjp(lambda h: model.logits_from_hidden(h, w), h)
            dz = _logit_cotangent(z, t, temperature, g_logp, g_ent)
            return _add_head_grad(acc, dz, h, tied), head_vjp(dz)[0]

        acc, dhs = jax.lax.scan(body, acc, (hs, ts, *ct), reverse=True)
        return acc, None, dhs, None

    run.defvjp(fwd, bwd)
    return run(model.lm_head_weight(), acc, hs, ts)


def sequence_logprobs(
    model, input_ids: jax.Array, attention_mask: jax.Array, temperature: float = 1.0, layer_grads_into=None,
    head_grad_into: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(logp, entropy)`` [B, T] of every token given its prefix; position 0 and padding are 0.

    ``entropy[:, t]`` is the entropy of the distribution that predicted token t. ``layer_grads_into``: the model's
    (``CausalLM.__call__``), a gradient accumulator for the stacked layers; ``head_grad_into``: one for the LM head's
    parameter (:func:`chunked_token_logprobs`).
    """
    b, t = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden = model(input_ids, positions=positions, attention_mask=attention_mask, return_logits=False,
                   layer_grads_into=layer_grads_into).hidden
    logp, ent = chunked_token_logprobs(model, hidden[:, :-1], input_ids[:, 1:], temperature,
                                       head_grad_into=head_grad_into)
    valid = attention_mask[:, 1:].astype(jnp.float32)
    pad = jnp.zeros((b, 1), jnp.float32)
    return jnp.concatenate([pad, logp * valid], axis=1), jnp.concatenate([pad, ent * valid], axis=1)


def cast_to_compute(model) -> None:
    """Inside a trace, cast the floating parameters of every module that computes in ``module.dtype`` (projections,
    biases, embedding, LM head) to that dtype, once, before the layers run: each use casts them so anyway (the same
    values), but FSDP then gathers bfloat16 weights, half a float32 gather (the old-policy pass on the float32
    masters). RMSNorm has no ``dtype`` (it scales in float32) and keeps its own."""
    for _, module in nnx.iter_modules(model):
        dtype = getattr(module, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            continue
        for var in vars(module).values():
            if (isinstance(var, nnx.Param) and jnp.issubdtype(var.get_value().dtype, jnp.floating)
                    and jnp.finfo(var.get_value().dtype).bits > jnp.finfo(dtype).bits):
                var.set_value(var.get_value().astype(dtype))


def batch_logprobs(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    *,
    chunk_size: int,
    temperature: float = 1.0,
) -> jax.Array:
    """Log-probs [B, T] computed ``chunk_size`` rows at a time (bounded activation memory), no gradients. With FSDP
    every chunk gathers every layer's weights once: fewer, larger chunks gather less (:func:`logprob_chunk_rows`)."""
    model = nnx.merge(graphdef, params, rest)
    cast_to_compute(model)

    def one(xs):
        ids, mask = xs
        return sequence_logprobs(model, ids, mask, temperature)[0]

    chunks = (split_rows(input_ids, chunk_size), split_rows(attention_mask, chunk_size))
    return jax.lax.stop_gradient(unsplit_rows(jax.lax.map(one, chunks)))


def make_logprob_fn(graphdef: nnx.GraphDef, *, chunk_size: int, temperature: float, out_sharding=None, mesh=None,
                    rules: LogicalRules = LogicalRules()):
    """Jitted ``fn(params, rest, input_ids, attention_mask) -> logp [B, T]`` for the policy or the reference, in
    chunks of ``chunk_size`` rows (the run's: :func:`logprob_chunk_rows`); with a mesh, activations split by batch
    through every layer (as in the train step)."""
    fn = functools.partial(batch_logprobs, graphdef, chunk_size=chunk_size, temperature=temperature)
    return jax.jit(with_activations(fn, mesh, rules), out_shardings=out_sharding)
