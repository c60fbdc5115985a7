"""Adaptive speculation: arm parsing, the BEG-MAB bandit on scripted reward tables (convergence per bucket, the
exploration rate, arms nothing is known of first, transfer between buckets, plausible-only and time-share
exploration, forgetting after the best arm changes, reproducibility, state round trip, the loss budget against plain
decoding), the hysteresis gate and the reachable (arm, bucket) set."""

import dataclasses
import json

import numpy as np
import pytest

from tlt_jax.adaptive import Arm, Bandit, BanditConfig, SpecGate, agreed_seconds, make_bandit, parse_arm, parse_arms
from tlt_jax.rollout.run import _lag_tokens
from tlt_jax.rollout.spec_steps import SpecConfig

ARMS = ["off", "eagle:8x4x48", "eagle:4x2x12"]


def run(bandit: Bandit, table, rounds: int, noise_seed: int = 0, tokens=64):
    """Drive ``bandit`` for ``rounds`` round trips per bucket; table(t) -> {bucket: {arm: tokens/s}}. Seconds carry
    10% log-normal noise from their own seeded generator; ``tokens`` per round trip (an int, or {arm: int}). Returns
    {bucket: [chosen arm strings]}."""
    noise = np.random.default_rng(noise_seed)
    chosen = {}
    for t in range(rounds):
        for bucket, rates in table(t).items():
            arm = bandit.choose(bucket)
            n = tokens[str(arm)] if isinstance(tokens, dict) else tokens
            secs = n / rates[str(arm)] * float(np.exp(noise.normal(0, 0.1)))
            bandit.observe(arm, bucket, n, secs, steps=3)
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
        b = make_bandit(ARMS, epsilon=1.0, seed=seed, transfer=False)
        assert [str(b.choose(4)) for _ in range(1)] == ["off"]
        firsts = []
        for _ in range(3):
            arm = b.choose(4)
            firsts.append(str(arm))
            b.observe(arm, 4, 10, 1.0)
        assert firsts == ARMS  # whatever the seed and with epsilon = 1
        assert b.stats()["choices"][4]["untried"] == 4
    # without transfer every bucket is its own bandit: a new bucket starts untried again
    assert str(b.choose(2)) == "off" and b.stats()["choices"][2]["untried"] == 1


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
    m = st["median_reward"][1]["eagle:8x4x48"]
    assert 250 < m < 350
    assert 100 < st["tokens_per_s"]["off"] < 900


def test_explores_at_rate_epsilon():
    """margin = 1 (every arm plausible) and no time share: the original BEG-MAB rate. Exploration draws never pick
    the best arm (that would be exploitation)."""
    eps, n = 0.3, 2000
    b = make_bandit(ARMS, epsilon=eps, window=10_000, seed=11, margin=1.0, time_share=False)
    rates = {2: {"off": 100.0, "eagle:8x4x48": 200.0, "eagle:4x2x12": 50.0}}
    chosen = run(b, lambda t: rates, n)[2]
    c = b.stats()["choices"][2]
    k = 3 * 3  # each arm measured min_count = 3 times first, round robin
    assert chosen[:k] == ARMS * 3
    assert c["untried"] == k and c["explore"] + c["exploit"] == n - k and c["declined"] == 0
    sd = np.sqrt(n * eps * (1 - eps))
    assert abs(c["explore"] - n * eps) < 4 * sd
    assert sum(a != "eagle:8x4x48" for a in chosen[k:]) == c["explore"]
    # epsilon = 0: once every arm is measured, only the best is chosen
    g = make_bandit(ARMS, epsilon=0.0, window=10_000)
    assert set(run(g, lambda t: rates, 200)[2][k:]) == {"eagle:8x4x48"}


