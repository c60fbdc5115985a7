"""A hot swap that drafts: a row still decoding gets a better EAGLE drafter mid-rollout (``set_drafter``, as the
controller does for slices still busy), and from that chunk on every verify accepts exactly what the new drafter
accepts from a cache of its own (its offline chain profile, ``chain_acceptance``), while the tokens stay plain
greedy decoding's. Before the swap the same walk follows the old drafter's profile. A drafter cache left as the old
weights built it would not match: its keys, values and the root's feature are the old drafter's.

The profile walk: with one row, a top-1 chain and one verify per round trip, chunk c of a greedy rollout starts at a
known response position; its accepted drafts are the drafter's profile there (capped by the depth), so the accepted
counts per chunk follow from the profiles and the chunk where the swap lands."""

import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from tlt_jax.controller import Controller, ControllerConfig, SlicedRollout
from tlt_jax.distributed import MeshConfig, make_mesh
from tlt_jax.drafter import DrafterOptimConfig, EagleDrafter
from tlt_jax.drafter.buffer import DrafterBuffer
from tlt_jax.drafter.evaluate import chain_acceptance
from tlt_jax.drafter.spot import SpotTrainer
from tlt_jax.drafter.warmup import run_warmup
from tlt_jax.models import CausalLM, tiny_config
from tlt_jax.rollout import HiddenCapture, RolloutEngine, SamplingParams, SpecConfig

CFG = tiny_config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=())
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
DEPTH = 4
CHAIN = SpecConfig(depth=DEPTH, topk=1, verify_tokens=DEPTH + 1, threshold=1, steps_per_call=1)  # 1 verify per chunk
NEW = 40
SWAP_AT = 4  # the round trip from which the better drafter drafts
ENGINE = dict(max_batch=1, max_len=64, length_buckets=(64,), batch_buckets=(1,), compiler_options=FAST)


@pytest.fixture(scope="module")
def setup():
    """The tiny policy, its plain greedy outputs, a random ("bad") drafter and one warmed up on those outputs."""
    policy = CausalLM(CFG, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 64, size=int(rng.integers(4, 9))).tolist() for _ in range(16)]
    good, hist, samples = run_warmup(policy, prompts, max_new_tokens=NEW, steps=150, batch_size=8, row_len=64,
                                     rows_per_batch=4, temperature=0.0, stop_tokens=(),
                                     optim=DrafterOptimConfig(learning_rate=3e-3), log=lambda *_: None)
    assert hist[-1]["loss"] < hist[0]["loss"]
    plain = RolloutEngine(policy, **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    for p, r in samples[:4]:  # the warm-up's samples are plain greedy decoding's
        assert plain.generate([p], greedy).tokens == [[r]]
    plain.close()
    return policy, samples, EagleDrafter(CFG, rngs=nnx.Rngs(9)), good


def profile(policy, drafter, prompt, response) -> np.ndarray:
    """Draft tokens a top-1 chain of ``drafter`` gets accepted at each response position (greedy verification)."""
    return chain_acceptance(policy, drafter, [prompt + response], [len(prompt)], depth=DEPTH, rows=8).accepted


def walk(before: np.ndarray, after: np.ndarray, swap_at: int, length: int) -> list[int]:
    """Accepted drafts per chunk of a greedy chain rollout of ``length`` tokens whose drafter changes (with a cache
    of its own) at chunk ``swap_at``: the root of the first chunk is response token 0 (the prefill's)."""
    pos, out = 0, []
    while pos < length - 1:
        a = min(int((before if len(out) < swap_at else after)[pos]), DEPTH)
        out.append(a)
        pos += a + 1
    return out


def check_chunks(chunks: list[dict], want: list[int], swap_at: int) -> list[int]:
    """Each round trip one verify of the one row, accepting what the walk says (the last one may accept more than
    the budget leaves, which a profile cannot see); the rebuild is reported at the swap's chunk."""
    real = [c["accepted"] for c in chunks]
    assert all(c["row_verifies"] == 1 for c in chunks) and len(real) == len(want), (real, want)
    assert real[:-1] == want[:-1] and real[-1] >= want[-1], (real, want)
    assert [i for i, c in enumerate(chunks) if c.get("drafter_swapped")][:1] == [swap_at]
    assert not any(c.get("drafter_swapped") for c in chunks[:swap_at])
    return real


def swap_hook(engine: RolloutEngine, drafter: EagleDrafter):
    """An on_chunk hook that hands ``drafter`` to ``engine`` before round trip SWAP_AT (the hook runs before each)."""
    calls = []

    def hook(finished, active):
        calls.append(active)
        if len(calls) == SWAP_AT + 1:
            assert active == 1  # the row is still decoding
            engine.set_drafter(drafter)

    return hook


def test_swapped_drafter_drafts_from_its_own_cache(setup):
    """Engine level: the swap lands at chunk SWAP_AT of a running generate; the accept length rises from there, by
    exactly the better drafter's profile, and the tokens are plain decoding's."""
    policy, samples, bad, good = setup
    engine = RolloutEngine(policy, drafter=bad, spec=CHAIN, **ENGINE)
    try:
        for p, r in samples[:3]:
            engine.set_drafter(bad)
            res = engine.generate([p], SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True),
                                  on_chunk=swap_hook(engine, good))
            assert res.tokens == [[r]]  # lossless: plain greedy decoding's tokens
            pb, pg = profile(policy, bad, p, r), profile(policy, good, p, r)
            real = check_chunks(res.stats["chunks"], walk(pb, pg, SWAP_AT, len(r)), SWAP_AT)
            assert np.mean(real[SWAP_AT:]) > np.mean(real[:SWAP_AT]) + 0.5, real  # the accept length rises
    finally:
        engine.close()


