"""benchmarks/gpu_tlt.py: its --smoke run on CPU (every kind of cell, the JSON the GPU run writes) and the time
budget that skips cells."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_tlt  # noqa: E402


def _run(*args, timeout=600):
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_tlt.py"), "--smoke", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout, time.perf_counter() - t


@pytest.mark.slow
def test_smoke_writes_every_figure(tmp_path):
    out = tmp_path / "tlt.json"
    stdout, seconds = _run(f"--out={out}")
    res = json.loads(out.read_text())
    assert res["complete"] and res["smoke"] and not res["errors"] and not res["skipped"], (res["errors"], stdout)
    assert set(res["cells"]) == {"sd 1", "sd 2", "adaptive 1", "adaptive 2", "e2e off", "e2e tlt"}
    for key in ("sd_speedup", "accept_length", "adaptive_over_plain", "adaptive_over_best_fixed"):
        assert {t: sorted(v) for t, v in res[key].items()} == {"greedy": ["1", "2"], "t0.9": ["1", "2"]}, key
    assert all(a >= 1.0 for t in res["accept_length"].values() for a in t.values())
    assert res["adaptive_cells"] == 4 and res["adaptive_over_plain_min"] == min(
        v for t in res["adaptive_over_plain"].values() for v in t.values()
    )
    assert res["e2e_tlt_over_off"] == res["e2e_step_s"]["off"] / res["e2e_step_s"]["tlt"] > 0
    assert res["e2e_adaptive_over_off"] is None  # not run in the smoke
    off = res["e2e"]["off"]
    assert len(off["steps"]) == 2 and len(off["steps"][0]["lengths"]) == 32 and off["group"] == 4
    # lossless on CPU fp32: every speculative arm emitted plain decoding's tokens, the adaptive engine too
    lossless = res["lossless"]
    assert lossless["identical"] and lossless["mismatched_rows_total"] == 0 and lossless["precision"] == "highest"
    assert set(lossless["mismatched_rows"]["greedy"]["1"]) == {"eagle:3x1x4", "ngram:2x1x3", "adaptive"}
    assert res["goals"]["lossless"]["met"] and set(res["goals"]) >= {"sd_b1_greedy", "e2e_tlt_over_off"}
    assert res["step_costs"]["decode_ms"].keys() == {"1", "2"} and "3x1x4" in res["step_costs"]["spec_step_ms"]
    # the pod model reads the run's own step costs and predicts its RL cells' rollouts (the GPU check's path)
    import pod_model

    assert pod_model.main([f"--gpu_costs={out}#step_costs", f"--gpu_run={out}", f"--out={tmp_path / 'pod.json'}"]) == 0
    pod = json.loads((tmp_path / "pod.json").read_text())
    assert set(pod["e2e_rollout"]) == {"off", "tlt"} and pod["e2e_rollout"]["off"]["predicted"] > 0
    print(f"smoke: {seconds:.0f} s")


def test_zero_budget_skips_every_cell_and_says_so(tmp_path):
    out = tmp_path / "tlt.json"
    _run(f"--out={out}", "--time_budget_s=0", timeout=300)
    res = json.loads(out.read_text())
    assert res["complete"] and not res["cells"] and not res["errors"]
    assert [s["cell"] for s in res["skipped"]] == ["sd 1", "e2e off", "e2e tlt", "sd 2", "adaptive 1", "adaptive 2"]
    assert all("time budget" in s["reason"] for s in res["skipped"])
    assert all(g["met"] is None for g in res["goals"].values()) and res["lossless"]["identical"] is None


def test_budget_scales_estimates_by_finished_cells():
    b = gpu_tlt.Budget(100.0, {})
    assert b.fits(90)[0] and b.scale() == 1.0
    b.done(10.0, 20.0)  # a cell took twice its estimate: the later ones are expected to as well
    assert b.scale() == 2.0 and b.fits(45)[0] and not b.fits(55)[0]
    b.done(10.0, 1000.0)
    assert b.scale() == 3.0  # clamped
