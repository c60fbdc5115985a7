"""benchmarks/gpu_suite.py --smoke: the GPU suite's code on CPU with tiny shapes, every section and every layout."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.slow
def test_gpu_suite_smoke(tmp_path):
    import gpu_suite

    out = tmp_path / "suite.json"
    assert gpu_suite.main(["--smoke", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["smoke"] and r["backend"] == "cpu" and r["jax"] and r["device_kind"]
    assert not r["errors"] and not r["skipped"]
    assert set(r["decode"]) == set(gpu_suite.DECODE_VARIANTS)
    for variant, cells in r["decode"].items():
        assert all(c["ms"] > 0 and c["bytes"] > 0 for c in cells.values()), variant
    assert r["verify64_over_decode_bs1"] > 0 and 0 < r["prefill_mfu"]
    assert set(r["engine_bs1"]) == {"floor_ms", "unstacked", "stacked"}
    assert r["tail"]["tokens_equal"] and r["tail_speedup"] > 0
    # The plan's estimate of bf16 decode / verify temporaries beside the device's compile (a CPU here: XLA:CPU's own
    # bf16 figures, which hold float32 copies the estimate leaves out).
    plan = r["plan"]
    assert set(plan["device"]) == {"decode", "verify"} and plan["device"] == plan["cpu_compiled"]
    assert all(0 < plan["cpu_estimate"][k] < plan["device"][k] for k in plan["device"])
    assert r["plan_gpu_over_estimate"] == plan["gpu_over_estimate"] and min(plan["gpu_over_estimate"].values()) > 1
    # No peak bandwidth is known for a CPU: the HBM figures stay empty rather than invented.
    assert r["decode_hbm_fraction"] == {"1": None, "64": None} and r["engine_bs1_step_over_floor"] is None
