"""Drafts from earlier rollouts (issue 60, part 3): the bounded store of earlier calls' responses per prompt, its
checkpoint state, the n-gram trees drawing from it (accepting more on a second pass over the same prompts) with the
output still plain decoding's token for token (greedy and sampled), and ``rollout.ngram_history_bytes`` reaching
the engine through the builders."""

import json

import numpy as np
import pytest
from flax import nnx

from tlt_jax.models import CausalLM, tiny_config
from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig
from tlt_jax.speculative.history import NgramHistory, prompt_key

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
CFG = tiny_config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, eos_token_ids=()
)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
MAX_NEW = [12, 30, 20]
KW = dict(max_batch=8, max_len=64, length_buckets=(64,), batch_buckets=(8, 2), compiler_options=FAST)
SPEC = SpecConfig(depth=4, topk=2, verify_tokens=9, threshold=8)


def test_store_bounds_order_and_state_dict():
    h = NgramHistory(max_bytes=40, per_prompt=3)  # 10 int32 tokens in all
    h.add([1, 2], [[10, 11], [12, 13, 14], []])  # the empty response is skipped
    h.add([3], [[20, 21, 22]])
    assert len(h) == 3 and h.num_prompts == 2 and h.nbytes == 32
    assert [r.tolist() for r in h.get([1, 2])] == [[12, 13, 14], [10, 11]]  # newest first
    assert h.get([2, 1]) == [] and prompt_key([1, 2]) != prompt_key([2, 1])
    h.add([3], [[23, 24, 25]])  # 44 bytes > 40: the oldest response of any prompt ([10, 11]) leaves
    assert [r.tolist() for r in h.get([1, 2])] == [[12, 13, 14]] and h.nbytes == 36
    h.add([3], [[26], [27]])  # prompt [3] now has 4 > per_prompt: its oldest ([20, 21, 22]) leaves
    assert [r.tolist() for r in h.get([3])] == [[27], [26], [23, 24, 25]] and h.nbytes == 32
    h.add([4], [list(range(11))])  # larger than the whole store: not kept, nothing evicted
    assert h.get([4]) == [] and len(h) == 4
    state = json.loads(json.dumps(h.state_dict()))  # JSON values (the checkpoint's controller item)
    back = NgramHistory(max_bytes=40, per_prompt=3)
    back.load_state_dict(state)
    assert back.state_dict() == h.state_dict()
    assert [r.tolist() for r in back.get([3])] == [[27], [26], [23, 24, 25]]
    small = NgramHistory(max_bytes=8)
    small.load_state_dict(state)  # its own bound: the newest that fit
    assert [r.tolist() for r in small.get([3])] == [[27], [26]] and small.get([1, 2]) == []
    with pytest.raises(ValueError, match="version"):
        back.load_state_dict(dict(state, version=99))
    with pytest.raises(ValueError, match="max_bytes"):
        NgramHistory(-1)


