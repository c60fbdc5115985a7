"""Adaptive speculation: arm parsing, the BEG-MAB bandit on scripted reward tables (convergence per bucket, the
exploration rate, untried arms first, forgetting after the best arm changes, reproducibility, state round trip), the
hysteresis gate and the reachable (arm, bucket) set."""

import json

import numpy as np
import pytest

from tlt_jax.adaptive import Arm, Bandit, BanditConfig, SpecGate, agreed_seconds, make_bandit, parse_arm, parse_arms
from tlt_jax.rollout.spec_steps import SpecConfig

ARMS = ["off", "eagle:8x4x48", "eagle:4x2x12"]


def run(bandit: Bandit, table, rounds: int, noise_seed: int = 0, tokens: int = 64):
    """Drive ``bandit`` for ``rounds`` round trips per bucket; table(t) -> {bucket: {arm: tokens/s}}. Seconds carry
    10% log-normal noise from their own seeded generator. Returns {bucket: [chosen arm strings]}."""
    noise = np.random.default_rng(noise_seed)
    chosen = {}
    for t in range(rounds):
        for bucket, rates in table(t).items():
            arm = bandit.choose(bucket)
            secs = tokens / rates[str(arm)] * float(np.exp(noise.normal(0, 0.1)))
            bandit.observe(arm, bucket, tokens, secs, steps=3)
            chosen.setdefault(bucket, []).append(str(arm))
    return chosen


def test_arm_parsing_and_shape_constraints():
    for s in ("off", "ngram:4x1x5", "eagle:8x4x48", "eagle:1x1x2"):
        assert str(parse_arm(s)) == s
    a = parse_arm(" EAGLE:8x4x48 ")
    assert a == Arm("eagle", 8, 4, 48) and hash(a) == hash(Arm("eagle", 8, 4, 48)) and a.speculative
    assert {a: 1}[parse_arm("eagle:8x4x48")] == 1 and not parse_arm("off").speculative
    assert a.pool_name == SpecConfig(8, 4, 48).arm("eagle") and parse_arm("off").pool_name == "plain"
    assert SpecConfig(threshold=5).for_arm(a) == SpecConfig(8, 4, 48, threshold=5)
    assert Arm.from_spec("ngram", SpecConfig(3, 2, 9)) == parse_arm("ngram:3x2x9")
    for depth, topk in ((1, 1), (1, 3), (2, 2), (8, 4)):  # the arm bound is exactly SpecConfig's
        top = 1 + topk + (depth - 1) * topk**2
        SpecConfig().for_arm(Arm("eagle", depth, topk, top))
        with pytest.raises(ValueError, match=rf"must be in \[2, {top}\]"):
            Arm("eagle", depth, topk, top + 1)
        with pytest.raises(ValueError, match="verify_tokens"):
            SpecConfig(depth, topk, top + 1)
    bad = {
        "eagle:8x4x999": r"\[2, 117\]",
        "eagle:8x4": "DEPTHxTOPKxVERIFY_TOKENS",
        "beam:2x2x3": "expected 'off'",
        "eagle:0x4x2": ">= 1",
        "eagle:2x2x1": r"\[2, 7\]",
        "off:1x1x1": "expected 'off'",
    }
    for s, msg in bad.items():
        with pytest.raises(ValueError, match=msg):
            parse_arm(s)
    with pytest.raises(ValueError, match="listed twice"):
        parse_arms(["off", "eagle:8x4x48", "off"])
    with pytest.raises(ValueError, match="empty"):
        parse_arms([])
    assert parse_arms("off, ngram:4x1x5") == (Arm("off"), Arm("ngram", 4, 1, 5))
    with pytest.raises(ValueError, match="no tree shape"):
        SpecConfig().for_arm(Arm("off"))


def test_untried_arms_first_in_order_without_randomness():
    for seed in (0, 1):
        b = make_bandit(ARMS, epsilon=1.0, seed=seed)
        assert [str(b.choose(4)) for _ in range(1)] == ["off"]
        firsts = []
        for _ in range(3):
            arm = b.choose(4)
            firsts.append(str(arm))
            b.observe(arm, 4, 10, 1.0)
        assert firsts == ARMS  # whatever the seed and with epsilon = 1
        assert b.stats()["choices"][4]["untried"] == 4
    # every bucket is its own bandit: a new bucket starts untried again
    assert str(b.choose(2)) == "off"