ONLINE_STEPS = 120  # drafter steps the idle slice takes before the busy one drafts on (a random drafter learns)


def test_controller_hot_swaps_an_online_trained_replica_into_the_busy_slice(setup, monkeypatch):
    """Controller level, TLT's online drafter: both slices start from the random ("bad") drafter. Slice 0 finishes
    its short share and trains it online (learning rate 3e-3, on a buffer of the policy's captured greedy rollouts of
    other prompts) while slice 1 decodes a 40-token row; with hot_swap each new replica goes to slice 1, which waits
    at chunk SWAP_AT until slice 0 took ONLINE_STEPS drafter steps and a replica arrived. From there slice 1's accept
    length rises (the trained drafter drafts from a cache of its own), every sample is plain decoding's, and the
    drafter slice 1 ends with is neither the random one nor the offline-warmed one: the online trainer's."""
    policy, samples, bad, good = setup
    (p0, r0), (p1, r1) = samples[4], samples[5]
    rollout = SlicedRollout(policy, make_mesh(MeshConfig(data=2), jax.devices()[:2]), 2, drafter=bad, spec=CHAIN,
                            capture=HiddenCapture(window=48), **ENGINE)
    trainer = SpotTrainer(bad, rollout.meshes, rollout.policy, optim=DrafterOptimConfig(learning_rate=3e-3))
    buffer = DrafterBuffer(2**22)
    buffer.start_step(0)  # the previous RL step's data, as the controller keeps it
    capture = RolloutEngine(policy, capture=HiddenCapture(window=48), **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    for prompt, _ in samples[6:]:  # the policy's own greedy responses to the other prompts, captured whole
        assert buffer.add_result([prompt], capture.generate([prompt], greedy)) == 1
    capture.close()
    ctl = Controller(rollout, trainer=trainer, buffer=buffer, cfg=ControllerConfig(row_len=64, rows=4, hot_swap=True))
    busy, first = rollout.engines[1], rollout.engines[1].drafter_params
    at_swap = threading.Event()

    def trained():
        return trainer.local_steps.get(0, 0) >= ONLINE_STEPS and busy.drafter_params is not first

    def hooked(engine, hook):
        run = engine.generate

        def generate(prompts, params, *, request_ids=None, on_chunk=None):
            calls = []

            def chunk(finished, active):
                on_chunk(finished, active)
                calls.append(active)
                if engine is busy and len(calls) == SWAP_AT + 1:
                    at_swap.set()
                    hook(trained)
                if engine is not busy and active == 0:  # slice 0's last hook: its share is done
                    hook(at_swap.is_set)

            return run(prompts, params, request_ids=request_ids, on_chunk=chunk)

        monkeypatch.setattr(engine, "generate", generate)

    def wait(ready, timeout=300.0):
        end = time.monotonic() + timeout
        while not ready():
            assert time.monotonic() < end, "timed out waiting for the other slice"
            time.sleep(0.005)

    for e in rollout.engines.values():
        hooked(e, wait)
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=[4, NEW], ignore_eos=True)
        res, m = ctl.run_step(1, [p0, p1], params, on_chunk=lambda f, a: None)
    finally:
        rollout.close()
    assert res.tokens == [[r0[:4]], [r1]]  # lossless: plain greedy decoding's tokens
    assert m["controller/hot_swaps"] >= 1 and m["controller/train_steps"] >= ONLINE_STEPS, m
    chunks = res.stats["slices"][1]["chunks"]
    real = [c["accepted"] for c in chunks]
    assert all(c["row_verifies"] == 1 for c in chunks) and chunks[SWAP_AT].get("drafter_swapped"), chunks
    pb = profile(policy, bad, p1, r1)  # what the random drafter accepts at every position of the row
    unswapped = walk(pb, pb, SWAP_AT, len(r1))
    assert np.mean(real[SWAP_AT:]) > np.mean(unswapped[SWAP_AT:]) + 0.4, (real, unswapped)  # it rises
    after = [np.asarray(x) for x in jax.tree.leaves(busy.drafter_params)]
    for other in (bad, good):
        ref = [np.asarray(x) for x in jax.tree.leaves(nnx.state(other, nnx.Param))]
        assert not all(np.array_equal(x, y) for x, y in zip(after, ref, strict=True))
