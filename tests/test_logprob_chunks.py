"""Log-prob passes in chunks sized by memory, not by rl.micro_batch_size (issue 58, item 5): with FSDP every chunk
gathers the whole model, so the old-policy and reference passes take few large chunks (``rl.logprob_chunk_rows``,
0 = auto from ``rl.logprob_max_gb``). The log-probs do not depend on the chunking."""

import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_main import _cfg

from tlt_jax.config import ConfigError
from tlt_jax.distributed import MeshConfig, make_mesh
from tlt_jax.models import CausalLM, tiny_config
from tlt_jax.rl.logprobs import (
    GB,
    batch_logprobs,
    cast_to_compute,
    choose_chunk_rows,
    logprob_chunk_rows,
    logprob_row_bytes,
    make_logprob_fn,
    sequence_logprobs,
)

CFG = tiny_config(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  attention_bias=True)


def _batch(rows: int = 16, t: int = 24, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, CFG.vocab_size, (rows, t)).astype(np.int32)
    lens = rng.integers(t // 2, t + 1, rows)
    attn = (np.arange(t)[None] < lens[:, None]).astype(np.int32)
    return jnp.asarray(ids * attn), jnp.asarray(attn)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunked_logprobs_equal_unchunked(dtype):
    """Chunks of 2, 4, 8 rows and one whole-batch chunk give the log-probs of one unchunked forward: within float32
    rounding in float32 compute; in bfloat16 compute one chunk is bitwise the unchunked forward, and the chunkings
    agree bitwise with each other and within bfloat16 rounding with it (XLA:CPU rounds a bfloat16 matmul by shape)."""
    model = CausalLM(CFG, dtype=dtype, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids, attn = _batch()

    def unchunked(p, i, a):
        return sequence_logprobs(nnx.merge(graphdef, p, rest), i, a, 0.9)[0]

    whole = np.asarray(jax.jit(unchunked)(params, ids, attn))
    got = {rows: np.asarray(jax.jit(lambda p, i, a, r=rows: batch_logprobs(graphdef, p, rest, i, a, chunk_size=r,
                                                                            temperature=0.9))(params, ids, attn))
           for rows in (2, 4, 8, 16)}
    if dtype == jnp.float32:
        for rows, lp in got.items():
            np.testing.assert_allclose(lp, whole, atol=1e-6, rtol=1e-6, err_msg=str(rows))
    else:
        np.testing.assert_array_equal(got[16], whole)
        for rows in (4, 8):
            np.testing.assert_array_equal(got[rows], got[2])
        np.testing.assert_allclose(got[2], whole, atol=2e-3, rtol=0)
    assert np.all(whole[np.asarray(attn) == 0] == 0) and np.all(whole[:, 0] == 0)


def test_compute_dtype_copy_changes_no_value():
    """``cast_to_compute`` (float32 masters to the bfloat16 compute dtype before the layers, so FSDP gathers half the
    bytes) gives bitwise the log-probs of the model that casts at each use; RMSNorm weights stay float32."""
    model = CausalLM(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids, attn = _batch(8, seed=1)

    def logp(p, i, a, cast):
        m = nnx.merge(graphdef, p, rest)
        if cast:
            cast_to_compute(m)
        return sequence_logprobs(m, i, a)[0]

    cast, plain = (np.asarray(jax.jit(functools.partial(logp, cast=c))(params, ids, attn)) for c in (True, False))
    np.testing.assert_array_equal(cast, plain)
    m = nnx.merge(graphdef, params, rest)
    cast_to_compute(m)
    assert m.embed_tokens[...].dtype == jnp.bfloat16 and m.layers.mlp.up_proj[...].dtype == jnp.bfloat16
    assert m.layers.self_attn.q_bias[...].dtype == jnp.bfloat16
    assert m.norm.weight[...].dtype == jnp.float32 and m.layers.input_layernorm.weight[...].dtype == jnp.float32


def test_chunk_rows_follow_the_memory_budget():
    """The largest chunk that divides the rows, splits over the batch devices and fits the budget; the smallest
    such chunk when none fits; larger with tensor parallelism (heads, MLP and vocabulary split) or shorter rows."""
    row = logprob_row_bytes(CFG, 1024)
    assert choose_chunk_rows(512, row, batch_devices=8, budget_bytes=16 * row) == 128  # 16 rows per device
    assert choose_chunk_rows(512, row, batch_devices=8, budget_bytes=15 * row) == 64
    assert choose_chunk_rows(512, row, batch_devices=8, budget_bytes=1) == 8
    assert choose_chunk_rows(24, row, batch_devices=2, budget_bytes=5 * row) == 8  # 8 divides 24, 10 does not
    with pytest.raises(ValueError, match="do not split"):
        choose_chunk_rows(12, row, batch_devices=8, budget_bytes=GB)
    assert logprob_row_bytes(CFG, 1024, tensor=4) < row and logprob_row_bytes(CFG, 512) < row
    from tlt_jax.models import layers
    from tlt_jax.rl import logprobs

    assert logprobs.ATTENTION_BLOCK == layers.ATTENTION_BLOCK  # the estimate's attention block is the model's


def test_config_keys_choose_the_chunks_and_are_checked():
    """rl.logprob_chunk_rows fixes the chunk (checked against the step's rows and the mesh's batch devices);
    0 takes the largest chunk rl.logprob_max_gb allows (Qwen2.5-7B at T = 3072 on 8 devices: 64 chunks of 8 rows
    before, 4 of 128 now; the 7B recipe's mesh 1 x 2 x 4: 8 of 64)."""
    from tlt_jax.plan.abstract import SHAPES
    from tlt_jax.rl.learner import check_micro_batch

    mesh = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    cfg = _cfg("tiny.py", "--config.model.dtype=bfloat16")
    assert logprob_chunk_rows(cfg, mesh, SHAPES["qwen2.5-7b"], 512, 3072) == 128
    assert logprob_chunk_rows(_cfg("tiny.py", "--config.rl.logprob_max_gb=1"), mesh, SHAPES["qwen2.5-7b"], 512,
                              3072) == 8
    assert logprob_chunk_rows(_cfg("tiny.py", "--config.rl.logprob_chunk_rows=16"), mesh, CFG, 32, 16) == 16
    tp = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    assert logprob_chunk_rows(cfg, tp, SHAPES["qwen2.5-7b"], 512, 3072) == 64
    with pytest.raises(ConfigError, match="rl.logprob_chunk_rows: 12 must divide the step's sequences"):
        _cfg("tiny.py", "--config.rl.logprob_chunk_rows=12")
    with pytest.raises(ConfigError, match="rl.logprob_chunk_rows: 4 does not divide over the mesh's batch axes"):
        check_micro_batch(_cfg("tiny.py", "--config.rl.logprob_chunk_rows=4", "--config.rl.micro_batch_size=8"),
                          mesh)
    with pytest.raises(ConfigError, match="rl.logprob_max_gb"):
        _cfg("tiny.py", "--config.rl.logprob_max_gb=0")


def _learner_step(*overrides):
    from tlt_jax.builders import build_data, build_engine, build_model, build_reward
    from tlt_jax.rl.learner import GRPOLearner

    # Two updates per step and a KL term: both passes (old policy, reference) run.
    cfg = _cfg("tiny.py", "--config.rl.mini_batch_prompts=4", "--config.rl.micro_batch_size=8", *overrides)
    mesh = make_mesh(cfg.mesh)
    model, tok = build_model(cfg, mesh)
    data = build_data(cfg, tok, model.config)
    learner = GRPOLearner(cfg, model, build_engine(cfg, model, mesh, data), build_reward(cfg, tok), mesh=mesh)
    metrics = learner.step(1, data.train[: cfg.data.prompts_per_step])
    return metrics, sorted(learner._logprob_fns)


def test_learner_passes_in_the_configured_chunks_give_the_same_update():
    """The learner's passes run in the configured chunks (auto: one chunk of the step's 32 rows; a 1-byte budget:
    the smallest, 8 = the batch devices; 16 fixed), and the step's update is the same each way."""
    auto, rows_auto = _learner_step()
    small, rows_small = _learner_step("--config.rl.logprob_max_gb=1e-9")
    fixed, rows_fixed = _learner_step("--config.rl.logprob_chunk_rows=16")
    assert (rows_auto, rows_small, rows_fixed) == ([32], [8], [16])
    for other in (small, fixed):
        for k in ("train/loss", "train/kl_loss", "train/approx_kl", "train/clip_frac", "train/grad_norm"):
            np.testing.assert_allclose(other[k], auto[k], rtol=1e-5, atol=1e-7, err_msg=k)


def _installed(name: str) -> bool:
    """Whether module ``name`` can be imported (its missing parent package is no error)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _installed("jax_plugins.xla_cuda12"), reason="needs jax-cuda12-plugin")
def test_xla_gpu_auto_chunks_gather_less_within_the_budget():
    """XLA:GPU for 8 H100s (compile-only), a small Qwen2-shaped model FSDP over 8: the auto chunks gather far less
    than chunks of 8 rows, at most 8 x the model, and their temporaries stay within rl.logprob_max_gb."""
    from tlt_jax.distributed import LogicalRules
    from tlt_jax.plan import abstract as ab
    from tlt_jax.plan.hlo import collective_stats
    from tlt_jax.plan.targets import compile_only_devices

    mesh = make_mesh(MeshConfig(1, 8, 1), compile_only_devices("h100:1x8"))
    mcfg = dataclasses.replace(ab.SHAPES["qwen2.5-7b"], num_layers=2, vocab_size=32768, intermediate_size=4096)
    cfg = _cfg("tiny.py", "--config.model.dtype=bfloat16", "--config.rl.logprob_max_gb=1")
    policy = ab.abstract_policy(cfg, mcfg, mesh)
    rows, t = 256, 1024
    ids = ab.batch_sds((rows, t), jnp.int32, mesh, LogicalRules())
    params = ab.reference_params(cfg, policy.params)
    model_bytes = sum(x.size * 2 for x in jax.tree.leaves(params))
    chunk = logprob_chunk_rows(cfg, mesh, mcfg, rows, t)
    assert 8 < chunk < rows
    gathered = {}
    for r in (8, chunk):
        fn = make_logprob_fn(policy.graphdef, chunk_size=r, temperature=1.0, mesh=mesh)
        compiled = fn.lower(params, policy.rest, ids, ids).compile()
        gathered[r] = collective_stats(compiled.as_text()).by_kind["all-gather"]
        if r == chunk:
            assert compiled.memory_analysis().temp_size_in_bytes <= cfg.rl.logprob_max_gb * GB
    # Each chunk gathers the layers again (XLA hoists some gathers out of the chunk loop): 32 chunks of 8 rows gather
    # more than twice what the auto chunks (8 of 32 rows) do, and these gather at most 8 x the model's bytes.
    assert gathered[8] > 2 * gathered[chunk] and gathered[chunk] <= 8 * model_bytes, (gathered, model_bytes)
