"""Controller: the busy / idle / training state machine on scripted timings, the sliced rollout (R = 1 vs R = 2 give
the same tokens), and a real step that trains the drafter on an idle slice while another still decodes."""

import json
import time

import numpy as np
import pytest
from flax import nnx

from tlt_jax.controller import (
    BUSY,
    IDLE,
    TIMELINE_FILE,
    TRAINING,
    Controller,
    ControllerConfig,
    SlicedRollout,
    SliceScheduler,
    assign_prompts,
    simulate,
)
from tlt_jax.distributed import MeshConfig, make_mesh
from tlt_jax.drafter import DrafterOptimConfig, EagleDrafter
from tlt_jax.drafter.buffer import DrafterBuffer
from tlt_jax.drafter.spot import HELDOUT, SpotTrainer
from tlt_jax.drafter.train import drafter_loss
from tlt_jax.models import CausalLM, tiny_config
from tlt_jax.rollout import HiddenCapture, SamplingParams

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def check_timeline(sched, end):
    """Per slice: intervals sorted, back to back from 0 to ``end``, no two neighbours in the same state."""
    for s in range(sched.n):
        ivs = [iv for iv in sched.timeline if iv["slice"] == s]
        assert ivs[0]["start"] == 0.0 and ivs[-1]["end"] == end
        for a, b in zip(ivs, ivs[1:], strict=False):
            assert a["end"] == b["start"] and a["state"] != b["state"]
        assert all(iv["end"] > iv["start"] for iv in ivs)
    return {s: [(iv["state"], iv["start"], iv["end"]) for iv in sched.timeline if iv["slice"] == s]
            for s in range(sched.n)}


def test_early_slice_trains_until_the_last_rollout_ends():
    sched, m = simulate([1.0, 5.25], train_step_s=0.5)
    tl = check_timeline(sched, 5.5)
    # Slice 0 trains from its rollout's end; the step in flight when slice 1 ends (5.0 -> 5.5) finishes, then stop.
    assert tl[0] == [(BUSY, 0.0, 1.0), (TRAINING, 1.0, 5.5)]
    assert tl[1] == [(BUSY, 0.0, 5.25), (IDLE, 5.25, 5.5)]
    assert sched.train_steps == [9, 0]
    assert m["controller/busy_s"] == 6.25 and m["controller/train_s"] == 4.5 and m["controller/idle_s"] == 0.25
    assert m["controller/train_steps"] == 9 and m["controller/train_slices"] == 1
    assert m["controller/rollout_s"] == 5.25 and m["controller/overhang_s"] == 0.25


def test_a_process_dispatches_only_its_own_slices():
    """Across processes a scheduler follows every slice but runs only its own: process A (slice 0) trains while the
    other process's slices decode, stops after the step in flight once the last one anywhere ends, and its timeline
    holds only slice 0; the other process (slices 1, 2) sees slice 0 end and trains slice 1 meanwhile."""
    a = SliceScheduler(3, ControllerConfig(), local=[0])
    a.start(0.0)
    assert a.rollout_done(0, 1.0) == [0]
    assert a.rollout_done(1, 2.0) == []  # another process's slice: idle, never dispatched here
    assert a.train_step_done(0, 2.5)  # slice 2 still decodes
    assert a.rollout_done(2, 2.75) == []
    assert not a.train_step_done(0, 3.0)  # the last slice anywhere ended: stop
    a.finish(3.0)
    assert {iv["slice"] for iv in a.timeline} == {0}
    assert [(iv["state"], iv["start"], iv["end"]) for iv in a.timeline] == [(BUSY, 0.0, 1.0), (TRAINING, 1.0, 3.0)]
    b = SliceScheduler(3, ControllerConfig(steps_without_idle=2), local=[1, 2])
    b.start(0.0)
    assert b.rollout_done(0, 1.0) == []  # slice 0 is not b's; b's slices still decode
    assert b.rollout_done(1, 2.0) == [1]
    assert b.rollout_done(2, 2.75) == []  # rollout over; steps_without_idle is slice 0's, which b does not run
    assert not b.train_step_done(1, 3.0)
    with pytest.raises(ValueError, match="out of range"):
        SliceScheduler(2, local=[2])