def test_explores_only_plausible_arms():
    """Default margin 0.1: off (within 5% of the best) is explored at rate epsilon, eagle:4x2x12 (half the best) never
    after its first try (min_count = 1; the window is longer than the run, so it never ages out)."""
    eps, n = 0.2, 1500
    rates = {2: {"off": 190.0, "eagle:8x4x48": 200.0, "eagle:4x2x12": 100.0}}
    b = make_bandit(ARMS, epsilon=eps, window=10_000, seed=4, time_share=False, min_count=1)
    chosen = run(b, lambda t: rates, n)[2]
    c = b.stats()["choices"][2]
    assert chosen.count("eagle:4x2x12") == 1 and c["untried"] == 3
    assert chosen[3:].count("off") == c["explore"]
    sd = np.sqrt(n * eps * (1 - eps))
    assert abs(c["explore"] - n * eps) < 4 * sd
    # nothing plausible: every exploration draw is declined (counted), none explores
    far = {2: {"off": 100.0, "eagle:8x4x48": 200.0, "eagle:4x2x12": 50.0}}
    d = make_bandit(ARMS, epsilon=eps, window=10_000, seed=4)
    assert run(d, lambda t: far, n)[2][9:] == ["eagle:8x4x48"] * (n - 9)
    cd = d.stats()["choices"][2]
    assert cd["explore"] == 0 and abs(cd["declined"] - n * eps) < 4 * sd
    # noise-free timings (no spread): margin 0 explores nothing slower than the best, margin 1 every arm
    for margin, want in ((0.0, {"eagle:8x4x48"}), (0.1, {"eagle:8x4x48", "off"}), (1.0, set(ARMS))):
        z = make_bandit(ARMS, epsilon=0.5, window=10_000, seed=4, margin=margin)
        chosen = []
        for _ in range(200):
            a = z.choose(2)
            chosen.append(str(a))
            z.observe(a, 2, 64, 64 / rates[2][str(a)])
        assert chosen[:9] == ARMS * 3 and set(chosen[9:]) == want, margin


def test_time_share_bounds_exploration_time():
    """Equal tokens/s, but eagle:8x4x48's round trips take 4x as long as off's: its exploration draws are kept with
    probability 1/4, so exploring it takes about epsilon of the time, not 4x epsilon."""
    arms = ["off", "eagle:8x4x48"]
    rates = {8: {"off": 100.0, "eagle:8x4x48": 92.0}}
    tokens = {"off": 50, "eagle:8x4x48": 200}
    eps, n = 0.4, 1500
    counts = {}
    for share in (True, False):
        b = make_bandit(arms, epsilon=eps, window=10_000, seed=2, time_share=share)
        chosen = run(b, lambda t: rates, n, tokens=tokens)[8]
        assert b.best(8) == parse_arm("off")
        counts[share] = chosen[2:].count("eagle:8x4x48")
    sd = np.sqrt(n * eps)
    assert abs(counts[False] - n * eps) < 4 * sd
    assert abs(counts[True] - n * eps / 4) < 4 * np.sqrt(n * eps / 4)


def test_transfer_between_buckets():
    """Bucket 8 measured every arm; bucket 4 then borrows relative speeds (not absolute ones): its first choice is
    bucket 8's best, no forced tries, and the transferred estimates scale with what bucket 4 measures itself."""
    b8 = {"off": 100.0, "eagle:8x4x48": 50.0, "eagle:4x2x12": 160.0}
    b = make_bandit(ARMS, epsilon=0.0, window=50, seed=0)
    run(b, lambda t: {8: b8}, 10)
    first = b.choose(4)
    assert str(first) == "eagle:4x2x12" and b.stats()["choices"][4] == dict(
        untried=0, explore=0, exploit=1, declined=0, transferred=1, held=0, safe=0
    )
    est = b.estimates(4)
    assert {str(a): e.source for a, e in est.items()} == {a: 8 for a in ARMS}  # the empty bucket takes 8's medians
    b.observe(first, 4, 80, 1.0)  # bucket 4 measures half bucket 8's speed
    est = b.estimates(4)
    assert est[first].source == 4 and est[first].count == 1 and est[first].rate == 80.0
    off = est[parse_arm("off")]
    assert off.transferred and off.source == 8 and off.rate == pytest.approx(80.0 * 100 / 160, rel=0.1)
    chosen = run(b, lambda t: {4: {"off": 50.0, "eagle:8x4x48": 25.0, "eagle:4x2x12": 80.0}}, 30)[4]
    assert chosen == ["eagle:4x2x12"] * 30  # the losing arms are never forced in bucket 4
    assert b.stats()["transferred"][4] == {"off": 8, "eagle:8x4x48": 8}
    # without transfer bucket 4 pays a forced try of every arm
    n = make_bandit(ARMS, epsilon=0.0, window=50, seed=0, transfer=False)
    run(n, lambda t: {8: b8}, 10)
    assert run(n, lambda t: {4: {"off": 50.0, "eagle:8x4x48": 25.0, "eagle:4x2x12": 80.0}}, 3)[4] == ARMS


