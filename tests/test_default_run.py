"""The default run's pieces: the arithmetic task, the format + correctness reward, the shipped drafter, adaptive
speculation with online drafter training (sliced, resumed), and the console's arm column."""

import json

import numpy as np
import pytest
from test_main import _cfg, _train_rows

from tlt_jax.assets import EMBEDDED_DRAFTER, EMBEDDED_DRAFTERS, resolve_drafter_path
from tlt_jax.config import ConfigError
from tlt_jax.data import ANSWER_IS_INSTRUCTION, PromptFormatter, generated_splits
from tlt_jax.main import run
from tlt_jax.metrics.writers import ConsoleTable, speculative_arm
from tlt_jax.rewards import GSM8KReward, has_answer_statement


def test_arithmetic_splits_are_disjoint_additions_with_numeric_answers():
    fmt = PromptFormatter(instruction=ANSWER_IS_INSTRUCTION)
    s = generated_splits("arithmetic", 300, 20, formatter=fmt)
    assert len(s.train) == 300 and len(s.eval) == 20
    assert not {e["question"] for e in s.train} & {e["question"] for e in s.eval}
    for ex in s.train[:50] + s.eval:
        a, b = (int(x) for x in ex["question"].split("Calculate ")[1].rstrip(".").split(" + "))
        assert 0 <= a < 100 and 0 <= b < 100 and int(ex["ground_truth"]) == a + b
        assert ex["prompt_text"].startswith(ANSWER_IS_INSTRUCTION)
    again = generated_splits("arithmetic", 300, 20, formatter=fmt)
    assert [e["question"] for e in again.train] == [e["question"] for e in s.train]  # deterministic
    with pytest.raises(ValueError, match="unknown generated task 'algebra'"):
        generated_splits("algebra", 4, 2)


def test_answer_statement_is_the_format_part():
    stated = ["The answer is 7.", "so the answer is: 42", "The answer is N = 109.", "#### 12", "\\boxed{3}",
              "The answer is -3", "The answer is $5"]
    unstated = ["1 + 6 = 7", "The answer is N.", "the answer is unknown, maybe 5", ""]
    assert all(has_answer_statement(t) for t in stated)
    assert not any(has_answer_statement(t) for t in unstated)


def test_format_reward_adds_to_correctness_and_accuracy_stays_exact_match():
    from tlt_jax.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    texts = [["12 + 30 = 42. The answer is 42.", "12 + 30 = 42", "The answer is 41.", "I do not know."]]
    completions = [[tok.encode(t) for t in texts[0]]]
    examples = [{"ground_truth": "42"}]
    with pytest.raises(ValueError, match="format_weight must be >= 0"):
        GSM8KReward(tok, num_workers=1, format_weight=-1)
    for w in (0.0, 0.5):
        r = GSM8KReward(tok, num_workers=1, format_weight=w)
        try:
            out = r(examples, completions)
        finally:
            r.close()
        np.testing.assert_allclose(out.scores, [[1 + w, 1, w, 0]])
        assert out.correct.tolist() == [[True, True, False, False]]
        assert out.info.get("reward/format") == (pytest.approx(0.5) if w else None)


def test_shipped_drafter_and_adaptive_online_config():
    path = resolve_drafter_path(EMBEDDED_DRAFTER)
    shipped = EMBEDDED_DRAFTERS[EMBEDDED_DRAFTER]
    assert path == str(shipped) and (shipped / "tlt_drafter.json").is_file() and (shipped / "warmup.json").is_file()
    assert resolve_drafter_path("/some/dir") == "/some/dir"
    cfg = _cfg("gsm8k.py")  # the default run: adaptive arms with eagle, the shipped drafter, online training
    assert cfg.rollout.speculative == "adaptive" and cfg.drafter.online and cfg.rollout.needs_eagle
    assert cfg.data.source == "arithmetic" and cfg.rl.kl_coef == 0 and cfg.eval.every_steps > 0
    with pytest.raises(ConfigError, match=r"drafter_path.*neither a directory nor a shipped drafter.*eagle-smollm2"):
        _cfg("gsm8k.py", "--config.rollout.drafter_path=no-such-drafter")
    with pytest.raises(ConfigError, match=r"drafter.online.*spec_arms='off,ngram:3x2x6' drafts with none"):
        _cfg("gsm8k.py", "--config.rollout.spec_arms=off,ngram:3x2x6")
    with pytest.raises(ConfigError, match=r"rollout.drafter_path: an 'eagle:' arm needs a drafter"):
        _cfg("gsm8k.py", "--config.rollout.drafter_path=", "--config.drafter.online=False")
    _cfg("gsm8k.py", "--config.rollout.drafter_path=")  # online: a fresh drafter
    with pytest.raises(ConfigError, match=r"reward.format_weight.*must be >= 0"):
        _cfg("gsm8k.py", "--config.reward.format_weight=-0.5")
    assert _cfg("gsm8k.py", "--config.reward.format_weight=0.5").reward.format_weight == 0.5