def test_random_timings_keep_the_invariants():
    rng = np.random.default_rng(0)
    for _ in range(50):
        r = int(rng.integers(1, 6))
        ends = [float(x) for x in np.round(rng.uniform(0.1, 10.0, r), 3)]
        step = float(rng.uniform(0.05, 2.0))
        sched, m = simulate(ends, step, ControllerConfig(min_idle_slices=int(rng.integers(1, r + 1))))
        last = max(ends)
        end = max(iv["end"] for iv in sched.timeline)
        check_timeline(sched, end)
        assert end - last < step + 1e-9  # nothing waits more than one drafter step
        assert m["controller/rollout_s"] == last and m["controller/overhang_s"] == end - last
        for iv in sched.timeline:
            if iv["state"] == TRAINING:
                assert iv["start"] < last  # training only starts while the rollout runs
        assert abs(m["controller/busy_s"] - sum(ends)) < 1e-9
        total = m["controller/busy_s"] + m["controller/idle_s"] + m["controller/train_s"]
        assert abs(total - r * end) < 1e-9


def test_min_idle_slices_no_data_and_steps_without_idle():
    sched, _ = simulate([1.0, 2.0, 6.0], 1.0, ControllerConfig(min_idle_slices=2))
    tl = check_timeline(sched, 6.0)
    assert tl[0] == [(BUSY, 0.0, 1.0), (IDLE, 1.0, 2.0), (TRAINING, 2.0, 6.0)]  # waits for a second idle slice
    assert tl[1] == [(BUSY, 0.0, 2.0), (TRAINING, 2.0, 6.0)]
    assert sched.train_steps == [4, 4, 0]
    sched, m = simulate([1.0, 3.0], 0.5, can_train=False)  # empty buffer: nothing is dispatched
    assert m["controller/train_steps"] == 0 and m["controller/idle_s"] == 2.0
    sched, m = simulate([1.0, 3.0], 0.5, ControllerConfig(train_drafter=False))
    assert m["controller/train_steps"] == 0
    # A slice with no prompt trains from the start when there is data (the previous step's).
    sched, _ = simulate([None, 4.0], 1.5)
    assert check_timeline(sched, 4.5)[0] == [(TRAINING, 0.0, 4.5)] and sched.train_steps == [3, 0]
    sched, _ = simulate([None, 4.0], 1.5, can_train=False)
    assert check_timeline(sched, 4.0)[0] == [(IDLE, 0.0, 4.0)]
    # One slice: never idle during the rollout; steps_without_idle trains after it.
    sched, m = simulate([2.0], 0.5, ControllerConfig(steps_without_idle=3))
    assert check_timeline(sched, 3.5)[0] == [(BUSY, 0.0, 2.0), (TRAINING, 2.0, 3.5)]
    assert m["controller/train_steps"] == 3
    # With two slices the extra steps follow slice 0's in-flight ones.
    sched, _ = simulate([1.0, 2.25], 0.5, ControllerConfig(steps_without_idle=2))
    assert sched.train_steps == [5, 0]