def test_transfer_takes_the_nearest_fresh_measurement():
    """Nearest by log distance (ties: the larger bucket), from measurements only (not from transferred estimates);
    the margin compounds per octave; an arm measured only long ago (beyond the window of the whole bandit's
    observations) transfers nothing, so it is tried again."""
    e48 = parse_arm("eagle:8x4x48")
    b = make_bandit(["off", "eagle:8x4x48"], epsilon=0.0, window=40, seed=0)
    b.observe("off", 1, 10, 1.0)  # noise-free timings: eagle 3x off at batch 1
    b.observe(e48, 1, 30, 1.0)
    b.observe("off", 2, 20, 1.0)
    assert b.estimates(2)[e48].source == 1 and b.estimates(2)[e48].rate == pytest.approx(60, rel=0.25)
    b.observe("off", 16, 100, 1.0)
    b.observe(e48, 16, 50, 1.0)  # eagle 0.5x off at batch 16
    b.observe("off", 4, 40, 1.0)
    e = b.estimates(4)[e48]  # 2 is nearest but only transferred eagle there; 1 and 16 tie at 2 octaves: 16
    assert (e.source, e.distance, e.rate) == (16, 2.0, 20.0)
    b.observe(e48, 2, 50, 1.0)  # now measured at 2 (2.5x off)
    e = b.estimates(4)[e48]
    assert (e.source, e.distance, e.rate) == (2, 1.0, 100.0)
    # plausibility without noise: (1 - 0.1)^(1 + d) of the best's rate
    assert b._windows.noise() == 0.0
    best = b.estimates(4)[parse_arm("off")]
    assert b._plausible(dataclasses.replace(e, rate=0.82 * best.rate), best)  # 0.9^2 = 0.81
    assert not b._plausible(dataclasses.replace(e, rate=0.82 * best.rate, distance=0.0), best)
    # staleness: bucket 1's eagle, 40 observations later (of off only, in bucket 16), no longer speaks for bucket 2
    d = make_bandit(["off", "eagle:8x4x48"], epsilon=0.0, window=40, seed=0, table={16: ["off"]})
    run(d, lambda t: {1: {"off": 10.0, "eagle:8x4x48": 30.0}}, 4)
    d.observe("off", 2, 20, 1.0)
    assert d.estimates(2)[e48].source == 1
    run(d, lambda t: {16: {"off": 100.0}}, 40)
    assert e48 not in d.estimates(2)
    assert d.choose(2) == e48 and d.stats()["choices"][2]["untried"] == 1  # tried again


def test_reward_is_per_live_row():
    """A round trip's reward is tokens/s per live row (averaged over its steps): early in a wave (16 rows) and late
    (9 rows, or rows finishing mid-trip) compare alike."""
    b = make_bandit(["off", "eagle:8x4x48"], epsilon=0.0)
    b.observe("off", 16, 1600, 1.0, steps=8, rows=16)  # 100 per row
    b.observe("eagle:8x4x48", 16, 1080, 1.0, steps=4, rows=9)  # fewer tokens/s, but 120 per row
    assert b.medians(16) == {parse_arm("off"): 100.0, parse_arm("eagle:8x4x48"): 120.0}
    assert str(b.best(16)) == "eagle:8x4x48"
    b.observe("off", 16, 60, 0.08, steps=8, rows=7.5)  # 8 rows, one finished after 4 of the 8 steps: 100 per row
    assert b.medians(16)[parse_arm("off")] == 100.0
    with pytest.raises(ValueError, match=r"rows must be the mean live rows over the round trip's steps, in \(0, 16\]"):
        b.observe("off", 16, 10, 1.0, rows=17)


