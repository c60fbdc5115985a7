"""Rollout engine: exactness against a no-cache reference loop, counter-based sampling invariances, the sampled
distribution (chi-square), mesh slices, the compiled-step pool, input validation and hidden-state capture."""

import concurrent.futures
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as sps

from tlt_jax.distributed import MeshConfig, engine_meshes, make_mesh
from tlt_jax.models import CausalLM, tiny_config
from tlt_jax.rollout import HiddenCapture, RolloutEngine, SamplingParams, StepKey, StepPool

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
MAX_LEN = 64
PROMPTS = [[5, 9, 17, 33], [2, 200, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48], [100, 3]]
MAX_NEW = [9, 37, 17, 3]
SAMPLED = SamplingParams(temperature=1.1, top_k=60, top_p=0.9, n=2, max_new_tokens=MAX_NEW, seed=7, ignore_eos=True)


class Reference:
    """Full forward over the whole (right-padded) sequence, no cache: logits and hidden at every position."""

    def __init__(self, model, length=MAX_LEN):
        graphdef, state = nnx.split(model)
        self.model, self.length = model, length
        f = jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids)[:2])
        self.fwd = lambda ids: f(state, ids)

    def __call__(self, seq):
        ids = np.zeros((1, self.length), np.int32)
        ids[0, : len(seq)] = seq
        logits, hidden = self.fwd(jnp.asarray(ids))
        return np.asarray(logits[0], np.float64), np.asarray(hidden[0])

    def greedy(self, prompt, max_new, stops=()):
        seq = list(prompt)
        for _ in range(max_new):
            tok = int(np.argmax(self(seq)[0][len(seq) - 1]))
            seq.append(tok)
            if tok in stops:
                break
        return seq[len(prompt) :]

    def logprobs(self, prompt, gen):
        logits = self(list(prompt) + list(gen))[0]
        lsm = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        p = len(prompt)
        return np.array([lsm[p - 1 + i, t] for i, t in enumerate(gen)])


@pytest.fixture(scope="module")
def model():
    return CausalLM(tiny_config(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def ref(model):
    return Reference(model)


@pytest.fixture(scope="module")
def engine(model):
    return RolloutEngine(
        model,
        max_batch=8,
        max_len=MAX_LEN,
        chunk_size=8,
        length_buckets=(32, 64),
        capture=HiddenCapture(window=6, side="last"),
        compiler_options=FAST,
    )


@pytest.fixture(scope="module")
def sampled(engine):
    return engine.generate(PROMPTS, SAMPLED)


def test_greedy_matches_reference_loop_and_logprobs(engine, ref):
    prompts = PROMPTS[:3]
    res = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW[:3], ignore_eos=True))
    for i, p in enumerate(prompts):
        want = ref.greedy(p, MAX_NEW[i])
        assert res.tokens[i][0] == want
        assert res.finish_reason[i][0] == "length"
        np.testing.assert_allclose(res.logprobs[i][0], ref.logprobs(p, want), atol=1e-5, rtol=0)
    # A stop token ends the sample (included) with reason "stop"; other samples are unaffected.
    long = res.tokens[1][0]
    stop = long[20]
    res2 = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW[:3], stop_token_ids=[stop]))
    for i, p in enumerate(prompts):
        want = ref.greedy(p, MAX_NEW[i], stops=(stop,))
        assert res2.tokens[i][0] == want
        assert res2.finish_reason[i][0] == ("stop" if want[-1] == stop else "length")
    assert res2.tokens[1][0][-1] == stop and len(res2.tokens[1][0]) <= 21
    # Compaction and length buckets were used: rows left, batches shrank, early chunks read less than the cap.
    chunks = res.stats["chunks"]
    assert res.stats["compactions"] and chunks[-1]["batch"] < chunks[0]["batch"]
    assert chunks[0]["length"] == 32 and chunks[-1]["length"] == 64
    assert res.stats["total_tokens"] == sum(MAX_NEW[:3])
    # New weights of the same structure reuse every compiled step.
    other = CausalLM(tiny_config(), rngs=nnx.Rngs(1))
    compiles = engine.pool.counters()["compiles"]
    engine.set_params(other)
    try:
        res3 = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW[:3], ignore_eos=True))
    finally:
        engine.set_params(ref.model)
    assert res3.tokens[1][0] == Reference(other).greedy(prompts[1], MAX_NEW[1]) != res.tokens[1][0]
    assert engine.pool.counters()["compiles"] == compiles