@pytest.mark.parametrize("ends", [(1.0, 2.25), (0.3, 1.1, 2.0, 5.7), (4.0, 1.0)])
def test_default_steps_without_idle_keeps_several_slices_off_the_critical_path(ends):
    """drafter.steps_without_idle = -1 (the default): 4 with one slice, 0 with several; with several slices drafter
    work after the last shard is at most the step in flight, whatever the timings."""
    from tlt_jax.config import ConfigError, from_config_dict, to_config_dict
    from tlt_jax.rollout_config import DrafterConfig

    d = DrafterConfig()
    assert d.steps_without_idle == -1 and d.resolved_steps_without_idle(1) == 4
    assert d.resolved_steps_without_idle(2) == d.resolved_steps_without_idle(8) == 0
    assert DrafterConfig(steps_without_idle=3).resolved_steps_without_idle(2) == 3
    step = 0.7
    _, m = simulate(list(ends), step, ControllerConfig(steps_without_idle=d.resolved_steps_without_idle(len(ends))))
    assert m["controller/train_steps"] > 0 and 0 <= m["controller/overhang_s"] <= step
    _, m = simulate([2.0], step, ControllerConfig(steps_without_idle=d.resolved_steps_without_idle(1)))
    assert m["controller/overhang_s"] == pytest.approx(4 * step)  # one slice: the 4 steps after the rollout
    cd = to_config_dict()
    cd.drafter.steps_without_idle = -2
    with pytest.raises(ConfigError, match=r"drafter.steps_without_idle: must be >= 0 drafter steps, or -1"):
        from_config_dict(cd)


def test_a_dropped_step_leaves_the_slice_idle_or_starts_an_extra_step():
    sched = SliceScheduler(2)
    sched.start(0.0)
    assert sched.rollout_done(0, 1.0) == [0]  # slice 0 trains (its step queued behind the held-out evaluation)
    assert sched.rollout_done(1, 2.0) == []
    assert sched.train_step_dropped(0, 2.0) is False and sched.done()
    m = sched.finish(2.0)
    assert m["controller/train_steps"] == 0 and m["controller/overhang_s"] == 0.0
    assert check_timeline(sched, 2.0)[0] == [(BUSY, 0.0, 1.0), (TRAINING, 1.0, 2.0)]
    # steps_without_idle: the dropped step does not count against the steps owed after the rollout
    sched = SliceScheduler(2, ControllerConfig(steps_without_idle=1))
    sched.start(0.0)
    sched.rollout_done(0, 1.0)
    sched.rollout_done(1, 2.0)
    assert sched.train_step_dropped(0, 2.0) is True and not sched.done()
    assert sched.train_step_done(0, 3.0) is False and sched.train_steps == [1, 0]
    with pytest.raises(ValueError, match="slice 1 is idle, not training"):
        sched.train_step_dropped(1, 3.0)


def test_scheduler_rejects_bad_events():
    sched = SliceScheduler(2)
    sched.start(0.0)
    with pytest.raises(ValueError, match="slice 0 is busy, not training"):
        sched.train_step_done(0, 1.0)
    assert sched.rollout_done(0, 1.0) == [0]
    with pytest.raises(ValueError, match="not busy"):
        sched.rollout_done(0, 2.0)
    with pytest.raises(ValueError, match="before the previous event"):
        sched.rollout_done(1, 0.5)
    with pytest.raises(ValueError, match="still running"):
        sched.finish(3.0)
    with pytest.raises(ValueError, match="min_idle_slices"):
        ControllerConfig(min_idle_slices=0)


def test_assign_prompts_keeps_order_and_balance():
    assert assign_prompts(5, 2) == [[0, 1, 2], [3, 4]]
    assert assign_prompts(2, 3) == [[0], [1], []]
    assert sum(assign_prompts(17, 4), []) == list(range(17))


