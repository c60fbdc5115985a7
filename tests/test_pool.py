"""The compiled-step pool's byte budget: LRU eviction by bytes and by count, counters, sizes of real executables on
this backend, precompiling a plan of keys (e.g. every reachable (arm, bucket)), and background compiles on a
low-priority worker thread."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest

from tlt_jax.rollout.pool import (
    BACKGROUND_NICE,
    COMPILE,
    StepKey,
    StepPool,
    executable_bytes,
    lower_compile_threads,
    thread_kinds,
)


def scripted(sizes):
    """A sizer handing out the given byte sizes in compile order."""
    it = iter(sizes)
    return lambda exe: (next(it), "measured")


def pool_with(**kw) -> StepPool:
    pool = StepPool(**kw)
    pool.register("decode", "plain", lambda key: jax.jit(lambda x: x + key.batch))
    return pool


X = jnp.zeros((2,), jnp.int32)
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
K = [StepKey("decode", i, 8) for i in range(6)]


def test_byte_bound_evicts_least_recently_used():
    pool = pool_with(budget=10, max_bytes=100, sizer=scripted([40, 30, 50, 60, 150, 20]))
    pool.get(K[0], X), pool.get(K[1], X)
    assert pool.bytes == 70 and pool.evictions == 0
    pool.get(K[2], X)  # 120 > 100: the oldest (K0) goes
    assert pool.keys() == [K[1], K[2]] and pool.bytes == 80 and pool.evictions == 1
    assert int(pool.get(K[1], X)(X)[0]) == 1  # a hit: K2 is now least recently used
    pool.get(K[3], X)  # 140 > 100: K2 goes, 90 left
    assert pool.keys() == [K[1], K[3]] and pool.bytes == 90 and pool.evictions == 2
    pool.get(K[4], X)  # alone over the bound: kept, everything else goes
    assert pool.keys() == [K[4]] and pool.bytes == 150 and pool.oversized == 1 and pool.evictions == 4
    pool.get(K[5], X)  # the oversized one is the LRU now
    assert pool.keys() == [K[5]] and pool.bytes == 20 and pool.evictions == 5
    c = pool.counters()
    assert (c["hits"], c["misses"], c["compiles"], c["size"]) == (1, 6, 6, 1)
    assert (c["bytes"], c["peak_bytes"], c["max_bytes"], c["estimated"]) == (20, 150, 100, 0)
    assert pool.nbytes(K[5]) == 20


def test_count_budget_still_applies_with_a_byte_bound():
    pool = pool_with(budget=2, max_bytes=1000, sizer=scripted([10, 10, 10]))
    for k in K[:3]:
        pool.get(k, X)
    assert pool.keys() == K[1:3] and pool.bytes == 20 and pool.evictions == 1
    with pytest.raises(ValueError, match="max_bytes"):
        StepPool(max_bytes=0)


def test_real_executable_sizes_bound_the_pool():
    def build(key):
        def f(x, w):
            for i in range(key.length):
                x = jnp.tanh(x @ w + i)
            return x

        return jax.jit(f)

    args = (jax.ShapeDtypeStruct((8, 32), jnp.float32), jax.ShapeDtypeStruct((32, 32), jnp.float32))
    free = StepPool(budget=10, compiler_options=FAST)
    free.register("decode", "plain", build)
    small, big = StepKey("decode", 1, 1), StepKey("decode", 1, 12)
    free.compile(small, *args), free.compile(big, *args)
    size, source = executable_bytes(free._compiled[big])
    assert size == free.nbytes(big) > free.nbytes(small) > 0  # more program, more bytes
    stats = free._compiled[big].memory_analysis()
    if source == "measured":
        assert size == stats.generated_code_size_in_bytes + stats.host_generated_code_size_in_bytes
    else:  # XLA:CPU reports no code size: estimated from the program text, and counted as such
        assert stats.generated_code_size_in_bytes == 0 and free.counters()["estimated"] == 2
        assert size == len(free._compiled[big].as_text())
    keys = [StepKey("decode", b, 4) for b in (1, 2, 3)]  # three programs of one size
    sizes = []
    for k in keys:
        free.compile(k, *args)
        sizes.append(free.nbytes(k))
    bound = sizes[0] + sizes[1] + sizes[2] // 2
    pool = StepPool(budget=10, max_bytes=bound, compiler_options=FAST)
    pool.register("decode", "plain", build)
    for k in keys:
        pool.compile(k, *args)
        assert pool.bytes <= bound
    assert pool.keys() == keys[1:] and pool.evictions == 1
    assert pool.bytes == sum(pool.nbytes(k) for k in pool.keys())


def test_precompile_plan_reports_what_does_not_fit():
    made = []

    def thunk(k):
        def make():
            made.append(k)
            return (X,)

        return make

    pool = pool_with(budget=10, max_bytes=100, sizer=scripted([30] * 10))
    pool.get(K[0], X)
    rep = pool.precompile([(k, thunk(k)) for k in K[:3]])
    assert made == K[1:3]  # abstract arguments are built only for keys not pooled yet
    assert rep == dict(keys=3, compiled=2, bytes=90, evicted=0)
    before = pool.counters()
    rep = pool.precompile([(k, thunk(k)) for k in K[:4]])  # 4 x 30 > 100: the plan does not fit
    assert rep == dict(keys=4, compiled=1, bytes=90, evicted=1) and pool.evictions == before["evictions"] + 1
    assert pool.counters()["hits"] == before["hits"]  # precompiling is neither a hit nor a miss


@pytest.mark.slow
def test_precompile_every_reachable_arm_and_bucket_of_an_engine():
    """Two n-gram tree shapes and "off" on a tiny engine: the plan compiles each reachable (arm, bucket) once (the
    extra arm's verify step from the same builders), and a rollout afterwards compiles only its prefill."""
    from flax import nnx

    from tlt_jax.adaptive import BanditConfig, parse_arms
    from tlt_jax.models import CausalLM, tiny_config
    from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig
    from tlt_jax.rollout.plan import reachable_plan
    from tlt_jax.rollout.spec_steps import register_spec

    cfg = tiny_config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, eos_token_ids=()
    )
    eng = RolloutEngine(
        CausalLM(cfg, rngs=nnx.Rngs(0)),
        drafter="ngram",
        spec=SpecConfig(2, 2, 4, threshold=1),
        max_batch=1,
        max_len=32,
        length_buckets=(32,),
        batch_buckets=(1,),
        compiler_options=FAST,
    )
    bandit = BanditConfig(parse_arms(["off", "ngram:2x2x4", "ngram:3x1x4"]))
    for arm in bandit.arms:
        if arm.speculative and not eng.pool.has_builder("verify", arm.pool_name):
            register_spec(eng.pool, eng.ctx, eng.spec.for_arm(arm), arm.kind)

    def abstract_args(arm, b, length):
        state = eng.ctx.abstract_state(b)
        if not arm.speculative:
            return eng.step_params(), state
        sh = eng.ctx.batch_sharding((b, arm.verify_tokens))
        tree = [jax.ShapeDtypeStruct((b, arm.verify_tokens), dt, sharding=sh) for dt in (jnp.int32, jnp.int32, bool)]
        return eng.step_params(), state, *tree

    plan = reachable_plan(bandit, eng.batch_buckets, eng.length_buckets, 1, abstract_args)
    assert sorted((k.phase, k.batch, k.length, k.arm) for k, _ in plan) == [
        ("decode", 1, 32, "plain"),
        ("verify", 1, 32, "tree/ngram/d2k2n4"),
        ("verify", 1, 32, "tree/ngram/d3k1n4"),
    ]
    rep = eng.pool.precompile(plan)
    assert rep["compiled"] == rep["keys"] == 3 and rep["evicted"] == 0 and rep["bytes"] > 0
    assert eng.pool.precompile(plan)["compiled"] == 0
    res = eng.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
    assert res.stats["arms"] == {eng.spec_arm: res.stats["verify_steps"]}  # the engine's verify arm, from the plan
    assert {k.phase for k in eng.pool.keys()} == {"decode", "verify", "prefill"}
    assert res.stats["pool_this_call"]["compiles"] == 1