def test_sampled_logprobs_and_lengths(sampled, ref):
    assert sampled.stats["total_tokens"] == 2 * sum(MAX_NEW)
    for i, p in enumerate(PROMPTS):
        assert sampled.tokens[i][0] != sampled.tokens[i][1] or MAX_NEW[i] < 4
        for j in range(2):
            gen = sampled.tokens[i][j]
            assert len(gen) == MAX_NEW[i] and sampled.finish_reason[i][j] == "length"
            np.testing.assert_allclose(sampled.logprobs[i][j], ref.logprobs(p, gen), atol=1e-5, rtol=0)


def test_tokens_independent_of_batch_compaction_and_chunk_size(engine, model, sampled):
    alone = engine.generate([PROMPTS[2]], dataclasses.replace(SAMPLED, max_new_tokens=MAX_NEW[2]), request_ids=[2])
    assert alone.tokens[0] == sampled.tokens[2]
    engine.compaction = False
    try:
        flat = engine.generate(PROMPTS, SAMPLED)
    finally:
        engine.compaction = True
    assert not flat.stats["compactions"] and flat.tokens == sampled.tokens
    # K=1 and max_batch=4: the 8 rows also run as two waves of 4 (prompts 0-1, then 2-3).
    k1 = RolloutEngine(
        model,
        max_batch=4,
        max_len=MAX_LEN,
        chunk_size=1,
        length_buckets=(64,),
        capture=HiddenCapture(window=4, side="first", prompt=3),
        compiler_options=FAST,
    )
    res = k1.generate(PROMPTS, SAMPLED)
    assert res.tokens == sampled.tokens
    np.testing.assert_allclose(
        np.concatenate(sum(res.logprobs, [])), np.concatenate(sum(sampled.logprobs, [])), atol=1e-5
    )
    assert len(res.stats["prefills"]) == 2
    # K=1: one step per chunk; the first token of each row comes from prefill.
    assert res.stats["steps"] == len(res.stats["chunks"]) == (max(MAX_NEW[:2]) - 1) + (max(MAX_NEW[2:]) - 1)
    # side="first": the window is the first w generated tokens, extended back over up to 3 prompt positions (prompt
    # 1 has 3 tokens: 2 positions before its last; prompt 2 has 9) with the prefill's hidden states.
    for i, c in ((1, 2), (2, 3)):
        _, hid = Reference(model)(PROMPTS[i] + res.tokens[i][0])
        p = len(PROMPTS[i])
        assert res.hidden_start[i][0] == -c and res.hidden[i][0].shape == (c + 4, model.config.hidden_size)
        np.testing.assert_allclose(res.hidden[i][0], hid[p - 1 - c : p + 3], atol=1e-5)
    windows = [min(3, len(q) - 1) + min(4, m) for q, m in zip(PROMPTS, MAX_NEW, strict=True)]
    assert res.stats["hidden_bytes"] == sum(windows) * 2 * model.config.hidden_size * 4
    k1.capture = HiddenCapture(window=4, side="first", prompt=2)  # the prefill returns 3 positions: compiled in
    with pytest.raises(ValueError, match="only max_bytes may change"):
        k1.generate(PROMPTS, SAMPLED)


def test_hidden_capture_window_and_cap(engine, sampled, ref):
    h = engine.config.hidden_size
    for i, p in enumerate(PROMPTS):
        for j in range(2):
            gen = sampled.tokens[i][j]
            w = min(6, len(gen))
            cap = sampled.hidden[i][j]
            assert cap.shape == (w, h) and sampled.hidden_start[i][j] == len(gen) - w
            hid = ref(p + gen)[1]
            start = len(p) - 1 + len(gen) - w
            np.testing.assert_allclose(cap, hid[start : start + w], atol=1e-5)
    assert sampled.stats["hidden_dropped"] == 0
    assert sampled.stats["hidden_bytes"] == sum(min(6, m) for m in MAX_NEW) * 2 * h * 4
    cap_bytes = 3 * 6 * h * 4  # room for three full windows
    engine.capture = dataclasses.replace(engine.capture, max_bytes=cap_bytes)
    try:
        res = engine.generate(PROMPTS, SAMPLED)
    finally:
        engine.capture = dataclasses.replace(engine.capture, max_bytes=256 * 2**20)
    kept = [x for row in res.hidden for x in row if x is not None]
    assert res.stats["hidden_bytes"] <= cap_bytes and res.stats["hidden_bytes"] == sum(x.nbytes for x in kept)
    assert res.stats["hidden_dropped"] == 8 - len(kept) > 0
    assert res.tokens == sampled.tokens


