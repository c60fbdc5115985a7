"""Gradient accumulation in place (models/grad_accumulation.py, the LM head's in rl/logprobs.py): the layers' and the
LM head's gradients added into an accumulator in the backward pass equal the accumulator plus plain autodiff's
gradients, and the accumulation holds one gradient buffer; gradient clipping without a clipped copy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tlt_jax.config import OptimConfig
from tlt_jax.models import CausalLM, tiny_config
from tlt_jax.rl import logprobs
from tlt_jax.rl.logprobs import chunked_token_logprobs
from tlt_jax.rl.train_step import LossConfig, clip_by_global_norm, init_train_state, make_optimizer, make_train_step

B, T = 4, 24


def _split(**overrides):
    model = CausalLM(tiny_config(**overrides), rngs=nnx.Rngs(3))
    model.remat = True
    return nnx.split(model, nnx.Param, ...)


def _inputs(vocab, seed=0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(1, vocab, (B, T)), jnp.int32)
    mask = jnp.asarray(np.arange(T)[None] < rng.integers(T // 2, T + 1, (B, 1)), jnp.int32)
    return ids, mask


def _loss(params, rest, graphdef, ids, mask, into=None):
    out = nnx.merge(graphdef, params, rest)(ids, attention_mask=mask, layer_grads_into=into)
    return jnp.sum(jnp.tanh(out.logits) * mask[..., None])


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "tie_word_embeddings": False}], ids=str)
def test_layer_gradients_are_added_into_the_accumulator(overrides):
    """grad with layer_grads_into = A equals A + the plain gradient for every layer parameter (bitwise: each sum is
    the same acc[l] + g[l]), and the plain gradient elsewhere; the forward value is the plain one."""
    graphdef, params, rest = _split(**overrides)
    ids, mask = _inputs(tiny_config(**overrides).vocab_size)
    rng = np.random.default_rng(1)
    acc = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params["layers"])
    value_and_grad = jax.jit(jax.value_and_grad(_loss), static_argnums=2)
    plain_v, plain = value_and_grad(params, rest, graphdef, ids, mask)
    into_v, into = value_and_grad(params, rest, graphdef, ids, mask, acc)
    assert float(into_v) == float(plain_v)
    same = lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # noqa: E731
    jax.tree.map(lambda a, g, h: same(h, a + g), acc, plain["layers"], into["layers"])
    for key in plain:
        if key != "layers":
            jax.tree.map(same, into[key], plain[key])
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(plain["layers"])) > 0  # the layers have gradients


def test_accumulating_two_micro_batches_holds_one_gradient_buffer():
    """Summing two micro-batches' gradients in a scan: in place, the compiled program's temporaries are smaller by
    nearly the layers' parameter bytes (no second [L, ...] gradient buffer) and the sums are bitwise the same."""
    graphdef, params, rest = _split(hidden_size=128, intermediate_size=1024, num_layers=8)
    ids, mask = _inputs(tiny_config().vocab_size)
    micro = (jnp.stack([ids, ids[::-1]]), jnp.stack([mask, mask[::-1]]))
    grad = jax.grad(_loss)

    def plain(params):
        def body(acc, xs):
            return jax.tree.map(jnp.add, acc, grad(params, rest, graphdef, *xs)), None
        return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)[0]

    def in_place(params):
        def body(acc, xs):
            g = grad(params, rest, graphdef, *xs, acc["layers"])
            return jax.tree_util.tree_map_with_path(
                lambda p, a, b: b if p[0] == jax.tree_util.DictKey("layers") else a + b, acc, g), None
        return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)[0]

    temps = [jax.jit(f).lower(params).compile().memory_analysis().temp_size_in_bytes for f in (plain, in_place)]
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
    assert temps[0] - temps[1] > 0.8 * layer_bytes, (temps, layer_bytes)
    for a, b in zip(jax.tree.leaves(jax.jit(plain)(params)), jax.tree.leaves(jax.jit(in_place)(params)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_rematerialised_train_step_equals_the_plain_one():
    """The GRPO step on a rematerialised model (which accumulates in place) gives the plain model's update."""
    results = []
    for remat in (False, True):
        graphdef, params, rest = _split()
        graphdef = nnx.graphdef(_with_remat(graphdef, params, rest, remat))
        tx = make_optimizer(OptimConfig(lr=1e-2, eps=1e-3), 10)
        state = init_train_state(params, tx)
        step = make_train_step(graphdef, tx, LossConfig(micro_batch_size=2), state)
        ids, mask = _inputs(tiny_config().vocab_size, seed=2)
        rng = np.random.default_rng(2)
        resp = (mask * (np.arange(T)[None] >= T // 4)).astype(np.float32)
        batch = dict(input_ids=ids, attention_mask=mask, response_mask=resp,
                     advantages=jnp.asarray(rng.normal(size=(B,)), jnp.float32),
                     old_logp=jnp.asarray(-3.0 * resp), ref_logp=jnp.asarray(-3.0 * resp), loss_scale=jnp.float32(1))
        state, m = step(state, rest, batch)
        results.append((jax.tree.leaves(state.params), float(m["loss"])))
    (a, la), (b, lb) = results
    assert abs(la - lb) < 1e-6
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=0)


def _with_remat(graphdef, params, rest, remat):
    model = nnx.merge(graphdef, params, rest)
    model.remat = remat
    return model


def test_grads_into_rejects_a_cached_or_unstacked_forward():
    graphdef, params, rest = _split()
    model = nnx.merge(graphdef, params, rest)
    from tlt_jax.models import KVCache, unstack_layers

    ids = jnp.ones((1, 4), jnp.int32)
    cache = KVCache.zeros(model.config, 1, 8, jnp.float32)
    with pytest.raises(ValueError, match="grads_into goes with a training forward"):
        model(ids, cache=cache, layer_grads_into=params["layers"])
    model.layers = unstack_layers(model.layers, model.config.num_layers)
    with pytest.raises(ValueError, match="grads_into goes with a training forward"):
        model(ids, layer_grads_into=params["layers"])


def _head_loss(graphdef, rest, targets, weights):
    """A loss that reads both outputs of the chunked LM head: sum(a * logp) + sum(b * entropy)."""

    def loss(params, hidden, into=None):
        model = nnx.merge(graphdef, params, rest)
        logp, ent = chunked_token_logprobs(model, hidden, targets, 0.8, chunk=16, head_grad_into=into)
        return jnp.sum(weights[0] * logp) + jnp.sum(weights[1] * ent), (logp, ent)

    return loss


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_head_gradient_is_added_into_the_accumulator(monkeypatch, tied):
    """head_grad_into = A: the same log-probs and entropies; the LM head parameter's gradient is A + the plain one
    (a written-out logits cotangent and a weight gradient in row blocks, 300 = 128 + 128 + 44: float32 rounding
    apart), the hidden states' gradient the plain one."""
    monkeypatch.setattr(logprobs, "HEAD_GRAD_BLOCK", 128)
    cfg = tiny_config(vocab_size=300, tie_word_embeddings=tied)
    graphdef, params, rest = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(4)), nnx.Param, ...)
    key = "embed_tokens" if tied else "lm_head"
    rng = np.random.default_rng(5)
    hidden = jnp.asarray(rng.normal(size=(2, 37, cfg.hidden_size)), jnp.float32)  # 3 chunks, the last padded
    targets = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 37)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(2, 2, 37)), jnp.float32)
    acc = jnp.asarray(rng.normal(size=params[key].shape), jnp.float32)
    grad = jax.jit(jax.grad(_head_loss(graphdef, rest, targets, weights), argnums=(0, 1), has_aux=True))
    (plain_p, plain_h), plain_out = grad(params, hidden)
    (into_p, into_h), into_out = grad(params, hidden, acc)
    for a, b in zip(plain_out, into_out, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(into_p[key][...]), np.asarray(acc + plain_p[key][...]), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(into_h), np.asarray(plain_h), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(plain_p[key][...]).max()) > 1e-3  # the head has a gradient to add