PROMPTS = [[5, 9, 17, 33], [2, 200, 7], [40, 41, 42], [100, 3], [7, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def model():
    return CausalLM(tiny_config(), rngs=nnx.Rngs(0))


def sliced(model, r):
    mesh = make_mesh(MeshConfig(data=8))
    return SlicedRollout(model, mesh, r, max_batch=16, max_len=64, chunk_size=4, length_buckets=(64,),
                         compaction=False, capture=HiddenCapture(window=8), compiler_options=FAST)


@pytest.fixture(scope="module")
def two(model):
    rollout = sliced(model, 2)
    yield rollout
    rollout.close()


def test_slices_bandits_get_distinct_deterministic_seeds(model):
    from tlt_jax.rollout import RolloutEngine, SpecConfig

    spec = SpecConfig(arms=("off", "ngram:3x2x6"), seed=7)
    mesh = make_mesh(MeshConfig(data=8))
    kw = dict(spec=spec, max_batch=8, max_len=64, length_buckets=(64,), compiler_options=FAST)

    def bandits(r):
        rollout = SlicedRollout(model, mesh, r, **kw)
        try:
            engines = list(rollout.engines.values())
            return [e.bandit.config.seed for e in engines], [e.state_dict()["bandit"]["rng"] for e in engines]
        finally:
            rollout.close()

    seeds, rngs = bandits(4)
    assert len(set(seeds)) == 4 and len({json.dumps(g, sort_keys=True) for g in rngs}) == 4
    assert (seeds, rngs) == bandits(4)  # a rebuild (or another process) gets the same bandits
    single = RolloutEngine(model, mesh, **kw)
    try:  # slice 0 (and a one-slice rollout) is seeded as a single engine
        assert seeds[0] == single.bandit.config.seed == 7 and rngs[0] == single.state_dict()["bandit"]["rng"]
    finally:
        single.close()
    assert bandits(1) == (seeds[:1], rngs[:1])


@pytest.mark.slow
def test_two_slices_match_one(model, two):
    params = SamplingParams(temperature=1.0, top_k=50, n=2, max_new_tokens=[5, 30, 12, 3, 20], seed=11,
                            ignore_eos=True)
    one = sliced(model, 1)
    try:
        a, b = one.generate(PROMPTS, params), two.generate(PROMPTS, params)
        # One slice is never idle during the rollout: steps_without_idle trains after it (the single-slice path).
        trainer = SpotTrainer(EagleDrafter(model.config, rngs=nnx.Rngs(1)), one.meshes, one.policy)
        with pytest.raises(ValueError, match=r"capture=HiddenCapture"):
            Controller(SlicedRollout(model, one.meshes[0], 1, max_len=64), buffer=DrafterBuffer(2**20),
                       trainer=trainer)
        with pytest.raises(ValueError, match=r"rows=4 must be a multiple of 8"):
            Controller(one, trainer=trainer, buffer=DrafterBuffer(2**20), cfg=ControllerConfig(rows=4))
        ctl = Controller(one, trainer=trainer, buffer=DrafterBuffer(2**20),
                         cfg=ControllerConfig(steps_without_idle=2, row_len=16, rows=8))
        c, m = ctl.run_step(1, PROMPTS, params)
    finally:
        one.close()
    assert c.tokens == a.tokens
    assert m["controller/train_steps"] == 2 and m["drafter/total_steps"] == 2
    assert 0 <= m[HELDOUT] <= 1  # a single slice scores the drafter at its end, on all of the step's responses
    states = [iv["state"] for iv in ctl.scheduler.timeline]
    assert states in ([BUSY, TRAINING], [BUSY, TRAINING, IDLE])  # idle only between the last step and finish
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    for i in range(len(PROMPTS)):
        for j in range(2):
            np.testing.assert_allclose(a.logprobs[i][j], b.logprobs[i][j], atol=1e-5)
            np.testing.assert_allclose(a.hidden[i][j], b.hidden[i][j], atol=1e-5)
            assert a.hidden_start[i][j] == b.hidden_start[i][j]
    assert [s["prompts"] for s in b.stats["slices"]] == [3, 2]  # whole groups, contiguous blocks
    assert b.stats["total_tokens"] == a.stats["total_tokens"] == 2 * (5 + 30 + 12 + 3 + 20)
    d0, d1 = ({d.id for d in m.devices.flat} for m in two.meshes)
    assert len(d0) == len(d1) == 4 and not d0 & d1


@pytest.mark.slow
def test_controller_trains_on_the_idle_slice(model, two, tmp_path):
    import jax

    rollout = two
    drafter = EagleDrafter(model.config, rngs=nnx.Rngs(1))
    trainer = SpotTrainer(drafter, rollout.meshes, rollout.policy, optim=DrafterOptimConfig(learning_rate=1e-3))
    buffer = DrafterBuffer(max_bytes=2**20)
    ctl = Controller(rollout, trainer=trainer, buffer=buffer, cfg=ControllerConfig(row_len=16, rows=4),
                     workdir=tmp_path)
    trainer.compile(4, 16)  # as the main job does: a step queued behind a compiling evaluation may be preempted
    # Slice 0 (prompts 0-2) finishes after a few tokens; slice 1 (prompts 3-4) decodes 50 more, 1 per round trip.
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=[4, 4, 4, 50, 50], seed=3, ignore_eos=True)
    want = rollout.generate(PROMPTS, params)
    evaluated, evaluate = [], trainer.evaluate

    def spy(s, batch):  # the held-out top-1: on slice 0 while slice 1 decodes, of the drafter before any step
        evaluated.append((s, list(ctl.scheduler.busy()), batch, jax.device_get(trainer.params_on(s))))
        return evaluate(s, batch)

    trainer.evaluate = spy
    res, m = ctl.run_step(1, PROMPTS, params)
    [(s, busy, batch, before)] = evaluated
    assert s == 0 and 1 in busy
    top1 = drafter_loss(nnx.merge(trainer.graphdef, before), rollout.policy(0), batch, trainer.loss_cfg)[1].top1
    assert m[HELDOUT] == pytest.approx(float(top1), abs=1e-6)
    assert batch.next_tokens.shape == (4, 16) and 0 < float(batch.loss_mask.sum()) <= 6 * 4  # slice 0's responses
    calls, releases, release = [], [], rollout.release

    def spy_release(pools):  # deferred compiles go only once the drafter's average is read and nothing is in flight
        releases.append((trainer._pending["metrics"] is not None, dict(trainer.replicas), ctl.scheduler.training()))
        return release(pools)

    rollout.release = spy_release
    res2, m2 = ctl.run_step(2, PROMPTS, params, on_chunk=lambda f, a: calls.append((f, a)))
    del rollout.release
    # released after the drafter work in flight at the rollout's end (overhang_s) and the average
    assert releases == [(True, {}, [])] and m2["controller/compile_release_s"] >= m2["controller/overhang_s"]
    assert trainer.step_metrics() == {k: m2[k] for k in trainer.step_metrics()}  # the average's, read once
    assert all(f + a == 10 for f, a in calls) and calls[-1] == (10, 0)
    assert [f for f, _ in calls] == sorted(f for f, _ in calls)
    assert res.tokens == want.tokens and res2.tokens == want.tokens  # the controller changes nothing sampled
    lines = [json.loads(x) for x in (tmp_path / TIMELINE_FILE).read_text().splitlines()]
    for step, metrics in ((1, m), (2, m2)):
        ivs = [x for x in lines if x["step"] == step]
        busy_end = {x["slice"]: x["end"] for x in ivs if x["state"] == BUSY}
        assert busy_end[0] < busy_end[1]
        trained = [x for x in ivs if x["state"] == TRAINING]
        assert trained and all(x["slice"] == 0 and x["start"] == busy_end[0] for x in trained)
        assert metrics["controller/train_steps"] >= 1 and metrics["drafter/replicas"] == 1
        assert metrics["controller/train_s"] == pytest.approx(sum(x["end"] - x["start"] for x in trained))
        assert metrics["controller/busy_s"] == pytest.approx(sum(x["end"] - x["start"] for x in ivs
                                                                 if x["state"] == BUSY))
        assert np.isfinite(metrics["drafter/loss"])
    assert m2["drafter/total_steps"] == m["controller/train_steps"] + m2["controller/train_steps"]
    assert m2["buffer/current_step_samples"] == 10 and m2["buffer/previous_step_samples"] == 10
    # A slice that fails: the other slice's work drains, then the error surfaces; the controller stays usable.
    bad = [list(p) for p in PROMPTS]
    bad[0] = [999]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ctl.run_step(3, bad, params)
    assert not trainer.replicas
    _, m4 = ctl.run_step(4, PROMPTS, params)
    assert m4["drafter/total_steps"] == m2["drafter/total_steps"] + m4["controller/train_steps"]
    # An average that fails: the error surfaces and the deferred compiles are still let go.

    def failing_average():
        raise RuntimeError("the average failed")

    releases.clear()
    rollout.release, trainer.average = spy_release, failing_average
    with pytest.raises(RuntimeError, match="the average failed"):
        ctl.run_step(5, PROMPTS, params)
    del rollout.release
    assert len(releases) == 1


def test_drafter_work_not_started_when_the_rollout_ends_is_dropped(model, two):
    """Slice 0 finishes first: it runs a drafter step, then scores the drafter, then runs the next step. Whatever of
    that has not started when slice 1 finishes is dropped: with a long first step, the scoring (no held-out figure);
    with a long scoring, the second step (the score is kept)."""
    trainer = SpotTrainer(EagleDrafter(model.config, rngs=nnx.Rngs(1)), two.meshes, two.policy)
    ctl = Controller(two, trainer=trainer, buffer=DrafterBuffer(2**20), cfg=ControllerConfig(row_len=16, rows=4))
    trainer.compile(4, 16)
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=[4, 4, 4, 30, 30], seed=3, ignore_eos=True)
    calls = []

    def outlasting(fn, name):  # slice 0's first call of fn runs until slice 1 has finished and the controller knows
        def run(s, batch):
            calls.append(name)
            if len(calls) == 1:
                while ctl.scheduler.busy():
                    time.sleep(0.005)
                time.sleep(0.5)
            return fn(s, batch)
        return run

    step, evaluate = trainer.train_step, trainer.evaluate
    trainer.train_step = outlasting(step, "step")
    _, m = ctl.run_step(1, PROMPTS, params)
    assert calls == ["step"] and m["controller/train_steps"] == m["drafter/steps"] == 1 and np.isnan(m[HELDOUT])
    trainer.train_step, trainer.evaluate = step, outlasting(evaluate, "score")
    calls.clear()
    _, m = ctl.run_step(2, PROMPTS, params)
    assert m["controller/train_steps"] == m["drafter/steps"] == 1 and 0 <= m[HELDOUT] <= 1  # the next step dropped
    slice0 = [iv["state"] for iv in ctl.scheduler.timeline if iv["slice"] == 0]
    assert slice0[:2] == [BUSY, TRAINING] and m["drafter/total_steps"] == 2


