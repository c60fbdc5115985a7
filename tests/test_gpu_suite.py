"""benchmarks/gpu_suite.py --smoke: the GPU suite's code on CPU with tiny shapes, every section and every layout."""

import json
import statistics
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
    # each cell's bytes are the weights plus its rows' committed KV (half the smoke cache), its GB/s those over its ms
    cfg, committed = gpu_suite.SMOKE_LM, 128 // 2
    for variant, cells in r["decode"].items():
        for name, c in cells.items():
            want = gpu_suite.weight_bytes(cfg, 4) + c["batch"] * committed * cfg.kv_bytes_per_token(4)
            assert c["bytes"] == want and c["gbps"] == pytest.approx(want / c["ms"] / 1e6), (variant, name, c)
    assert r["verify64_over_decode_bs1"] > 0 and 0 < r["prefill_mfu"]
    assert set(r["engine_bs1"]) == {"floor_ms", "unstacked", "stacked"}
    # the tail's speed-up is the one its timed rounds give (each round: whole-batch seconds over engine seconds)
    tail = r["tail"]
    rounds = [b / e for b, e in zip(tail["whole_batch_seconds"], tail["engine_seconds"], strict=True)]
    assert tail["tokens_equal"] and len(rounds) == 2 and r["tail_speedup"] == tail["speedup"]
    assert tail["speedup_median_of_rounds"] == pytest.approx(statistics.median(rounds))
    # The plan's estimate of bf16 decode / verify temporaries beside the device's compile (a CPU here: XLA:CPU's own
    # bf16 figures, which hold float32 copies the estimate leaves out).
    plan = r["plan"]
    assert set(plan["device"]) == {"decode", "verify"} and plan["device"] == plan["cpu_compiled"]
    assert all(0 < plan["cpu_estimate"][k] < plan["device"][k] for k in plan["device"])
    assert r["plan_gpu_over_estimate"] == plan["gpu_over_estimate"] and min(plan["gpu_over_estimate"].values()) > 1
    # No peak bandwidth is known for a CPU: the HBM figures stay empty rather than invented.
    assert r["decode_hbm_fraction"] == {"1": None, "64": None} and r["engine_bs1_step_over_floor"] is None


@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_compile_only_h100_traffic(tmp_path, attention):
    """--compile_only=h100 on the tiny shape: the engine's decode and verify programs compiled by XLA:GPU for an H100
    on this CPU (XLA's attention or the Triton tree-attention kernel), their must-move bytes from the model's shape
    and their HLO traffic."""
    pytest.importorskip("jax_plugins.xla_cuda12")
    import gpu_suite

    out = tmp_path / "compile_only.json"
    assert gpu_suite.main(["--compile_only=h100", "--smoke", "--programs=decode_b1,decode_b64,verify64_b1",
                           f"--attention_impl={attention}", f"--out={out}"]) == 0
    r = json.loads(out.read_text())
    assert r["device_kind"] == "NVIDIA H100 80GB HBM3" and r["smoke"] and r["attention_impl"] == attention
    if attention == "pallas":  # the kernel's custom call takes the whole cache (no copy of its bucket)
        assert all(p["cache_copies"] == 0 for p in r["programs"].values()), r["programs"]
    progs = r["programs"]
    assert set(progs) == {"decode_b1", "decode_b64", "verify64_b1"}
    cfg, programs = gpu_suite.SMOKE_LM, gpu_suite.programs(True)
    kv = cfg.kv_bytes_per_token(2)
    weights = (cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (not cfg.tie_word_embeddings)) * 2
    for name, p in progs.items():  # bf16 weights once, each row's KV of the length bucket, what it commits
        commit = 9 if name.startswith("verify") else 1  # a verify commits up to depth (8) + 1 tokens
        b = programs[name].batch
        assert p["must_bytes"] == weights + b * (128 + commit) * kv + p["unaliased_output_bytes"], name
        assert 0 < p["unaliased_output_bytes"] < 64 * 64, name  # the state is donated: only the step info is new
    for name, p in progs.items():
        assert p["moved_bytes"] >= weights, name  # every weight is read at least once
        assert p["unknown_trip_loops"] == (1 if name.startswith("decode") else 0), name  # the chunk's early exit
        assert p["top_ops"] and p["top_ops"][0][0] > 0
    for name in ("decode_b1", "decode_b64"):  # the decode attention reads the cache where it lies
        assert progs[name]["cache_concats"] == 0 and progs[name]["cache_transposes"] == 0, name
    assert progs["verify64_b1"]["moved_bytes"] > progs["decode_b1"]["moved_bytes"]  # 64 tokens' work
    assert r["goals"]["verify64_over_decode_b1"] == pytest.approx(
        progs["verify64_b1"]["moved_bytes"] / progs["decode_b1"]["moved_bytes"])