def test_second_identical_call_compiles_nothing(engine, sampled):
    events = []

    def listener(name, secs, **kw):
        if "compile" in name:
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        res = engine.generate(PROMPTS, SAMPLED)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert res.tokens == sampled.tokens
    assert res.stats["pool_this_call"]["compiles"] == 0 and res.stats["pool_this_call"]["misses"] == 0
    assert res.stats["pool_this_call"]["hits"] > 0
    assert events == []


def test_on_chunk_reports_progress_every_round_trip(engine, sampled):
    calls = []
    res = engine.generate(PROMPTS, SAMPLED, on_chunk=lambda finished, active: calls.append((finished, active)))
    assert res.tokens == sampled.tokens
    total = len(PROMPTS) * SAMPLED.n
    assert len(calls) == len(res.stats["chunks"]) + 1  # once per round trip, and once when the wave drains
    assert all(f + a == total for f, a in calls)
    assert [f for f, _ in calls] == sorted(f for f, _ in calls) and calls[-1] == (total, 0)
    assert calls[0][1] > 0


def test_precompile_covers_decode_and_compaction(model):
    eng = RolloutEngine(model, max_batch=2, max_len=32, length_buckets=(32,), precompile=True, compiler_options=FAST)
    assert eng.pool.counters()["compiles"] == 3  # decode@2, decode@1, compact 2->1
    res = eng.generate([[3, 4, 5], [6]], SamplingParams(temperature=0.0, max_new_tokens=[3, 12], ignore_eos=True))
    assert res.stats["compactions"] and [c["batch"] for c in res.stats["chunks"]] == [2, 1]
    # Only the prefill step (its shape depends on the call) was compiled on the way.
    assert res.stats["pool_this_call"] == dict(compiles=1, hits=3, misses=1, evictions=0)


def test_pool_lru_eviction():
    pool = StepPool(budget=2)
    pool.register("decode", "plain", lambda key: jax.jit(lambda x: x + key.batch))
    x = jnp.zeros((2,), jnp.int32)
    a, b, c = (StepKey("decode", i, 8) for i in (1, 2, 3))
    assert int(pool.get(a, x)(x)[0]) == 1
    pool.get(b, x)
    pool.get(a, x)  # hit: b is now the least recently used
    pool.get(c, x)  # evicts b
    assert a in pool and c in pool and b not in pool
    assert int(pool.get(b, x)(x)[0]) == 2  # compiled again, evicting a
    cnt = pool.counters()
    assert (cnt["compiles"], cnt["hits"], cnt["misses"], cnt["evictions"], cnt["size"]) == (4, 1, 4, 2, 2)
    with pytest.raises(KeyError, match="no step builder"):
        pool.get(StepKey("verify", 1, 8, "tree"), x)


def _expected(logits, temperature, top_k, top_p, order="tk_p"):
    """Sampling distribution in float64 numpy: temperature, then top-k, then top-p (ties kept)."""
    z = np.asarray(logits, np.float64)
    if order == "p_first":  # wrong transform used to check the test's power: top-p before temperature
        z = _filter_top_p(z, top_p) / temperature
    else:
        z = z / temperature
    if top_k:
        z = np.where(z >= np.sort(z)[::-1][top_k - 1], z, -np.inf)
    if order != "p_first":
        z = _filter_top_p(z, top_p)
    p = np.exp(z - z.max())
    return p / p.sum()


def _filter_top_p(z, top_p):
    if top_p >= 1:
        return z
    p = np.exp(z - z.max())
    p /= p.sum()
    srt = np.sort(p)[::-1]
    before = np.cumsum(srt) - srt
    cutoff = srt[(before < top_p) | (np.arange(len(srt)) == 0)].min()
    return np.where(p >= cutoff, z, -np.inf)


def _pvalue(counts, probs):
    """Chi-square p-value with categories of expected count < 5 pooled; mass outside the support rejects."""
    n = counts.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    exp = probs * n
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if (~big).any() and exp[~big].sum() > 0:
        obs_b.append(counts[~big].sum())
        exp_b.append(exp[~big].sum())
    return sps.chisquare(np.array(obs_b, float), np.array(exp_b, float)).pvalue