@pytest.fixture(scope="module")
def model():
    return CausalLM(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def plain(model):
    return RolloutEngine(model, **KW)


def _accept(res) -> float:
    return res.stats["mean_accept_length"]


def test_greedy_with_history_equals_plain_and_accepts_more_the_second_time(model, plain):
    params = SamplingParams(temperature=0.0, n=2, max_new_tokens=MAX_NEW, ignore_eos=True)
    want = plain.generate(PROMPTS, params)
    eng = RolloutEngine(model, drafter="ngram", spec=SPEC, ngram_history_bytes=1 << 20, **KW)
    assert eng.ngram_history is not None and len(eng.ngram_history) == 0
    first = eng.generate(PROMPTS, params)
    assert len(eng.ngram_history) == 6 and eng.ngram_history.get(PROMPTS[1])[0].tolist() == want.tokens[1][1]
    second = eng.generate(PROMPTS, params)
    assert first.tokens == want.tokens and second.tokens == want.tokens  # fp32, token for token
    np.testing.assert_allclose(np.concatenate([np.asarray(x) for g in second.logprobs for x in g]),
                               np.concatenate([np.asarray(x) for g in want.logprobs for x in g]), atol=1e-5, rtol=0)
    # The stored greedy answers are the continuation: whole paths (depth 4 + the bonus token) are accepted.
    assert _accept(second) > 4.0 > _accept(first) + 1.0
    restored = RolloutEngine(model, drafter="ngram", spec=SPEC, ngram_history_bytes=1 << 20, **KW)
    restored.load_state_dict(eng.state_dict())  # the engine's own state (the bandit's) leaves the store alone
    restored.ngram_history.load_state_dict(json.loads(json.dumps(eng.ngram_history.state_dict())))
    again = restored.generate(PROMPTS, params)
    assert again.tokens == want.tokens and _accept(again) == _accept(second)
    assert RolloutEngine(model, drafter="ngram", spec=SPEC, **KW).ngram_history is None  # default: off
    assert RolloutEngine(model, ngram_history_bytes=1 << 20, **KW).ngram_history is None  # no n-gram arm


def test_sampled_with_history_equals_plain_with_the_same_seed(model, plain):
    """Another epoch: the store holds seed 3's samples, the rollout draws seed 5's; each token is still drawn with
    its own position's key, so the samples are plain sampling's."""
    eng = RolloutEngine(model, drafter="ngram", spec=SPEC, ngram_history_bytes=1 << 20, **KW)
    seeds = [SamplingParams(temperature=t, n=2, max_new_tokens=MAX_NEW, seed=s, ignore_eos=True)
             for t, s in [(1.0, 3), (1.0, 5), (0.7, 5)]]
    for params in seeds:
        want = plain.generate(PROMPTS, params)
        res = eng.generate(PROMPTS, params)
        assert res.tokens == want.tokens and res.finish_reason == want.finish_reason
        np.testing.assert_allclose(np.concatenate([np.asarray(x) for g in res.logprobs for x in g]),
                                   np.concatenate([np.asarray(x) for g in want.logprobs for x in g]), atol=1e-5,
                                   rtol=0)
        assert want.tokens[0][0] != want.tokens[0][1]
    assert len(eng.ngram_history) == 3 * 6 and eng.ngram_history.num_prompts == 3


def test_config_key_reaches_the_engine_through_the_builders():
    from test_main import _cfg

    from tlt_jax.builders import build_data, build_engine, build_model
    from tlt_jax.distributed import make_mesh
    from tlt_jax.typed_config import ConfigError

    args = ("--config.rollout.speculative=ngram", "--config.rollout.spec_depth=3", "--config.rollout.spec_topk=2",
            "--config.rollout.spec_verify_tokens=6", "--config.eval.max_new_tokens=2")
    cfg = _cfg("tiny.py", *args, "--config.rollout.ngram_history_bytes=4096")
    mesh = make_mesh(cfg.mesh)
    model, tok = build_model(cfg, mesh)
    data = build_data(cfg, tok, model.config)
    engine = build_engine(cfg, model, mesh, data)
    assert engine.ngram_history.max_bytes == 4096
    prompts = [ex["prompt_ids"] for ex in data.train[:2]]
    engine.generate(prompts, SamplingParams(temperature=1.0, n=2, max_new_tokens=4, ignore_eos=True))
    assert len(engine.ngram_history) == 4 and engine.ngram_history.nbytes == 4 * 4 * 4
    assert build_engine(_cfg("tiny.py", *args), model, mesh, data).ngram_history is None  # default 0: off
    with pytest.raises(ConfigError, match="rollout.ngram_history_bytes"):
        _cfg("tiny.py", "--config.rollout.ngram_history_bytes=-1")


def test_main_job_checkpoints_the_store_and_a_resumed_run_drafts_from_it(tmp_path):
    """The main job with n-gram speculation over a store of earlier steps' responses (every step the same 8 prompts,
    sampled at T = 0.05, so at step 2 each row's step-1 responses predict it): the store is in the checkpoint, and a
    run stopped after step 1 and resumed speculates at step 2 exactly as the uninterrupted run (same accept length);
    without the store the same step accepts less (the store is what it drafts from)."""
    from test_main import _assert_same_metrics, _cfg, _train_rows

    from tlt_jax.main import run

    args = ("--config.rollout.speculative=ngram", "--config.rollout.spec_depth=4", "--config.rollout.spec_topk=2",
            "--config.rollout.spec_verify_tokens=9", "--config.rollout.spec_threshold=64",
            "--config.rollout.temperature=0.05",
            "--config.data.synthetic.num_prompts=8", "--config.eval.at_start=False", "--config.eval.every_steps=0",
            "--config.metrics.tensorboard=False", "--config.checkpoint.every_steps=1")
    store = ("--config.rollout.ngram_history_bytes=65536",)
    run(_cfg("tiny.py", *args, *store, "--config.train.num_steps=2"), str(tmp_path / "whole"))
    run(_cfg("tiny.py", *args, *store, "--config.train.num_steps=1"), str(tmp_path / "resumed"))
    run(_cfg("tiny.py", *args, *store, "--config.train.num_steps=2"), str(tmp_path / "resumed"))
    run(_cfg("tiny.py", *args, "--config.train.num_steps=2"), str(tmp_path / "none"))
    whole, resumed, none = (_train_rows(tmp_path / d) for d in ("whole", "resumed", "none"))
    rl = lambda row: {k: v for k, v in row.items() if k.startswith(("reward/", "response/", "train/"))}  # noqa: E731
    _assert_same_metrics(rl(whole[2]), rl(resumed[2]), 2)
    assert whole[2]["rollout/accept_length"] == resumed[2]["rollout/accept_length"]
    assert whole[2]["rollout/accept_length"] > none[2]["rollout/accept_length"] + 0.1, (whole[2], none[2])
    saved = json.loads((tmp_path / "whole" / "checkpoints" / "1" / "controller" / "metadata").read_text())
    assert len(saved["ngram_history"]["entries"]) == 8 * 4  # step 1's 8 prompts x 4 samples
