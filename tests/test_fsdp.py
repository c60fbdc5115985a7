"""FSDP training on simulated devices (issue 42): activations split by batch through every layer, so a train step's
temporary memory per device falls as devices are added; log-probs over the vocabulary in chunks (parity with the
whole-logits reference, values and gradients); a bfloat16 reference policy."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax.config import OptimConfig
from tlt_jax.distributed import LogicalRules, activation_sharding, constrain, init_sharded
from tlt_jax.models import CausalLM, tiny_config
from tlt_jax.rl.logprobs import chunked_token_logprobs, token_logprobs
from tlt_jax.rl.train_step import LossConfig, init_train_state, make_optimizer, make_train_step

CFG = tiny_config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=512)


def _train_step_memory(devices: int, batch: int = 16, length: int = 128, micro: int = 8) -> tuple[int, int]:
    """(temporary, argument) bytes per device of one compiled train step with the model FSDP over ``devices``."""
    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(1, devices, 1), ("data", "fsdp", "tensor"))
    graphdef, params, rest = nnx.split(init_sharded(lambda: CausalLM(CFG, rngs=nnx.Rngs(0)), mesh), nnx.Param, ...)
    tx = make_optimizer(OptimConfig(), 10)
    state = init_train_state(params, tx)
    step = make_train_step(graphdef, tx, LossConfig(micro_batch_size=micro, kl_coef=0.01), state, mesh=mesh)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    spec = {k: jax.ShapeDtypeStruct((batch, length), dt, sharding=rows) for k, dt in (
        ("input_ids", jnp.int32), ("attention_mask", jnp.int32), ("response_mask", jnp.int32),
        ("old_logp", jnp.float32), ("ref_logp", jnp.float32))}
    spec["advantages"] = jax.ShapeDtypeStruct((batch,), jnp.float32, sharding=rows)
    spec["loss_scale"] = jax.ShapeDtypeStruct((), jnp.float32)
    mem = step.lower(state, rest, spec).compile().memory_analysis()
    return mem.temp_size_in_bytes, mem.argument_size_in_bytes


def test_train_step_memory_per_device_falls_as_devices_double():
    """Each doubling of the devices about halves the temporary bytes, as it does the arguments (parameters and
    optimizer state, FSDP): activations are split by batch through every layer, not kept whole on every device."""
    temp2, arg2 = _train_step_memory(2)
    temp4, arg4 = _train_step_memory(4)
    temp8, arg8 = _train_step_memory(8)
    assert temp4 < 0.65 * temp2 and temp8 < 0.65 * temp4, (temp2, temp4, temp8)
    assert arg4 < 0.6 * arg2 and arg8 < 0.6 * arg4


def test_chunked_logprobs_match_whole_logits_values_and_gradients():
    model = CausalLM(tiny_config(), rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(0), (2, 41), 0, 256)
    hidden = model(ids).hidden[:, :-1]
    targets = ids[:, 1:]

    def whole(h):
        return token_logprobs(model.logits_from_hidden(h), targets, 0.9)

    def chunked(h):
        return chunked_token_logprobs(model, h, targets, 0.9, chunk=16)  # 40 positions: 3 chunks, the last padded

    for a, b in zip(whole(hidden), chunked(hidden), strict=True):
        np.testing.assert_allclose(b, a, atol=2e-6)
    g_whole = jax.grad(lambda h: whole(h)[0].sum() + whole(h)[1].sum())(hidden)
    g_chunk = jax.grad(lambda h: chunked(h)[0].sum() + chunked(h)[1].sum())(hidden)
    np.testing.assert_allclose(g_chunk, g_whole, atol=1e-6)
    text = jax.jit(chunked).lower(hidden).as_text()
    assert "2x16x256xf32" in text and "40x256" not in text  # logits only as [2, 16, 256] chunks, never [2, 40, 256]


def test_constrain_pins_activations_only_inside_a_sharded_trace():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2, 1), ("data", "fsdp", "tensor"))
    x = jnp.ones((8, 4, 16))
    assert constrain(x, ("batch", None, None)) is x  # outside: untouched

    def f(x):
        with activation_sharding(mesh, LogicalRules()):
            return constrain(x * 2, ("batch", None, None))

    assert jax.jit(f)(x).sharding.spec == P(("data", "fsdp"))  # rows over data x fsdp, the rest whole


def test_reference_policy_is_bfloat16():
    from test_main import _cfg

    from tlt_jax.builders import build_data, build_engine, build_model, build_reward
    from tlt_jax.distributed import make_mesh
    from tlt_jax.rl.learner import GRPOLearner

    cfg = _cfg("tiny.py", "--config.rl.kl_coef=0.01")
    mesh = make_mesh(cfg.mesh)
    model, tok = build_model(cfg, mesh)
    engine = build_engine(cfg, model, mesh, build_data(cfg, tok, model.config))
    learner = GRPOLearner(cfg, model, engine, build_reward(cfg, tok), mesh=mesh)
    assert {x.dtype for x in jax.tree.leaves(learner.ref_params)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(learner.state.params)} == {jnp.dtype(jnp.float32)}


def test_blocked_attention_matches_whole_values_and_gradients():
    """Queries past ATTENTION_BLOCK are taken a block at a time (the last one padded): the same values and
    gradients as all queries at once, without a [B, KV, G, T, T] score tensor."""
    from tlt_jax.models import layers

    rng = np.random.default_rng(0)
    b, t, h, kv, d = 2, layers.ATTENTION_BLOCK + 37, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, kv, kv))
    valid = np.arange(t)[None] < np.array([[t], [t - 100]])
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None] & valid[:, None, :])

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, mask) ** 2)

    np.testing.assert_allclose(layers.attention(q, k, v, mask), layers.attention_block(q, k, v, mask), atol=2e-6)
    g_block = jax.grad(loss(layers.attention), argnums=(0, 1, 2))(q, k, v)
    g_whole = jax.grad(loss(layers.attention_block), argnums=(0, 1, 2))(q, k, v)
    for a, w in zip(g_block, g_whole, strict=True):
        np.testing.assert_allclose(a, w, atol=2e-5, rtol=1e-5)
    text = jax.jit(jax.grad(loss(layers.attention))).lower(q, k, v).as_text()
    assert f"{t}x{t}xf32" not in text and f"{layers.ATTENTION_BLOCK}x{t}xf32" in text


def test_vocab_parallel_logprobs_match_values_and_gradients():
    """Inside a sharded trace the LM head runs split by vocabulary (no whole weight gathered, its gradient local):
    the log-probs, entropies and gradients are those of the unsharded computation."""
    from tlt_jax.rl.logprobs import vocab_parallel_head

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8, 1), ("data", "fsdp", "tensor"))
    model = CausalLM(tiny_config(tie_word_embeddings=False), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jax.random.randint(jax.random.key(1), (8, 41), 0, 256)
    hidden = jax.random.normal(jax.random.key(2), (8, 40, model.config.hidden_size))
    assert vocab_parallel_head(model) is None  # outside a sharded trace: the plain LM head

    def f(params, hidden):
        m = nnx.merge(graphdef, params, rest)
        logp, ent = chunked_token_logprobs(m, hidden, ids[:, 1:], 0.9, chunk=16)
        return jnp.sum(logp) + 0.5 * jnp.sum(ent), (logp, ent)

    def sharded(params, hidden):
        with activation_sharding(mesh, LogicalRules()):
            assert vocab_parallel_head(nnx.merge(graphdef, params, rest)) is not None
            return f(params, hidden)

    (_, want), g_want = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, hidden)
    (_, got), g_got = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1), has_aux=True))(params, hidden)
    for a, w in zip(got, want, strict=True):
        np.testing.assert_allclose(a, w, atol=2e-6, rtol=2e-6)  # sums over the vocabulary in another order
    for a, w in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True):
        np.testing.assert_allclose(a, w, atol=2e-5, rtol=1e-5)


# ----- meshes for pods (issue 58, item 4): devices ordered by node, HSDP -----------------------------------------

def _installed(name: str) -> bool:
    """Whether module ``name`` can be imported (its missing parent package is no error)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