def test_sampled_distribution_chi_square():
    cfg = tiny_config(vocab_size=32)
    m = CausalLM(cfg, rngs=nnx.Rngs(3))
    m.lm_head[...] = m.lm_head[...] * 12.0  # peaked logits, so the transforms differ clearly
    prompt = [4, 7, 11]
    logits = Reference(m, 16)(prompt)[0][len(prompt) - 1]
    eng = RolloutEngine(m, max_batch=4096, max_len=16, length_buckets=(16,), compiler_options=FAST)
    n = 4000
    cases = [  # (temperature, top_k, top_p, a wrong transform that must be rejected)
        (0.7, 0, 1.0, dict(temperature=1.0, top_k=0, top_p=1.0)),
        (1.0, 6, 1.0, dict(temperature=1.0, top_k=7, top_p=1.0)),
        (1.3, 0, 0.75, dict(temperature=1.3, top_k=0, top_p=0.75, order="p_first")),
        (0.9, 10, 0.9, dict(temperature=0.9, top_k=0, top_p=0.9)),
    ]
    for seed, (t, k, p, wrong) in enumerate(cases):
        res = eng.generate(
            [prompt], SamplingParams(temperature=t, top_k=k, top_p=p, n=n, max_new_tokens=1, seed=seed, ignore_eos=True)
        )
        first = np.array([s[0] for s in res.tokens[0]])
        counts = np.bincount(first, minlength=cfg.vocab_size)
        probs = _expected(logits, t, k, p)
        assert _pvalue(counts, probs) > 1e-3, (t, k, p)
        assert _pvalue(counts, _expected(logits, **wrong)) < 1e-3, wrong
        np.testing.assert_allclose(res.logprobs[0][0][0], logits[first[0]] - np.logaddexp.reduce(logits), atol=1e-5)
    greedy = eng.generate([prompt], SamplingParams(temperature=0.0, n=n, max_new_tokens=1))
    assert {s[0] for s in greedy.tokens[0]} == {int(np.argmax(logits))}
    assert eng.pool.counters()["compiles"] == 1  # one prefill step served every transform


def test_two_mesh_slices_match_single_device():
    m = CausalLM(tiny_config(num_heads=8, num_kv_heads=4), rngs=nnx.Rngs(5))
    ref = Reference(m, 32)
    prompts = [[3, 4, 5, 6], [9, 8]]
    max_new = [11, 19]
    want = [ref.greedy(p, k) for p, k in zip(prompts, max_new, strict=True)]
    slices = engine_meshes(make_mesh(MeshConfig(data=2, fsdp=1, tensor=4)), 2)
    # Slice 0: tensor-parallel over 4 devices. Slice 1: the same 4 devices as fsdp 2 x tensor 2 (batch sharded).
    slices[1] = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), list(slices[1].devices.flat))
    engines = [
        RolloutEngine(m, s, max_batch=4, max_len=32, length_buckets=(32,), compiler_options=FAST) for s in slices
    ]
    q = engines[0].params["layers"]["self_attn"]["q_proj"][...]
    # The decode layout (decode_rules): heads over tensor, not split over the data axes (no weight gathers).
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor", None)
    assert q.sharding.mesh.shape["tensor"] == 4
    batch_spec = engines[1].ctx.abstract_state(4).tokens.sharding.spec
    assert batch_spec == jax.sharding.PartitionSpec(("data", "fsdp"), None)
    params = SamplingParams(temperature=0.0, n=2, max_new_tokens=max_new, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        results = list(ex.map(lambda e: e.generate(prompts, params), engines))
    for res in results:
        assert res.stats["compactions"]
        for i in range(2):
            assert res.tokens[i] == [want[i], want[i]]
    d0 = {d.id for d in slices[0].devices.flat}
    d1 = {d.id for d in slices[1].devices.flat}
    assert not d0 & d1 and {d.id for d in q.sharding.device_set} == d0


def test_bad_inputs_raise_before_compute(engine):
    before = engine.pool.counters()
    ok = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate([[1, 2], []], ok)
    with pytest.raises(ValueError, match=r"prompts\[0\] has 65 tokens.*max_len=64"):
        engine.generate([[3] * 65], ok)
    with pytest.raises(ValueError, match=r"max_new_tokens=10 exceeds max_len=64"):
        engine.generate([[3] * 60], SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[3, 999]], ok)
    with pytest.raises(ValueError, match="max_new_tokens has 1 values for 2 prompts"):
        engine.generate([[3], [4]], SamplingParams(max_new_tokens=[4]))
    with pytest.raises(ValueError, match="prompts must be a non-empty list"):
        engine.generate([], ok)
    for field, value in [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("max_new_tokens", 0),
        ("max_new_tokens", [3, 0]),
        ("n", 0),
    ]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**{field: value})
    assert engine.pool.counters() == before


