"""The unstacked layer layout (issue 44): one array per layer, the layers run unrolled over a per-layer KV cache.
Same numbers as the stacked (scanned) model, and the rollout engine decodes the same tokens with it, plain and
speculative (lossless), from ``rollout.layers`` through the builder."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter import EagleDrafter
from tlt_jax.models import CausalLM, KVCache, rollout_copy, tiny_config
from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig

CFG = tiny_config(num_layers=3)
FAST = {"xla_backend_optimization_level": 0}
PROMPTS = [[5, 9, 11, 3], [7, 2, 8, 8, 1, 4]]


def test_unstacked_forward_matches_stacked_and_owns_its_arrays():
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    flat = rollout_copy(model, layers="unstacked")
    assert isinstance(flat.layers, nnx.List) and len(flat.layers) == CFG.num_layers
    assert isinstance(model.layers, CausalLM(CFG, rngs=nnx.Rngs(0)).layers.__class__)  # the original is untouched
    w = flat.layers[1].mlp.up_proj[...]
    np.testing.assert_array_equal(w, model.layers.mlp.up_proj[...][1])
    ids = jnp.array([[1, 2, 3, 4, 5], [5, 6, 7, 8, 9]])
    ref, got = model(ids), flat(ids)
    np.testing.assert_allclose(got.logits, ref.logits, atol=1e-5)
    np.testing.assert_allclose(got.k_new, ref.k_new, atol=1e-6)
    stacked = KVCache.zeros(CFG, 2, 16).append(ref.k_new, ref.v_new)
    per_layer = KVCache.zeros(CFG, 2, 16, per_layer=True).append(got.k_new, got.v_new)
    assert per_layer.per_layer and per_layer.batch == 2 and per_layer.max_len == 16
    tok = jnp.array([[3], [4]])
    want = model(tok, cache=stacked, attend_len=8).logits
    np.testing.assert_allclose(flat(tok, cache=per_layer, attend_len=8).logits, want, atol=1e-5)
    np.testing.assert_allclose(flat(tok, cache=stacked, attend_len=8).logits, want, atol=1e-5)
    rows = jnp.array([1, 0, 1])
    for a, b in ((per_layer.gather(rows), stacked.gather(rows)), (per_layer.pad_to(20), stacked.pad_to(20)),
                 (per_layer.view(8), stacked.view(8))):
        np.testing.assert_allclose(jnp.stack(a.k), b.k, atol=1e-6)
        np.testing.assert_array_equal(a.lengths, b.lengths)
    flat.remat = True  # rematerialised unrolled layers: the same gradients as the scanned stack
    grad_flat = nnx.grad(lambda m: m(ids).logits.sum())(flat)
    grad_ref = nnx.grad(lambda m: m(ids).logits.sum())(model)
    np.testing.assert_allclose(grad_flat.layers[2].mlp.down_proj[...], grad_ref.layers.mlp.down_proj[...][2],
                               atol=1e-5)
    with pytest.raises(ValueError, match="per-layer KVCache goes with unstacked layers"):
        model(tok, cache=per_layer)
    with pytest.raises(ValueError, match="already unstacked"):
        rollout_copy(flat, layers="stacked")
    with pytest.raises(ValueError, match="layers must be one of"):
        rollout_copy(model, layers="rolled")


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
def test_engine_unstacked_greedy_equals_stacked_plain_and_speculative(drafter):
    """Greedy tokens (fp32): the unstacked engine == the stacked one, plain and with tree speculation (lossless)."""
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    kw = dict(max_batch=4, max_len=48, length_buckets=(48,), batch_buckets=(2, 4), compiler_options=FAST)
    params = SamplingParams(temperature=0.0, n=2, max_new_tokens=[20, 9], ignore_eos=True)
    ref = RolloutEngine(model, layers="stacked", **kw).generate(PROMPTS, params)
    plain = RolloutEngine(model, layers="unstacked", **kw)
    assert plain.ctx.per_layer_cache
    got = plain.generate(PROMPTS, params)
    assert got.tokens == ref.tokens and got.stats["compactions"]
    d = EagleDrafter(CFG, rngs=nnx.Rngs(1)) if drafter == "eagle" else "ngram"
    spec = RolloutEngine(model, layers="unstacked", drafter=d,
                         spec=SpecConfig(depth=3, topk=2, verify_tokens=5, threshold=4), **kw)
    res = spec.generate(PROMPTS, params)
    assert res.tokens == ref.tokens and res.stats["verify_steps"] > 0
    np.testing.assert_allclose(np.concatenate([np.asarray(x) for r in res.logprobs for x in r]),
                               np.concatenate([np.asarray(x) for r in ref.logprobs for x in r]), atol=1e-5)
    assert jax.tree.structure(plain.params) != jax.tree.structure(RolloutEngine(model, **kw).params)


def _decode_program(layers: str) -> tuple[str, str]:
    """(lowered StableHLO, compiled CPU HLO) of one cached decode step of a 4-layer model in this layout."""
    cfg = tiny_config(num_layers=4)
    model = rollout_copy(CausalLM(cfg, rngs=nnx.Rngs(0)), layers=layers)
    graphdef, params = nnx.split(model)
    cache = KVCache.zeros(cfg, 2, 64, per_layer=layers == "unstacked")

    def step(params, tok, cache):
        out = nnx.merge(graphdef, params)(tok[:, None], cache=cache, attend_len=32)
        return out.logits, cache.append(out.k_new, out.v_new)

    lowered = jax.jit(step, donate_argnums=(2,)).lower(params, jnp.zeros((2,), jnp.int32), cache)
    return lowered.as_text(), lowered.compile().as_text()


def test_unstacked_decode_program_slices_no_weights_out_of_a_stack():
    """The layer-loop fix in the compiled program: the stacked model's decode step loops over the layers and slices
    every layer's weights (and cache) out of the stacks (on GPU each such slice is a device copy every step: 6.4 of
    12.5 ms of a 7B step on an H200); the unstacked step has no layer loop and slices nothing out of a stack. (The
    compiled CPU programs also hold small loops and slices of XLA's own, expanding the cache-write scatters.)"""
    per_layer_slice = re.compile(r"dynamic-slice\(.*op_name=\"[^\"]*while/body/jit\(dynamic_index_in_dim\)")
    stacked, stacked_hlo = _decode_program("stacked")
    assert "stablehlo.while" in stacked and "stablehlo.dynamic_slice" in stacked
    assert len(per_layer_slice.findall(stacked_hlo)) >= 7  # q, k, v, o, gate, up, down (+ norms, cache) per layer
    flat, flat_hlo = _decode_program("unstacked")
    assert "stablehlo.while" not in flat and "dynamic_slice" not in flat
    assert not per_layer_slice.findall(flat_hlo) and "dynamic_index_in_dim" not in flat_hlo


def _decode_chunk_temp_bytes(num_layers: int) -> int:
    cfg = tiny_config(num_layers=num_layers, hidden_size=128, intermediate_size=256, vocab_size=512,
                      max_position_embeddings=1024)
    engine = RolloutEngine(CausalLM(cfg, rngs=nnx.Rngs(0)), max_batch=16, max_len=1024, length_buckets=(1024,),
                           batch_buckets=(16,), layers="unstacked", compiler_options=FAST)
    engine.generate([[1, 2, 3]] * 16, SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True))
    key = next(k for k in engine.pool.keys() if k.phase == "decode")
    return engine.pool.compile(key).memory_analysis().temp_size_in_bytes


def test_unstacked_decode_chunk_holds_no_copy_of_every_layers_cache():
    """Decode attention reads each layer's cache in place: the unrolled chunk's temporaries do not grow with the
    layers. (A dot per layer transposes each layer's cache; in the unrolled program those copies could all be
    scheduled early and alive at once: a whole extra KV cache.)"""
    layer_cache = 2 * 16 * 1024 * 2 * 32 * 4  # k and v of one layer: 16 rows x 1024 positions x 2 heads x 32 x fp32
    assert _decode_chunk_temp_bytes(6) - _decode_chunk_temp_bytes(2) < layer_cache