def test_reward_with_lag_is_the_lagging_rows_progress():
    """With ``lag`` the reward is the lagging row's tokens/s: a tree that advances its rows unevenly (26 tokens over
    4 rows, the row with the most budget left got 4) loses to plain steps that advance every row by 6, though its
    mean row is faster. The engine's lagging row: the live row with the most budget left that is still live after
    the round trip (ties: their mean; none left: the mean live row)."""
    b = make_bandit(["off", "eagle:3x1x4"], epsilon=0.0)
    b.observe("off", 4, 24, 1.0, steps=6, rows=4, lag=6)
    b.observe("eagle:3x1x4", 4, 26, 1.0, steps=4, rows=4, lag=4)
    assert b.medians(4) == {parse_arm("off"): 6.0, parse_arm("eagle:3x1x4"): 4.0}
    b2 = make_bandit(["off", "eagle:3x1x4"], epsilon=0.0)
    b2.observe("off", 4, 24, 1.0, steps=6, rows=4)
    b2.observe("eagle:3x1x4", 4, 26, 1.0, steps=4, rows=4)
    assert str(b2.best(4)) == "eagle:3x1x4" and str(b.best(4)) == "off"  # the mean row says the opposite
    with pytest.raises(ValueError, match="lag must be the lagging row's tokens"):
        b.observe("off", 4, 24, 1.0, lag=-1)
    emitted, live = np.array([5, 2, 3, 0, 4]), np.array([True, True, True, False, True])
    done = np.array([False, False, False, True, True])  # row 4 stopped during the round trip: it lags no more
    assert _lag_tokens(emitted, live, done, np.array([10, 20, 20, 0, 30])) == 2.5
    assert _lag_tokens(emitted, live, done, np.array([30, 20, 20, 0, 30])) == 5.0
    assert _lag_tokens(emitted, live, np.ones(5, bool), np.zeros(5)) == 3.5  # the wave ended: the mean live row


def test_forgets_after_the_best_arm_changes():
    before = {4: {"off": 400.0, "eagle:8x4x48": 200.0, "eagle:4x2x12": 150.0}}
    after = {4: {"off": 400.0, "eagle:8x4x48": 900.0, "eagle:4x2x12": 150.0}}  # e.g. the drafter improved
    b = make_bandit(ARMS, epsilon=0.05, window=60, seed=5)
    chosen = run(b, lambda t: before if t < 300 else after, 600)[4]
    assert chosen[200:300].count("off") > 85
    assert str(b.best(4)) == "eagle:8x4x48"
    assert chosen[-150:].count("eagle:8x4x48") > 130
    assert b.stats()["best_changes"][4] >= 1
    # the window alone forgets, even without exploration: arms age out of it and are retried (min_count = 1: once
    # they are gone; the default 3: once fewer than 3 are left, i.e. 3 of every 30 round trips per losing arm); a
    # window longer than the run with no exploration never learns of the change (the control)
    w = make_bandit(ARMS, epsilon=0.0, window=30, seed=5, min_count=1)
    chosen = run(w, lambda t: before if t < 100 else after, 200)[4]
    assert chosen[-50:].count("eagle:8x4x48") > 45
    w3 = make_bandit(ARMS, epsilon=0.0, window=30, seed=5)
    chosen = run(w3, lambda t: before if t < 100 else after, 200)[4]
    assert str(w3.best(4)) == "eagle:8x4x48" and 30 <= chosen[-50:].count("eagle:8x4x48") <= 45
    frozen = make_bandit(ARMS, epsilon=0.0, window=10_000, seed=5)
    chosen = run(frozen, lambda t: before if t < 100 else after, 200)[4]
    assert chosen[-50:].count("off") == 50  # no exploration and no window: never finds out


def test_one_slow_measurement_does_not_rule_an_arm_out():
    """The default run's failure mode: "off" measured once on a slow stretch of the machine (the first rollout, a
    compile beside it) at less than half its speed. With one measurement enough (min_count = 1) that median rules it
    out and the bandit stays on a slower EAGLE arm for good; with the default min_count = 3 it is measured again and
    wins."""
    def table(t):
        return {8: {"off": 60.0 if t == 0 else 150.0, "eagle:8x4x48": 120.0, "eagle:4x2x12": 100.0}}

    one = make_bandit(ARMS, epsilon=0.1, window=300, seed=1, min_count=1)
    chosen = run(one, table, 250)[8]
    assert chosen.count("off") == 1 and str(one.best(8)) == "eagle:8x4x48"
    three = make_bandit(ARMS, epsilon=0.1, window=300, seed=1)
    chosen = run(three, table, 250)[8]
    assert chosen[:9] == ARMS * 3 and str(three.best(8)) == "off"
    assert chosen[-100:].count("off") > 85
    assert 140 < three.medians(8)[parse_arm("off")] < 160
    # a transferred estimate stands in for measurements: bucket 4 exploits what bucket 8 measured, unmeasured
    assert str(three.choose(4)) == "off" and three.stats()["choices"][4] == dict(
        untried=0, explore=0, exploit=1, declined=0, transferred=1, held=0, safe=0
    )
    assert SpecConfig(arms=ARMS, min_count=2).bandit_config().min_count == 2
    assert BanditConfig(parse_arms(ARMS), window=2).min_count == 2  # a window of 2 holds at most 2 measurements


