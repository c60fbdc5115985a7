"""benchmarks/pod_model.py: the engine's host loop (GenerateRun) on simulated steps, against hand-computed costs and
the real engine's call sequence; speculative steps at a measured accept length; GPU costs files and the +-15 % check;
the pod projection's idle time and spot training. Every clock is virtual: nothing depends on the machine's speed."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import pod_model as pm  # noqa: E402

from tlt_jax.adaptive import parse_arm  # noqa: E402

EAGLE = parse_arm("eagle:8x4x48")


class LinearCosts:
    """prefill 2 s; decode chunk 0.5 + steps * batch; verify call 1 + steps * 3 * batch; compaction 0.25 s."""

    def prefill(self, batch, prompts, length):
        return 2.0

    def decode(self, batch, length, steps):
        return 0.5 + steps * batch

    def verify(self, batch, length, steps, arm, accept, behind=0):
        return 1.0 + steps * 3 * batch

    def compact(self, src, dst):
        return 0.25


def _sim(lengths, prompt_len=4, group=1, **kw):
    eng = pm.SimEngine(LinearCosts(), **{"max_batch": 2, "max_len": 64, **kw})
    return eng, eng.generate(lengths, prompt_len, group)


def test_plain_run_emits_the_lengths_at_hand_computed_cost():
    eng, run = _sim([3, 20])
    assert run.final_n.tolist() == [3, 20]
    # prefill (2); a chunk of 8 steps at batch 2 (16.5); row 0 done -> compaction 2 -> 1 (0.25); 8 steps at batch 1
    # (8.5); the last 3 steps (3.5: the chunk ends once every row is done)
    assert eng.clock.now == pytest.approx(2 + 16.5 + 0.25 + 8.5 + 3.5)
    assert [(c["batch"], c["length"], c["steps"], c["tokens"]) for c in run.chunks] == [
        (2, 16, 8, 10), (1, 32, 8, 8), (1, 32, 3, 3)]  # lengths: 4 + 1 - 1 + 7 ahead = 11 -> 16; 12 + 7 -> 32
    assert [(c["src"], c["dst"]) for c in run.compactions] == [(2, 1)]
    # every chunk GenerateRun recorded is one call of the simulated steps, with the seconds they charged
    assert [c[1:] for c in eng.calls if c[0] == "decode"] == [(c["batch"], c["length"], c["steps"]) for c in run.chunks]
    assert [c["seconds"] for c in run.chunks] == pytest.approx([16.5, 8.5, 3.5])
    # waves of max_batch rows run one after another; a GRPO group of 2 shares one prompt (one prefill row)
    eng2, run2 = _sim([3, 20, 3, 20])
    assert eng2.clock.now == pytest.approx(2 * eng.clock.now) and run2.final_n.tolist() == [3, 20, 3, 20]
    _, grouped = _sim([5, 7, 9, 2], group=2, max_batch=4)
    assert grouped.final_n.tolist() == [5, 7, 9, 2] and grouped.prefills[0]["prompts"] == 2


def test_the_same_calls_as_the_real_engine():
    """The real RolloutEngine (tiny model, forced lengths) and the simulated one make the same calls: same prefills,
    compactions, chunks (batch, live rows, cache-length bucket, steps, tokens)."""
    from flax import nnx

    from tlt_jax.models import CausalLM, tiny_config
    from tlt_jax.rollout import RolloutEngine, SamplingParams

    lengths = [3, 20, 5, 9, 40, 12]
    real = RolloutEngine(CausalLM(tiny_config(), rngs=nnx.Rngs(0)), max_batch=4, max_len=64, chunk_size=8,
                         compiler_options={"xla_backend_optimization_level": 0})
    params = SamplingParams(temperature=0.0, max_new_tokens=lengths, ignore_eos=True)
    res = real.generate([[5, 6, 7, 8]] * len(lengths), params)
    st = res.stats
    eng = pm.SimEngine(LinearCosts(), max_batch=4, max_len=64)
    run = eng.generate(lengths, prompt_len=4)

    def calls(chunks, prefills, compactions):
        return ([(c["batch"], c["active"], c["length"], c["steps"], c["tokens"]) for c in chunks],
                [(p["batch"], p["prompts"], p["length"]) for p in prefills],
                [(c["src"], c["dst"]) for c in compactions])

    assert calls(run.chunks, run.prefills, run.compactions) == calls(st["chunks"], st["prefills"], st["compactions"])
    assert run.final_n.tolist() == lengths == [len(t[0]) for t in res.tokens]


def test_speculative_steps_at_the_accept_length():
    """Live rows at or under the threshold run verify calls of up to 4 steps; a row needs about 1 / a of the steps
    at accept length a (a fractional carry: 2.5 emits 2, 3, 2, 3, ...), and the run's accept length is a."""
    for accept, verifies in ((1.0, 1000), (2.5, 400), (4.0, 250)):
        eng, run = _sim([1001] * 2, max_len=2048, arm=EAGLE, accept=accept, threshold=2)
        assert run.final_n.tolist() == [1001, 1001]
        spec = [c for c in run.chunks if c["arm"] != "plain"]
        assert len(spec) == len(run.chunks) == -(-verifies // 4)
        assert sum(c["row_verifies"] for c in spec) == 2 * verifies
        assert sum(c["tokens"] for c in spec) / sum(c["row_verifies"] for c in spec) == pytest.approx(1000 / verifies)
        assert sum(c["accepted"] for c in spec) == 2 * (1000 - verifies)  # drafts beyond each step's bonus token
    # more live rows than the threshold: plain chunks until the longer row is alone
    _, run = _sim([9, 41], max_len=128, arm=EAGLE, accept=3.0, threshold=1)
    assert [c["arm"] for c in run.chunks] == ["plain"] + ["tree/eagle/d8k4n48"] * 3
    assert run.final_n.tolist() == [9, 41] and run.switches[0]["active"] == 1
    with pytest.raises(ValueError, match="accept length"):
        pm.SimEngine(LinearCosts(), 2, 64, arm=EAGLE, accept=10.0)


def test_roofline_catches_the_drafter_up_once_per_switch():
    r = pm.Roofline(pm.QWEN25_7B, pm.H100, 4, 4096)
    assert r.verify(1, 4096, 2, EAGLE, 3.0, behind=80) - r.verify(1, 4096, 2, EAGLE, 3.0) == pytest.approx(
        10 * r.drafter(1, 8, False))
    assert r.decode(4, 4096, 8) - r.decode(4, 4096, 0) == pytest.approx(8 * r.forward(4, 1, 4096, r.model.params))
    assert 1 <= r.max_rows() <= 256 and r.max_rows() > pm.Roofline(pm.QWEN25_7B, pm.H100, 4, 32768).max_rows()


COSTS = {"source": "hand-made for the test", "device": "NVIDIA H200", "decode_ms": {"1": 2.0, "4": 2.0, "16": 2.5,
         "64": 4.0}, "verify_ms": {"16": {"1": 2.2, "64": 10.0}}, "draft_ms": {"1": 0.25, "64": 0.5},
         "spec_step_ms": {"3x1x4": {"1": 3.0}}, "roundtrip_ms": 0.5}


def test_costs_file_round_trips(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(COSTS))
    c = pm.load_costs(str(path))
    assert c.data == COSTS and c.step_ms(10) == pytest.approx(2.25) and c.step_ms(128) == pytest.approx(6.0)
    assert c.spec_step(1, parse_arm("eagle:3x1x4")) == 3.0  # a whole measured step wins over the parts
    assert c.spec_step(1, parse_arm("eagle:5x1x6")) == pytest.approx(2.0 + 0.2 * 5 / 15 + 5 * 0.25)
    assert c.decode(4, 512, 8) == pytest.approx((8 * 2.0 + 0.5) / 1e3)
    (tmp_path / "run.json").write_text(json.dumps({"step_costs": COSTS}))
    assert pm.load_costs(f"{tmp_path / 'run.json'}#step_costs").data == COSTS
    suite = {"device_kind": "NVIDIA H100", "decode": {"a": {"decode_bs1": {"batch": 1, "ms": 9.0}}, "b": {
        "decode_bs1": {"batch": 1, "ms": 8.0, "attend_len": 2176}, "v": {"batch": 1, "tree_tokens": 64, "ms": 9.5}}}}
    (tmp_path / "suite.json").write_text(json.dumps(suite))
    s = pm.load_costs(str(tmp_path / "suite.json"))  # the fastest variant at batch 1
    assert s.data["decode_ms"] == {"1": 8.0} and s.data["verify_ms"] == {"64": {"1": 9.5}} and s.data["length"] == 2176
    path.write_text(json.dumps(dict(COSTS, verfy_ms={})))
    with pytest.raises(ValueError, match="unknown keys"):
        pm.load_costs(str(path))
    with pytest.raises(KeyError, match="draft_ms"):
        pm.GpuCosts({"decode_ms": {"1": 1.0}}).spec_step(1, EAGLE)


def _record(costs, factor: float, **spec) -> dict:
    """A gpu_tlt.py e2e record whose measured rollouts are the model's prediction x ``factor`` (+ compile seconds);
    speculating at <= 32 live rows with ``spec`` (arm, accept)."""
    steps = []
    for i, lengths in enumerate(([40, 200, 30, 35], [50, 60, 256, 20], [25, 30, 90, 100])):
        pred = pm.seconds(costs, lengths, 64, 2, max(lengths), max_batch=4, max_len=512, **spec)
        steps.append(dict(step=i + 1, lengths=lengths, rollout_s=pred * factor + 0.25, compile_s=0.25,
                          accept_length=spec.get("accept")))
    return dict(steps=steps, prompt_len=64, group=2, max_batch=4, max_len=512)


def test_gpu_check_flags_a_mismatch(tmp_path):
    (tmp_path / "costs.json").write_text(json.dumps(COSTS))
    costs = pm.load_costs(str(tmp_path / "costs.json"))
    tlt = _record(costs, 1.3, arm=parse_arm("eagle:5x1x6"), accept=2.5)
    run = {"e2e": {"off": _record(costs, 1.1), "tlt": tlt, "adaptive": None}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    out = tmp_path / "out.json"
    argv = ["--gpu_costs", str(tmp_path / "costs.json"), "--gpu_run", str(tmp_path / "run.json"), "--out", str(out)]
    assert pm.main(argv) == 0
    res = json.loads(out.read_text())
    off, tlt = res["e2e_rollout"]["off"], res["e2e_rollout"]["tlt"]
    assert off["within"] and off["error"] == pytest.approx(1 / 1.1 - 1) and len(off["steps"]) == 2  # step 1 left out
    assert not tlt["within"] and tlt["error"] == pytest.approx(1 / 1.3 - 1) and tlt["arm"] == "eagle:5x1x6"
    assert set(res["e2e_rollout"]) == {"off", "tlt"} and res["costs"] == COSTS
    assert res["command"].startswith("python benchmarks/pod_model.py --gpu_costs")
    bare = pm.gpu_report(pm.GpuCosts({"decode_ms": {"1": 2.0}}), run)  # no cost for the speculative arm: said
    assert "predicted" in bare["e2e_rollout"]["off"] and "5x1x6" in bare["e2e_rollout"]["tlt"]["failed"]
    assert pm.compare(86.0, 100.0)["within"] and not pm.compare(84.0, 100.0)["within"]


def test_pod_projection_idle_time_and_spot_training():
    lengths, accept = [4000, 100, 100, 100], (4.0, 2.0)
    two = pm.project(pm.QWEN25_7B, pm.H100, 4, 8, lengths, 64, EAGLE, accept, run_steps=11)
    # engine 0 holds the 4000-token response, engine 1 two short ones: its wait is the idle time, on 4 devices
    r = pm.Roofline(pm.QWEN25_7B, pm.H100, 4, 64 + 4000)
    t0, t1 = (pm.seconds(r, x, 64, max_batch=r.max_rows(), max_len=r.max_len) for x in ([4000, 100], [100, 100]))
    assert two["plain"]["times"] == [t0, t1] and two["plain"]["idle_device_s"] == pytest.approx(4 * (t0 - t1))
    t = two["tlt"]  # the idle time covers the drafter's pass: one update behind, the fresh accept length
    assert t["staleness"] == 1.0 and t["accept"] == 4.0 and two["static"]["accept"] == 2.0
    assert t["rollout_s"] < two["static"]["rollout_s"]
    assert 0 < t["overhang_s"] < t["drafter_step_s"] and t["drafter_steps"] >= 1
    assert t["step_s"] == pytest.approx(t["rollout_s"] + two["train_s"] + t["overhang_s"])
    # one engine has no idle slice: no spot training, the drafter drifts (lag 1 + (11 - 1) / 2)
    solo = pm.project(pm.QWEN25_7B, pm.H100, 4, 4, lengths, 64, EAGLE, accept, run_steps=11)
    assert solo["tlt"]["idle_device_s"] == 0 and solo["tlt"]["staleness"] == pytest.approx(6.0)
    assert solo["tlt"]["accept"] == pytest.approx(pm.stale_accept(4.0, 2.0, 6.0))
    with pytest.raises(ValueError, match="multiple of the tensor-parallel"):
        pm.project(pm.QWEN25_7B, pm.H100, 4, 6, lengths, 64, EAGLE, accept)


def test_projection_reads_this_projects_accept_lengths():
    assert pm.measured_accept(task="arithmetic") == pytest.approx(2.578, abs=1e-3)
    assert pm.measured_accept(tree="5x1x6") == pytest.approx(1.992, abs=1e-3)
    assert 0.6 < pm.measured_drift() < 0.8
    with pytest.raises(KeyError, match="no EAGLE 9x9x9"):
        pm.measured_accept(tree="9x9x9")
    res = json.loads((pm.HERE / "results" / "pod_model.json").read_text())  # the committed projection
    assert res["inputs"]["accept_file"].endswith("accept_smollm2_cpu.json")
    for row in res["rows"]:
        assert row["tlt"]["accept"] <= pm.measured_accept(task=row["task"]) + 1e-9
        assert row["static"]["accept"] == pytest.approx(pm.measured_accept(task=row["task"]) * pm.measured_drift())
    assert np.isfinite([r["tlt"]["step_speedup"] for r in res["rows"]]).all()
