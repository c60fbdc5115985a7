"""The adaptive engine (issue 17): one engine holds both drafters and a BEG-MAB bandit picks "off", an n-gram or an
EAGLE tree shape for every chunk. Lossless whatever it picks: greedy and sampled output equal plain decoding token
for token with arms switching inside a wave, and the law of the first two sampled tokens passes a chi-square test
against the exact joint. The bandit lives on the engine across generate calls and round-trips through state_dict;
the hysteresis gate delays speculation by ``patience`` chunks; arms are validated against the drafter given; only
EAGLE verify steps run the drafter, caught up over what the other steps recorded to the state it would have had."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.stats import chisquare

from tlt_jax.drafter import EagleDrafter
from tlt_jax.models import CausalLM, tiny_config
from tlt_jax.rollout import HiddenCapture, RolloutEngine, SamplingParams, SpecConfig

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
CFG = tiny_config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, eos_token_ids=()
)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
MAX_NEW = [12, 30, 20]
KW = dict(
    max_batch=8,
    max_len=64,
    length_buckets=(64,),
    batch_buckets=(8, 2),
    capture=HiddenCapture(window=6),
    compiler_options=FAST,
)
ARMS = ("off", "ngram:3x2x6", "eagle:3x2x6")
GREEDY = SamplingParams(temperature=0.0, n=2, max_new_tokens=MAX_NEW, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, n=2, max_new_tokens=MAX_NEW, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return CausalLM(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def drafter():
    return EagleDrafter(CFG, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def plain(model):
    return RolloutEngine(model, **KW)


@pytest.fixture(scope="module")
def adaptive(model, drafter):
    """epsilon = 1 and margin = 1 (every arm plausible), min_count = 1, no time share (no draw declined for its
    timing): after each arm's first measurement every chunk picks a random arm other than the best, so arms switch
    inside waves. Every reachable (arm, bucket) is precompiled."""
    spec = SpecConfig(arms=ARMS, epsilon=1.0, margin=1.0, threshold=8, seed=1, min_count=1, time_share=False)
    return RolloutEngine(model, drafter=drafter, spec=spec, precompile=True, **KW)


def assert_same(res, ref):
    assert res.tokens == ref.tokens and res.finish_reason == ref.finish_reason
    flat = lambda r: np.concatenate([np.asarray(x) for row in r.logprobs for x in row])  # noqa: E731
    np.testing.assert_allclose(flat(res), flat(ref), atol=1e-5, rtol=0)
    for row, ref_row in zip(res.hidden, ref.hidden, strict=True):
        for h, h_ref in zip(row, ref_row, strict=True):
            np.testing.assert_allclose(h, h_ref, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_arms_switching_mid_wave_equal_plain_greedy_and_sampled(adaptive, plain):
    ran, firsts = set(), 0
    start = adaptive.state_dict()
    for params in (GREEDY, SAMPLED):
        adaptive.load_state_dict(start)  # each wave tries every arm afresh: it switches whatever the timings
        res = adaptive.generate(PROMPTS, params)
        assert_same(res, plain.generate(PROMPTS, params))
        st = res.stats
        choices = [c["choice"] for c in st["chunks"]]
        assert len(set(choices)) >= 2  # arms switched in this one wave, mid-generation
        ran |= set(choices)
        assert sum(s for per in st["arm_steps"].values() for s in per.values()) == st["steps"]
        assert set(st["arm_tokens_per_s"]) == set(choices) and min(st["arm_tokens_per_s"].values()) > 0
        # each arm is tried first once, and again after a try that was its compiled step's first run (not observed)
        firsts += sum(c["first_run"] for c in st["chunks"] if c["batch"] == 8)
        assert len(ARMS) <= st["bandit"]["choices"][8]["untried"] <= len(ARMS) + firsts
    assert ran == set(ARMS)
    assert sum(c["explore"] for c in st["bandit"]["choices"].values()) > 0  # random picks after the first tries


def test_bandit_state_lives_across_calls_and_round_trips(adaptive, model, drafter):
    def chosen(st):
        return sum(sum(c.values()) for c in st["bandit"]["choices"].values())

    untried = lambda st: st["bandit"]["choices"][8]["untried"]  # noqa: E731
    first = adaptive.generate(PROMPTS, GREEDY).stats
    for _ in range(3):  # until a call finds every arm measured (a wave may end before an arm's observed try)
        second = adaptive.generate(PROMPTS, GREEDY).stats
        assert chosen(second) > chosen(first)  # the counters (and windows) carry over: one bandit per engine
        if untried(second) == untried(first):
            break
        first = second
    # arms tried in an earlier call are not tried again
    third = adaptive.generate(PROMPTS, GREEDY).stats
    assert untried(third) == untried(second) == untried(first)
    assert third["pool_this_call"]["compiles"] == 0  # precompiled: whatever the bandit picks (prefill: call 1)
    state = adaptive.state_dict()
    spec = SpecConfig(arms=ARMS, epsilon=1.0, margin=1.0, threshold=8, seed=1, min_count=1, time_share=False)
    other = RolloutEngine(model, drafter=drafter, spec=spec, **KW)
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert [str(other.bandit.choose(8)) for _ in range(20)] == [str(adaptive.bandit.choose(8)) for _ in range(20)]
    with pytest.raises(ValueError, match="differ from the configured arms"):
        RolloutEngine(model, drafter=drafter, spec=dataclasses.replace(spec, arms=ARMS[::-1]), **KW).load_state_dict(
            state
        )
    with pytest.raises(ValueError, match="not adaptive"):
        RolloutEngine(model, **KW).load_state_dict(state)


def test_drafter_catch_up_is_kept_out_of_the_bandits_reward(model, drafter):
    """An EAGLE round trip after prefill, plain or n-gram steps first catches the drafter up over their pairs alone
    (a cost of switching arms, not of the arm): the chunk's seconds include it, the bandit's observation does not.
    Two arms, always exploring: "off" first, then EAGLE, then mostly alternating."""
    spec = SpecConfig(arms=("off", "eagle:3x2x6"), epsilon=1.0, margin=1.0, time_share=False, threshold=8)
    engine = RolloutEngine(model, drafter=drafter, spec=spec, **KW)
    calls = [engine.generate(PROMPTS, SAMPLED).stats for _ in range(2)]  # the second call's steps have all run
    chunks = calls[0]["chunks"] + calls[1]["chunks"]
    state = engine.bandit.state_dict()
    obs = sorted((o for window in state["observations"].values() for o in window), key=lambda o: o[3])  # a fresh bandit
    observed = [c for c in chunks if not c["first_run"]]  # a compiled step's first run is not observed
    assert len(observed) < len(chunks) and len(obs) == len(observed)
    seen = dict(zip(map(id, observed), obs, strict=True))  # in order
    eagle = [(i, c) for i, c in enumerate(chunks) if c["choice"].startswith("eagle")]
    starts = {id(calls[0]["chunks"][0]), id(calls[1]["chunks"][0])}
    previous = ["prefill" if id(c) in starts else chunks[i - 1]["choice"] for i, c in eagle]
    for (_, c), prev in zip(eagle, previous, strict=True):
        assert (c["catchup_seconds"] > 0) == (not prev.startswith("eagle"))
        if id(c) in seen:
            assert seen[id(c)][0] == c["choice"]
            np.testing.assert_allclose(seen[id(c)][2], c["seconds"] - c["catchup_seconds"], rtol=1e-9)
    assert any(id(c) in seen and c["catchup_seconds"] > 0 for _, c in eagle)
    for c in observed:  # the reward: the lagging row's tokens over the observed seconds (plain: every row's steps)
        np.testing.assert_allclose(seen[id(c)][1], c["lag_tokens"] / seen[id(c)][2], rtol=1e-9)
        if c["choice"] == "off" and c["lag_tokens"] != c["steps"]:
            assert c["tokens"] < c["steps"] * c["active"]  # only when rows finished during the round trip
    assert calls[1]["spec"]["catchup_seconds"] == sum(c.get("catchup_seconds", 0) for c in calls[1]["chunks"]) > 0


def test_background_compile_decodes_plain_meanwhile(model, drafter, plain):
    """background_compile: the bandit's first pick of EAGLE finds its step not compiled; it compiles on the pool's
    worker thread while that chunk (and any other until it is in) decodes plain, the same tokens, and the bandit
    hears nothing of round trips that overlapped a compile. Once the step is in, the arm runs."""
    spec = SpecConfig(arms=("off", "eagle:3x2x6"), epsilon=1.0, margin=1.0, time_share=False, threshold=8)
    engine = RolloutEngine(model, drafter=drafter, spec=spec, background_compile=True, **KW)
    calls = [engine.generate(PROMPTS, GREEDY)]
    engine.pool.collect(wait=True)
    assert engine.pool.counters()["background_compiles"] >= 1
    engine.precompile()  # whatever the first call did not reach: nothing waits in the second call
    calls.append(engine.generate(PROMPTS, GREEDY))
    ref = plain.generate(PROMPTS, GREEDY)
    for res in calls:
        assert_same(res, ref)
    first, second = (r.stats["chunks"] for r in calls)
    waited = [c for c in first if "waited_for" in c]
    assert waited[0]["waited_for"] == "eagle:3x2x6" and waited[0]["choice"] == "off"  # after "off" was measured
    assert all(c["compile_overlap"] for c in waited)
    observed = [c for c in first + second if not c["first_run"] and not c.get("compile_overlap")]
    assert len(observed) < len(first + second)
    steps = engine.bandit.stats()["steps"]
    assert sum(s for per in steps.values() for s in per.values()) == sum(c["steps"] for c in observed)
    assert not any("waited_for" in c or "compile_overlap" in c for c in second)
    assert "eagle:3x2x6" in {c["choice"] for c in second}


def test_compile_between_calls_compiles_after_the_call(model, drafter, plain):
    """compile_between_calls (the main job's setting): a speculative step not compiled yet is asked for during the
    call but built only after it has returned, so no round trip shares the host with a compile; the next call runs
    the arm. The tokens are plain decoding's either way."""
    spec = SpecConfig(arms=("off", "eagle:3x2x6"), epsilon=1.0, margin=1.0, time_share=False, threshold=8)
    engine = RolloutEngine(model, drafter=drafter, spec=spec, background_compile=True, compile_between_calls=True,
                           **KW)
    held_at_build = []  # whether the engine was decoding (the pool held) when each verify step began to build
    for (phase, arm), builder in list(engine.pool._builders.items()):
        if phase == "verify":
            engine.pool.register(phase, arm, lambda key, b=builder: held_at_build.append(engine.pool.held) or b(key))
    ref = plain.generate(PROMPTS, GREEDY)
    calls = []
    for _ in range(2):
        calls.append(engine.generate(PROMPTS, GREEDY))
        assert not engine.pool.held and engine.pool.deferred == 0
        engine.pool.collect(wait=True)
    for res in calls:
        assert_same(res, ref)
    first, second = (r.stats["chunks"] for r in calls)
    assert {c["choice"] for c in first} == {"off"} and any(c.get("waited_for") == "eagle:3x2x6" for c in first)
    assert not any(c.get("compile_overlap") for c in first + second)
    assert held_at_build and not any(held_at_build)  # none built during a call
    assert "eagle:3x2x6" in {c["choice"] for c in second}
    engine.close()


def test_loss_budget_charges_every_round_trip_and_holds_compiles(model, drafter, plain):
    """max_loss (a conservative bandit): "off" is measured first whatever the arms' order; every round trip the
    bandit decided is in its ledger (plain decoding's seconds + the loss = their seconds, first runs and compile
    overlaps included); once the budget is spent the engine decodes plain and starts no compile (the same tokens)."""
    spec = SpecConfig(arms=("eagle:3x2x6", "off"), epsilon=1.0, margin=1.0, time_share=False, threshold=8, min_count=1)
    free = RolloutEngine(model, drafter=drafter, spec=spec, background_compile=True, **KW)
    assert free.generate(PROMPTS, GREEDY).stats["chunks"][0].get("waited_for") == "eagle:3x2x6"  # unbounded: first
    free.close()
    bounded = dataclasses.replace(spec, max_loss=0.05)
    engine = RolloutEngine(model, drafter=drafter, spec=bounded, background_compile=True, **KW)
    res = engine.generate(PROMPTS, GREEDY)
    assert_same(res, plain.generate(PROMPTS, GREEDY))
    chunks, led = res.stats["chunks"], res.stats["bandit"]["ledger"]
    assert chunks[0]["choice"] == "off" and "waited_for" not in chunks[0]  # the baseline first
    assert led["max_loss"] == 0.05 and led["plain_s"] > 0
    assert led["plain_s"] + led["loss_s"] == pytest.approx(sum(c["seconds"] for c in chunks), rel=1e-9)
    engine.close()
    # compiled in place (no background_compile), a speculative step's compile is charged too, a plain step's is not
    inline = RolloutEngine(model, drafter=drafter, spec=bounded, **KW)
    chunks = inline.generate(PROMPTS, GREEDY).stats["chunks"]
    led = inline.bandit.stats()["ledger"]
    spec_compile = sum(c.get("compile_seconds", 0.0) for c in chunks if c["arm"] != "plain")
    assert spec_compile > 0 and any(c.get("compile_seconds") for c in chunks if c["arm"] == "plain")
    assert led["plain_s"] + led["loss_s"] == pytest.approx(sum(c["seconds"] for c in chunks) + spec_compile, rel=1e-9)
    # a spent budget: "off" known in both buckets, a loss far beyond 5 % of anything decoded
    held = RolloutEngine(model, drafter=drafter, spec=bounded, background_compile=True, **KW)
    for bucket in (8, 2):
        held.bandit.observe("off", bucket, 8, 0.1, steps=1, rows=8 if bucket == 8 else 2, lag=1)
    held.bandit.charge("off", 8, 8, 1000.0, lag=1, as_plain=False)
    res = held.generate(PROMPTS, GREEDY)
    assert_same(res, plain.generate(PROMPTS, GREEDY))
    assert {c["choice"] for c in res.stats["chunks"]} == {"off"} and not held.pool.compiling
    assert held.pool.counters()["background_compiles"] == 0 and res.stats["bandit"]["choices"][8]["held"] > 0


def test_patience_delays_speculation_and_ngram_arms_need_no_drafter(model, plain):
    spec = SpecConfig(arms=("off", "ngram:3x2x6"), epsilon=0.0, threshold=8, patience=2, min_count=1)
    eng = RolloutEngine(model, spec=spec, pool_max_bytes=10**9, **KW)  # n-gram arms: no drafter object
    res = eng.generate(PROMPTS, GREEDY)
    assert_same(res, plain.generate(PROMPTS, GREEDY))
    pool = res.stats["pool"]
    assert pool["max_bytes"] == 10**9 and 0 < pool["bytes"] <= 10**9 and pool["evictions"] == 0
    choices = [c["choice"] for c in res.stats["chunks"]]
    # Gate closed for `patience` chunks (plain chunks still teach the bandit "off"), then the untried n-gram arm.
    assert choices[:3] == ["off", "off", "ngram:3x2x6"] and res.stats["spec"]["switches"][0]["active"] <= 8
    best = eng.bandit.best(8)
    eng.spec = dataclasses.replace(eng.spec, patience=0)  # host-side: no recompile
    again = eng.generate(PROMPTS, GREEDY)
    assert again.stats["chunks"][0]["choice"] == str(best)  # epsilon = 0: exploit from the first chunk
    assert again.tokens == res.tokens


def test_adaptive_arguments_are_validated(model, drafter):
    with pytest.raises(ValueError, match="need an EAGLE drafter"):
        RolloutEngine(model, drafter="ngram", spec=SpecConfig(arms=ARMS), **KW)
    with pytest.raises(ValueError, match="need an EAGLE drafter"):
        RolloutEngine(model, spec=SpecConfig(arms=ARMS), **KW)
    with pytest.raises(ValueError, match="has no 'eagle:DxKxN' arm"):
        RolloutEngine(model, drafter=drafter, spec=SpecConfig(arms=("off", "ngram:3x2x6")), **KW)
    for kw, match in [
        (dict(arms=("off", "eagle:3x2x99")), r"\[2, 11\]"),
        (dict(arms=("off", "off")), "listed twice"),
        (dict(arms=ARMS, epsilon=2.0), "epsilon"),
        (dict(arms=ARMS, window=0), "window"),
        (dict(arms=ARMS, margin=1.5), r"SpecConfig.margin must be in \[0, 1\]"),
        (dict(arms=ARMS, transfer=None), "SpecConfig.transfer must be True or False"),
        (dict(patience=-1), "patience"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpecConfig(**kw)


@pytest.mark.slow
def test_first_two_tokens_chi_square_with_random_arms():
    """2048 samples in 32 waves of 64; with epsilon = 1 each wave's verify chunks pick random arms. The joint law of
    the first two generated tokens must be plain sampling's exact joint (64 cells)."""
    v = 8
    cfg = tiny_config(
        vocab_size=v, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, eos_token_ids=()
    )
    m = CausalLM(cfg, rngs=nnx.Rngs(2))
    m.lm_head[...] = m.lm_head[...] * 12.0  # spread the distributions
    prompt = [1, 2, 3]
    spec = SpecConfig(arms=("off", "ngram:2x2x4", "eagle:2x2x4"), epsilon=1.0, margin=1.0, threshold=64, seed=4)
    eng = RolloutEngine(
        m,
        drafter=EagleDrafter(cfg, rngs=nnx.Rngs(5)),
        spec=spec,
        max_batch=64,
        max_len=16,
        length_buckets=(16,),
        batch_buckets=(64,),
        chunk_size=1,
        compiler_options=FAST,
    )
    res = eng.generate([prompt], SamplingParams(temperature=1.0, n=2048, max_new_tokens=2, seed=7, ignore_eos=True))
    firsts = {c["choice"] for c in res.stats["chunks"]}
    assert firsts == {"off", "ngram:2x2x4", "eagle:2x2x4"}
    pairs = np.array([s[:2] for s in res.tokens[0]])
    counts = np.bincount(pairs[:, 0] * v + pairs[:, 1], minlength=v * v).astype(float)
    logp = lambda ids: np.asarray(jax.nn.log_softmax(m(jnp.array([ids])).logits[0, -1].astype(jnp.float32)))  # noqa: E731
    p1 = np.exp(logp(prompt))
    joint = np.concatenate([p1[a] * np.exp(logp(prompt + [a])) for a in range(v)])
    exp = joint * counts.sum()
    big = exp >= 5
    obs_b = np.append(counts[big], counts[~big].sum())
    exp_b = np.append(exp[big], exp[~big].sum())
    assert chisquare(obs_b, exp_b * obs_b.sum() / exp_b.sum()).pvalue > 1e-3


def test_drafter_catches_up_over_plain_and_ngram_steps(adaptive, model, drafter):
    """Prefill, plain chunks and n-gram verify steps only record the drafter's input pairs; the next EAGLE verify
    extends the drafter over them first. After prefill, plain, n-gram, plain steps the drafter has not run, and after
    catching up (alone, as a 0-round EAGLE step, and inside an EAGLE verify step) its cache and feature equal the
    drafter run over each row's whole sequence (prompt + output) at once."""
    from tlt_jax.adaptive import parse_arm
    from tlt_jax.rollout.drafter_sync import catch_up
    from tlt_jax.rollout.plan import step_key
    from tlt_jax.rollout.run import GenerateRun
    from tlt_jax.rollout.state import StepInfo
    from tlt_jax.speculative.tree import drafter_prefill, init_draft_state

    engine = adaptive  # its steps are precompiled; this test calls them directly, so its bandit is left alone
    prompts = [[5, 6, 7, 5, 6, 7], [9, 10, 11, 12, 13, 14], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    params = SamplingParams(temperature=0.0, n=2, max_new_tokens=[40, 3, 40], ignore_eos=True)
    run = GenerateRun(engine, prompts, [40, 3, 40], [0, 1, 2], params, ())
    state, info, slots, plen, _ = run.prefill([(i, j) for i in range(3) for j in range(2)])
    first = info.num_generated.copy()

    def advance(state, info, arm, rounds=None):
        args = (engine.step_params(), state)
        if arm.kind == "ngram":
            live = ~info.done & (slots >= 0)
            args = (*args, *map(run._put, run._ngram_trees(arm, live, slots)))
        if arm.kind == "eagle":
            args = (*args, run._rounds(engine.arm_specs[arm].steps_per_call if rounds is None else rounds))
        state, packed = engine.pool.get(step_key(arm, len(slots), 64), *args)(*args)
        new = StepInfo.unpack(jax.device_get(packed), speculative=arm.speculative)
        run._keep_tokens(new, info.num_generated, slots)
        return state, new

    for arm in ("off", "ngram:3x2x6", "off"):
        state, info = advance(state, info, parse_arm(arm))
    live = ~info.done & (slots >= 0)
    assert live.sum() == 4 and info.done[2:4].all()  # the second prompt's rows finished during the plain chunk
    assert (np.asarray(state.aux.draft.cache.lengths) == 0).all()  # nothing ran the drafter yet
    assert (info.num_generated - first)[live].min() > engine.chunk_size  # the n-gram step emitted tokens too

    def reference(state):
        """The drafter over each row's prompt + output in one pass: pairs (h_t, x_{t+1}) for t < the cache length."""
        n = np.asarray(state.num_generated)
        seqs = [list(prompts[s // 2]) + np.asarray(state.tokens)[r, : n[r]].tolist() if s >= 0 else [0]
                for r, s in enumerate(slots)]
        ids = np.zeros((len(seqs), 64), np.int32)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = s
        lens = np.array([len(s) for s in seqs])
        out = model(jnp.asarray(ids), attention_mask=jnp.arange(64)[None] < lens[:, None])
        ds = init_draft_state(CFG, len(seqs), engine.ctx.drafter_len)
        return drafter_prefill(model, drafter, ds, out.hidden, jnp.asarray(ids), jnp.asarray(lens - 1))

    def assert_current(draft, state):
        ref = reference(state)
        lengths = np.asarray(state.cache.lengths)
        np.testing.assert_array_equal(np.asarray(draft.cache.lengths)[live], lengths[live])
        for r in np.nonzero(live)[0]:
            n = lengths[r]
            for got, want in ((draft.cache.k, ref.cache.k), (draft.cache.v, ref.cache.v)):
                np.testing.assert_allclose(np.asarray(got)[0, r, :n], np.asarray(want)[0, r, :n], atol=2e-5)
            np.testing.assert_allclose(np.asarray(draft.feature)[r], np.asarray(ref.feature)[r], atol=2e-5)

    caught = jax.jit(lambda p, d, s: catch_up(p, d, s.aux, s.cache.lengths, s.done, piece=4, attend_len=64))(
        model, drafter, state
    )
    assert_current(caught.draft, state)
    alone, none = advance(jax.tree.map(jnp.copy, state), info, parse_arm("eagle:3x2x6"), rounds=0)
    np.testing.assert_array_equal(none.num_generated, info.num_generated)  # 0 rounds: the catch-up alone
    assert (none.verifies == 0).all()
    assert_current(alone.aux.draft, alone)
    state, info = advance(state, info, parse_arm("eagle:3x2x6"))  # catches up inside the step, then drafts
    assert (info.verifies[live] >= 1).all()
    assert_current(state.aux.draft, state)