def test_background_compile_enters_the_pool_on_the_callers_thread():
    """``prepare`` starts a compile on the worker thread and says "not ready"; the pool changes only when the caller
    collects it (or asks ``get`` for it, which waits instead of compiling twice); a builder's error reaches the caller.
    The worker and XLA's compile threads run at the lowest CPU priority, XLA's execution threads as they were."""
    import threading

    threads, started, release = [], threading.Event(), threading.Event()

    def build(key):
        threads.append(threading.current_thread().name)
        if sys.platform == "linux":  # the worker runs at the lowest CPU priority
            assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == BACKGROUND_NICE
        if key.length == 0:
            raise ValueError("no program for length 0")
        if key.length == 3:  # running when the caller asks for it
            started.set()
            assert release.wait(60)
        return jax.jit(lambda x: x * key.length)

    pool = StepPool(budget=10, compiler_options=FAST)
    pool.register("verify", "eagle", build)
    a, b, bad = StepKey("verify", 1, 2, "eagle"), StepKey("verify", 1, 3, "eagle"), StepKey("verify", 1, 0, "eagle")
    jax.jit(lambda x: x * 7.0).lower(X).compile()  # in place: XLA's compile threads exist, at the caller's priority
    assert not pool.prepare(a, lambda: (X,)) and pool.compiling
    assert not pool.prepare(a, lambda: (X,))  # once: still compiling or not yet collected, not submitted again
    assert a not in pool and len(pool) == 0  # not pooled before the caller collects it
    pool.collect(wait=True)
    assert a in pool and not pool.compiling and pool.prepare(a, lambda: (X,))
    if sys.platform == "linux":  # XLA's compile threads were lowered too; its execution threads and Python's were not
        nice = {(kind, tid): os.getpriority(os.PRIO_PROCESS, tid) for tid, kind in thread_kinds().items()}
        compile_threads = [n for (kind, _), n in nice.items() if kind == COMPILE]
        assert compile_threads and min(compile_threads) == BACKGROUND_NICE
        assert all(n < BACKGROUND_NICE for (kind, _), n in nice.items() if kind == "tf_XLAEigen")
        assert nice[("MainThread", threading.main_thread().native_id)] < BACKGROUND_NICE
        assert lower_compile_threads() == 0  # nothing left to lower
    assert not pool.prepare(b, lambda: (X,)) and started.wait(60)
    threading.Timer(0.2, release.set).start()
    assert int(pool.get(b, X)(X)[0]) == 0 and b in pool  # get waits for the running background compile
    counters = pool.counters()
    assert counters["compiles"] == counters["background_compiles"] == 2 and counters["misses"] == 1
    assert counters["background_seconds"] > 0  # compile_seconds holds only get's wait for b
    assert threads == ["step-compile_0", "step-compile_0"]  # built on the worker thread only
    assert not pool.prepare(bad, lambda: (X,))
    with pytest.raises(ValueError, match="no program for length 0"):
        pool.collect(wait=True)
    assert bad not in pool and not pool.compiling
    pool.close()