@pytest.mark.slow
def test_trained_drafter_published_to_eagle_slices_stays_lossless(model, two):
    import jax

    from tlt_jax.rollout import SpecConfig

    drafter = EagleDrafter(model.config, rngs=nnx.Rngs(2))
    spec = SpecConfig(depth=3, topk=2, verify_tokens=6, threshold=16)  # every chunk speculative
    rollout = SlicedRollout(model, make_mesh(MeshConfig(data=2), jax.devices()[:2]), 2, drafter=drafter, spec=spec,
                            max_batch=8, max_len=64, chunk_size=4, length_buckets=(64,), compaction=False,
                            capture=HiddenCapture(window=16), compiler_options=FAST)
    trainer = SpotTrainer(drafter, rollout.meshes, rollout.policy, optim=DrafterOptimConfig(learning_rate=3e-3))
    ctl = Controller(rollout, trainer=trainer, buffer=DrafterBuffer(2**20), cfg=ControllerConfig(row_len=16, rows=2))
    trainer.compile(2, 16)
    greedy = SamplingParams(temperature=0.0, n=2, max_new_tokens=[6, 6, 6, 40, 40], ignore_eos=True)
    try:
        want = two.generate(PROMPTS, greedy)  # plain decoding
        res, m = ctl.run_step(1, PROMPTS, greedy)
        assert res.tokens == want.tokens and res.stats["verify_steps"] > 0
        assert m["controller/train_steps"] >= 1
        before = jax.tree.leaves(rollout.engines[1].drafter_params)
        rollout.set_drafter(trainer.drafter())  # between steps: the next rollout drafts with the trained drafter
        after = jax.tree.leaves(rollout.engines[1].drafter_params)
        assert any(not np.array_equal(x, y) for x, y in zip(before, after, strict=True))
        res2 = rollout.generate(PROMPTS, greedy)
    finally:
        rollout.close()
    assert res2.tokens == want.tokens and res2.stats["verify_steps"] > 0
    for i in range(len(PROMPTS)):
        for j in range(2):
            np.testing.assert_allclose(res2.logprobs[i][j], want.logprobs[i][j], atol=1e-5)