def test_head_accumulation_holds_no_second_weight_gradient(monkeypatch):
    """An accumulator plus one micro-batch's LM head gradient (4 chunks): in place, the compiled program's temporaries
    are smaller by more than the head weight's bytes (no per-chunk [V, E] product, no second [V, E] sum)."""
    monkeypatch.setattr(logprobs, "HEAD_GRAD_BLOCK", 1024)
    cfg = tiny_config(vocab_size=8192, hidden_size=256, tie_word_embeddings=True)
    graphdef, params, rest = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(4)), nnx.Param, ...)
    hidden = jnp.ones((2, 64, cfg.hidden_size), jnp.float32)
    loss = _head_loss(graphdef, rest, jnp.ones((2, 64), jnp.int32), jnp.ones((2, 2, 64), jnp.float32))
    grad = jax.grad(loss, has_aux=True)

    def plain(params, acc):
        return acc + grad(params, hidden)[0]["embed_tokens"][...]

    def in_place(params, acc):
        return grad(params, hidden, acc)[0]["embed_tokens"][...]

    acc = jnp.zeros(params["embed_tokens"].shape, jnp.float32)
    temps = [jax.jit(f, donate_argnums=1).lower(params, acc).compile().memory_analysis().temp_size_in_bytes
             for f in (plain, in_place)]  # the accumulator donated, as a scan's carry is
    assert temps[0] - temps[1] > acc.nbytes, (temps, acc.nbytes)


def test_clip_by_global_norm_matches_optax_without_a_clipped_copy():
    """The clipping multiplies by one factor: optax's result up to rounding when it clips, bitwise when it does not,
    the same (empty) state; Adam on clipped gradients compiles without a gradient-sized copy."""
    rng = np.random.default_rng(0)
    params = {"a": jnp.asarray(rng.normal(size=(512, 1024)), jnp.float32), "b": jnp.zeros((1024,), jnp.float32)}
    grads = {"a": jnp.asarray(rng.normal(size=(512, 1024)), jnp.float32), "b": jnp.ones((1024,), jnp.float32)}
    for max_norm in (1.0, 1e4):  # clips, does not
        ours, theirs = clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
        assert jax.tree.structure(ours.init(params)) == jax.tree.structure(theirs.init(params))
        a, b = ours.update(grads, ours.init(params))[0], theirs.update(grads, theirs.init(params))[0]
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            if max_norm > 1:
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            else:
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)

    def temps(clip):
        tx = optax.chain(clip(1.0), optax.adamw(1e-3))
        state = tx.init(params)

        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert temps(optax.clip_by_global_norm) - temps(clip_by_global_norm) > 0.8 * param_bytes
