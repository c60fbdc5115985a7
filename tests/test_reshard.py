"""Rollout engines on tensor-parallel groups: the reshard program (trainer layout -> every engine's layout, exact and
without copies), and engine programs whose only collectives are their TP group's (none with tensor 1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.controller.slices import SlicedRollout
from tlt_jax.distributed import LogicalRules, MeshConfig, decode_rules, engine_meshes, make_mesh, shard_module
from tlt_jax.models import CausalLM, rollout_copy, tiny_config
from tlt_jax.plan.hlo import collective_stats
from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig
from tlt_jax.rollout.reshard import Resharder

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
PROMPTS = [[5, 9, 17, 33], [2, 200, 7], [40, 41, 42], [100, 3], [7, 7, 8], [1, 2, 3, 4, 5], [60, 61], [9, 8, 7]]
GREEDY = SamplingParams(temperature=0.0, n=2, max_new_tokens=[9, 21, 5, 13, 17, 3, 11, 25], ignore_eos=True)


@pytest.fixture(scope="module")
def trained():
    """A tiny policy in the trainer's layout: FSDP over data x fsdp = 2 x 2, heads over tensor 2."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    return mesh, shard_module(CausalLM(tiny_config(num_heads=8, num_kv_heads=4), rngs=nnx.Rngs(3)), mesh)


def test_engine_meshes_are_whole_tp_groups(trained):
    mesh, _ = trained
    groups = engine_meshes(mesh, -1)
    assert len(groups) == 4 and all(m.devices.shape == (1, 1, 2) for m in groups)
    tp = {tuple(d.id for d in row) for row in mesh.devices.reshape(-1, 2)}
    assert {tuple(d.id for d in m.devices.flat) for m in groups} == tp
    assert [m.devices.shape for m in engine_meshes(mesh, 2)] == [(2, 1, 2)] * 2
    with pytest.raises(ValueError, match="do not split the mesh's 4 tensor-parallel groups"):
        engine_meshes(mesh, 3)


@pytest.mark.parametrize("layout", [{}, {"dtype": jnp.bfloat16, "layers": "unstacked"}], ids=["f32", "bf16_unstacked"])
def test_reshard_round_trip_is_exact(trained, layout):
    """Every engine's copy equals rollout_copy(policy) bit for bit, placed exactly as the engine places it; each
    device holds only its engine's tensor-parallel share."""
    mesh, policy = trained
    meshes = engine_meshes(mesh, -1)
    resharder = Resharder(meshes, layout)
    copies = resharder(policy)
    assert sorted(copies) == [0, 1, 2, 3]
    want = rollout_copy(policy, **layout)
    for e, copy in copies.items():
        ref = nnx.state(shard_module(want, meshes[e], decode_rules(LogicalRules())))
        got = nnx.state(copy)
        assert jax.tree.structure(got) == jax.tree.structure(ref)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            assert a.sharding == b.sharding and a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(nnx.state(copies[0])))
    assert resharder.last_bytes == per_device
    # The engines' arrays are the program's own buffers: assembling them copied nothing.
    program, state = resharder.program_for(policy)
    assert resharder.program_for(policy)[0] is program  # compiled once for the policy's structure and shardings


def test_engine_steps_have_no_collective_outside_their_tp_group():
    """Prefill, decode, compaction and verify on engines of one TP group (two engines each, so as few compiles as
    show it): with tensor 1 no collective at all, with tensor 2 only the group's own; one engine batch-sharded over 2
    devices (the old layout) does move rows across devices when it compacts (the negative control)."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2), jax.devices()[:4])
    fresh = CausalLM(tiny_config(num_heads=8, num_kv_heads=4), rngs=nnx.Rngs(3))  # the fixture's policy
    policy = shard_module(fresh, mesh)
    spec = SpecConfig(depth=3, topk=1, verify_tokens=4, threshold=2)

    def collectives(engine):
        out = {}
        for key, exe in engine.pool._compiled.items():
            out[key.phase] = out.get(key.phase, 0) + collective_stats(exe.as_text()).ops
            devices = {d.id for sh in jax.tree.leaves(exe.input_shardings) for d in sh.device_set}
            assert devices == {d.id for d in engine.mesh.devices.flat}, key
        return out

    kw = dict(drafter="ngram", spec=spec, max_batch=8, max_len=64, length_buckets=(64,), compiler_options=FAST)
    tp1 = make_mesh(MeshConfig(data=-1), jax.devices()[:2])
    one = SlicedRollout(shard_module(fresh, tp1), tp1, -1, **kw)
    res = one.generate(PROMPTS, GREEDY)
    assert res.stats["verify_steps"] > 0
    counts = [collectives(e) for e in one.engines.values()]
    assert all(set(c) >= {"prefill", "decode", "compact"} for c in counts) and any("verify" in c for c in counts)
    assert all(n == 0 for c in counts for n in c.values()), counts
    tp2 = SlicedRollout(policy, mesh, -1, **kw)
    assert len(one.engines) == len(tp2.engines) == 2 and tp2.generate(PROMPTS, GREEDY).tokens == res.tokens
    for e in tp2.engines.values():
        for key, exe in e.pool._compiled.items():
            for groups in _replica_groups(exe.as_text()):
                assert groups in ([[0, 1]], []), (key, groups)  # the engine's own two devices
    old = RolloutEngine(policy, make_mesh(MeshConfig(data=2), jax.devices()[:2]), **kw)
    assert old.generate(PROMPTS, GREEDY).tokens == res.tokens
    assert collectives(old).get("compact", 0) > 0
    one.close(), tp2.close(), old.close()


def _replica_groups(text: str) -> list:
    """The replica groups of every collective in an HLO text ([[0, 1]] form; [] for an op over all devices)."""
    import re

    out = []
    for line in text.splitlines():
        if not re.search(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(", line):
            continue
        m = re.search(r"replica_groups=\{(\{[^=]*?\})\}", line)
        if m is None:
            m2 = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[(\d+)\]", line)  # iota form: [groups, size]<=[n]
            if m2:
                g, n = int(m2.group(1)), int(m2.group(2))
                out.append([list(range(i * n, (i + 1) * n)) for i in range(g)])
            else:
                out.append([])
            continue
        out.append([[int(x) for x in grp.split(",") if x] for grp in re.findall(r"\{([\d,]*)\}", m.group(1))])
    return out