def test_activity_marks_other_owners_work():
    from tlt_jax.adaptive.quiet import Activity

    act = Activity()
    m = act.mark(own="me")
    with act.busy("me"):  # one's own work never disturbs
        pass
    assert act.quiet_since(m, own="me")
    m = act.mark(own="me")
    with act.busy("other"):  # started and ended within the chunk
        pass
    assert not act.quiet_since(m, own="me")
    with act.busy("other"):
        m = act.mark(own="me")  # running when the chunk starts
    assert not act.quiet_since(m, own="me")
    assert act.quiet_since(act.mark(own="me"), own="me")


def test_disturbed_chunks_stay_out_of_the_bandit(model):
    """Bandit hygiene: chunks that ran while other work of this process was registered (another slice's drafter
    step or compile) are flagged and not observed by the bandit; the same call undisturbed is observed."""
    from tlt_jax.adaptive.quiet import Activity
    from tlt_jax.rollout import RolloutEngine, SpecConfig

    spec = SpecConfig(arms=("off", "ngram:3x2x6"), seed=7, threshold=64)
    engine = RolloutEngine(model, spec=spec, max_batch=8, max_len=64, chunk_size=4, length_buckets=(64,),
                           compiler_options=FAST)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 5, 6, 5]]
    engine.pool.activity = act = Activity()  # as a SlicedRollout's engines share one
    try:
        engine.generate(prompts, params)  # compiles; first runs are not observed either
        seen = lambda: sum(len(v) for v in engine.bandit.state_dict()["observations"].values())  # noqa: E731
        before = seen()
        with act.busy(("drafter", 1)):
            res = engine.generate(prompts, params)
        assert res.stats["chunks"] and all(c.get("disturbed") for c in res.stats["chunks"])
        assert seen() == before
        res = engine.generate(prompts, params)
        assert not any(c.get("disturbed") for c in res.stats["chunks"]) and seen() > before
    finally:
        engine.close()