def run_charged(bandit: Bandit, rates: dict, rounds: int, compile_s: float = 0.0, tokens: int = 64):
    """``run`` as the engine keeps the loss ledger: every round trip is charged (one row, lag = tokens); a
    speculative arm's first round trip in a bucket costs ``compile_s`` more and is not observed (its step's first
    run). Returns (chosen arms per bucket, seconds taken, seconds plain decoding would have taken)."""
    noise = np.random.default_rng(0)
    chosen, seen, taken, plain = {}, set(), 0.0, 0.0
    for _ in range(rounds):
        for bucket, r in rates.items():
            arm = bandit.choose(bucket)
            secs = tokens / r[str(arm)] * float(np.exp(noise.normal(0, 0.1)))
            first = arm.speculative and (bucket, arm) not in seen
            seen.add((bucket, arm))
            if first:
                secs += compile_s
            else:
                bandit.observe(arm, bucket, tokens, secs, steps=3, lag=tokens)
            bandit.charge(arm, bucket, tokens, secs, lag=tokens, as_plain=not arm.speculative)
            taken, plain = taken + secs, plain + tokens / r["off"]
            chosen.setdefault(bucket, []).append(str(arm))
    return chosen, taken, plain


def test_loss_budget_bounds_what_exploration_costs():
    """Arms much slower than plain decoding and a compile per arm: the unbounded bandit (epsilon 0.3, every arm
    plausible) loses a large share of the time to exploring them; with max_loss = 0.05 it loses about 5 % (at most
    one compile and one round trip beyond), measures "off" first, and still tries every arm as the budget recovers.
    The ledger's plain seconds track what plain decoding would have taken."""
    rates = {8: {"off": 150.0, "eagle:8x4x48": 50.0, "eagle:4x2x12": 60.0}}
    kw = dict(epsilon=0.3, margin=1.0, window=300, seed=2)
    _, taken, plain = run_charged(make_bandit(ARMS, **kw), rates, 400, compile_s=3.0)
    assert taken / plain > 1.15
    b = make_bandit(ARMS, max_loss=0.05, **kw)
    chosen, taken, plain = run_charged(b, rates, 400, compile_s=3.0)
    assert chosen[8][:3] == ["off"] * 3  # the baseline first
    assert taken - plain <= 0.05 * plain + 3.0 + 64 / 50.0 * 1.5
    assert taken / plain > 1.02  # the budget is used, not left idle
    led, c = b.stats()["ledger"], b.stats()["choices"][8]
    assert led["max_loss"] == 0.05 and led["plain_s"] == pytest.approx(plain, rel=0.05)
    assert led["plain_s"] + led["loss_s"] == pytest.approx(taken, rel=1e-9)
    assert c["held"] > 0 and set(chosen[8]) == set(ARMS)  # every arm tried, as the budget allowed
    assert c["safe"] == 0  # no slow arm is let through a spent budget
    assert sum(c.values()) - c["declined"] - c["transferred"] - c["safe"] == 400  # untried + explore + exploit + held


