"""The rollout's decode layout (issue 42): the engine holds the policy split over mesh.tensor only (replicated over the
data axes), so its compiled decode and verify steps all-gather no weight, on 8 simulated devices."""

import re

import jax
import numpy as np
from flax import nnx

from tlt_jax.distributed import LogicalRules, MeshConfig, decode_rules, make_mesh, max_device_bytes, shard_module
from tlt_jax.models import CausalLM, rollout_copy, tiny_config
from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig

FAST = {"xla_backend_optimization_level": 0}
ALL_GATHER = re.compile(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather(?:-start)?\(")


def test_decode_rules_drop_the_data_axes_from_parameters_only():
    rules = decode_rules(LogicalRules())
    assert rules.lookup("batch") == ("data", "fsdp")  # the decode batch stays split over the data axes
    assert rules.lookup("embed") == () and rules.lookup("vocab") == ("tensor",) and rules.lookup("mlp") == ("tensor",)
    assert LogicalRules().lookup("vocab_in") == ("tensor",) and rules.lookup("vocab_in") == ()  # whole on an engine
    custom = decode_rules(LogicalRules.from_mapping({**dict(LogicalRules().rules), "mlp": ["fsdp", "tensor"]}))
    assert custom.lookup("mlp") == ("tensor",)


def _weight_shapes(model) -> set[tuple[int, ...]]:
    """Every parameter's shape, and its per-layer shape (without the stacked 'layers' axis)."""
    shapes = set()
    for x in jax.tree.leaves(nnx.state(model, nnx.Param)):
        shapes |= {tuple(x.shape), tuple(x.shape[1:])}
    return {s for s in shapes if len(s) >= 2}


def _gathered_weights(engine, weights) -> dict[str, list]:
    out = {}
    for key in engine.pool.keys():
        if key.phase in ("decode", "verify"):
            text = engine.pool.compile(key).as_text()
            shapes = [tuple(int(d) for d in m.split(",") if d) for m in ALL_GATHER.findall(text)]
            out[key.phase] = [s for s in shapes if s in weights]
    return out


def _run(model, mesh, param_rules_fn=None):
    kw = dict(max_batch=8, max_len=32, length_buckets=(32,), batch_buckets=(8,), compiler_options=FAST)
    engines = [RolloutEngine(model, mesh, **kw),
               RolloutEngine(model, mesh, drafter="ngram", spec=SpecConfig(depth=2, topk=1, verify_tokens=3,
                                                                             threshold=8), **kw)]
    params = SamplingParams(temperature=0.0, n=2, max_new_tokens=6, ignore_eos=True)
    results = []
    for e in engines:
        if param_rules_fn is not None:  # a copy laid out by other rules, published as it is (no reshard)
            e.param_rules = param_rules_fn(e.rules)
            e.set_rollout_copy(shard_module(rollout_copy(model, **e.rollout_layout), mesh, e.param_rules))
        results.append(e.generate([[1, 2, 3, 4]] * 4, params))
    return engines, results


def test_decode_and_verify_steps_gather_no_weight_on_8_devices():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    model = CausalLM(tiny_config(), rngs=nnx.Rngs(0))
    masters = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    weights = _weight_shapes(model)
    (plain, spec), (got_plain, got_spec) = _run(model, mesh)
    gathered = {**_gathered_weights(plain, weights), **_gathered_weights(spec, weights)}
    assert set(gathered) == {"decode", "verify"} and gathered == {"decode": [], "verify": []}
    assert got_spec.tokens == got_plain.tokens
    # The old layout (the training rules: weights split over fsdp) gathers weights in the same steps: the check bites.
    (old, old_spec), (want, _) = _run(model, mesh, param_rules_fn=lambda rules: rules)
    assert _gathered_weights(old, weights)["decode"] and want.tokens == got_plain.tokens
    # The reshard leaves the trained (master) weights bit-identical and the decode copy equal to them.
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(model, nnx.Param)), masters)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, plain.params), masters)
    # Per device the decode copy is the whole model split in two (tensor = 2), more than the training layout's.
    total = sum(x.nbytes for x in jax.tree.leaves(masters))
    assert total // 2 <= max_device_bytes(plain.params) < total
    assert max_device_bytes(old.params) < max_device_bytes(plain.params)


def _gathered_caches(engine, head_dim: int, lengths: tuple[int, ...]) -> list:
    shapes = []
    for key in engine.pool.keys():
        if key.phase == "decode":
            for m in ALL_GATHER.findall(engine.pool.compile(key).as_text()):
                s = tuple(int(d) for d in m.split(",") if d)
                if len(s) == 4 and s[-1] == head_dim and s[1] in lengths:  # [B, S or attend_len, KV, D]
                    shapes.append(s)
    return shapes


def test_pallas_kernel_runs_under_shard_map_gathering_no_cache(monkeypatch):
    """With attention_impl="pallas" on a 2 x 2 x 2 mesh the kernel runs per device on its rows and heads
    (``kernel_attention``): the decode step gathers no KV cache, and decodes the XLA engine's tokens. Called
    without the shard_map (no activation context), the same step all-gathers the cache into the kernel."""
    import tlt_jax.models.layers as layers

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    cfg = tiny_config()
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    kw = dict(max_batch=8, max_len=32, length_buckets=(16, 32), batch_buckets=(8,), compiler_options=FAST)
    params = SamplingParams(temperature=0.0, n=2, max_new_tokens=14, ignore_eos=True)
    xla = RolloutEngine(model, mesh, **kw).generate([[1, 2, 3, 4]] * 4, params)
    kernel = RolloutEngine(model, mesh, attention_impl="pallas", **kw)
    assert kernel.generate([[1, 2, 3, 4]] * 4, params).tokens == xla.tokens
    assert _gathered_caches(kernel, cfg.head_dim, (16, 32)) == []
    monkeypatch.setattr(layers, "activation_context", lambda: None)
    unsharded = RolloutEngine(model, mesh, attention_impl="pallas", **kw)
    assert unsharded.generate([[1, 2, 3, 4]] * 4, params).tokens == xla.tokens
    assert _gathered_caches(unsharded, cfg.head_dim, (16, 32))


