"""Answer extraction, GSM8K scoring, and the parallel scorer's timeout / crash handling."""

import os
import signal
import time

import numpy as np
import pytest

from tlt_jax.rewards import ParallelScorer, extract_answer, parse_number, score_batch, score_gsm8k

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the total is\n#### 1,234", "1,234"),
        ("#### 5 apples, not 7", "5"),  # the first number after the last ####
        ("first #### 3 then #### 4", "4"),
        ("#### no number here", None),  # #### present but empty: no fallback to earlier numbers
        (r"we get 3 and 5, so \boxed{8}", "8"),
        (r"\boxed{1} wait, no: \boxed{2}", "2"),
        (r"\boxed{\frac{3}{4}}", "3/4"),
        (r"\boxed{\dfrac{-1}{2}}", "-1/2"),
        (r"\boxed{1{,}234 \text{ dollars}}", "1,234"),
        (r"\boxed{x = 5}", "5"),
        (r"\boxed{\{1\}} \boxed 7", "7"),
        ("160-48=112 emails per day, 112*5=560", "560"),
        ("The answer is -5.", "-5"),
        ("The answer is \u22125", "-5"),  # unicode minus
        ("It costs $1,234.50.", "1,234.50"),
        ("about 50% of them", "50"),
        ("only .5 left", ".5"),
        ("3/4 of the pie", "3/4"),
        ("version2 has no number", None),
        ("no digits at all", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "s, value",
    [("1,234", 1234.0), ("-5", -5.0), (".5", 0.5), ("0.50", 0.5), ("3/4", 0.75), ("-1/2", -0.5), ("1/0", None)],
)
def test_parse_number(s, value):
    assert parse_number(s) == value


