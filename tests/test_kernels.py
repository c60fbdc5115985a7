"""Pallas tree attention against the dense reference (interpret mode on CPU): random trees, GQA ratios, ragged
lengths, fp32 and bf16, both the Triton kernel and its Mosaic variant; lowering for CUDA and TPU from this CPU-only
machine; attention_impl="pallas" in the model and the engine, and the bf16 rollout layout, both lossless
(speculative == plain decoding of the same policy, greedy and by a chi-square test of the sampled law)."""

import contextlib
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_speculative_stats import chi2, draft_table, exact_joint, make_policy, spec_two_tokens

from tlt_jax.drafter import EagleDrafter
from tlt_jax.kernels import prefix_tree_attention, tree_attention, tree_attention_reference
from tlt_jax.models import CausalLM, KVCache, rollout_copy, tiny_config
from tlt_jax.models.transformer import PALLAS_MAX_NEW_TOKENS
from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
SD = jax.ShapeDtypeStruct


def tree_masks(rng, b, t, p_dead=0.0):
    """[B, T, T] ancestor-or-self masks of random topologically ordered trees; with p_dead some rows see nothing
    among the new tokens (padding nodes)."""
    mask = np.zeros((b, t, t), bool)
    for r in range(b):
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
        for i in range(t):
            j = i
            while j >= 0:
                mask[r, i, j] = True
                j = parent[j]
            if rng.random() < p_dead:
                mask[r, i] = False
    return jnp.asarray(mask)


def inputs(seed, b, t, hq, hkv, d, s, cache_len, dtype=jnp.float32, p_dead=0.0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in
               [(b, t, hq, d), (b, s, hkv, d), (b, s, hkv, d)])
    return q, k, v, jnp.asarray(cache_len, jnp.int32), tree_masks(rng, b, t, p_dead)


def max_err(out, ref):
    return float(np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32)).max())


# (B, T, Hq, Hkv, D, S, cache_len, tuning): GQA ratios 3, 8 and 1; several row blocks; splits; the last cache block
# partial (S not a multiple of block_k); rows at 0, mid and full cache; head_dim 8 (padded to Triton's 16).
GPU_CASES = [
    (3, 9, 6, 2, 16, 45, [0, 20, 36], dict(block_k=16, block_m=16, num_splits=3)),
    (2, 1, 8, 1, 32, 70, [69, 5], dict(block_k=32)),
    (2, 4, 4, 4, 8, 19, [15, 0], dict(block_k=16, num_splits=1)),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=["gqa3-splits", "decode-gqa8", "mha-d8"])
def test_triton_kernel_matches_reference_fp32(case):
    b, t, hq, hkv, d, s, lens, tuning = case
    q, k, v, cl, tm = inputs(0, b, t, hq, hkv, d, s, lens, p_dead=0.1 if t > 1 else 0.0)
    ref = tree_attention_reference(q, k, v, cl, tm)
    out = tree_attention(q, k, v, cl, tm, interpret=True, backend="gpu", **tuning)
    assert out.shape == (b, t, hq, d) and out.dtype == jnp.float32
    assert max_err(out, ref) <= 2e-5


def test_triton_kernel_matches_reference_bf16():
    b, t, hq, hkv, d, s, lens, tuning = GPU_CASES[0]
    q, k, v, cl, tm = inputs(1, b, t, hq, hkv, d, s, lens, dtype=jnp.bfloat16)
    out = tree_attention(q, k, v, cl, tm, interpret=True, backend="gpu", **tuning)
    assert out.dtype == jnp.bfloat16
    assert max_err(out, tree_attention_reference(q, k, v, cl, tm)) <= 2e-2


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
def test_mosaic_variant_matches_reference(dtype, tol):
    # 260 positions in blocks of 128: the third block is partial; the rows end in blocks 0, 1 and 2.
    q, k, v, cl, tm = inputs(2, 3, 5, 4, 2, 16, 260, [0, 170, 255], dtype=dtype, p_dead=0.1)
    out = tree_attention(q, k, v, cl, tm, interpret=True, backend="tpu", block_k=128)
    assert out.dtype == dtype
    assert max_err(out, tree_attention_reference(q, k, v, cl, tm)) <= tol


def test_cache_prefix_beyond_length_is_never_read():
    """NaN in every cache position at or after a row's prefix length (new tokens held apart): output unaffected."""
    q, k, v, cl, tm = inputs(3, 2, 3, 4, 2, 16, 40, [7, 30])
    k_new, v_new = k[:, :3] + 1.0, v[:, :3] - 1.0
    beyond = jnp.arange(40)[None, :, None, None] >= cl[:, None, None, None]
    poisoned = jnp.where(beyond, jnp.nan, k), jnp.where(beyond, jnp.nan, v)
    out = prefix_tree_attention(q, *poisoned, cl, k_new, v_new, tm, interpret=True, backend="gpu", block_k=16)
    rows, idx = jnp.arange(2)[:, None], cl[:, None] + jnp.arange(3)[None, :]  # reference: tree keys at cache_len
    kr = jnp.where(beyond, 0.0, k).at[rows, idx].set(k_new)
    vr = jnp.where(beyond, 0.0, v).at[rows, idx].set(v_new)
    assert np.isfinite(np.asarray(out)).all()
    assert max_err(out, tree_attention_reference(q, kr, vr, cl, tm)) <= 2e-5