COLLECTIVE = re.compile(r"= \(?(\w+\[[\d,]*\])[^=]*? "
                        r"(?:all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def _vocab_collectives(engine, vocab_shard: int) -> list[str]:
    """The decode steps' collectives whose result holds a vocabulary-sized dimension (the logits moved)."""
    out = []
    for key in engine.pool.keys():
        if key.phase == "decode":
            for shape in COLLECTIVE.findall(engine.pool.compile(key).as_text()):
                if any(int(d) >= vocab_shard for d in shape[shape.index("[") + 1:-1].split(",") if d):
                    out.append(shape)
    return out


def test_tensor_parallel_sampling_keeps_the_vocabulary_split():
    """On a tensor-parallel engine the LM head's logits are split by vocabulary. An engine compiled without top-k /
    top-p (``sampling_filters=False``, the RL engines') samples them where they lie: its decode step moves no
    vocabulary-sized array (per row only a few scalars beside the layers' all-reduces), and it samples the same
    tokens as an engine with the filters compiled in, whose sort moves the logits (the negative control); it refuses
    SamplingParams that filter."""
    import pytest

    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=2), jax.devices()[:2])
    cfg = tiny_config(vocab_size=512)
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    kw = dict(max_batch=8, max_len=32, length_buckets=(32,), batch_buckets=(8,), compiler_options=FAST)
    params = SamplingParams(temperature=0.9, n=2, max_new_tokens=6, seed=3, ignore_eos=True)
    lean, full = RolloutEngine(model, mesh, sampling_filters=False, **kw), RolloutEngine(model, mesh, **kw)
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]]
    assert lean.generate(prompts, params).tokens == full.generate(prompts, params).tokens
    assert _vocab_collectives(lean, cfg.vocab_size // 2) == []
    assert _vocab_collectives(full, cfg.vocab_size // 2)
    with pytest.raises(ValueError, match="sampling_filters=False"):
        lean.generate(prompts, SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=2))


def test_vocab_top_k_merges_each_devices_top_k_into_the_global_one():
    """``vocab_top_k`` (the drafter's children, vocabulary split over tensor) equals ``jax.lax.top_k`` in values and
    indices, ties to the lower index included, inside a sharded step and outside one; in the step it moves no
    vocabulary-sized array."""
    from jax.sharding import NamedSharding, PartitionSpec

    from tlt_jax.distributed import with_activations
    from tlt_jax.sampling import vocab_top_k

    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=2), jax.devices()[:2])
    rng = np.random.default_rng(0)
    x = rng.integers(0, 6, size=(4, 3, 512)).astype(np.float32)  # many ties, across the two halves too
    placed = jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, None, "tensor")))
    fn = jax.jit(with_activations(lambda a: vocab_top_k(a, 5), mesh, LogicalRules()))
    want = jax.lax.top_k(x, 5)
    for got in (fn(placed), vocab_top_k(x, 5)):
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    text = fn.lower(placed).compile().as_text()
    assert not [s for s in COLLECTIVE.findall(text) if "512" in s or "256" in s], COLLECTIVE.findall(text)


def _hidden_all_reduces(engine, hidden: int) -> list[str]:
    """The decode steps' all-reduces of hidden-state rows ([..., hidden]): a tensor-parallel layer's two, and the
    input embedding's lookup when that is split by vocabulary."""
    out = []
    for key in engine.pool.keys():
        if key.phase == "decode":
            for line in engine.pool.compile(key).as_text().splitlines():
                if re.search(r" all-reduce(?:-start)?\(", line):
                    out += [s for s in COLLECTIVE.findall(line) if s.endswith(f",{hidden}]")]
    return out


def test_untied_input_embedding_is_whole_on_an_engine_so_a_token_step_all_reduces_only_in_the_layers():
    """An untied model's input embedding ("vocab_in") is whole on each device of a tensor-parallel engine
    (decode_rules): a decode step's all-reduces of hidden states are the layers' (attention output, MLP down).
    Split by vocabulary (the training rules' layout, published as it is) the lookup adds one more; tokens equal."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=2), jax.devices()[:2])
    cfg = tiny_config(vocab_size=512)
    assert not cfg.tie_word_embeddings
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    kw = dict(max_batch=8, max_len=32, length_buckets=(32,), batch_buckets=(8,), sampling_filters=False,
              compiler_options=FAST)
    params = SamplingParams(temperature=0.9, n=2, max_new_tokens=6, seed=3, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]]
    whole, split = RolloutEngine(model, mesh, **kw), RolloutEngine(model, mesh, **kw)
    split.param_rules = LogicalRules()  # without decode_rules: vocab_in split over tensor (and nothing over fsdp = 1)
    split.set_rollout_copy(shard_module(rollout_copy(model, **split.rollout_layout), mesh, split.param_rules))
    assert whole.generate(prompts, params).tokens == split.generate(prompts, params).tokens
    embed = whole.params["embed_tokens"]
    assert embed.sharding.shard_shape(embed.shape) == embed.shape  # whole on each device
    layers, extra = _hidden_all_reduces(whole, cfg.hidden_size), _hidden_all_reduces(split, cfg.hidden_size)
    assert layers and len(extra) == len(layers) + 1, (layers, extra)
