"""EAGLE drafter: shared frozen embedding/head, packed training without cross-sample attention, loss decrease,
sharded step == single-device step, save/load and EAGLE-layout export round trips, warm-up end to end."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from tlt_jax.distributed import MeshConfig, make_mesh
from tlt_jax.drafter import EagleDrafter, num_trainable_params
from tlt_jax.drafter.evaluate import chain_acceptance
from tlt_jax.drafter.export import export_eagle, import_eagle, load_drafter, save_drafter
from tlt_jax.drafter.train import (
    DrafterBatch,
    DrafterLossConfig,
    DrafterOptimConfig,
    drafter_loss,
    init_drafter_train_state,
    make_drafter_optimizer,
    make_drafter_train_step,
    pack_sequences,
    train_drafter,
)
from tlt_jax.drafter.warmup import generate_samples, policy_hidden_states, run_warmup
from tlt_jax.models import CausalLM, tiny_config
from tlt_jax.rollout import HiddenCapture, RolloutEngine, SamplingParams, SpecConfig

CFG = tiny_config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=())
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _engine(policy, drafter=None, spec=None, batch=4, **kw):
    """An engine for the warm-up tests' short sequences (prompts < 9 tokens + 24 new fit one 64-slot bucket)."""
    return RolloutEngine(policy, drafter=drafter, spec=spec, max_batch=batch, max_len=64, length_buckets=(64,),
                         batch_buckets=(batch,), compiler_options=FAST, **kw)


@pytest.fixture(scope="module")
def policy():
    return CausalLM(CFG, rngs=nnx.Rngs(0))


def _samples(policy, n=5, seed=0):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 64, size=int(rng.integers(6, 14))).tolist() for _ in range(n)]
    hidden = policy_hidden_states(policy, seqs, batch_size=8)
    return [(np.asarray(s), h, int(rng.integers(2, len(s) - 1))) for s, h in zip(seqs, hidden, strict=True)]


def test_drafter_owns_no_embedding_or_head():
    cfg = tiny_config(vocab_size=100, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2)
    drafter = EagleDrafter(cfg, rngs=nnx.Rngs(1))
    shapes = [x.shape for x in jax.tree.leaves(nnx.state(drafter, nnx.Param))]
    assert all(cfg.vocab_size not in s for s in shapes)
    h, f = cfg.hidden_size, cfg.intermediate_size
    attn = h * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    assert num_trainable_params(drafter) == 2 * h * h + h + attn + 3 * h * f + h  # fc(+bias), layer, post norm
    assert drafter.layer.input_layernorm is None


def test_packing_layout_and_no_cross_sample_attention(policy):
    drafter = EagleDrafter(CFG, rngs=nnx.Rngs(1))
    samples = _samples(policy)
    batch = pack_sequences(samples, row_len=32)
    ids0, h0, start0 = samples[0]
    n0 = len(ids0) - 1
    np.testing.assert_array_equal(batch.next_tokens[0, :n0], ids0[1:])
    np.testing.assert_allclose(batch.features[0, :n0], h0[:-1])
    np.testing.assert_allclose(batch.targets[0, :n0], h0[1:])
    np.testing.assert_array_equal(batch.positions[0, :n0], np.arange(n0))
    np.testing.assert_array_equal(batch.loss_mask[0, :n0], np.arange(1, n0 + 1) >= start0)
    assert batch.segment_ids.max() >= 2  # several samples share a row
    assert batch.loss_mask[batch.segment_ids == 0].sum() == 0
    packed = drafter(policy, jnp.asarray(batch.next_tokens), jnp.asarray(batch.features),
                     positions=jnp.asarray(batch.positions), segment_ids=jnp.asarray(batch.segment_ids))
    checked = 0
    for r in range(batch.segment_ids.shape[0]):
        for seg in range(1, batch.segment_ids[r].max() + 1):
            cols = np.flatnonzero(batch.segment_ids[r] == seg)
            alone = drafter(policy, jnp.asarray(batch.next_tokens[r:r + 1, cols]),
                            jnp.asarray(batch.features[r:r + 1, cols]))
            np.testing.assert_allclose(packed[r, cols], alone[0], atol=1e-5)
            checked += 1
    assert checked == len(samples)
    # Cropping: a sample longer than a row keeps a window starting just before its response.
    long = [(np.arange(40) % 64, np.zeros((40, CFG.hidden_size), np.float32), 30)]
    b = pack_sequences(long, row_len=16)
    np.testing.assert_array_equal(b.positions[0], np.arange(23, 39))
    assert b.loss_mask[0].sum() == 10