def test_processed_logprobs_mixed_filters_match_reference_and_skip_is_batch_independent():
    """Rows with filters off get log_softmax(logits / T) whether or not another row in the batch filters (the
    sort-free path and the filtered path agree on them), and filtered rows match the float64 reference."""
    from tlt_jax.sampling import processed_logprobs

    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 50)) * 3, jnp.float32)
    temp = jnp.asarray([0.8, 1.0, 1.3, 0.8])
    mixed = processed_logprobs(logits, temp, jnp.asarray([0, 5, 0, 0]), jnp.asarray([1.0, 1.0, 0.6, 1.0]))
    plain = processed_logprobs(logits, temp, jnp.zeros(4, jnp.int32), jnp.ones(4))
    np.testing.assert_array_equal(np.asarray(mixed)[[0, 3]], np.asarray(plain)[[0, 3]])
    np.testing.assert_allclose(np.asarray(plain), jax.nn.log_softmax(logits / temp[:, None], axis=-1), atol=1e-6)
    for row, (k, p) in zip((1, 2), ((5, 1.0), (0, 0.6)), strict=True):
        got = np.exp(np.asarray(mixed[row], np.float64))
        np.testing.assert_allclose(got, _expected(logits[row], float(temp[row]), k, p), atol=1e-6)
        assert (got > 0).sum() < 50


def test_step_info_packs_into_one_array_and_unpacks_by_name():
    """The host reads one int32 array per round trip; its rows come back under their names for every step kind."""
    from tlt_jax.rollout.state import StepInfo

    done, ngen = jnp.array([True, False, False]), jnp.array([4, 2, 7])
    plain = StepInfo.unpack(np.asarray(StepInfo(done, ngen).pack()), speculative=False)
    np.testing.assert_array_equal(plain.done, [True, False, False])
    np.testing.assert_array_equal(plain.num_generated, [4, 2, 7])
    assert plain.verifies is None and plain.accepted is None and plain.tokens is None
    tokens = jnp.array([[9, 8, -1], [7, -1, -1]])  # [R, B]
    packed = StepInfo(done, ngen, jnp.array([1, 1, 0]), jnp.array([3, 0, 0]), tokens).pack()
    assert packed.shape == (6, 3) and packed.dtype == jnp.int32
    spec = StepInfo.unpack(np.asarray(packed), speculative=True)
    np.testing.assert_array_equal(spec.verifies, [1, 1, 0])
    np.testing.assert_array_equal(spec.accepted, [3, 0, 0])
    np.testing.assert_array_equal(spec.tokens, np.asarray(tokens))
    eagle = StepInfo.unpack(np.asarray(StepInfo(done, ngen, jnp.array([2, 1, 0]), jnp.array([5, 1, 0])).pack()), True)
    assert eagle.tokens is None and eagle.accepted.tolist() == [5, 1, 0]
    decode = StepInfo.unpack(np.asarray(StepInfo(done, ngen, tokens=tokens).pack()), speculative=False)
    assert decode.verifies is None and decode.tokens.tolist() == [[9, 8, -1], [7, -1, -1]]


def test_sample_tokens_derives_keys_only_when_a_row_samples():
    """Keys given as a function (the decode step's lazy form, derived inside the sampling branch) sample exactly what
    the same keys as an array sample; greedy rows take the argmax; different keys sample differently."""
    from tlt_jax.sampling import sample_tokens, token_keys

    logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, 40)) * 2, jnp.float32)
    keys = token_keys(3, jnp.arange(4), 0, jnp.arange(4) + 11)
    temp = jnp.asarray([0.0, 0.9, 0.0, 1.3])
    eager = sample_tokens(logits, keys, temp, 0, 1.0)
    lazy = jax.jit(lambda lg, t: sample_tokens(lg, lambda: keys, t, 0, 1.0))
    np.testing.assert_array_equal(lazy(logits, temp), eager)
    np.testing.assert_array_equal(np.asarray(eager)[[0, 2]], np.argmax(np.asarray(logits), -1)[[0, 2]])
    np.testing.assert_array_equal(lazy(logits, jnp.zeros(4)), np.argmax(logits, -1))
    other = token_keys(4, jnp.arange(4), 0, jnp.arange(4) + 11)
    assert not np.array_equal(sample_tokens(logits, other, 5.0, 0, 1.0), sample_tokens(logits, keys, 5.0, 0, 1.0))