def test_loss_budget_still_finds_a_faster_arm_and_holds_after_a_loss():
    """A faster arm pays for the exploration it took to find it: the bounded bandit exploits it and the ledger
    shows a gain. A loss beyond the budget (e.g. a long compile beside plain decoding) stops exploration and
    compiles (``may_spend``) until plain decoding has earned max_loss of it back; the best arm is still exploited."""
    rates = {1: {"off": 100.0, "eagle:8x4x48": 80.0, "eagle:4x2x12": 200.0}}
    b = make_bandit(ARMS, epsilon=0.1, margin=1.0, window=300, seed=3, max_loss=0.05)
    chosen, taken, plain = run_charged(b, rates, 300, compile_s=1.0)
    assert chosen[1][-100:].count("eagle:4x2x12") > 85 and b.stats()["ledger"]["loss_s"] < 0 and taken < plain
    assert b.may_spend() and make_bandit(ARMS).headroom() == float("inf")
    b.charge("off", 1, 64, 1000.0, lag=64, as_plain=False)  # 1000 s for what plain does in 0.64 s
    h = b.headroom()
    assert h < 0 and not b.may_spend()
    before = dict(b.stats()["choices"][1])
    picks = [str(b.choose(1)) for _ in range(200)]
    after = b.stats()["choices"][1]
    assert set(picks) == {"eagle:4x2x12"} and after["held"] > before["held"] and after["explore"] == before["explore"]
    # plain round trips at plain's cost add max_loss of their seconds to the headroom
    b.charge("off", 1, 64, -h / 0.05 + 1.0, lag=64, as_plain=True)
    assert b.may_spend() and b.headroom() == pytest.approx(0.05, abs=1e-6)
    # the ledger lives in the state (checkpoints); a state saved before it had none loads as an empty ledger
    c = Bandit.from_state_dict(b.config, json.loads(json.dumps(b.state_dict())))
    assert c.stats()["ledger"] == b.stats()["ledger"] and c.headroom() == b.headroom()
    old = b.state_dict()
    del old["ledger"]
    assert Bandit.from_state_dict(b.config, old).stats()["ledger"]["plain_s"] == 0.0
    # where "off" is not known in the bucket, a round trip counts at its own seconds (no baseline to compare with)
    d = make_bandit(ARMS, max_loss=0.05)
    d.charge("eagle:4x2x12", 2, 64, 0.5, lag=64, as_plain=False)
    assert d.stats()["ledger"] == dict(plain_s=0.5, loss_s=0.0, max_loss=0.05)


