"""Speculative rollouts: the engine with an EAGLE or n-gram drafter emits exactly what plain decoding emits (greedy and
sampled, token for token, log-probs and captured hidden states too) whether tree decoding is on from the start or
switches on mid-rollout, across compaction, stop tokens and per-prompt budgets inside accepted paths; the pool compiles
nothing twice; stats report acceptance and SD on/off time; the generate CLI runs with --drafter=ngram.

Compile budget: every engine uses one length bucket and batch buckets (8, 2); engines of one drafter kind share
their prefill / decode / compaction programs (identical HLO is served by the persistent compilation cache).
"""

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest
from absl.testing import flagsaver
from flax import nnx

from tlt_jax import generate as gen
from tlt_jax.drafter import EagleDrafter
from tlt_jax.models import CausalLM, tiny_config
from tlt_jax.rollout import HiddenCapture, RolloutEngine, SamplingParams, SpecConfig
from tlt_jax.speculative import NgramDrafter

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
CFG = tiny_config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, eos_token_ids=()
)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
MAX_NEW = [12, 30, 20]  # n=2: 6 rows in bucket 8; 4 live after 12 tokens, 2 after 20 (compaction 8 -> 2)
KW = dict(
    max_batch=8,
    max_len=64,
    length_buckets=(64,),
    batch_buckets=(8, 2),
    capture=HiddenCapture(window=6),
    compiler_options=FAST,
)
GREEDY = SamplingParams(temperature=0.0, n=2, max_new_tokens=MAX_NEW, ignore_eos=True)
SAMPLED = [
    SamplingParams(temperature=1.0, n=2, max_new_tokens=MAX_NEW, seed=3, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, n=2, max_new_tokens=MAX_NEW, seed=5, ignore_eos=True),
]
# (kind, config): configs of one kind share (depth - 1) * topk, hence the drafter cache shape and its programs.
CONFIGS = {
    "eagle-a": ("eagle", SpecConfig(depth=3, topk=2, verify_tokens=6)),
    "eagle-b": ("eagle", SpecConfig(depth=5, topk=1, verify_tokens=5)),
    "ngram-a": ("ngram", SpecConfig(depth=4, topk=2, verify_tokens=9)),
    "ngram-b": ("ngram", SpecConfig(depth=2, topk=2, verify_tokens=4)),
}


@pytest.fixture(scope="module")
def model():
    return CausalLM(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def plain(model):
    return RolloutEngine(model, **KW)


@pytest.fixture(scope="module")
def drafter():
    return EagleDrafter(CFG, rngs=nnx.Rngs(1))  # random: drafts are rarely accepted, the output must not care


@pytest.fixture(scope="module")
def engines(model, drafter):
    cache = {}

    def get(name: str, threshold: int) -> RolloutEngine:
        if name not in cache:
            kind, spec = CONFIGS[name]
            cache[name] = RolloutEngine(model, drafter=drafter if kind == "eagle" else "ngram", spec=spec, **KW)
        eng = cache[name]
        eng.spec = dataclasses.replace(eng.spec, threshold=threshold)  # a host-side decision: no recompile
        return eng

    return get


@pytest.fixture(scope="module")
def reference(plain):
    return plain.generate(PROMPTS, GREEDY)


def assert_same(res, ref):
    assert res.tokens == ref.tokens
    assert res.finish_reason == ref.finish_reason
    flat = lambda r: np.concatenate([np.asarray(x) for row in r.logprobs for x in row])  # noqa: E731
    np.testing.assert_allclose(flat(res), flat(ref), atol=1e-5, rtol=0)
    for row, ref_row in zip(res.hidden, ref.hidden, strict=True):
        for h, h_ref in zip(row, ref_row, strict=True):
            np.testing.assert_allclose(h, h_ref, atol=1e-5, rtol=0)


@dataclasses.dataclass
class Oracle(NgramDrafter):
    """A host drafter that knows the answer: the reference continuation as a chain, plus wrong siblings."""

    reference: dict = dataclasses.field(default_factory=dict)  # prompt tuple -> greedy continuation

    def propose_one(self, b, contexts):
        ctx = [int(t) for t in contexts[b]]
        prompt = next(p for p in self.reference if tuple(ctx[: len(p)]) == p)
        chain = self.reference[prompt][len(ctx) - len(prompt) : len(ctx) - len(prompt) + self.max_depth]
        n = self.num_nodes
        tokens, parent, valid = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, bool)
        tokens[0], parent[0], valid[0] = ctx[-1], -1, True
        for i, t in enumerate(chain[: n - 1]):
            tokens[i + 1], parent[i + 1], valid[i + 1] = t, i, True
        k = len(chain[: n - 1]) + 1
        for i, t in enumerate(chain):
            if k >= n:
                break
            tokens[k], parent[k], valid[k] = (t + 1) % CFG.vocab_size, i, True
            k += 1
        return tokens, parent, valid


