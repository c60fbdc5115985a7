"""benchmarks/pod_sim_gpu.py: the pod model on GPU-measured step costs (a hand-made costs file), the predicted vs
measured check (synthetic runs), the roofline calibration, and the README's verify-cost figures."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import pod_sim  # noqa: E402
import pod_sim_gpu as pg  # noqa: E402
import pod_sim_model as ps  # noqa: E402
import pod_sim_roofline as rf  # noqa: E402

COSTS = {
    "source": "hand-made for the test",
    "device": "NVIDIA H200",
    "decode_ms": {"1": 2.0, "4": 2.0, "16": 2.5, "64": 4.0},
    "verify_ms": {"16": {"1": 2.2, "64": 10.0}},
    "draft_ms": {"1": 0.25, "64": 0.5},
    "spec_step_ms": {"3x1x4": {"1": 3.0}},
    "roundtrip_ms": 0.5,
}


@pytest.fixture
def costs_file(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(COSTS))
    return path


def test_costs_from_a_file_interpolate_as_documented(costs_file):
    c = pg.load(str(costs_file))
    assert c.meta["device"] == "NVIDIA H200"
    assert c.step_ms(1) == 2.0 and c.step_ms(10) == pytest.approx(2.25) and c.step_ms(40) == pytest.approx(3.25)
    assert c.step_ms(128) == pytest.approx(6.0)  # the last segment (16 -> 64: 1.5 ms over 48 rows) extended
    # tree sizes: decode is the 1-token tree; 16 measured; 8 lies between
    assert c.verify_pass_ms(1, 8) == pytest.approx(2.0 + 0.2 * 7 / 15)
    arm5 = ps.Arm(5, 1, 6, accept=3.0)
    assert c.spec_step(1, arm5) == pytest.approx(c.verify_pass_ms(1, 6) + 5 * 0.25)
    assert c.spec_step(1, ps.Arm(3, 1, 4, 2.0)) == 3.0  # a whole measured step wins over the parts
    assert pg.sd_speedup(c, ps.Arm(3, 1, 4, 2.4), 1) == pytest.approx(2.4 * 2.0 / 3.0)
    # engine calls in seconds: K steps plus one round trip
    assert c.decode(4, 512, 8) == pytest.approx((8 * 2.0 + 0.5) / 1e3)
    assert c.verify(1, 512, 4, ps.Arm(3, 1, 4, 2.0)) == pytest.approx((4 * 3.0 + 0.5) / 1e3)


def test_bad_costs_are_named(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"decode_ms": {"1": 1.0}, "verfy_ms": {}}))
    with pytest.raises(ValueError, match="unknown keys"):
        pg.load(str(path))
    c = pg.GpuCosts(decode_ms={"1": 1.0})
    with pytest.raises(KeyError, match="draft_ms"):
        c.spec_step(1, ps.Arm(3, 1, 4, 2.0))


def test_suite_json_and_a_key_of_a_file(tmp_path):
    suite = {
        "device_kind": "NVIDIA H100 80GB HBM3",
        "decode": {
            "stacked/xla": {"decode_bs1": {"batch": 1, "tree_tokens": 1, "ms": 12.0, "attend_len": 2176}},
            "unstacked/xla": {
                "decode_bs1": {"batch": 1, "tree_tokens": 1, "ms": 8.0, "attend_len": 2176},
                "decode_bs64": {"batch": 64, "tree_tokens": 1, "ms": 20.0, "attend_len": 2176},
                "verify64_bs1": {"batch": 1, "tree_tokens": 64, "ms": 9.0, "attend_len": 2176},
            },
        },
    }
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(suite))
    c = pg.load(str(path))  # the fastest batch-1 variant
    assert c.decode_ms == {"1": 8.0, "64": 20.0} and c.verify_ms == {"64": {"1": 9.0}}
    assert c.meta["length"] == 2176 and "unstacked/xla" in c.meta["source"]
    assert pg.load(str(path), "stacked/xla").decode_ms == {"1": 12.0}
    (tmp_path / "run.json").write_text(json.dumps({"step_costs": COSTS}))
    assert pg.load(f"{tmp_path / 'run.json'}#step_costs").decode_ms == COSTS["decode_ms"]


def test_predicted_rollout_by_hand(costs_file):
    c = pg.load(str(costs_file))
    # two rows of one prompt (one wave, batch 2 -> 1 after compaction); plain: prefill (round trip only), one chunk of
    # 8 steps at batch 2 (row 0 needs 2 more tokens, row 1 19: early exit only when all are done), then row 1 alone
    tr = pg.predict_rollout([3, 20], 10, c, max_batch=2, max_len=64, group=2)
    b2 = pg.interpolate(COSTS["decode_ms"], 2)
    expect = 0.5 + (8 * b2 + 0.5) + (8 * 2.0 + 0.5) + (3 * 2.0 + 0.5)
    assert tr.seconds == pytest.approx(expect / 1e3)
    spec = pg.predict_rollout([3, 20], 10, c, max_batch=2, max_len=64, group=2, arm=ps.Arm(3, 1, 4, 2.0), threshold=1)
    assert spec.verify_steps > 0 and spec.seconds < tr.seconds


def _run(costs: pg.GpuCosts, factor: float) -> dict:
    """A synthetic gpu_tlt.py e2e record whose measured rollouts are the prediction times ``factor``."""
    steps = []
    for i, lengths in enumerate(([40, 200, 30, 35], [50, 60, 256, 20], [25, 30, 90, 100])):
        pred = pg.predict_rollout(lengths, 64, costs, max_batch=4, max_len=512, group=2).seconds
        compile_s = 5.0 if i == 0 else 0.25
        steps.append(dict(step=i + 1, lengths=lengths, rollout_s=pred * factor + compile_s, compile_s=compile_s))
    return dict(steps=steps, prompt_len=64, group=2, max_batch=4, max_len=512)


def test_validation_against_a_measured_run(costs_file):
    c = pg.load(str(costs_file))
    ok = pg.validate_run(c, _run(c, 1.1))
    assert ok["within"] and ok["error"] == pytest.approx(1 / 1.1 - 1) and len(ok["steps"]) == 2  # step 1 left out
    bad = pg.validate_run(c, _run(c, 1.3))
    assert not bad["within"] and bad["error"] == pytest.approx(1 / 1.3 - 1)
    assert pg.compare(86.0, 100.0)["within"] and not pg.compare(84.0, 100.0)["within"]


def test_cli_writes_the_validation(costs_file, tmp_path):
    c = pg.load(str(costs_file))
    run = {
        "sd": {
            "greedy": {"1": {"best_spec": {"arm": "eagle:3x1x4", "accept": 2.4, "speedup": 1.25}}},
            "t0.9": {"1": {"plain": {"tokens_per_s": 100.0}}},
        },
        "e2e": {"off": _run(c, 1.05), "tlt": None},
    }
    (tmp_path / "run.json").write_text(json.dumps(run))
    out = tmp_path / "out.json"
    assert (
        pod_sim.main(["--gpu_costs", str(costs_file), "--gpu_run", str(tmp_path / "run.json"), "--out", str(out)]) == 0
    )
    res = json.loads(out.read_text())
    (sd,) = res["sd_speedup"]  # a cell without a speculative arm has nothing to predict
    assert sd["predicted"] == pytest.approx(2.4 * 2.0 / 3.0) and sd["measured"] == 1.25 and not sd["within"]
    assert res["e2e_rollout"]["off"]["within"] and list(res["e2e_rollout"]) == ["off"]
    assert res["costs"]["decode_ms"] == COSTS["decode_ms"]


def test_calibrated_hardware_recovers_the_fitted_parameters():
    model, length = rf.QWEN25_7B, 4096
    truth = dataclasses.replace(rf.H200, bw_eff=0.3, verify_scale=1.25)
    r = rf.Roofline(model, truth, 1, length)
    c = pg.GpuCosts(
        decode_ms={"1": 1e3 * r.policy(1, 1, length)},
        verify_ms={"64": {"1": 1e3 * truth.verify_scale * r.policy(1, 64, length)}},
        meta={"device": "NVIDIA H200", "length": length, "source": "synthetic"},
    )
    hw = pg.calibrated_hardware(c, model)
    assert hw.hbm_bytes_s == rf.H200.hbm_bytes_s
    assert hw.bw_eff == pytest.approx(0.3) and hw.verify_scale == pytest.approx(1.25)
    assert hw.draft_s == rf.H200.draft_s  # no draft_ms measured: the default stays


def test_readme_verify_cost_figures():
    """benchmarks/README.md (pod_sim section) quotes these; `python benchmarks/pod_sim.py --step_costs` prints them."""
    arm = ps.Arm(8, 4, 48, 6.53)
    lo, hi = (rf.verify_step_cost(rf.QWEN25_7B, 4, arm, n) for n in (2048, 8192))
    assert round(lo["verify_over_plain"], 2) == 4.87 and round(hi["verify_over_plain"], 2) == 4.81
    assert round(lo["speedup"], 2) == 1.34 and round(hi["speedup"], 2) == 1.36
    lo, hi = (rf.verify_step_cost(rf.QWEN25_7B, 1, arm, n) for n in (2048, 8192))  # TP 1
    assert (round(lo["verify_over_plain"], 2), round(hi["verify_over_plain"], 2)) == (2.89, 2.85)
    assert (round(lo["speedup"], 2), round(hi["speedup"], 2)) == (2.26, 2.29)