@pytest.mark.parametrize(
    "completion, ground_truth, score",
    [
        ("Step by step ... #### 72", GSM8K_SOLUTION, 1.0),
        ("Step by step ... #### 71", GSM8K_SOLUTION, 0.0),
        ("She sold 72 clips.", GSM8K_SOLUTION, 1.0),  # last number
        (r"So \boxed{72}. Check: 72-1=71", GSM8K_SOLUTION, 1.0),  # boxed wins over the last number
        ("#### $1,234.", "1234", 1.0),
        ("#### 1234 dollars", "#### 1,234", 1.0),
        ("#### 3.0", "3", 1.0),
        ("#### 0.50", ".5", 1.0),
        ("#### 50%", "50", 1.0),
        ("#### -5", "-5", 1.0),
        ("#### 5", "-5", 0.0),
        (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
        ("#### 3/4", "0.75", 1.0),
        ("#### 3.000001", "3", 0.0),  # beyond the tolerance
        ("#### 3.0000000001", "3", 1.0),
        ("I don't know", "3", 0.0),
        ("", "3", 0.0),
    ],
)
def test_score_gsm8k(completion, ground_truth, score):
    assert score_gsm8k(completion, ground_truth) == score


def test_ground_truth_without_number_raises():
    with pytest.raises(ValueError, match="ground truth"):
        score_gsm8k("#### 1", "no answer")


# Score functions run in spawned workers, so they are module-level (picklable by reference).
def _slow_score(completion: str, ground_truth: str) -> float:
    if completion == "slow":
        time.sleep(30)
    return score_gsm8k(completion, ground_truth)


def _stuck_score(completion: str, ground_truth: str) -> float:
    """Hangs where the per-item timer cannot interrupt it (SIGALRM blocked), like a stuck C extension."""
    if completion == "stuck":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
    return score_gsm8k(completion, ground_truth)


def _faulty_score(completion: str, ground_truth: str) -> float:
    if completion == "raise":
        raise RuntimeError("bad item")
    if completion == "nan":
        return float("nan")
    if completion == "die":
        os._exit(1)
    return score_gsm8k(completion, ground_truth)


def _pid_score(completion: str, ground_truth: str) -> float:
    return float(os.getpid())


def test_score_batch_matches_serial_and_reuses_workers():
    completions = [f"#### {i}" for i in range(20)] + ["no answer", r"\boxed{7}"]
    truths = [str(i if i % 3 else i + 1) for i in range(20)] + ["1", "7"]
    out = score_batch(completions, truths, num_workers=2, timeout_s=5.0)
    expected = [score_gsm8k(c, t) for c, t in zip(completions, truths, strict=True)]
    np.testing.assert_array_equal(out.scores, np.asarray(expected, np.float32))
    assert out.scores.dtype == np.float32 and (out.num_timeouts, out.num_errors) == (0, 0)
    assert score_batch([], [], num_workers=2).scores.shape == (0,)

    with ParallelScorer(_pid_score, num_workers=2) as scorer:
        first = set(scorer(["a"] * 16, ["1"] * 16).scores.tolist())
        second = set(scorer(["a"] * 16, ["1"] * 16).scores.tolist())
        assert 1 <= len(first) <= 2 and second <= first  # the same worker processes served both calls
        assert os.getpid() not in first
    with pytest.raises(ValueError, match="ground truths"):
        score_batch(["a", "b"], ["1"])


def test_timeouts_and_errors_score_zero_and_are_counted():
    with ParallelScorer(_slow_score, num_workers=2, timeout_s=0.5) as scorer:
        t0 = time.monotonic()
        out = scorer(["#### 1", "slow", "#### 3", "slow", "#### 4"], ["1", "2", "3", "4", "5"])
        assert time.monotonic() - t0 < 20  # the 30 s items were cut short
        np.testing.assert_array_equal(out.scores, [1, 0, 1, 0, 0])
        assert (out.num_timeouts, out.num_errors) == (2, 0)
        again = scorer(["#### 2"], ["2"])  # workers survived the timeouts
        assert again.scores.tolist() == [1.0] and again.num_timeouts == 0

    with ParallelScorer(_faulty_score, num_workers=2, timeout_s=5.0) as scorer:
        out = scorer(["raise", "#### 2", "nan"], ["1", "2", "3"])
        np.testing.assert_array_equal(out.scores, [0, 1, 0])
        assert (out.num_timeouts, out.num_errors) == (0, 2)
        crashed = scorer(["die"], ["1"])  # a worker process dies: counted, pool rebuilt
        assert crashed.scores.tolist() == [0.0] and crashed.num_errors == 1
        after = scorer(["#### 1", "#### 2"], ["1", "2"])
        assert after.scores.tolist() == [1.0, 1.0] and after.num_errors == 0


def test_uninterruptible_hang_hits_batch_deadline():
    # Generous per-item time (1 s): a loaded machine must still score the healthy item in time.
    with ParallelScorer(_stuck_score, num_workers=2, timeout_s=1.0, grace_s=2.0) as scorer:
        assert scorer(["#### 1"], ["1"]).scores.tolist() == [1.0]  # warm the pool so start-up is not timed
        t0 = time.monotonic()
        out = scorer(["stuck", "#### 2"], ["1", "2"])
        assert time.monotonic() - t0 < 15
        assert out.scores.tolist() == [0.0, 1.0] and out.num_timeouts == 1
        assert scorer(["#### 3"], ["3"]).scores.tolist() == [1.0]  # a fresh pool replaced the stuck one


def test_target_token_reward_scores_fraction_of_max_new_tokens():
    from tlt_jax.rewards import RewardOutput, TargetTokenReward

    reward = TargetTokenReward(max_new_tokens=4)
    out = reward([{"ground_truth": "5"}, {"ground_truth": "7"}], [[[5, 5, 5, 5], [5, 1]], [[7, 7, 7, 1], []]])
    assert isinstance(out, RewardOutput)
    np.testing.assert_allclose(out.scores, [[1.0, 0.25], [0.75, 0.0]])  # stopping early scores the rest as 0
    assert out.correct.tolist() == [[True, False], [False, False]]
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        TargetTokenReward(0)


def test_gsm8k_reward_decodes_and_scores_in_workers():
    from tlt_jax.rewards import GSM8KReward

    class Chars:  # token id = a character's code point
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    enc = lambda s: [ord(c) for c in s]
    reward = GSM8KReward(Chars(), num_workers=1, timeout_s=5.0)
    try:
        out = reward([{"ground_truth": "72"}], [[enc("so #### 72"), enc("#### 71")]])
    finally:
        reward.close()
    assert out.scores.tolist() == [[1.0, 0.0]] and out.correct.tolist() == [[True, False]]
    assert out.info == {"reward/timeouts": 0.0, "reward/errors": 0.0}
