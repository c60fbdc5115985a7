"""A long-tailed tiny task (``data.synthetic.answer_len_sigma``): each prompt carries its own answer length, so
rollout slices finish at different times and the drafter trains in their idle time (TLT's spot training), with
no training outside it (``drafter.steps_without_idle=0``)."""

import json

import numpy as np
import pytest
from test_main import _cfg, _train_rows
from test_online import QUIET

from tlt_jax.config import ConfigError
from tlt_jax.controller import TIMELINE_FILE
from tlt_jax.main import run


def test_per_example_answer_lengths_cap_the_reward():
    from tlt_jax.rewards import TargetTokenReward, example_max_new_tokens

    reward = TargetTokenReward(max_new_tokens=4)
    examples = [{"ground_truth": "5", "max_new_tokens": 2}, {"ground_truth": "5", "max_new_tokens": 9}]
    out = reward(examples, [[[5, 5], [5, 1]], [[5, 5, 5, 5], [5]]])
    np.testing.assert_allclose(out.scores, [[1.0, 0.5], [1.0, 0.25]])  # the second is capped at 4
    assert out.correct.tolist() == [[True, False], [True, False]]
    assert [example_max_new_tokens(ex, 4) for ex in [*examples, {}]] == [2, 4, 4]
    with pytest.raises(ConfigError, match=r"config.data.synthetic.answer_len_sigma: must be >= 0"):
        _cfg("tiny.py", "--config.data.synthetic.answer_len_sigma=-1")


def test_slices_that_finish_early_train_the_drafter(tmp_path):
    """configs/tiny_tlt.py: two slices, long-tailed answers, no drafter steps outside idle time: every step's
    responses have a tail (p50 < max <= the cap), and at every step a slice was training the drafter while the other
    still decoded."""
    cfg = _cfg("tiny_tlt.py", *QUIET, "--config.train.num_steps=2", "--config.checkpoint.every_steps=100")
    assert cfg.rollout.num_slices == 2 and cfg.drafter.online and cfg.drafter.steps_without_idle == 0
    run(cfg, str(tmp_path))
    rows = _train_rows(tmp_path)
    for step, r in rows.items():
        assert r["response/len_p50"] < r["response/len_max"] <= 16, (step, r)
        assert r["controller/train_s"] > 0, (step, r)  # dispatched (a step not started by the rollout's end is dropped)
    assert sum(r["drafter/steps"] for r in rows.values()) > 0
    timeline = [json.loads(line) for line in (tmp_path / TIMELINE_FILE).read_text().splitlines()]
    for step in rows:
        spans = [t for t in timeline if t["step"] == step]
        overlaps = [
            (a, b) for a in spans for b in spans
            if a["state"] == "training" and b["state"] == "busy" and a["slice"] != b["slice"]
            and a["start"] < b["end"] and b["start"] < a["end"]
        ]
        assert overlaps, (step, spans)
