"""Per-token log-probabilities of sampled responses, recomputed by a policy (or the frozen reference).

GRPO never takes log-probs from the rollout: the engine may have decoded speculatively, in another batch layout or
precision, so the old and reference log-probs (where the update needs them: several updates per step, a KL term)
are recomputed here by one teacher-forced forward pass. Sequences are ``prompt ++ response`` right-padded to ``T``;
``logp[:, t]`` is ``log p(ids[:, t] | ids[:, :t])`` at temperature ``temperature`` (VeRL divides the logits by the
rollout temperature), 0 at ``t = 0`` and at padding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.distributed import LogicalRules, with_activations

__all__ = [
    "batch_logprobs",
    "chunked_token_logprobs",
    "make_logprob_fn",
    "sequence_logprobs",
    "split_rows",
    "token_logprobs",
    "unsplit_rows",
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


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Log-prob of ``targets`` [B, T] under ``logits`` [B, T, V] / temperature, and the entropy there (float32)."""
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


# Tokens per LM-head chunk: longer sequences take their log-probs chunk by chunk (rematerialised in the backward
# pass), so float32 logits [B, T, V] never exist whole, only [B, LOGIT_CHUNK, V].
LOGIT_CHUNK = 512


def chunked_token_logprobs(model, hidden: jax.Array, targets: jax.Array, temperature: float = 1.0,
                           chunk: int = LOGIT_CHUNK) -> tuple[jax.Array, jax.Array]:
    """:func:`token_logprobs` of ``model.logits_from_hidden(hidden)`` [B, T, H], ``chunk`` positions at a time."""
    b, t, h = hidden.shape
    if t <= chunk:
        return token_logprobs(model.logits_from_hidden(hidden), targets, temperature)
    n = -(-t // chunk)
    pad = n * chunk - t
    hs = jnp.swapaxes(jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, h), 0, 1)
    ts = jnp.swapaxes(jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk), 0, 1)
    one = jax.checkpoint(lambda hc, tc: token_logprobs(model.logits_from_hidden(hc), tc, temperature))
    logp, ent = jax.lax.map(lambda xs: one(*xs), (hs, ts))

    def unchunk(x):
        return jnp.swapaxes(x, 0, 1).reshape(b, n * chunk)[:, :t]

    return unchunk(logp), unchunk(ent)


def sequence_logprobs(
    model, input_ids: jax.Array, attention_mask: jax.Array, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """``(logp, entropy)`` [B, T] of every token given its prefix; position 0 and padding are 0.

    ``entropy[:, t]`` is the entropy of the distribution that predicted token t.
    """
    b, t = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden = model(input_ids, positions=positions, attention_mask=attention_mask, return_logits=False).hidden
    logp, ent = chunked_token_logprobs(model, hidden[:, :-1], input_ids[:, 1:], temperature)
    valid = attention_mask[:, 1:].astype(jnp.float32)
    pad = jnp.zeros((b, 1), jnp.float32)
    return jnp.concatenate([pad, logp * valid], axis=1), jnp.concatenate([pad, ent * valid], axis=1)


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
    """Log-probs [B, T] computed ``chunk_size`` rows at a time (bounded logits memory), no gradients."""
    model = nnx.merge(graphdef, params, rest)

    def one(xs):
        ids, mask = xs
        return sequence_logprobs(model, ids, mask, temperature)[0]

    chunks = (split_rows(input_ids, chunk_size), split_rows(attention_mask, chunk_size))
    return jax.lax.stop_gradient(unsplit_rows(jax.lax.map(one, chunks)))


def make_logprob_fn(graphdef: nnx.GraphDef, *, chunk_size: int, temperature: float, out_sharding=None, mesh=None,
                    rules: LogicalRules = LogicalRules()):
    """Jitted ``fn(params, rest, input_ids, attention_mask) -> logp [B, T]`` for the policy or the reference; with a
    mesh, activations split by batch through every layer (as in the train step)."""
    fn = functools.partial(batch_logprobs, graphdef, chunk_size=chunk_size, temperature=temperature)
    return jax.jit(with_activations(fn, mesh, rules), out_shardings=out_sharding)
