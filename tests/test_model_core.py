"""Core model numerics: KV-cache decode equals the full forward; masks; sharded forward equals single device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.distributed import LogicalRules, MeshConfig, init_sharded, make_mesh, shard_module
from tlt_jax.models import CausalLM, KVCache, tiny_config


@pytest.fixture(scope="module")
def model():
    return CausalLM(tiny_config(attention_bias=True, num_heads=8, num_kv_heads=4), rngs=nnx.Rngs(0))


def test_kv_cache_decode_matches_full_forward_with_ragged_lengths(model):
    cfg = model.config
    ids = jax.random.randint(jax.random.key(1), (3, 12), 0, cfg.vocab_size)
    full = model(ids).logits
    prompt_lens = jnp.array([3, 5, 8])
    # Right-padded prefill: each row commits only its own prompt.
    pad = jnp.arange(8)[None, :] < prompt_lens[:, None]
    cache = KVCache.zeros(cfg, 3, 24)
    out = model(ids[:, :8], attention_mask=pad, cache=cache)
    cache = cache.append(out.k_new, out.v_new, prompt_lens)
    for _ in range(4):
        pos = cache.lengths
        tok = jnp.take_along_axis(ids, pos[:, None], axis=1)
        step = model(tok, cache=cache)
        ref = full[jnp.arange(3), pos]
        np.testing.assert_allclose(step.logits[:, 0], ref, atol=1e-5, rtol=0)
        cache = cache.append(step.k_new, step.v_new)
    np.testing.assert_array_equal(cache.lengths, prompt_lens + 4)


def test_attend_len_reads_only_the_cache_prefix(model):
    """attend_len=n (sliced per layer inside the scan) gives the logits of a cache cut to n positions, and those of
    the full cache when every row's length is <= n; positions >= n are never read (garbage there changes nothing)."""
    cfg = model.config
    ids = jax.random.randint(jax.random.key(5), (3, 8), 0, cfg.vocab_size)
    lens = jnp.array([3, 6, 8])
    cache = KVCache.zeros(cfg, 3, 32)
    out = model(ids, attention_mask=jnp.arange(8)[None, :] < lens[:, None], cache=cache)
    cache = cache.append(out.k_new, out.v_new, lens)
    tok = ids[:, :1]
    full = model(tok, cache=cache)
    junk = KVCache(cache.k.at[:, :, 16:].set(1e3), cache.v.at[:, :, 16:].set(-1e3), cache.lengths)
    cut = model(tok, cache=cache.view(16))
    part = model(tok, cache=junk, attend_len=16)
    np.testing.assert_array_equal(part.logits, cut.logits)
    np.testing.assert_allclose(part.logits, full.logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(part.k_new, full.k_new, atol=1e-6, rtol=0)  # sums over 16 vs 32 positions: rounding
    long = KVCache(junk.k, junk.v, jnp.full((3,), 20))  # rows "see" 20 positions: attend_len=16 hides the junk
    seen = model(tok, cache=long, attend_len=16).logits
    np.testing.assert_array_equal(seen, model(tok, cache=KVCache(cache.k, cache.v, long.lengths).view(16)).logits)
    assert not np.allclose(seen, model(tok, cache=long).logits, atol=1e-2)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((4, 4), bool)), (3, 4, 4))
    tree = model(ids[:, :4], cache=junk, attend_len=16, tree_mask=causal)
    np.testing.assert_allclose(tree.logits, model(ids[:, :4], cache=cache).logits, atol=1e-5, rtol=0)


def test_packed_segments_equal_separate_sequences(model):
    cfg = model.config
    a = jax.random.randint(jax.random.key(2), (1, 5), 0, cfg.vocab_size)
    b = jax.random.randint(jax.random.key(3), (1, 7), 0, cfg.vocab_size)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.array([[0] * 5 + [1] * 7])
    pos = jnp.array([list(range(5)) + list(range(7))])
    out = model(packed, segment_ids=seg, positions=pos).logits
    np.testing.assert_allclose(out[:, :5], model(a).logits, atol=1e-5)
    np.testing.assert_allclose(out[:, 5:], model(b).logits, atol=1e-5)


def test_logits_indices_select_positions(model):
    ids = jax.random.randint(jax.random.key(4), (2, 6), 0, model.config.vocab_size)
    full = model(ids).logits
    idx = jnp.array([[5], [2]])
    part = model(ids, logits_indices=idx).logits
    np.testing.assert_allclose(part[:, 0], full[jnp.arange(2), idx[:, 0]], atol=1e-6)


def test_stacked_params_carry_logical_axes(model):
    state = nnx.state(model)
    axes = state["layers"]["self_attn"]["q_proj"].get_metadata()["logical_axes"]
    assert axes == ("layers", "embed", "q_heads", "head_dim")
    assert state["layers"]["self_attn"]["q_proj"][...].shape[0] == model.config.num_layers


def test_sharded_forward_equals_single_device(model):
    assert jax.device_count() == 8
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    ids = jax.random.randint(jax.random.key(5), (4, 9), 0, model.config.vocab_size)
    ref = model(ids).logits
    sharded = shard_module(model, mesh)
    q = nnx.state(sharded)["layers"]["self_attn"]["q_proj"][...]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    graphdef, state = nnx.split(sharded)
    out = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x).logits)(state, ids)
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_init_sharded_creates_params_in_place():
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    cfg = tiny_config(num_heads=8, num_kv_heads=4)
    m = init_sharded(lambda: CausalLM(cfg, rngs=nnx.Rngs(7)), mesh)
    emb = nnx.state(m)["embed_tokens"][...]
    assert emb.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    # Each device holds only its shard.
    assert emb.addressable_shards[0].data.shape == (cfg.vocab_size // 4, cfg.hidden_size // 2)
    plain = CausalLM(cfg, rngs=nnx.Rngs(7))
    np.testing.assert_allclose(np.asarray(emb), np.asarray(plain.embed_tokens[...]), atol=1e-7)


def test_rules_reject_two_logical_axes_on_one_mesh_axis():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    rules = LogicalRules.from_mapping({"embed": "tensor", "mlp": "tensor"})
    with pytest.raises(ValueError, match="both map to mesh axis 'tensor'"):
        rules.spec(("embed", "mlp"), mesh)
    with pytest.raises(KeyError, match="no sharding rule"):
        rules.spec(("nonexistent",), mesh)
    with pytest.raises(ValueError, match="more than once"):
        LogicalRules((("embed", "fsdp"), ("embed", "tensor")))
    with pytest.raises(ValueError, match="mesh has no axis"):
        LogicalRules.from_mapping({"embed": "model"}).validate(mesh)


def test_mesh_config_errors_and_slices():
    from tlt_jax.distributed import engine_meshes

    with pytest.raises(ValueError, match="needs 6 devices"):
        make_mesh(MeshConfig(data=3, fsdp=2, tensor=1))
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
    slices = engine_meshes(mesh, 2)
    assert [s.devices.size for s in slices] == [4, 4]
    assert set(slices[0].devices.flat).isdisjoint(set(slices[1].devices.flat))