def test_bad_inputs_name_the_problem():
    q, k, v, cl, tm = inputs(4, 2, 3, 4, 2, 16, 20, [1, 2])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tree_attention(q[:, :, :3], k, v, cl, tm, interpret=True)
    with pytest.raises(ValueError, match=r"tree_mask must be \[B, T, T\]"):
        tree_attention(q, k, v, cl, tm[:, :2], interpret=True)
    with pytest.raises(ValueError, match=r"cache_len must be \[B\]"):
        tree_attention(q, k, v, cl[:1], tm, interpret=True)
    with pytest.raises(ValueError, match="backend must be 'gpu'"):
        tree_attention(q, k, v, cl, tm, interpret=True, backend="cuda")
    with pytest.raises(ValueError, match="block_k must be a multiple of 128"):
        tree_attention(q, k, v, cl, tm, interpret=True, backend="tpu", block_k=100)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        tree_attention(q, k, v, cl, tm, interpret=True, num_splits=0)
    model = CausalLM(tiny_config(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        rollout_copy(model, attention_impl="triton")
    with pytest.raises(ValueError, match="floating dtype"):
        rollout_copy(model, dtype=jnp.int8)


# ------------------------------------------------------------------------------------------- lowering (no device)


@pytest.mark.parametrize("platform,backend,call", [("cuda", "gpu", "__gpu$xla.gpu.triton"),
                                                    ("tpu", "tpu", "tpu_custom_call")])
def test_kernels_lower_for_gpu_and_tpu(platform, backend, call):
    """Qwen2.5-7B attention shapes (28 query heads on 4 KV heads, head_dim 128): decode and a 64-token verify tree
    over a 2000-position cache, fp32 and bf16, lower to one Triton / Mosaic custom call from this CPU machine (jax
    0.11's Triton lowering asks the mesh for the target GPU, so CUDA lowers under an abstract H100)."""
    target = contextlib.nullcontext()
    if platform == "cuda":
        h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
        target = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100))
    for t in (1, 64):
        for dtype in (jnp.float32, jnp.bfloat16):
            f = functools.partial(tree_attention, backend=backend)
            args = (SD((2, t, 28, 128), dtype), SD((2, 2000, 4, 128), dtype), SD((2, 2000, 4, 128), dtype),
                    SD((2,), jnp.int32), SD((2, t, t), jnp.bool_))
            with target:
                text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
            assert len(re.findall(re.escape(call), text)) == 1, (t, dtype)


# --------------------------------------------------------------------------------- model and engine integration

CFG = tiny_config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=())


@pytest.mark.slow
def test_model_pallas_forward_matches_xla_on_a_verify_tree():
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    fast = rollout_copy(model, attention_impl="pallas")
    assert fast is not model and model.attention_impl == "xla" and rollout_copy(model) is model
    cache = KVCache.zeros(CFG, 2, 24)
    out = model(jnp.asarray([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]]), cache=cache)
    cache = cache.append(out.k_new, out.v_new, jnp.asarray([5, 2]))
    rng = np.random.default_rng(5)
    ids, tm = jnp.asarray(rng.integers(0, 64, (2, 6))), tree_masks(rng, 2, 6)
    pos = cache.lengths[:, None] + tm.sum(-1) - 1  # length + depth in the tree
    kw = dict(positions=pos, tree_mask=tm, cache=cache.view(16))
    uses_kernel = lambda m, x, **k: "pallas_call" in str(jax.make_jaxpr(lambda: m(x, **k))())  # noqa: E731
    assert uses_kernel(fast, ids, **kw) and not uses_kernel(model, ids, **kw)
    long = jnp.zeros((2, PALLAS_MAX_NEW_TOKENS + 1), jnp.int32)  # prefill-sized calls stay on XLA
    assert not uses_kernel(fast, long, cache=KVCache.zeros(CFG, 2, 160))
    want, got = model(ids, **kw), fast(ids, **kw)
    assert max_err(got.logits, want.logits) <= 2e-5 and max_err(got.k_new, want.k_new) <= 2e-5
    low = rollout_copy(model, dtype=jnp.bfloat16)
    want, got = low(ids, **kw), rollout_copy(model, dtype="bfloat16", attention_impl="pallas")(ids, **kw)
    assert got.logits.dtype == jnp.bfloat16 and max_err(got.logits, want.logits) <= 2e-2