def test_loss_decreases_on_fixed_batch(policy):
    drafter = EagleDrafter(CFG, rngs=nnx.Rngs(2))
    batch = pack_sequences(_samples(policy, 8), row_len=32)
    _, hist = train_drafter(drafter, policy, [batch], 60, optim=DrafterOptimConfig(learning_rate=3e-3))
    assert hist[-1]["value_loss"] < 0.3 * hist[0]["value_loss"]  # the CE part has the policy's entropy as floor
    assert hist[-1]["loss"] < hist[0]["loss"] - 0.3
    assert hist[-1]["top1"] > hist[0]["top1"]
    # The loss pieces are what they say: SmoothL1 on features and soft CE against the policy's distribution.
    loss, m = drafter_loss(drafter, policy, jax.tree.map(jnp.asarray, batch), DrafterLossConfig())
    assert abs(float(loss) - (float(m.value_loss) + 0.1 * float(m.prob_loss))) < 1e-5


def test_frozen_policy_gets_no_gradient(policy):
    drafter = EagleDrafter(CFG, rngs=nnx.Rngs(2))
    batch = jax.tree.map(jnp.asarray, pack_sequences(_samples(policy, 3), row_len=32))
    g = jax.grad(lambda pol: drafter_loss(drafter, pol, batch)[0])(policy)
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(nnx.state(g, nnx.Param)))