def test_get_compiles_a_queued_key_in_place_and_close_stops_the_worker():
    """A key still queued behind another background compile is taken off the queue by ``get`` and compiled on the
    caller's thread; the running one is left to finish. ``close`` drops what is queued and stops the worker."""
    import threading

    threads, release = {}, threading.Event()

    def build(key):
        threads[key.length] = threading.current_thread().name
        if key.length == 2:
            assert release.wait(60)  # holds the worker until the caller has asked for key 3
        return jax.jit(lambda x: x * key.length)

    pool = StepPool(budget=10, compiler_options=FAST)
    pool.register("verify", "eagle", build)
    busy, queued = StepKey("verify", 1, 2, "eagle"), StepKey("verify", 1, 3, "eagle")
    assert not pool.prepare(busy, lambda: (X,)) and not pool.prepare(queued, lambda: (X,))
    assert float(pool.get(queued, X)(X)[0]) == 3 * float(X[0])
    assert threads == {2: "step-compile_0", 3: "MainThread"}
    release.set()
    pool.collect(wait=True)
    assert busy in pool and queued in pool and not pool.compiling
    assert pool.counters()["background_compiles"] == 1
    release.clear()
    later, dropped = StepKey("verify", 2, 2, "eagle"), StepKey("verify", 1, 4, "eagle")
    assert not pool.prepare(later, lambda: (X,)) and not pool.prepare(dropped, lambda: (X,))
    threading.Timer(0.2, release.set).start()
    pool.close()  # waits for the running compile, drops the queued one
    assert 4 not in threads and not pool.compiling and later not in pool and dropped not in pool
    assert [t.name for t in threading.enumerate() if t.name.startswith("step-compile")] == []


def test_held_pool_defers_background_compiles_until_release():
    """While held, ``prepare`` starts nothing (the key is outstanding, not compiling), a compile queued behind a
    running one goes back to waiting, ``get`` of a deferred key compiles it in place; ``release`` queues the rest in
    the order asked for, on the worker thread."""
    import threading

    built, release_running = [], threading.Event()

    def build(key):
        built.append((key.length, threading.current_thread().name))
        if key.length == 1:
            assert release_running.wait(60)
        return jax.jit(lambda x: x * key.length)

    pool = StepPool(budget=10, compiler_options=FAST)
    pool.register("verify", "eagle", build)
    running, queued, asked, taken = (StepKey("verify", 1, n, "eagle") for n in (1, 2, 3, 4))
    assert not pool.prepare(running, lambda: (X,)) and not pool.prepare(queued, lambda: (X,))
    while not built:  # the first one is running on the worker
        threading.Event().wait(0.01)
    pool.hold()
    assert pool.held and pool.deferred == 1 and pool.compiling  # the queued one waits again; the running one stays
    assert not pool.prepare(asked, lambda: (X,)) and not pool.prepare(taken, lambda: (X,)) and pool.deferred == 3
    assert not pool.prepare(asked, lambda: (X,)) and pool.deferred == 3  # asked once
    release_running.set()
    pool.collect(wait=True)
    assert running in pool and not pool.compiling and pool.outstanding
    assert float(pool.get(taken, X)(X)[0]) == 0.0 and taken in pool and pool.deferred == 2  # in place, now
    assert built == [(1, "step-compile_0"), (4, "MainThread")]  # nothing started on the worker while held
    pool.release()
    assert not pool.held and pool.deferred == 0 and pool.compiling
    pool.collect(wait=True)
    assert queued in pool and asked in pool and not pool.outstanding
    assert built[2:] == [(2, "step-compile_0"), (3, "step-compile_0")]
    pool.hold()
    assert not pool.prepare(StepKey("verify", 2, 5, "eagle"), lambda: (X,)) and pool.deferred == 1
    pool.close()  # drops what is deferred
    assert not pool.outstanding and len(built) == 4