def test_converges_to_the_best_arm_per_bucket():
    rates = {
        1: {"off": 100.0, "eagle:8x4x48": 300.0, "eagle:4x2x12": 220.0},
        8: {"off": 500.0, "eagle:8x4x48": 260.0, "eagle:4x2x12": 420.0},
        32: {"off": 900.0, "eagle:8x4x48": 200.0, "eagle:4x2x12": 950.0},
    }
    b = make_bandit(ARMS, epsilon=0.1, window=100, seed=3)
    chosen = run(b, lambda t: rates, 400)
    for bucket, want in ((1, "eagle:8x4x48"), (8, "off"), (32, "eagle:4x2x12")):
        assert str(b.best(bucket)) == want
        tail = chosen[bucket][-200:]
        assert tail.count(want) / len(tail) > 0.85, (bucket, tail.count(want))
    st = b.stats()
    assert st["best"] == {1: "eagle:8x4x48", 8: "off", 32: "eagle:4x2x12"}
    assert sum(st["steps"][1].values()) == 3 * 400
    m = st["median_tokens_per_s"][1]["eagle:8x4x48"]
    assert 250 < m < 350
    assert 100 < st["tokens_per_s"]["off"] < 900


def test_explores_at_rate_epsilon():
    eps, n = 0.3, 2000
    b = make_bandit(ARMS, epsilon=eps, window=10_000, seed=11)
    rates = {2: {"off": 100.0, "eagle:8x4x48": 200.0, "eagle:4x2x12": 50.0}}
    chosen = run(b, lambda t: rates, n)[2]
    c = b.stats()["choices"][2]
    assert c["untried"] == 3 and c["explore"] + c["exploit"] == n - 3
    sd = np.sqrt(n * eps * (1 - eps))
    assert abs(c["explore"] - n * eps) < 4 * sd
    # a uniform exploration draw lands on a non-best arm 2 times in 3
    non_best = sum(a != "eagle:8x4x48" for a in chosen[3:])
    p = eps * 2 / 3
    assert abs(non_best - n * p) < 4 * np.sqrt(n * p * (1 - p))
    # epsilon = 0: once every arm is tried, only the best is chosen
    g = make_bandit(ARMS, epsilon=0.0, window=10_000)
    assert set(run(g, lambda t: rates, 200)[2][3:]) == {"eagle:8x4x48"}


def test_forgets_after_the_best_arm_changes():
    before = {4: {"off": 400.0, "eagle:8x4x48": 200.0, "eagle:4x2x12": 150.0}}
    after = {4: {"off": 400.0, "eagle:8x4x48": 900.0, "eagle:4x2x12": 150.0}}  # e.g. the drafter improved
    b = make_bandit(ARMS, epsilon=0.05, window=60, seed=5)
    chosen = run(b, lambda t: before if t < 300 else after, 600)[4]
    assert chosen[200:300].count("off") > 85
    assert str(b.best(4)) == "eagle:8x4x48"
    assert chosen[-150:].count("eagle:8x4x48") > 130
    assert b.stats()["best_changes"][4] >= 1
    # the window alone forgets, even without exploration: arms age out of it and are retried; a window longer than
    # the run with no exploration never learns of the change (the control)
    w = make_bandit(ARMS, epsilon=0.0, window=30, seed=5)
    chosen = run(w, lambda t: before if t < 100 else after, 200)[4]
    assert chosen[-50:].count("eagle:8x4x48") > 45
    frozen = make_bandit(ARMS, epsilon=0.0, window=10_000, seed=5)
    chosen = run(frozen, lambda t: before if t < 100 else after, 200)[4]
    assert chosen[-50:].count("off") == 50  # no exploration and no window: never finds out


def test_reproducible_given_the_timings():
    rates = {1: {"off": 100.0, "eagle:8x4x48": 110.0, "eagle:4x2x12": 105.0}}
    a = run(make_bandit(ARMS, epsilon=0.5, window=50, seed=7), lambda t: rates, 200)
    b = run(make_bandit(ARMS, epsilon=0.5, window=50, seed=7), lambda t: rates, 200)
    c = run(make_bandit(ARMS, epsilon=0.5, window=50, seed=8), lambda t: rates, 200)
    assert a == b and a != c


def test_state_round_trip_through_json():
    rates = {
        1: {"off": 100.0, "eagle:8x4x48": 300.0, "eagle:4x2x12": 200.0},
        16: {"off": 500.0, "eagle:8x4x48": 100.0, "eagle:4x2x12": 450.0},
    }
    cfg = BanditConfig(tuple(parse_arms(ARMS)), epsilon=0.4, window=40, seed=2)
    a = Bandit(cfg)
    run(a, lambda t: rates, 70)
    state = json.loads(json.dumps(a.state_dict()))
    b = Bandit.from_state_dict(cfg, state)
    assert b.stats() == a.stats() and b.state_dict() == a.state_dict()
    # the same continuation on both: same choices (the generator state came along) and the same stats
    assert run(a, lambda t: rates, 50, noise_seed=9) == run(b, lambda t: rates, 50, noise_seed=9)
    assert b.stats() == a.stats()
    # a smaller window keeps the newest observations
    small = Bandit.from_state_dict(BanditConfig(cfg.arms, window=5), state)
    assert len(small.state_dict()["observations"]["1"]) == 5
    with pytest.raises(ValueError, match="differ from the configured arms"):
        Bandit.from_state_dict(BanditConfig(parse_arms(["off", "eagle:8x4x48"])), state)
    with pytest.raises(ValueError, match="version"):
        Bandit.from_state_dict(cfg, {**state, "version": 99})


