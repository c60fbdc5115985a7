"""benchmarks/pod_sim_model.py: the rollout model's mechanics on hand-computed cases (no JAX model, milliseconds)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import pod_sim_model as ps  # noqa: E402


class LinearCosts:
    """prefill 2 s; decode chunk 0.5 + steps * batch; verify call 1 + steps * 3 * batch; compaction 0.25 s."""

    def prefill(self, batch, prompts, length):
        return 2.0

    def decode(self, batch, length, steps):
        return 0.5 + steps * batch

    def verify(self, batch, length, steps, arm):
        return 1.0 + steps * 3 * batch

    def compact(self, src, dst):
        return 0.25


POLICY = ps.Policy(max_batch=2, max_len=64, chunk_size=8, batch_buckets=(2, 1))


def test_two_requests_plain_exact_time():
    # prefill 2; chunk of 8 steps at batch 2 (16.5); row 0 done -> compact 2->1 (0.25);
    # 8 steps at batch 1 (8.5); the last 3 steps (3.5, early exit).
    tr = ps.simulate([3, 20], [4, 4], POLICY, LinearCosts())
    assert tr.seconds == pytest.approx(2 + 16.5 + 0.25 + 8.5 + 3.5)
    assert (tr.prefill_s, tr.compact_s, tr.chunks) == (2.0, 0.25, 3)
    assert tr.by_batch == {2: 16.5, 1: 12.0}
    # cache-length buckets: 4 + 1 - 1 + 7 ahead = 11 -> 16; then 12 + 7 = 19 -> 32
    assert {k for k in tr.keys if k[0] == "decode"} == {("decode", 2, 16), ("decode", 1, 32)}
    assert tr.spec_s == 0 and tr.switch_s == []


def test_speculative_switch_at_threshold_exact_time():
    arm = ps.Arm(depth=3, topk=1, verify_tokens=4, accept=2.0)
    policy = ps.Policy(
        max_batch=2, max_len=64, chunk_size=8, batch_buckets=(2, 1), threshold=1, steps_per_call=2, arms=((1, arm),)
    )
    tr = ps.simulate([3, 20], [4, 4], policy, LinearCosts())
    # as above until one row is live (t = 18.75), then 11 tokens at 2 per verify: 3 calls of 2 verify steps (7 s each)
    assert tr.switch_s == [pytest.approx(18.75)]
    assert tr.seconds == pytest.approx(18.75 + 3 * 7.0)
    assert tr.verify_steps == 6 and tr.spec_tokens == pytest.approx(11.0)
    assert ("verify", 1, 16, "3x1x4") in tr.keys and ("verify", 1, 32, "3x1x4") in tr.keys


def test_threshold_uses_live_rows_and_arm_schedule():
    small = ps.Arm(depth=2, topk=1, verify_tokens=3, accept=1.5)
    big = ps.Arm(depth=4, topk=2, verify_tokens=6, accept=3.0)
    policy = ps.Policy(max_batch=4, max_len=256, batch_buckets=(4, 2, 1), threshold=4, arms=((1, big), (2, small)))
    assert policy.arm_for(5) is None and policy.arm_for(3) is small and policy.arm_for(1) is big
    tr = ps.simulate([40, 40, 40, 100], [8] * 4, policy, LinearCosts())
    arms = {k[3] for k in tr.keys if k[0] == "verify"}
    assert arms == {"2x1x3", "4x2x6"} and tr.switch_s == [2.0]  # speculative from the first chunk (4 live <= 4)


def test_long_row_jumps_equal_chunk_by_chunk():
    # 1049 decode steps at batch 1 in chunks of 8: 132 calls, each 0.5 s fixed; the last one reads 4 + 1049 > 1024
    tr = ps.simulate([1050], [4], ps.Policy(max_batch=1, max_len=1100, chunk_size=8), LinearCosts())
    assert tr.chunks == 132 and tr.plain_s == pytest.approx(132 * 0.5 + 1049)
    lengths = sorted(k[2] for k in tr.keys if k[0] == "decode")
    assert lengths == [16, 32, 64, 128, 256, 512, 1024, 1100]


def test_waves_run_one_after_another():
    one = ps.simulate([3, 20], [4, 4], POLICY, LinearCosts())
    two = ps.simulate([3, 20, 3, 20], [4] * 4, POLICY, LinearCosts())
    assert two.seconds == pytest.approx(2 * one.seconds) and two.tokens == 46


def test_staleness_and_spot_training():
    st = ps.Staleness(fresh=6.0, stale=4.0, tau=2.0)
    assert st.accept(1) == 6.0 and st.accept(float("inf")) == 4.0
    assert st.accept(3) == pytest.approx(4.0 + 2.0 / 2.718281828459045)
    assert ps.mean_staleness(idle_s=10, demand_s=5, run_steps=100) == 1.0
    assert ps.mean_staleness(idle_s=5, demand_s=10, run_steps=101) == pytest.approx(1 + 0.5 * 50)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="max_len"):
        ps.simulate([60], [10], POLICY, LinearCosts())
    with pytest.raises(ValueError, match="speculative arm"):
        ps.Policy(threshold=8)
    with pytest.raises(ValueError, match="accept"):
        ps.Arm(depth=2, topk=1, verify_tokens=3, accept=0.5)
    with pytest.raises(KeyError, match="no measured cost"):
        ps.simulate([3], [4], POLICY, ps.TableCosts())


def test_pod_projection_idle_time_and_spot_training():
    import pod_sim_roofline as rf

    arm = ps.Arm(depth=8, topk=4, verify_tokens=48, accept=6.0)
    st = ps.Staleness(fresh=6.0, stale=3.0, tau=5.0)
    lengths = [4000, 100, 100, 100]
    two = rf.project(rf.QWEN25_7B, rf.H100, 4, 8, lengths, 64, arm, st, run_steps=11)
    # engine 0 holds the 4000-token response, engine 1 two short ones: its wait is the idle time, on 4 devices
    r0 = rf.Roofline(rf.QWEN25_7B, rf.H100, 4, 64 + 4000, drafter=False)
    pol = ps.Policy(max_batch=r0.max_rows(), max_len=64 + 4000, chunk_size=8, steps_per_call=4)
    t0 = ps.simulate([4000, 100], [64, 64], pol, r0).seconds
    t1 = ps.simulate([100, 100], [64, 64], pol, r0).seconds
    assert two["plain"]["rollout_s"] == pytest.approx(t0)
    assert two["plain"]["idle_device_s"] == pytest.approx(4 * (t0 - t1))
    assert two["tlt"]["staleness"] == 1.0 and two["tlt"]["accept"] == 6.0  # idle time covers the drafter's pass
    assert two["tlt"]["rollout_s"] < min(two["static"]["rollout_s"], two["plain"]["rollout_s"])
    # the built controller (scheduler.simulate): whole drafter steps on the idle engine while the other decodes; the
    # step in flight at the rollout's end finishes on the RL step's path, so it adds at most one drafter step
    t, d = two["tlt"], two["tlt"]["drafter_step_s"]
    assert 0 < t["overhang_s"] < d and t["drafter_steps"] >= 1
    assert t["train_engine_s"] == pytest.approx(t["drafter_steps"] * d)
    assert t["step_s"] == pytest.approx(t["rollout_s"] + two["train_s"] + t["overhang_s"])
    # a single engine has no idle slice: spot training never runs and the drafter drifts (lag grows 1 per step)
    solo = rf.project(rf.QWEN25_7B, rf.H100, 4, 4, lengths, 64, arm, st, run_steps=11)
    assert solo["tlt"]["idle_device_s"] == 0 and solo["tlt"]["staleness"] == pytest.approx(6.0)
    assert solo["tlt"]["accept"] == pytest.approx(st.accept(6.0))
    with pytest.raises(ValueError, match="multiple of the tensor-parallel"):
        rf.project(rf.QWEN25_7B, rf.H100, 4, 6, lengths, 64, arm, st)
