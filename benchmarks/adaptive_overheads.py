"""Where the adaptive engine's rollouts spend time that plain decoding does not, at the default run's shape.

    python benchmarks/adaptive_overheads.py [--calls=5] [--out=FILE.json]

Three measurements on SmolLM2 with the committed EAGLE drafter, 8 held-out prompts, T = 0.7 (configs/gsm8k.py):

- ``program_seconds``: tracing and loading (or compiling) one step program of the main job's engine in a fresh
  process: plain decode and both EAGLE verify arms at batches 4 and 8, cache length 256. The adaptive engine meets
  such programs mid-run that "off" never compiles; run this twice to see the cost with the persistent cache warm.
- ``recording``: a plain engine against an engine that holds the drafter (so its plain chunks record the drafter's
  input pairs) but never speculates (threshold 0): same prompts and tokens, whole generate calls interleaved
  (``--calls`` each), and one compiled plain chunk (8 steps, 8 rows) of each called 12 times interleaved on copies of
  the same prefilled state.
- ``catchup``: an adaptive engine (arms off, eagle:3x1x4, eagle:5x1x6) over ``--calls`` rollouts of 256 tokens: the
  drafter catch-up seconds (``stats["spec"]["catchup_seconds"]``) against the decode seconds of each call.
"""

from __future__ import annotations

import json
import pathlib
import platform
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from absl import app, flags  # noqa: E402

flags.DEFINE_integer("calls", 5, "generate calls per engine (recording, catch-up)")
flags.DEFINE_string("out", "benchmarks/results/adaptive_overheads_smollm2_cpu.json", "JSON output")
_F = flags.FLAGS


def program_seconds() -> list[dict]:
    """Trace + load/compile seconds of a few step programs of the main job's adaptive engine."""
    from benchmarks.e2e_step import load_config
    from tlt_jax.adaptive.bandit import BanditConfig
    from tlt_jax.builders import build_data, build_engine, build_model
    from tlt_jax.distributed import make_mesh
    from tlt_jax.rollout.plan import reachable_plan
    from tlt_jax.rollout.pool import abstract

    cfg = load_config("gsm8k", {"drafter.online": False})
    mesh = make_mesh(cfg.mesh)
    model, tokenizer = build_model(cfg, mesh)
    eng = build_engine(cfg, model, mesh, build_data(cfg, tokenizer, model.config))
    plan = reachable_plan(BanditConfig(eng.arms), eng.batch_buckets, eng.length_buckets, eng.spec.threshold,
                          eng._abstract_args, eng.compaction)
    rows = []
    for key, thunk in plan:
        if key.batch in (4, 8) and key.length == 256:
            fn = eng.pool._builders[(key.phase, key.arm)](key)
            t0 = time.perf_counter()
            lowered = fn.lower(*abstract(thunk()))
            t1 = time.perf_counter()
            lowered.compile()
            t2 = time.perf_counter()
            rows.append(dict(key=str(key), trace_s=t1 - t0, compile_s=t2 - t1))
            print(f"{key}: trace {t1 - t0:.2f} s, compile / cache load {t2 - t1:.2f} s", flush=True)
    return [dict(reachable_programs=len(plan)), *rows]


