"""The rollout's programs in the plan: one engine's prefill, decode, verify and compact steps (every key its pool can
reach listed, the largest of each phase compiled on the engine's own mesh) and the online drafter's step.

Keys an engine's pool can reach (``engine_keys``): decode and verify as ``rollout.plan.reachable_plan`` gives them
(every reachable arm x batch bucket x cache-length bucket), compact for every pair of batch buckets (source > dest),
prefill for every (rows, prompt-length bucket up to the longest prompt's, prompts <= rows). The compiled key of a
phase is its largest: decode at the largest wave's batch bucket and the longest cache bucket; verify the arm with the
largest tree at the largest batch bucket its threshold reaches; compact from the largest wave to the next bucket;
prefill of the largest training wave (rows / samples_per_prompt prompts) and of the largest evaluation wave (one
sample per prompt), the larger one's figures kept (both listed as compiled).

Collective bytes of an engine step are read with the engine's tensor size as group size: ``cross_group_bytes``
(JSON ``cross_engine_collective_bytes``) are the bytes of collectives whose groups span more than one of the engine's
tensor-parallel groups; a step whose collectives stay inside TP groups has 0 there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tlt_jax.config import Config
from tlt_jax.distributed import LogicalRules, engine_count
from tlt_jax.plan import abstract as ab
from tlt_jax.plan.hlo import collective_stats
from tlt_jax.plan.report import StepPlan

__all__ = ["decode_batch", "engine_keys", "key_name", "measure", "prefill_args", "rollout_steps"]


def key_name(key) -> str:
    """A pool key as the plan lists it: phase:batch:length:arm[:extra]."""
    extra = ":" + ",".join(str(x) for x in key.extra) if key.extra else ""
    return f"{key.phase}:{key.batch}:{key.length}:{key.arm}{extra}"


def measure(what: str, hint: str, build: Callable[[], Any], resident: int, *, group_size: int | None = None,
            **fields) -> StepPlan:
    """Compile (``build()``) and read the executable's own figures into a StepPlan."""
    import time

    t0 = time.perf_counter()
    compiled = build()
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    return StepPlan(what=what, argument_bytes=int(m.argument_size_in_bytes), output_bytes=int(m.output_size_in_bytes),
                    alias_bytes=int(m.alias_size_in_bytes), temp_bytes=int(m.temp_size_in_bytes),
                    resident_argument_bytes=resident, collectives=collective_stats(compiled.as_text(), group_size),
                    compile_seconds=seconds, hint=hint, **fields)


def decode_batch(cfg: Config, engine, engines: int) -> int:
    """The batch bucket of an engine's largest wave: its share of the step's rows, or of an evaluation batch."""
    from tlt_jax.rollout.buckets import pick

    rows = math.ceil(cfg.data.prompts_per_step / engines) * cfg.rollout.samples_per_prompt
    wave = min(engine.max_batch, max(rows, math.ceil(cfg.eval.batch_size / engines)))
    return pick(engine.batch_buckets, wave)


def engine_keys(cfg: Config, engine) -> dict[str, list]:
    """Every pool key the engine can reach, by phase (module docstring)."""
    from tlt_jax.adaptive.bandit import BanditConfig
    from tlt_jax.rollout import StepKey
    from tlt_jax.rollout.buckets import pick
    from tlt_jax.rollout.plan import reachable_plan

    threshold = engine.spec.threshold if engine.spec else 0
    plan = reachable_plan(BanditConfig(engine.arms), engine.batch_buckets, engine.length_buckets, threshold,
                          engine.abstract_args, engine.compaction)
    keys: dict[str, list] = {"prefill": [], "decode": [], "verify": [], "compact": []}
    for key, _ in plan:
        keys[key.phase].append(key)
    buckets = engine.batch_buckets
    if engine.compaction:
        keys["compact"] = [StepKey("compact", d, 0, "plain", (s,)) for s in buckets for d in buckets if d < s]
    longest = pick(engine.length_buckets, ab.prompt_length(cfg))
    keys["prefill"] = [StepKey("prefill", b, p, "plain", (bp,)) for b in buckets for p in engine.length_buckets
                       if p <= longest for bp in buckets if bp <= b]
    return {k: sorted(set(v)) for k, v in keys.items()}