def test_spec_config_and_engine_arguments_are_validated(model):
    assert (SpecConfig().depth, SpecConfig().topk, SpecConfig().verify_tokens, SpecConfig().threshold) == (8, 4, 48, 32)
    for kw, match in [
        (dict(depth=0), "depth"),
        (dict(topk=0), "topk"),
        (dict(verify_tokens=1), "verify_tokens"),
        (dict(depth=2, topk=2, verify_tokens=8), r"verify_tokens must be in \[2, 7\]"),
        (dict(threshold=-1), "threshold"),
        (dict(steps_per_call=0), "steps_per_call"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpecConfig(**kw)
    with pytest.raises(ValueError, match="spec was given without a drafter"):
        RolloutEngine(model, spec=SpecConfig(), **KW)
    with pytest.raises(ValueError, match="'ngram'"):
        RolloutEngine(model, drafter="suffix", **KW)
    with pytest.raises(ValueError, match="an EagleDrafter, or 'ngram'; got object"):  # not a TreeDrafter
        RolloutEngine(model, drafter=object(), **KW)
    other = nnx.eval_shape(lambda: EagleDrafter(tiny_config(hidden_size=48), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="hidden_size"):
        RolloutEngine(model, drafter=other, **KW)


# (config, threshold): 8 = tree decoding from the first step (compaction 8 -> 2 inside speculative mode); 4 = switch
# mid-rollout while still in bucket 8, then compaction; 2 = switch right after the compaction.
CASES = [("eagle-a", 8), ("eagle-a", 4), ("eagle-b", 2), ("ngram-a", 8), ("ngram-a", 4), ("ngram-b", 2)]


@pytest.mark.parametrize("name,threshold", CASES)
def test_greedy_equals_plain(engines, plain, reference, name, threshold):
    eng = engines(name, threshold)
    res = eng.generate(PROMPTS, GREEDY)
    assert_same(res, reference)
    st = res.stats
    arms = [c["arm"] for c in st["chunks"]]
    batches = [c["batch"] for c in st["chunks"]]
    assert res.stats["compactions"] and batches[0] == 8 and batches[-1] == 2
    if threshold == 8:
        assert set(arms) == {eng.spec_arm} and st["sd_off_seconds"] == 0
    else:
        assert arms[0] == "plain" and arms[-1] == eng.spec_arm and st["sd_off_seconds"] > 0
        (switch,) = st["spec"]["switches"]
        assert switch["active"] <= threshold and switch["batch"] == (8 if threshold == 4 else 2)
    assert st["sd_on_seconds"] > 0 and st["verify_steps"] > 0 and st["mean_accept_length"] >= 1.0
    assert st["arms"][eng.spec_arm] == arms.count(eng.spec_arm) and st["tokens_per_s"] > 0
    # A stop token the model emits: rows end on it exactly where plain decoding ends them (paths are truncated).
    stop = reference.tokens[1][0][7]
    eos = dataclasses.replace(GREEDY, ignore_eos=False, stop_token_ids=[stop])
    want = plain.generate(PROMPTS, eos)
    assert any(row[-1] == stop and len(row) < m for rows, m in zip(want.tokens, MAX_NEW, strict=True) for row in rows)
    assert_same(eng.generate(PROMPTS, eos), want)


@pytest.mark.parametrize("name", ["eagle-a", "ngram-a"])
def test_sampling_equals_plain_token_for_token(engines, plain, name):
    """Each emitted token is drawn with its own position's key in both modes, so the samples coincide."""
    for threshold in (8, 4):
        eng = engines(name, threshold)
        for params in SAMPLED:
            want = plain.generate(PROMPTS, params)
            assert_same(eng.generate(PROMPTS, params), want)
            assert want.tokens[0][0] != want.tokens[0][1]


def test_oracle_paths_with_stop_tokens_and_budgets(engines, plain, reference):
    """Drafts that are always right: whole paths accepted (accept length ~ depth + 1), and stop tokens / budgets
    that fall inside an accepted path cut it exactly where plain decoding stops."""
    eng = engines("ngram-a", 8)
    template = eng.ngram
    answers = {tuple(p): reference.tokens[i][0] for i, p in enumerate(PROMPTS)}
    eng.ngram = Oracle(num_nodes=9, max_depth=4, reference=answers)
    try:
        res = eng.generate(PROMPTS, GREEDY)
        assert_same(res, reference)
        st = res.stats
        assert st["mean_accept_length"] > 4.0 and st["spec"]["mean_accepted_drafts"] > 3.0
        # 1 token from prefill, then 5 per verify step: max_new 12 ends 1 token into the third path.
        assert st["verify_steps"] == -(-(max(MAX_NEW) - 1) // 5)
        stop = reference.tokens[1][0][7]  # generated token 7: the middle of the second path (tokens 6..10)
        eos = dataclasses.replace(GREEDY, ignore_eos=False, stop_token_ids=[stop])
        want = plain.generate(PROMPTS, eos)
        assert len(want.tokens[1][0]) <= 8 and want.tokens[1][0][-1] == stop
        assert_same(eng.generate(PROMPTS, eos), want)
    finally:
        eng.ngram = template


def test_ngram_accepts_on_repetitive_text_and_second_call_compiles_nothing(engines, plain, drafter):
    prompts = [[7, 8, 9, 10] * 4, [20, 21, 22] * 5]
    params = SamplingParams(temperature=0.0, n=2, max_new_tokens=[24, 16], ignore_eos=True)
    want = plain.generate(prompts, params)
    eng = engines("ngram-a", 8)
    res = eng.generate(prompts, params)
    assert_same(res, want)
    assert res.stats["mean_accept_length"] > 1.5  # the random model loops, so lookups in its own output hit
    for name in ("ngram-a", "eagle-a"):
        eng = engines(name, 4)
        first = eng.generate(PROMPTS, SAMPLED[0])
        again = eng.generate(PROMPTS, SAMPLED[0])
        assert again.tokens == first.tokens
        assert again.stats["pool_this_call"]["compiles"] == 0 and again.stats["pool_this_call"]["misses"] == 0
        keys = eng.pool.keys()
        assert any(k.phase == "verify" and k.arm == eng.spec_arm for k in keys)
    # New drafter weights (TLT trains the drafter between steps): compiled steps reused, output unchanged.
    other = nnx.clone(drafter)
    other.fc_bias[...] = other.fc_bias[...] + 0.5
    eng.set_drafter(other)
    try:
        res = eng.generate(PROMPTS, SAMPLED[0])
    finally:
        eng.set_drafter(drafter)
    assert res.tokens == first.tokens and res.stats["pool_this_call"]["compiles"] == 0


def test_generate_cli_with_ngram_drafter(monkeypatch, capsys):
    monkeypatch.setattr(gen, "RolloutEngine", functools.partial(RolloutEngine, compiler_options=FAST))
    model = Path(__file__).parent / "fixtures" / "tiny_qwen2"
    flags = dict(
        model=str(model),
        chat=False,
        prompt="a b c a b c a b c",
        max_new_tokens=7,  # 9 prompt tokens + 7 fit one length bucket (16): one verify program
        num_samples=2,
        drafter="ngram",
        spec_depth=3,
        spec_topk=2,
        spec_verify_tokens=6,
        chunk_size=2,  # adaptive: "off" runs the first chunk (untried arms in order), the tree the next
    )
    with flagsaver.flagsaver(**flags):
        gen.main([])
    out = capsys.readouterr().out
    assert "--- sample 1" in out and "tokens/s" in out
    line = next(x for x in out.splitlines() if "mean accept length" in x)
    # Default --spec_arms=auto: the bandit tries "off" and the flags' tree (untried arms first), and reports both.
    assert "adaptive, tokens/s per arm: ngram:3x2x6" in line and ", off " in line
    assert float(line.split("mean accept length ")[1].split()[0]) >= 1.0
    with flagsaver.flagsaver(**flags, spec_arms="fixed"):
        gen.main([])
    line = next(x for x in capsys.readouterr().out.splitlines() if "mean accept length" in x)
    assert "tree/ngram/d3k2n6" in line and float(line.split("mean accept length ")[1].split()[0]) >= 1.0
    with flagsaver.flagsaver(**flags, spec_arms="off,ngram:3x2x99"), pytest.raises(SystemExit, match="3x2x99"):
        gen.main([])