def test_console_names_the_arm_the_bandit_ran_most():
    assert speculative_arm({"reward/mean": 1.0}) is None
    assert speculative_arm({"rollout/arm_share/off": 1.0, "rollout/arm_share/eagle:3x1x4": 0.0}) == "off"
    m = {"rollout/arm_share/off": 0.5, "rollout/arm_share/eagle:3x1x4": 0.2, "rollout/arm_share/eagle:5x1x6": 0.3}
    assert speculative_arm(m) == "eagle:5x1x6 30%"
    t = ConsoleTable(speculative=True, adaptive=True)
    assert t.header().split()[-2:] == ["arm", "(share)"]
    assert t.row(dict(m, step=3)).endswith("eagle:5x1x6 30%") and t.row({"step": 4}).endswith("-")


def _slice_bandits(workdir, step):
    for p in (workdir / "checkpoints" / str(step) / "controller").rglob("*"):
        if p.is_file():
            try:
                return [s["bandit"] for s in json.loads(p.read_text())["engine"]["slices"]]
            except (ValueError, KeyError, UnicodeDecodeError):
                continue
    raise AssertionError(f"no sliced bandit state in checkpoint {step}")


@pytest.mark.slow
def test_adaptive_speculation_with_online_drafter_on_two_slices_resumes(tmp_path):
    """speculative="adaptive" with an eagle arm and drafter.online (a fresh drafter) on 2 rollout slices: arm shares
    and drafter metrics per step, every slice's bandit in the checkpoint, and a resumed run continues each bandit and
    gives the uninterrupted run's RL metrics (samples do not depend on the arms)."""
    common = (
        "--config.eval.at_start=False", "--config.metrics.tensorboard=False", "--config.checkpoint.every_steps=1",
        "--config.rollout.speculative=adaptive", "--config.rollout.spec_arms=off,eagle:2x1x3",
        "--config.rollout.spec_epsilon=0.5", "--config.drafter.online=True", "--config.rollout.num_slices=2",
        "--config.drafter.row_len=64", "--config.drafter.window=16", "--config.drafter.steps_without_idle=1",
    )
    run(_cfg("tiny.py", "--config.train.num_steps=3", *common), str(tmp_path / "straight"))
    run(_cfg("tiny.py", "--config.train.num_steps=2", *common), str(tmp_path / "resumed"))
    rows = _train_rows(tmp_path / "resumed")
    for step in (1, 2):
        shares = {k: v for k, v in rows[step].items() if k.startswith("rollout/arm_share/")}
        assert set(shares) <= {"rollout/arm_share/off", "rollout/arm_share/eagle:2x1x3"} and shares
        assert sum(shares.values()) == pytest.approx(1.0)
        assert rows[step]["drafter/steps"] >= 1 and np.isfinite(rows[step]["rollout/accept_length"])
    before = _slice_bandits(tmp_path / "resumed", 2)
    assert len(before) == 2 and all(b["arms"] == ["off", "eagle:2x1x3"] for b in before)
    run(_cfg("tiny.py", "--config.train.num_steps=3", *common), str(tmp_path / "resumed"))
    after = _slice_bandits(tmp_path / "resumed", 3)
    for b, a in zip(before, after, strict=True):
        for bucket, window in b["observations"].items():
            assert a["observations"][bucket][: len(window)] == window  # restored, then extended
    straight, resumed = _train_rows(tmp_path / "straight")[3], _train_rows(tmp_path / "resumed")[3]
    for k in ("reward/mean", "train/loss", "train/kl_loss", "response/len_mean"):
        assert resumed[k] == pytest.approx(straight[k], abs=1e-6), k
    with pytest.raises(ConfigError, match="rollout.num_slices must match"):
        run(_cfg("tiny.py", "--config.train.num_steps=4", *common[:-4], "--config.rollout.num_slices=4",
                 *common[-3:]), str(tmp_path / "resumed"))
