"""Token sampling shared by plain decoding and tree verification (one code path, so verification stays exact).

Sampling parameters are per-row arrays, so one compiled step serves rows with different settings. Randomness is
counter-based: the key of a token depends only on (seed, request id, sample index, position). A leaf module (jax
only): the rollout engine's steps and the speculative verifier both sample through it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax.distributed.sharding import activation_context, constrain

NEG_INF = -jnp.inf


def processed_logprobs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array | None,
                       top_p: jax.Array | None) -> jax.Array:
    """Log-probabilities of the distribution actually sampled from: temperature, then top-k, then top-p.

    logits [..., V]; temperature, top_k, top_p broadcastable to logits.shape[:-1] (top_k 0 = off, top_p 1 = off).
    Temperature 0 means greedy: a one-hot at the argmax (log-prob 0 there, -inf elsewhere).
    Ties at the top-k / top-p boundary keep every tied token, identically on every call. When no row filters (every
    top_k off, every top_p >= 1) the full-vocabulary sort is skipped: log_softmax(logits / temperature) directly.
    ``top_k`` and ``top_p`` both None: no row can filter (an RL engine's), so no sort is compiled at all. The
    log-probs keep the logits' layout (a vocabulary split over tensor-parallel devices stays split: no gather).
    """
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    batch = logits.shape[:-1]
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), batch)[..., None]
    greedy = temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    if top_k is None and top_p is None:
        logp = jax.nn.log_softmax(scaled, axis=-1)
    else:
        top_k = jnp.broadcast_to(jnp.asarray(0 if top_k is None else top_k, jnp.int32), batch)[..., None]
        top_p = jnp.broadcast_to(jnp.asarray(1.0 if top_p is None else top_p, jnp.float32), batch)[..., None]
        filters = jnp.any((top_k > 0) & (top_k < v) | (top_p < 1.0))
        # each branch's result laid out as the logits (XLA would otherwise gather a conditional's result whole)
        logical = ("batch",) + (None,) * (logits.ndim - 2) + ("vocab",)
        logp = jax.lax.cond(filters, lambda x, k, p: constrain(_filtered(x, k, p), logical),
                            lambda x, *_: constrain(jax.nn.log_softmax(x, axis=-1), logical), scaled, top_k, top_p)
        logp = constrain(logp, logical)
    argmax = jnp.argmax(logits, axis=-1)[..., None]
    onehot = jnp.where(jnp.arange(v) == argmax, 0.0, NEG_INF)
    return jnp.where(greedy, onehot, logp)


def _filtered(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p filtered log-probabilities of temperature-scaled logits (one full-vocabulary sort)."""
    v = scaled.shape[-1]
    sorted_desc = jnp.sort(scaled, axis=-1)[..., ::-1]
    k = jnp.where((top_k <= 0) | (top_k > v), v, top_k)
    kth = jnp.take_along_axis(sorted_desc, k - 1, axis=-1)
    scaled = jnp.where(scaled >= kth, scaled, NEG_INF)
    # top-p over the top-k-filtered distribution: keep the smallest prefix (by probability) whose mass reaches p.
    sorted_desc = jnp.where(jnp.arange(v) < k, sorted_desc, NEG_INF)
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    keep_sorted = (mass_before < top_p) | (jnp.arange(v) == 0) | (top_p >= 1.0)  # p >= 1: off, even if mass rounds to 1
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jax.nn.log_softmax(jnp.where(scaled >= cutoff, scaled, NEG_INF), axis=-1)


def vocab_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` over the last (vocabulary) axis. Inside a sharded step whose rules split the vocabulary over
    ``tensor`` devices, each device takes the top k of its share (``jax.shard_map``) and only those candidates are
    merged: the same values and indices (ties go to the lower index either way), where a top-k over the split axis
    gathers the whole array (XLA:CPU) or reshards it by all-to-all (XLA for TPU)."""
    ctx = activation_context()
    if ctx is None:
        return jax.lax.top_k(x, k)
    mesh, rules = ctx
    spec = rules.spec(("batch",) + (None,) * (x.ndim - 2) + ("vocab",), mesh, x.shape)
    split = (spec[-1],) if isinstance(spec[-1], str) else tuple(spec[-1] or ())
    tp = mesh.shape.get("tensor", 1)
    if tp == 1 or split != ("tensor",) or k > x.shape[-1] // tp:
        return jax.lax.top_k(x, k)

    def share(a):  # this device's vocabulary share: its top k, indices into the whole vocabulary
        val, idx = jax.lax.top_k(a, k)
        return val, idx + jax.lax.axis_index("tensor") * a.shape[-1]

    val, idx = jax.shard_map(share, mesh=mesh, in_specs=spec, out_specs=(spec, spec), check_vma=False)(x)
    best, pos = jax.lax.top_k(val, k)  # [..., tp * k], shares in vocabulary order: ties to the lower index
    return best, jnp.take_along_axis(idx, pos, axis=-1)


def gumbel_noise(keys: jax.Array, vocab: int) -> jax.Array:
    """The Gumbel(0, 1) noise [*keys.shape, vocab] that sampling adds to the log-probs of each key's token (shared with
    the EAGLE drafter, which guesses sampled tokens under the same noise)."""
    flat_keys = keys.reshape(-1)
    g = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(flat_keys)
    return g.reshape(keys.shape + (vocab,))


def sample_from_logprobs(keys: jax.Array, logp: jax.Array) -> jax.Array:
    """Gumbel-max sample per row: keys has logp.shape[:-1] (typed keys); returns int32 token ids."""
    return jnp.argmax(logp + gumbel_noise(keys, logp.shape[-1]), axis=-1).astype(jnp.int32)


def sample_tokens(logits: jax.Array, keys, temperature, top_k, top_p) -> jax.Array:
    """Plain decoding's token choice for logits [..., V]: a Gumbel-max sample of ``processed_logprobs``. ``keys``:
    typed keys of shape logits.shape[:-1], or a function returning them (derived only when some row samples). When
    every row is greedy it takes the argmax directly (the token the processed one-hot gives) and skips the key
    derivation, the full-vocabulary sort and the noise."""

    def greedy(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(_):
        k = keys() if callable(keys) else keys
        return sample_from_logprobs(k, processed_logprobs(logits, temperature, top_k, top_p))

    return jax.lax.cond(jnp.all(jnp.asarray(temperature) <= 0.0), greedy, sample, None)


def token_keys(seed: jax.Array, request_ids: jax.Array, sample_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """Counter-based keys: one per (seed, request, sample, position), whatever the batch layout.

    All arguments are integer arrays broadcast together; returns typed keys of the broadcast shape.
    """
    seed, request_ids, sample_ids, positions = jnp.broadcast_arrays(
        jnp.asarray(seed, jnp.uint32),
        jnp.asarray(request_ids, jnp.uint32),
        jnp.asarray(sample_ids, jnp.uint32),
        jnp.asarray(positions, jnp.uint32),
    )

    def one(s, r, i, p):
        k = jax.random.key(s)
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(k, r), i), p)

    shape = seed.shape
    keys = jax.vmap(one)(seed.reshape(-1), request_ids.reshape(-1), sample_ids.reshape(-1), positions.reshape(-1))
    return keys.reshape(shape)