_GPU = _installed("jax_plugins.xla_cuda12")


def test_one_process_keeps_the_device_order():
    """8 simulated CPU devices in one process: the mesh is today's reshape of the devices in the order given."""
    from tlt_jax.distributed import MeshConfig, make_mesh

    for cfg in (MeshConfig(2, 2, 2), MeshConfig(1, 8, 1), MeshConfig(-1, 1, 1)):
        assert list(make_mesh(cfg).devices.flat) == jax.devices()
    shuffled = jax.devices()[::-1]
    assert list(make_mesh(MeshConfig(1, 4, 2), shuffled).devices.flat) == shuffled


def test_hybrid_layout_without_accelerators():
    """``hybrid_devices`` on stand-in devices of 4 nodes x 8 (no compiler needed): data 4 x fsdp 8 puts node i in row
    i; data 8 x fsdp 2 x tensor 2 gives each node two data rows; data 2 x fsdp 16 two whole nodes per FSDP group."""
    import collections

    from tlt_jax.distributed.mesh import _locality_units, hybrid_devices

    dev = collections.namedtuple("dev", "id process_index platform")
    devices = [dev(i, i // 8, "gpu") for i in range(32)][::-1]
    units = _locality_units(devices)
    assert [[d.id for d in u] for u in units] == [list(range(8 * p, 8 * p + 8)) for p in range(4)]
    node = np.vectorize(lambda d: d.process_index)
    assert node(hybrid_devices((4, 8, 1), units))[:, :, 0].tolist() == [[p] * 8 for p in range(4)]
    assert node(hybrid_devices((8, 2, 2), units)).reshape(8, 4).tolist() == [[p] * 4 for p in range(4) for _ in "ab"]
    assert node(hybrid_devices((2, 16, 1), units))[:, :, 0].tolist() == [[0] * 8 + [1] * 8, [2] * 8 + [3] * 8]
    ids = np.vectorize(lambda d: d.id)(hybrid_devices((1, 8, 4), units))
    assert ids.ravel().tolist() == list(range(32))  # process-major, as a reshape of the sorted devices
    with pytest.raises(ValueError, match="devices per process differ"):
        hybrid_devices((1, 6, 1), _locality_units([dev(i, int(i >= 4), "gpu") for i in range(6)]))


def _process_grid(mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.process_index)(mesh.devices)


@pytest.mark.skipif(not _GPU, reason="needs jax-cuda12-plugin (compile-only H100s)")
def test_hsdp_mesh_keeps_fsdp_and_tensor_inside_a_node():
    """32 compile-only H100s in 4 processes (nodes), given in any order: mesh data 4 x fsdp 8 has each FSDP row on
    one node; data 8 x fsdp 2 x tensor 2 keeps every FSDP x tensor group on one node and every engine (TP group)
    too; FSDP groups of whole nodes are allowed (fsdp 16: 2 nodes each); a tensor-parallel group across nodes, or an
    FSDP group holding part of a node, is refused with the reason."""
    from tlt_jax.distributed import MeshConfig, engine_meshes, make_mesh
    from tlt_jax.plan.targets import compile_only_devices

    devices = compile_only_devices("h100:4x8")
    rng = np.random.default_rng(0)
    shuffled = [devices[i] for i in rng.permutation(len(devices))]
    mesh = make_mesh(MeshConfig(4, 8, 1), shuffled)
    procs = _process_grid(mesh)
    assert all(len(set(row)) == 1 for row in procs[:, :, 0]) and sorted(procs[:, 0, 0]) == [0, 1, 2, 3]
    assert mesh.devices.tolist() == make_mesh(MeshConfig(4, 8, 1), devices).devices.tolist()
    mesh = make_mesh(MeshConfig(8, 2, 2), shuffled)
    procs = _process_grid(mesh)
    assert all(len(set(procs[d].ravel())) == 1 for d in range(8))
    assert all(len({d.process_index for d in e.devices.flat}) == 1 for e in engine_meshes(mesh, -1))
    procs = _process_grid(make_mesh(MeshConfig(2, 16, 1), shuffled))
    assert [sorted(set(row)) for row in procs[:, :, 0]] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="tensor-parallel group would span nodes"):
        make_mesh(MeshConfig(1, 2, 16), devices)
    with pytest.raises(ValueError, match="neither fits inside a 4-device process"):
        make_mesh(MeshConfig(2, 6, 1), compile_only_devices("h100:3x4"))


@pytest.mark.skipif(not _GPU, reason="needs jax-cuda12-plugin (compile-only H100s)")
def test_compiled_fsdp_matmul_gathers_inside_a_node():
    """XLA:GPU's program for an FSDP matmul (rows over data x fsdp, the weight's rows over fsdp) on the HSDP mesh
    data 4 x fsdp 8 of 4 nodes: every all-gather's replica groups hold the devices of one node."""
    from tlt_jax.distributed import MeshConfig, make_mesh
    from tlt_jax.plan.hlo import _GROUPS, parse_groups
    from tlt_jax.plan.targets import compile_only_devices

    devices = compile_only_devices("h100:4x8")
    mesh = make_mesh(MeshConfig(4, 8, 1), devices[::-1])
    x = jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P(("data", "fsdp"), None)))
    w = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
    text = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P(("data", "fsdp"), None))).lower(
        x, w).compile().as_text()
    flat = list(mesh.devices.flat)
    gathers = [line for line in text.splitlines() if " all-gather" in line and "replica_groups=" in line]
    assert gathers, text
    for line in gathers:
        groups = parse_groups(_GROUPS.search(line).group(1), mesh.size)
        assert groups is not None and all(len({flat[i].process_index for i in g}) == 1 for g in groups), line
        assert all(len(g) == 8 for g in groups), line