def test_rollout_copy_casts_a_copy_and_the_engine_decodes_bf16():
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    low = rollout_copy(model, dtype=jnp.bfloat16)
    assert model.dtype == jnp.float32 and model.layers.self_attn.q_proj[...].dtype == jnp.float32  # masters kept
    assert low.dtype == jnp.bfloat16 and low.layers.mlp.dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(nnx.state(low, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    eng = RolloutEngine(model, dtype=jnp.bfloat16, max_batch=2, max_len=32, length_buckets=(32,),
                        batch_buckets=(2,), compiler_options=FAST)
    assert eng.ctx.cache_dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(eng.params)} <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int32)}
    eng.set_params(CausalLM(CFG, rngs=nnx.Rngs(9)))  # fp32 masters from the trainer: cast on publish
    assert {x.dtype for x in jax.tree.leaves(eng.params)} <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int32)}


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14]]


def _engine_pair(model, n_new, **layout):
    kw = dict(max_batch=2, max_len=32, length_buckets=(32,), batch_buckets=(2,), chunk_size=4,
              compiler_options=FAST, **layout)
    plain = RolloutEngine(model, **kw)
    spec = RolloutEngine(model, drafter="ngram", spec=SpecConfig(depth=3, topk=2, verify_tokens=5, threshold=2), **kw)
    params = SamplingParams(temperature=0.0, n=1, max_new_tokens=n_new, ignore_eos=True)
    return plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)


@pytest.mark.slow
def test_engine_pallas_greedy_speculative_equals_plain():
    """attention_impl="pallas" (interpreted on CPU) in decode and verify steps: speculative == plain, and both equal
    the XLA engine's greedy tokens."""
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    plain, spec = _engine_pair(model, 10, attention_impl="pallas")
    assert spec.tokens == plain.tokens and spec.stats["verify_steps"] > 0
    np.testing.assert_allclose(np.concatenate([np.asarray(x) for r in spec.logprobs for x in r]),
                               np.concatenate([np.asarray(x) for r in plain.logprobs for x in r]), atol=1e-5)
    xla, _ = _engine_pair(model, 10)
    assert plain.tokens == xla.tokens


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
def test_bf16_greedy_speculative_equals_plain_bf16(drafter):
    """Lossless in bf16: tree decoding reproduces plain decoding of the same bf16 policy token for token (here the
    random policy's near-uniform logits make greedy choices fragile: bf16 plain decoding differs from fp32)."""
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    kw = dict(max_batch=4, max_len=48, length_buckets=(48,), batch_buckets=(4,), compiler_options=FAST,
              dtype=jnp.bfloat16)
    params = SamplingParams(temperature=0.0, n=2, max_new_tokens=[20, 14], ignore_eos=True)
    plain = RolloutEngine(model, **kw).generate(PROMPTS, params)
    d = EagleDrafter(CFG, rngs=nnx.Rngs(1)) if drafter == "eagle" else "ngram"
    eng = RolloutEngine(model, drafter=d, spec=SpecConfig(depth=3, topk=2, verify_tokens=6, threshold=4), **kw)
    res = eng.generate(PROMPTS, params)
    assert res.tokens == plain.tokens and res.stats["verify_steps"] > 0
    assert RolloutEngine(model, **dict(kw, dtype=None)).generate(PROMPTS, params).tokens != plain.tokens


@pytest.mark.slow
def test_bf16_tree_sampling_matches_exact_joint():
    """The chi-square test of tests/test_speculative_stats.py with the policy in bf16: the law of the first two
    tokens emitted by tree verification equals the exact joint of plain sampling of the same bf16 policy."""
    policy = rollout_copy(make_policy(0), dtype=jnp.bfloat16)
    table = draft_table(0, policy)
    first, second, accepted = spec_two_tokens(policy, table, 0, 1.0, 0, 1.0)
    p, tv = chi2(first, second, exact_joint(policy, 1.0, 0, 1.0))
    assert (accepted >= 1).mean() > 0.1 and (accepted == 2).any()
    assert p > 1e-3 and tv < 0.03, (p, tv)


# --------------------------------------------------------------------------------------------------- on a GPU


@pytest.fixture
def gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
def test_triton_kernel_compiled_on_gpu(gpu, dtype, tol):
    for t, lens in ((1, [0, 1999]), (64, [0, 1000])):
        q, k, v, cl, tm = jax.device_put(inputs(6, 2, t, 28, 4, 128, 2064, lens, dtype=dtype), gpu)
        out = tree_attention(q, k, v, cl, tm)
        assert max_err(out, tree_attention_reference(q, k, v, cl, tm)) <= tol


@pytest.mark.gpu
def test_engine_pallas_on_gpu_equals_plain(gpu):
    model = CausalLM(dataclasses.replace(CFG, head_dim=16), rngs=nnx.Rngs(0))
    plain, spec = _engine_pair(model, 12, attention_impl="pallas")
    assert spec.tokens == plain.tokens