def prefill_args(engine, b: int, p: int, bp: int) -> tuple:
    """Abstract arguments of the prefill key (b, p, (bp,)), placed as the run places them (``rollout.run``)."""
    from tlt_jax.rollout.state import RowInit

    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=engine.ctx.batch_sharding(shape))
    i32 = jnp.int32
    init = RowInit(src=sds((b,), i32), valid=sds((b,), jnp.bool_), max_new=sds((b,), i32),
                   temperature=sds((b,), jnp.float32), top_k=sds((b,), i32), top_p=sds((b,), jnp.float32),
                   seed=sds((b,), jnp.uint32), request_id=sds((b,), i32), sample_id=sds((b,), i32),
                   stop_ids=sds((b, engine.max_stop_tokens), i32))
    return engine.step_params(), sds((bp, p), i32), sds((bp,), i32), init


def compact_args(engine, dst: int, src: int) -> tuple:
    rep = engine.ctx.replicated()
    return (engine.ctx.abstract_state(src), jax.ShapeDtypeStruct((dst,), jnp.int32, sharding=rep),
            jax.ShapeDtypeStruct((dst,), jnp.bool_, sharding=rep))


def _verify_arm(engine, wave: int) -> tuple[Any, int] | None:
    """(the speculative arm with the largest tree, the largest batch bucket up to ``wave`` it can verify at)."""
    from tlt_jax.adaptive.bandit import BanditConfig

    if not engine.arm_specs:
        return None
    arm = max(engine.arm_specs, key=lambda a: (engine.arm_specs[a].verify_tokens, str(a)))
    reach = BanditConfig(engine.arms).reachable(engine.batch_buckets, engine.spec.threshold)
    batches = [b for a, b in reach if a == arm and b <= wave]
    return (arm, max(batches)) if batches else None


def _compiled_keys(cfg: Config, engine, engines: int) -> dict[str, list[tuple]]:
    """The largest keys of each phase with their abstract-argument thunks (engine -> args), as [(key, thunk)]: one
    per phase, two for prefill when an evaluation wave (one sample per prompt) differs from a training wave."""
    from tlt_jax.adaptive import Arm
    from tlt_jax.rollout import StepKey
    from tlt_jax.rollout.buckets import pick
    from tlt_jax.rollout.plan import step_key

    length = engine.length_buckets[-1]
    b = decode_batch(cfg, engine, engines)
    out = {}
    p = pick(engine.length_buckets, ab.prompt_length(cfg))
    train_b = pick(engine.batch_buckets, min(engine.max_batch, math.ceil(cfg.data.prompts_per_step / engines)
                                             * cfg.rollout.samples_per_prompt))
    eval_b = pick(engine.batch_buckets, min(engine.max_batch, math.ceil(cfg.eval.batch_size / engines)))
    waves = {(train_b, pick(engine.batch_buckets, math.ceil(train_b / cfg.rollout.samples_per_prompt))),
             (eval_b, eval_b)}
    out["prefill"] = [(StepKey("prefill", wb, p, "plain", (bp,)), lambda e, wb=wb, bp=bp: prefill_args(e, wb, p, bp))
                      for wb, bp in sorted(waves, reverse=True)]
    out["decode"] = [(StepKey("decode", b, length), lambda e: e.abstract_args(Arm("off"), b, length))]
    verify = _verify_arm(engine, b)
    if verify is not None:
        arm, vb = verify
        out["verify"] = [(step_key(arm, vb, length), lambda e: e.abstract_args(arm, vb, length))]
    smaller = [d for d in engine.batch_buckets if d < b]
    if engine.compaction and smaller:
        out["compact"] = [(StepKey("compact", smaller[-1], 0, "plain", (b,)),
                           lambda e: compact_args(e, smaller[-1], b))]
    return out