def test_deferred_compiles_wait_for_every_slice(model):
    """Slices with compile_between_calls: no slice's pool starts its deferred compiles while another slice of the
    process still decodes (every pool stays held through the call, whichever slice ends first), then all are
    released."""
    rollout = SlicedRollout(model, make_mesh(MeshConfig(data=8)), 2, max_batch=8, max_len=64, chunk_size=4,
                            length_buckets=(64,), compile_between_calls=True, compiler_options=FAST)
    held = []
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=[4, 20], ignore_eos=True)
        rollout.generate([[1, 2, 3], [4, 5, 6]], params,
                         on_chunk=lambda f, a: held.append([e.pool.held for e in rollout.engines.values()]))
        assert held and all(all(h) for h in held)
        assert not any(e.pool.held for e in rollout.engines.values())
    finally:
        rollout.close()


def test_board_wait_returns_when_the_key_is_posted_or_stopped():
    """The board in one process: ``wait`` wakes as soon as another thread posts the key, and gives up on a stop."""
    import threading
    import time

    from tlt_jax.distributed.board import Board

    board, stop = Board("t"), threading.Event()
    threading.Timer(0.05, board.post, args=("1/3",)).start()
    t = time.monotonic()
    assert board.wait("1/3", stop, check_s=5.0) and time.monotonic() - t < 2.0
    threading.Timer(0.05, stop.set).start()
    assert not board.wait("1/4", stop, check_s=0.1)
    assert board.keys("1") == {"3"}