def test_table_restricts_buckets_and_reachable_set():
    cfg = BanditConfig(
        parse_arms(["off", "eagle:8x4x48", "eagle:8x4x16"]),
        table={1: ["eagle:8x4x48"], 4: ["off", "eagle:8x4x16"]},
    )
    b = Bandit(cfg)
    b.observe("off", 1, 10, 1.0)  # an arm outside the bucket's table: recorded, never chosen there
    assert b.best(1) is None and b.stats()["steps"][1] == {"off": 1}
    assert [str(b.choose(1)) for _ in range(5)] == ["eagle:8x4x48"] * 5  # one arm: never explores
    b.observe("eagle:8x4x16", 4, 10, 1.0)
    assert str(b.choose(4)) == "off"  # untried in bucket 4's table
    assert cfg.arms_for(2) == cfg.arms
    got = cfg.reachable((1, 2, 4, 8, 16), threshold=3)
    spec = sorted((str(a), bk) for a, bk in got if a.speculative)
    assert spec == [("eagle:8x4x16", 2), ("eagle:8x4x16", 4), ("eagle:8x4x48", 1), ("eagle:8x4x48", 2)]
    assert sorted(bk for a, bk in got if not a.speculative) == [1, 2, 4, 8, 16]
    no_compact = cfg.reachable((1, 2, 4, 8, 16), threshold=3, compaction=False)
    assert ("eagle:8x4x48", 16) in {(str(a), bk) for a, bk in no_compact}
    assert all(not a.speculative for a, _ in cfg.reachable((1, 2), threshold=0))
    with pytest.raises(ValueError, match="not in arms"):
        BanditConfig(parse_arms(["off"]), table={2: ["eagle:8x4x48"]})
    for kw, msg in (dict(epsilon=1.5), "epsilon"), (dict(window=0), "window"), (dict(seed=-1), "seed"):
        with pytest.raises(ValueError, match=msg):
            BanditConfig(parse_arms(["off"]), **kw)


def test_observe_rejects_bad_reports():
    b = make_bandit(ARMS)
    for args, msg in (
        (("eagle:2x2x4", 1, 5, 1.0), "not one of the bandit's arms"),
        (("off", 0, 5, 1.0), "bucket"),
        (("off", 1, -1, 1.0), "tokens"),
        (("off", 1, 5, 0.0), "seconds"),
        (("off", 1, 5, float("nan")), "seconds"),
    ):
        with pytest.raises(ValueError, match=msg):
            b.observe(*args)


def test_gate_hysteresis():
    g = SpecGate(threshold=4, patience=2)
    lives = [9, 4, 3, 3, 3, 5, 4, 2, 2, 1]
    assert [g.update(x) for x in lives] == [False, False, False, True, True, False, False, False, True, True]
    assert g.switches == 2 and g.on
    g.reset()
    assert not g.on and not g.update(1)  # a new wave waits again
    now = SpecGate(threshold=4)
    assert [now.update(x) for x in (5, 4, 5, 1)] == [False, True, False, True]
    never = SpecGate(threshold=0)
    assert not any(never.update(x) for x in (3, 1, 0))
    for kw, msg in (dict(threshold=-1), "threshold"), (dict(threshold=2, patience=-1), "patience"):
        with pytest.raises(ValueError, match=msg):
            SpecGate(**kw)
    with pytest.raises(ValueError, match="live"):
        now.update(-1)


def test_agreed_seconds_is_the_identity_in_one_process():
    assert agreed_seconds(0.125) == 0.125


WORKER = """
import json, sys
import jax
import numpy as np
pid, port, agree = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from tlt_jax.adaptive import agreed_seconds, make_bandit
b = make_bandit(["off", "eagle:8x4x48", "eagle:4x2x12"], epsilon=0.2, window=20, seed=1)
clock = np.random.default_rng(100 + pid)  # every process has its own clock noise
rates = {"off": 100.0, "eagle:8x4x48": 104.0, "eagle:4x2x12": 98.0}
choices = []
for t in range(40):
    arm = b.choose(2)
    secs = 64 / rates[str(arm)] * float(np.exp(clock.normal(0, 0.2)))
    b.observe(arm, 2, 64, agreed_seconds(secs) if agree else secs)
    choices.append(str(arm))
print("RESULT " + json.dumps(dict(choices=choices, state=b.state_dict())))
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_processes_agree_on_every_choice():
    import os
    import socket
    import subprocess
    import sys

    def launch(agree: bool):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(pid), port, "1" if agree else "0"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for pid in (0, 1)
        ]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-2000:]
            outs.append(json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]))
        return outs

    a, b = launch(agree=True)
    assert a == b  # same choices and the same bandit state in both processes
    c, d = launch(agree=False)  # the control: each process's own clock makes the states diverge
    assert c["state"] != d["state"]