def _what(phase: str, key, chunk: int, arms=()) -> str:
    if phase == "prefill":
        return f"prefill + fork: {key.extra[0]} prompts of {key.length} tokens into {key.batch} rows"
    if phase == "decode":
        return f"decode chunk: batch {key.batch}, cache {key.length}, up to {chunk} token steps"
    if phase == "verify":
        arm = next((str(a) for a in arms if a.pool_name == key.arm), key.arm)
        return f"verify ({arm}): batch {key.batch}, cache {key.length}"
    return f"compact: {key.extra[0]} rows into {key.batch}"


def rollout_steps(cfg: Config, mesh, rules: LogicalRules, eng: ab.AbstractEngine, steps: dict, notes: dict,
                  resident: dict, say: Callable[[str], None], est: ab.AbstractEngine | None = None) -> None:
    """Plan one engine's steps and the online drafter's step into ``steps`` (phase "rollout"), its decode state at
    the largest wave into ``resident``; with ``est`` (a float32 copy's engine), the policy-forward steps'
    temporaries are its steps' (``tlt_jax.plan.core``)."""
    r, engine = cfg.rollout, eng.engine
    engines = engine_count(mesh, r.num_slices)
    params_bytes = ab.device_bytes(engine.step_params())
    b = decode_batch(cfg, engine, engines)
    state_bytes = ab.device_bytes(engine.ctx.abstract_state(b))
    resident["decode_state"] = state_bytes
    tp = engine.mesh.shape["tensor"]
    keys = engine_keys(cfg, engine)
    dtype_hint = "" if r.dtype else ", rollout.dtype=bfloat16"
    hints = {"prefill": "data.max_prompt_len, data.prompts_per_step / rollout.samples_per_prompt",
             "decode": f"data.prompts_per_step / rollout.samples_per_prompt (batch {b}), rollout.max_new_tokens",
             "verify": "rollout.spec_threshold, rollout.spec_verify_tokens / spec_arms",
             "compact": "data.prompts_per_step / rollout.samples_per_prompt"}
    for phase, candidates in _compiled_keys(cfg, engine, engines).items():
        res = {"prefill": params_bytes, "decode": params_bytes + state_bytes, "verify": params_bytes + state_bytes,
               "compact": state_bytes}[phase]
        planned = []
        for key, args in candidates:
            what = _what(phase, key, engine.chunk_size, engine.arm_specs)
            say(f"compiling {phase} ({what}) ...")
            fields = dict(phase="rollout", key=key_name(key), keys=tuple(key_name(k) for k in keys[phase]),
                          resident_output_bytes=state_bytes if phase == "prefill" else 0)
            step = measure(what, hints[phase] + ("" if phase == "compact" else dtype_hint),
                           lambda k=key, a=args: engine.pool.compile(k, *a(engine)), res, group_size=tp, **fields)
            if est is not None and phase != "compact":
                temps = int(est.engine.pool.compile(key, *args(est.engine)).memory_analysis().temp_size_in_bytes)
                step = dataclasses.replace(step, temp_bytes=temps, temp_source="float32 estimate",
                                           compiled_temp_bytes=step.temp_bytes)
            planned.append(step)
        best = max(planned, key=lambda s: s.transient_bytes)
        steps[phase] = dataclasses.replace(best, also_compiled={s.key: s.transient_bytes for s in planned
                                                                if s is not best})
    if "verify" not in steps:
        steps["verify"] = None
        notes["verify"] = f"not run: rollout.speculative={r.speculative!r}"
    if "compact" not in steps:
        steps["compact"] = None
        notes["compact"] = "not run: one batch bucket, or compaction off"
    if cfg.drafter.online:
        dfn, dargs = ab.drafter_trainer(cfg, eng, rules)
        state = ab.device_bytes(dargs[0])
        resident["spot_trainer"] = 2 * state  # the current state and a replica training on it
        what = f"drafter update: {cfg.drafter.rows} rows x {cfg.drafter.row_len} positions"
        say(f"compiling drafter ({what}) ...")
        steps["drafter"] = measure(what, "drafter.rows / drafter.row_len", lambda: dfn.lower(*dargs).compile(),
                                   ab.device_bytes(engine.params) + state, group_size=tp, phase="rollout")
    else:
        steps["drafter"] = None
        notes["drafter"] = "not run: drafter.online is off"