def chunk_ms(engines: dict, prompts, sp, calls: int = 12) -> dict:
    """Milliseconds of one compiled plain chunk of each engine, called interleaved on copies of its prefilled
    state (the first call of each is dropped from the medians)."""
    import jax
    import jax.numpy as jnp

    from tlt_jax.rollout import StepKey
    from tlt_jax.rollout import buckets as bk
    from tlt_jax.rollout.run import GenerateRun

    copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s))
    steps = {}
    for name, e in engines.items():
        run = GenerateRun(e, prompts, [sp.max_new_tokens] * len(prompts), list(range(len(prompts))), sp, ())
        state, _, _, plen, _ = run.prefill([(i, 0) for i in range(len(prompts))])
        key = StepKey("decode", len(prompts), bk.pick(e.length_buckets, int(plen.max()) + 16), "plain")
        steps[name] = (e, e.pool.get(key, e.step_params(), copy(state)), state)
    ms = {name: [] for name in steps}
    for i in range(calls):
        for name, (e, exe, state) in list(steps.items())[:: 1 if i % 2 == 0 else -1]:
            fresh = jax.block_until_ready(copy(state))
            t0 = time.perf_counter()
            jax.block_until_ready(exe(e.step_params(), fresh))
            ms[name].append(1000 * (time.perf_counter() - t0))
    a, b = ms.values()
    res = dict(ms=ms, median={k: statistics.median(v[1:]) for k, v in ms.items()},
               paired_ratio=statistics.median(y / x for x, y in zip(a[1:], b[1:], strict=True)))
    print(f"plain chunk: {res['median']} ms (medians); {' / '.join(ms)} paired {res['paired_ratio']:.3f}", flush=True)
    return res


def main(argv):
    del argv
    import jax

    from tlt_jax.assets import EMBEDDED_DRAFTER, resolve_drafter_path
    from tlt_jax.drafter.export import load_drafter
    from tlt_jax.drafter.warmup import load_policy_and_prompts
    from tlt_jax.main import _enable_compilation_cache
    from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig

    _enable_compilation_cache()
    out = dict(meta=dict(machine=platform.platform(), jax=jax.__version__, device=jax.devices()[0].device_kind))
    out["program_seconds"] = program_seconds()

    policy, prompts, _ = load_policy_and_prompts(None, 16, 1000, "eval")
    drafter = load_drafter(resolve_drafter_path(EMBEDDED_DRAFTER))
    max_len = max(map(len, prompts)) + 260
    eight = prompts[:8]

    plain = RolloutEngine(policy, max_batch=8, max_len=max_len)
    rec = RolloutEngine(policy, drafter=drafter, spec=SpecConfig(arms=("off", "eagle:3x1x4"), threshold=0),
                        max_batch=8, max_len=max_len)
    sp = SamplingParams(temperature=0.7, max_new_tokens=128, seed=1)
    first = {name: e.generate(eight, sp).tokens for name, e in (("plain", plain), ("recording", rec))}  # compiles
    if first["plain"] != first["recording"]:
        raise AssertionError("the recording engine sampled other tokens than the plain engine")
    secs = {"plain": [], "recording": []}
    for call in range(_F.calls):
        order = (("plain", plain), ("recording", rec))
        for name, e in order if call % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            e.generate(eight, sp)
            secs[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in secs.items()}
    out["recording"] = dict(seconds=secs, median=med, plain_over_recording=med["plain"] / med["recording"])
    print(f"recording: plain {med['plain']:.2f} s, recording (never speculating) {med['recording']:.2f} s per call",
          flush=True)
    out["recording"]["chunk_ms"] = chunk_ms({"plain": plain, "recording": rec}, eight, sp)

    eng = RolloutEngine(policy, drafter=drafter, spec=SpecConfig(arms=("off", "eagle:3x1x4", "eagle:5x1x6")),
                        max_batch=8, max_len=max_len)
    calls = []
    for call in range(_F.calls):
        ps = prompts[(call % 2) * 8:(call % 2) * 8 + 8]
        st = eng.generate(ps, SamplingParams(temperature=0.7, max_new_tokens=256, seed=call)).stats
        row = dict(catchup_s=st["spec"]["catchup_seconds"], decode_s=st["decode_seconds"],
                   compile_s=st["compile_seconds_this_call"], arm_steps=st["arm_steps"])
        calls.append(row)
        print(f"catch-up call {call}: {row['catchup_s']:.3f} s of {row['decode_s']:.2f} s decode "
              f"(compile {row['compile_s']:.2f} s apart); arm steps {row['arm_steps']}", flush=True)
    out["catchup"] = calls
    pathlib.Path(_F.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"wrote {_F.out}")


if __name__ == "__main__":
    app.run(main)