def test_spent_budget_lets_through_only_tries_expected_to_gain():
    """With the budget spent, an arm measured once at twice plain's speed is measured again until its median decides
    (``safe``: even a pessimistic reading of one round trip beats "off"), then exploited; an arm slower than plain
    is held, tried or explored. Before the noise is known nothing is let through."""
    noise = np.random.default_rng(1)

    def observe(bandit, arm, rate):  # one round trip of 64 tokens at ``rate`` tokens/s, 10 % log-normal noise
        bandit.observe(arm, 1, 64, 64 / rate * float(np.exp(noise.normal(0, 0.1))), lag=64)

    b = make_bandit(ARMS, epsilon=0.0, window=300, seed=0, max_loss=0.05, min_count=3)
    for _ in range(20):
        observe(b, "off", 100.0)
    observe(b, "eagle:4x2x12", 200.0)
    observe(b, "eagle:8x4x48", 85.0)
    b.charge("off", 1, 64, 1000.0, lag=64, as_plain=False)  # the budget is spent
    assert not b.may_spend()
    picks = [str(b.choose(1)) for _ in range(2)]
    assert picks == ["eagle:4x2x12"] * 2 and b.stats()["choices"][1]["safe"] == 2
    for _ in range(2):
        observe(b, "eagle:4x2x12", 200.0)
    # the fast arm's median now decides; the slow arm is still under-measured, and held
    held = b.stats()["choices"][1]["held"]
    assert str(b.choose(1)) == "off" and b.stats()["choices"][1]["held"] == held + 1
    # every arm measured enough: the fast one is exploited, and exploring the other is held
    for _ in range(2):
        observe(b, "eagle:8x4x48", 85.0)
    e = make_bandit(ARMS, epsilon=1.0, margin=1.0, window=300, seed=0, max_loss=0.05, min_count=3)
    e.load_state_dict(b.state_dict())
    picks = [str(e.choose(1)) for _ in range(50)]
    assert picks == ["eagle:4x2x12"] * 50 and e.stats()["choices"][1]["explore"] == 0
    # no noise estimate yet (no spread in the observations): no try is let through
    d = make_bandit(ARMS, epsilon=0.0, max_loss=0.05, min_count=3)
    for _ in range(3):
        d.observe("off", 1, 64, 64 / 100.0, lag=64)
    d.observe("eagle:4x2x12", 1, 64, 64 / 200.0, lag=64)
    d.charge("off", 1, 64, 1000.0, lag=64, as_plain=False)
    assert str(d.choose(1)) == "off" and d.stats()["choices"][1]["held"] == 1


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
    assert state["version"] == 2 and state["seq"] == 140
    assert all(len(o) == 4 and o[2] > 0 for o in state["observations"]["16"])  # [arm, reward, seconds, sequence]
    b = Bandit.from_state_dict(cfg, state)
    assert b.stats() == a.stats() and b.state_dict() == a.state_dict()
    # what choose sees comes along: measured and transferred estimates (bucket 4 borrows from 16), the noise level
    assert b.estimates(4) == a.estimates(4) and {e.source for e in a.estimates(4).values()} == {16}
    assert b._windows.noise() == a._windows.noise() > 0
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
    # a version-1 checkpoint (observations [arm, reward], no times, three choice counters) still loads
    v1 = {k: v for k, v in state.items() if k != "seq"}
    v1["version"] = 1
    v1["observations"] = {k: [o[:2] for o in obs] for k, obs in state["observations"].items()}
    v1["choices"] = {k: {n: c[n] for n in ("untried", "explore", "exploit")} for k, c in state["choices"].items()}
    old = Bandit.from_state_dict(cfg, v1)
    assert old.medians(1) == Bandit.from_state_dict(cfg, state).medians(1)
    assert all(e.seconds == 0.0 for e in old.estimates(1).values())  # unknown times: no time share
    assert old.stats()["choices"][1]["declined"] == 0 and old.state_dict()["version"] == 2


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
    bad = [
        (dict(epsilon=1.5), "epsilon"),
        (dict(window=0), "window"),
        (dict(seed=-1), "seed"),
        (dict(margin=1.5), r"BanditConfig.margin must be in \[0, 1\], got 1.5: .* \(e.g. 0.1; 1 explores every arm\)"),
        (dict(margin=-0.1), r"BanditConfig.margin must be in \[0, 1\]"),
        (dict(margin=True), r"BanditConfig.margin must be in \[0, 1\]"),
        (dict(transfer="yes"), "BanditConfig.transfer must be True or False, got 'yes'"),
        (dict(time_share=1), "BanditConfig.time_share must be True or False, got 1"),
        (dict(min_count=0), r"BanditConfig.min_count must be an integer >= 1 .*got 0"),
        (dict(min_count=True), "BanditConfig.min_count must be an integer"),
        (dict(max_loss=0.0), r"BanditConfig.max_loss must be None \(no bound\) or in \(0, 1\], got 0.0: .*e.g. 0.05"),
        (dict(max_loss=1.5), r"BanditConfig.max_loss must be None"),
        (dict(max_loss=True), r"BanditConfig.max_loss must be None"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            BanditConfig(parse_arms(["off"]), **kw)
    # the engine's SpecConfig carries the knobs to the bandit, and its errors name SpecConfig's keys
    spec = SpecConfig(arms=("off", "eagle:8x4x48"), margin=0.25, transfer=False, time_share=False)
    assert (spec.bandit_config().margin, spec.bandit_config().transfer, spec.bandit_config().time_share) == (
        0.25,
        False,
        False,
    )
    with pytest.raises(ValueError, match=r"SpecConfig.margin must be in \[0, 1\]"):
        SpecConfig(arms=("off", "eagle:8x4x48"), margin=2.0)
    assert SpecConfig(arms=("off", "eagle:8x4x48"), max_loss=0.02).bandit_config().max_loss == 0.02
    with pytest.raises(ValueError, match=r"SpecConfig.max_loss bounds the loss against plain decoding, .*'off'"):
        SpecConfig(arms=("eagle:8x4x48", "eagle:4x2x12"), max_loss=0.05)


def test_observe_rejects_bad_reports():
    b = make_bandit(ARMS)
    for args, msg in (
        (("eagle:2x2x4", 1, 5, 1.0), "not one of the bandit's arms"),
        (("off", 0, 5, 1.0), "bucket"),
        (("off", 1, -1, 1.0), "tokens"),
        (("off", 1, 5, 0.0), "seconds"),
        (("off", 1, 5, float("nan")), "seconds"),
        (("off", 4, 5, 1.0, 1, 0), "rows"),
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