def test_sharded_train_step_equals_single_device(policy):
    batch = pack_sequences(_samples(policy, 12, seed=3), row_len=16, num_rows=8)
    opt = make_drafter_optimizer(DrafterOptimConfig(learning_rate=1e-3))
    key = jax.random.key(0)
    results = []
    for mesh in (None, make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))):
        drafter = EagleDrafter(CFG, rngs=nnx.Rngs(4))
        graphdef, state = init_drafter_train_state(drafter, opt, mesh)
        step = make_drafter_train_step(graphdef, opt, mesh=mesh)
        b = jax.tree.map(jnp.asarray, batch)
        pol = policy
        if mesh is not None:
            from tlt_jax.distributed import shard_module
            from tlt_jax.drafter.train import batch_sharding

            b = jax.device_put(b, batch_sharding(mesh))
            pol = shard_module(policy, mesh)
        for i in range(2):
            state, m = step(state, pol, b, jax.random.fold_in(key, i))
        results.append((float(m.loss), jax.device_get(state.params)))
        if mesh is not None:
            q = state.params["layer"]["self_attn"]["q_proj"][...]
            assert len(q.sharding.device_set) == 8
    assert abs(results[0][0] - results[1][0]) < 1e-5
    for a, c in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1]), strict=True):
        np.testing.assert_allclose(a, c, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_save_load_and_eagle_export_round_trip(tmp_path, bias):
    cfg = tiny_config(vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2,
                      attention_bias=bias, architecture="qwen2" if bias else "llama", eos_token_ids=(1, 2))
    drafter = EagleDrafter(cfg, rngs=nnx.Rngs(5))
    drafter.fc_bias[...] = jax.random.normal(jax.random.key(1), drafter.fc_bias.shape)
    ref = nnx.state(drafter, nnx.Param)
    save_drafter(drafter, tmp_path / "ours")
    export_eagle(drafter, tmp_path / "eagle")
    for loaded in (load_drafter(tmp_path / "ours"), import_eagle(tmp_path / "eagle")):
        assert loaded.config == cfg
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(nnx.state(loaded, nnx.Param)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLMEagle" if bias else "LlamaForCausalLMEagle"]
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == 32
    t = load_file(str(tmp_path / "eagle" / "model.safetensors"))
    h, d = 32, cfg.head_dim
    assert t["fc.weight"].shape == (h, 2 * h) and t["fc.bias"].shape == (h,)
    np.testing.assert_array_equal(t["fc.weight"], np.asarray(drafter.fc_kernel[...]).T)  # [out, in]
    assert t["layers.0.self_attn.q_proj.weight"].shape == (4 * d, h)
    assert t["layers.0.self_attn.k_proj.weight"].shape == (2 * d, h)
    assert t["layers.0.self_attn.o_proj.weight"].shape == (h, 4 * d)
    assert t["layers.0.mlp.down_proj.weight"].shape == (h, 48)
    assert "layers.0.post_attention_layernorm.weight" in t and not any("input_layernorm" in k for k in t)
    assert ("layers.0.self_attn.q_proj.bias" in t) == bias
    # The [out, in] q_proj matches the HF convention: y = x @ W.T with heads contiguous in the output.
    x = np.random.default_rng(0).normal(size=(3, h)).astype(np.float32)
    ours = np.einsum("te,ehd->thd", x, np.asarray(drafter.layer.self_attn.q_proj[...])).reshape(3, -1)
    np.testing.assert_allclose(x @ t["layers.0.self_attn.q_proj.weight"].T, ours, atol=1e-5)


@pytest.fixture(scope="module")
def warm(policy):
    """A drafter warmed up on the tiny policy's own greedy outputs: (prompts, drafter, loss history, samples)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 64, size=int(rng.integers(4, 9))).tolist() for _ in range(16)]
    drafter, hist, samples = run_warmup(policy, prompts, max_new_tokens=24, steps=150, batch_size=8, row_len=64,
                                        rows_per_batch=4, temperature=0.0, stop_tokens=(),
                                        optim=DrafterOptimConfig(learning_rate=3e-3), log=lambda *_: None)
    return prompts, drafter, hist, samples


def test_warmup_trains_a_drafter_that_gets_accepted(tmp_path, policy, warm):
    """Train on the policy's own greedy outputs; the trained drafter's greedy acceptance beats a random one's and
    speculative output still equals plain output. Publishing the trained weights back (``set_drafter_params``)
    restores the trained drafter's acceptance."""
    prompts, drafter, hist, samples = warm
    assert len(samples) == 16 and hist[-1]["loss"] < hist[0]["loss"]
    save_drafter(drafter, tmp_path)
    drafter = load_drafter(tmp_path)
    engine = _engine(policy, drafter, SpecConfig(depth=3, topk=2, verify_tokens=6, threshold=4))
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    trained = engine.generate(prompts[:4], params)
    engine.set_drafter(EagleDrafter(CFG, rngs=nnx.Rngs(9)))
    random = engine.generate(prompts[:4], params)
    assert [r[0] for r in trained.tokens] == [r[0] for r in random.tokens] == [r for _, r in samples[:4]]
    acc = [res.stats["mean_accept_length"] for res in (trained, random)]
    assert acc[0] > acc[1] + 0.5, acc
    engine.set_drafter_params(nnx.state(drafter, nnx.Param))  # the trained weights back, as a publish does
    again = engine.generate(prompts[:4], params)
    assert again.tokens == trained.tokens and again.stats["mean_accept_length"] == acc[0]
    with pytest.raises(ValueError, match="do not fit"):
        engine.set_drafter_params(nnx.state(policy, nnx.Param))


def test_chain_profile_predicts_every_verify_of_greedy_chain_decoding(policy, warm):
    """The offline profile is exact: walking a sequence by its per-position match counts reproduces the accept
    length of every verify step of real greedy chain speculative decoding (the last step may accept more than the
    budget leaves, which the profile cannot see), for chain depths 2 and 4 from one depth-4 profile."""
    prompts, drafter, _, samples = warm
    seqs = [p + r for p, r in samples[:4]]
    prof = chain_acceptance(policy, drafter, seqs, [len(p) for p, _ in samples[:4]], depth=4, rows=8)
    assert prof.positions == sum(len(r) - 1 for _, r in samples[:4])
    assert 0 < prof.accepted.mean() < 4 and prof.expected_accept(2) <= prof.expected_accept(4)
    offsets = np.cumsum([0] + [len(r) - 1 for _, r in samples[:4]])
    for depth in (2, 4):
        spec = SpecConfig(depth=depth, topk=1, verify_tokens=depth + 1, threshold=1, steps_per_call=1)
        engine = _engine(policy, drafter, spec, batch=1)
        for i, (p, r) in enumerate(samples[:4]):
            res = engine.generate([p], SamplingParams(temperature=0.0, max_new_tokens=len(r), ignore_eos=True))
            assert res.tokens == [[r]]
            real = [c["accepted"] for c in res.stats["chunks"]]  # one row, one verify step per chunk
            assert set(res.stats["arms"]) == {engine.spec_arm} and len(real) == res.stats["verify_steps"]
            acc, pos, walk = prof.accepted[offsets[i]: offsets[i + 1]], 0, []
            while pos < len(r) - 1:  # root = response token pos (the first comes from the prefill)
                a = min(int(acc[pos]), depth)
                walk.append(a)
                pos += a + 1
            assert walk[:-1] == real[:-1] and walk[-1] <= real[-1], (walk, real)
        assert prof.expected_accept(depth) > 1.0
    conditional = prof.conditional()
    assert len(conditional) == 4 and all(0.0 <= c <= 1.0 for c in conditional if c == c)
    with pytest.raises(ValueError, match="depth"):
        prof.expected_accept(5)


def test_generated_samples_are_the_engines_with_the_features_decoding_saw(policy):
    """The warm-up's samples are the RolloutEngine's generations (greedy and sampled, stop tokens honoured), and their
    features (one forward over prompt + response) are the hidden states the decode steps produced."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 64, size=int(rng.integers(4, 9))).tolist() for _ in range(6)]
    kw = dict(max_new_tokens=12, batch_size=4, temperatures=(0.0, 0.9), seed=1, stop_tokens=(5,), log=lambda *_: None)
    got = generate_samples(policy, prompts, **kw)
    engine = _engine(policy, batch=8, capture=HiddenCapture(window=12, side="first"))
    want = []
    for ti, temp in enumerate(kw["temperatures"]):
        res = engine.generate(prompts, SamplingParams(temperature=temp, max_new_tokens=12, seed=1 + ti,
                                                      stop_token_ids=[5]))
        want += [(p, r[0], h[0]) for p, r, h in zip(prompts, res.tokens, res.hidden, strict=True)]
    assert [(p, r) for p, r, _ in got] == [(p, r) for p, r, _ in want]
    assert any(r[-1] == 5 for _, r, _ in got) and any(len(r) == 12 for _, r, _ in got)
    for (p, r, feats), (_, _, captured) in zip(got, want, strict=True):
        assert feats.shape[0] == len(p) + len(r)
        # generated token i came from the feature at position len(p) - 1 + i
        np.testing.assert_allclose(feats[len(p) - 1: len(p) - 1 + len(r)], captured[: len(r)], atol=1e-4)


def test_warmup_cli_engine_generation_samples_and_continue(tmp_path):
    """The warm-up program end to end on the tiny model: engine generation written to --samples, then a second run
    that reads two sample files, continues from the first drafter (--init) and writes both formats."""
    import pathlib
    import subprocess
    import sys

    repo = pathlib.Path(__file__).resolve().parents[1]
    base = [sys.executable, "-m", "tlt_jax.drafter.warmup", "--model=tiny", "--num_prompts=4", "--max_new_tokens=8",
            "--steps=3", "--row_len=32", "--rows_per_batch=2", "--draft_vocab=64", "--unroll=2",
            "--eval_prompts=3"]
    pkl = tmp_path / "gen.pkl"
    first = subprocess.run([*base, f"--out={tmp_path / 'a'}", "--engine_batch=4", "--temperatures=0,0.9",
                            f"--samples={pkl}"], cwd=repo, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert pkl.exists() and (tmp_path / "a" / "eagle" / "model.safetensors").exists()
    heldout = json.loads((tmp_path / "a" / "warmup.json").read_text())["heldout_chain_acceptance"]
    assert heldout["prompts"] == 3 and 0 < heldout["positions"] <= 3 * 7 and len(heldout["expected_accept"]) == 6
    assert 1.0 <= heldout["expected_accept"][0] <= heldout["expected_accept"][-1] <= 7.0
    second = subprocess.run([*base, f"--out={tmp_path / 'b'}", f"--samples={pkl},{pkl}", f"--init={tmp_path / 'a'}",
                             "--value_weight=0", "--prob_weight=1"],
                            cwd=repo, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    summary = json.loads((tmp_path / "b" / "warmup.json").read_text())
    # the token loss alone: each logged step's loss is its (first pass's) soft-target cross-entropy
    assert summary["flags"]["value_weight"] == 0 and summary["flags"]["prob_weight"] == 1
    for row in (summary["first"], summary["last"]):
        assert row["loss"] == pytest.approx(row["prob_loss"], rel=1e-6) and row["value_loss"] > 0, row
    assert summary["num_samples"] == 16 and summary["flags"]["engine_batch"] == 0
    assert summary["flags"]["samples"] == [str(pkl)] * 2 and summary["init_summary"]["num_samples"] == 8
    assert load_drafter(tmp_path / "b").vocab_ids() is not None
    missing = subprocess.run([*base, f"--out={tmp_path / 'c'}", f"--samples={pkl},{tmp_path / 'nope.pkl'}"],
                             cwd=repo, capture_output=True, text=True, timeout=600)
    assert missing.returncode != 0 and "nope.pkl" in missing.stdout + missing.stderr
    bad = subprocess.run([*base, f"--out={tmp_path / 'd'}", "--value_weight=0", "--prob_weight=0"],
                         cwd=repo, capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "not both 0" in bad.stdout + bad.stderr


def test_batch_is_a_pytree():
    b = DrafterBatch(*(np.zeros((1, 2)) for _ in range(6)))
    assert len(jax.tree.leaves(b)) == 6


@pytest.mark.parametrize("chunk", [0, 8, 12])  # the token loss over whole rows, or 8 / 12 positions at a time
def test_loss_matches_numpy_reference(policy, chunk):
    """SmoothL1 + 0.1 * soft CE, masked mean over response pairs, recomputed in float64 numpy."""
    drafter = EagleDrafter(CFG, rngs=nnx.Rngs(6))
    batch = pack_sequences(_samples(policy, 4, seed=5), row_len=32)
    jb = jax.tree.map(jnp.asarray, batch)
    loss, m = drafter_loss(drafter, policy, jb, DrafterLossConfig(logit_chunk=chunk))
    h_hat = np.asarray(drafter(policy, jb.next_tokens, jb.features, positions=jb.positions,
                               segment_ids=jb.segment_ids), np.float64)
    w = np.asarray(policy.lm_head[...], np.float64)
    x = h_hat - batch.targets
    sl1 = np.where(np.abs(x) < 1, 0.5 * x * x, np.abs(x) - 0.5).mean(-1)
    mask = batch.loss_mask
    vref = (sl1 * mask).sum() / mask.sum()

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    p = np.exp(log_softmax(batch.targets.astype(np.float64) @ w))
    pref = ((-(p * log_softmax(h_hat @ w)).sum(-1)) * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(m.value_loss), vref, rtol=1e-5)
    np.testing.assert_allclose(float(m.prob_loss), pref, rtol=1e-5)
    np.testing.assert_allclose(float(loss), vref + 0.1 * pref, rtol=1e-5)
    assert abs(float(m.tokens) - mask.sum()) < 1e-6


def test_chunked_token_loss_gives_the_whole_rows_gradients(policy):
    """LM-head chunks of 12 positions (a chunk that does not divide the 32-position rows): the same loss, top-1 and
    gradients as the whole rows at once, up to float32 summation order."""
    drafter = EagleDrafter(CFG, rngs=nnx.Rngs(7))
    graphdef, params = nnx.split(drafter, nnx.Param)
    jb = jax.tree.map(jnp.asarray, pack_sequences(_samples(policy, 6, seed=9), row_len=32))

    def run(chunk):
        loss = lambda p: drafter_loss(nnx.merge(graphdef, p), policy, jb, DrafterLossConfig(logit_chunk=chunk))  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (whole, mw), gw = run(0)
    (chunked, mc), gc = run(12)
    np.testing.assert_allclose(float(chunked), float(whole), rtol=1e-6)
    assert float(mc.top1) == float(mw.top1)
    for a, b in zip(jax.tree.leaves(gw), jax.tree.leaves(gc), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(gw)) > 0


@pytest.mark.parametrize("weights", [(-1.0, 0.1), (1.0, -0.5), (0.0, 0.0)])
def test_loss_config_refuses_negative_or_all_zero_weights(weights):
    with pytest.raises(ValueError, match="must be >= 0 and not both 0"):
        DrafterLossConfig(value_weight=weights[0], prob_weight=weights[1])
    assert DrafterLossConfig(value_weight=0.0, prob_weight=1.0).prob_weight == 1.0
