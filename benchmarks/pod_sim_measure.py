"""CPU validation of the pod model (``pod_sim_model``): per-call costs measured on the engine's own compiled steps,
then a real engine run.

The simulator gets only the measured per-call costs (by batch bucket and cache-length bucket) and the requests'
lengths; its predicted rollout time is compared with the engine's measured time for the same workload (the
``rollout_tail.py`` long-tail workload: forced log-normal lengths, greedy). Calibration and measured runs alternate
in one process so both see the same machine load.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pod_sim_model as ps
import rollout_tail as rt

from tlt_jax.assets import EMBEDDED_DRAFTER, resolve_drafter_path
from tlt_jax.rollout import RolloutEngine, SamplingParams, StepKey


class _KeysOnly:
    """Zero costs: a simulation with these lists the cost keys a workload needs."""

    def prefill(self, *a):
        return 0.0

    decode = verify = compact = prefill


DRAFTER = Path(resolve_drafter_path(EMBEDDED_DRAFTER))  # the committed warmed-up drafter (package data)
CPU = {"on": False}  # measure process CPU seconds (all threads) instead of wall seconds: robust to other users' load


def _clock() -> float:
    return time.process_time() if CPU["on"] else time.perf_counter()


def _timed(exe, *args):
    t0 = _clock()
    out, info = exe(*args)
    np.asarray(jax.device_get(info))
    return out, _clock() - t0


def _decode_state(engine: RolloutEngine, b: int, length: int, steps: int, per_step: int = 1):
    """A live [b]-row state that runs exactly ``steps`` decode (or verify: up to per_step tokens each) steps,
    committed length just below ``length``."""
    ctx = engine.ctx
    st = ctx.empty_state(b)
    committed = max(1, length - max(engine.chunk_size, steps * per_step))
    st = st.replace(
        cache=dataclasses.replace(st.cache, lengths=jnp.full((b,), committed, jnp.int32)),
        done=jnp.zeros((b,), bool),
        num_generated=jnp.ones((b,), jnp.int32),
        max_new=jnp.full((b,), 1 + (steps if steps == 1 else steps * per_step), jnp.int32),
    )
    return jax.block_until_ready(jax.device_put(st, ctx.state_shardings(st)))


def measure_costs(engine: RolloutEngine, keys: set[tuple], prompts, reps: int = 3) -> ps.TableCosts:
    """Median seconds of every call in ``keys``: decode chunks of K and of 1 step (a fixed + per-step line),
    compactions, and the prefill (a generate call whose rows all stop after the prefill's token)."""
    costs = ps.TableCosts()
    k, params = engine.chunk_size, engine.step_params()
    for key in sorted(keys):
        if key[0] == "decode":
            _, b, length = key
            times = {}
            for steps in (1, k):
                runs = []
                for _ in range(reps):
                    st = _decode_state(engine, b, length, steps)
                    exe = engine.pool.get(StepKey("decode", b, length, "plain"), params, st)
                    runs.append(_timed(exe, params, st)[1])
                times[steps] = statistics.median(runs)
            per = max(0.0, (times[k] - times[1]) / (k - 1))
            costs.steps[("decode", b, length)] = (times[1] - per, per)
        elif key[0] == "verify":
            _, b, length, _arm = key
            spc, per = engine.spec.steps_per_call, engine.spec.depth + 1
            rounds = (jnp.int32(spc),) if engine.drafter_kind == "eagle" else ()  # the state stops after `steps`
            times = {}
            for steps in (1, spc):
                runs = []
                for _ in range(reps):
                    st = _decode_state(engine, b, length, steps, per)
                    exe = engine.pool.get(StepKey("verify", b, length, engine.spec_arm), params, st, *rounds)
                    runs.append(_timed(exe, params, st, *rounds)[1])
                times[steps] = statistics.median(runs)
            per_s = max(0.0, (times[spc] - times[1]) / (spc - 1))
            costs.steps[key] = (times[1] - per_s, per_s)
        elif key[0] == "compact":
            _, src, dst = key
            st = engine.ctx.empty_state(src)
            st = jax.block_until_ready(jax.device_put(st, engine.ctx.state_shardings(st)))
            rep = engine.ctx.replicated()
            idx = jax.device_put(np.arange(dst, dtype=np.int32), rep)
            ok = jax.device_put(np.ones(dst, bool), rep)
            exe = engine.pool.get(StepKey("compact", dst, 0, "plain", (src,)), st, idx, ok)
            costs.compactions[(src, dst)] = statistics.median(_timed(exe, st, idx, ok)[1] for _ in range(reps))
        elif key[0] == "prefill":
            runs = []
            for _ in range(reps):
                t0 = time.process_time()
                res = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
                runs.append(time.process_time() - t0 if CPU["on"] else res.stats["prefill_seconds"])
            costs.prefills[key[1:]] = statistics.median(runs)
        else:
            raise ValueError(f"cannot measure cost key {key}")
    return costs


def validate(
    name: str, requests: int = 64, max_new: int = 0, chunk: int = 8, rounds: int = 3, reps: int = 5, cpu: bool = False
) -> dict:
    """Predicted vs measured rollout seconds of the long-tail workload on one model (rollout_tail's set-up). cpu:
    both sides in process CPU seconds (every thread) instead of wall seconds, so other users' load cancels out."""
    CPU["on"] = cpu
    model = rt.load(name)
    max_new = max_new or (512 if name == "tiny" else 256)
    lengths = rt.tail_lengths(requests, max_new, seed=0)
    prompts = rt.make_prompts(requests, model.config.vocab_size, 8, 24, seed=1)
    max_len = max(map(len, prompts)) + max_new
    engine = RolloutEngine(model, max_batch=requests, max_len=max_len, chunk_size=chunk)
    params = SamplingParams(temperature=0.0, max_new_tokens=lengths, ignore_eos=True)
    policy = ps.Policy(
        max_batch=requests,
        max_len=max_len,
        chunk_size=chunk,
        batch_buckets=engine.batch_buckets,
        length_buckets=engine.length_buckets,
    )
    plens = [len(p) for p in prompts]
    keys = ps.simulate(lengths, plens, policy, _KeysOnly()).keys
    t0 = time.perf_counter()
    warm = engine.generate(prompts, params)  # compiles every step the run uses
    print(f"[{name}] warm-up {time.perf_counter() - t0:.1f}s, {len(keys)} cost keys", flush=True)
    run_keys = {("decode", c["batch"], c["length"]) for c in warm.stats["chunks"]}
    rounds_out = []
    for r in range(rounds):
        t0 = time.perf_counter()
        costs = measure_costs(engine, keys, prompts, reps)
        cal_s = time.perf_counter() - t0
        pred = ps.simulate(lengths, plens, policy, costs)
        t0 = time.process_time()
        res = engine.generate(prompts, params)
        st = res.stats
        if cpu:
            st["wall_seconds"] = time.process_time() - t0
        engine_s = st["prefill_seconds"] + st["decode_seconds"] + sum(c["seconds"] for c in st["compactions"])
        rounds_out.append(
            dict(
                predicted_s=pred.seconds,
                measured_s=st["wall_seconds"],
                error=pred.seconds / st["wall_seconds"] - 1,
                measured_calls_wall_s=engine_s,
                predicted_by_batch={str(b): round(s, 4) for b, s in sorted(pred.by_batch.items(), reverse=True)},
                measured_by_batch={str(b): round(d["seconds"], 4) for b, d in st["by_batch"].items()},
                predicted_chunks=pred.chunks,
                measured_chunks=len(st["chunks"]),
                calibration_s=cal_s,
                load_average=os.getloadavg()[0],
                costs=dict(
                    decode={
                        f"{b}x{length}": [round(f * 1e3, 3), round(p * 1e3, 3)]
                        for (_, b, length), (f, p) in sorted(costs.steps.items())
                    },
                    prefill_ms={str(k): round(v * 1e3, 2) for k, v in costs.prefills.items()},
                    compact_ms={f"{s}->{d}": round(v * 1e3, 3) for (s, d), v in costs.compactions.items()},
                ),
            )
        )
        print(
            f"[{name}] round {r}: predicted {pred.seconds:.2f}s  measured {st['wall_seconds']:.2f}s "
            f"({'CPU' if cpu else 'wall'})  error {100 * rounds_out[-1]['error']:+.1f}%  "
            f"chunks {pred.chunks}/{len(st['chunks'])}  (calibration {cal_s:.1f}s)",
            flush=True,
        )
    errs = [x["error"] for x in rounds_out]
    pred_med = statistics.median(x["predicted_s"] for x in rounds_out)
    meas_med = statistics.median(x["measured_s"] for x in rounds_out)
    return dict(
        clock="process CPU seconds" if cpu else "wall seconds",
        predicted_median_s=pred_med,
        measured_median_s=meas_med,
        error_of_medians=pred_med / meas_med - 1,
        model=name,
        workload=dict(
            requests=requests,
            max_new=max_new,
            total_tokens=int(sum(lengths)),
            chunk_size=chunk,
            median=float(np.median(lengths)),
            lengths_seed=0,
        ),
        sim_keys_equal_engine_keys=run_keys == {k for k in keys if k[0] == "decode"},
        rounds=rounds_out,
        max_abs_round_error=max(abs(e) for e in errs),
    )


def validate_spec(
    rounds: int = 2, reps: int = 3, prompts_n: int = 16, max_new: int = 320, threshold: int = 8, tree: str = "3x1x4"
) -> dict:
    """Speculative tail on CPU: SmolLM2 + the committed EAGLE drafter, held-out GSM prompts, greedy, stop at EOS,
    speculative once <= threshold rows are live. The simulator gets the response lengths and the mean accept length
    of a warm-up run (greedy: every run emits the same tokens) and the measured per-call costs, not the run's time."""
    from tlt_jax.drafter.export import load_drafter
    from tlt_jax.drafter.warmup import load_policy_and_prompts
    from tlt_jax.rollout import SpecConfig

    CPU["on"] = True
    policy, prompts, stops = load_policy_and_prompts(None, prompts_n, 1000, "eval")
    prompts = prompts[:prompts_n]
    depth, topk, n = (int(x) for x in tree.split("x"))
    spec = SpecConfig(depth=depth, topk=topk, verify_tokens=n, threshold=threshold, steps_per_call=4)
    max_len = max(map(len, prompts)) + max_new + 64
    engine = RolloutEngine(policy, drafter=load_drafter(DRAFTER), spec=spec, max_batch=prompts_n, max_len=max_len)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, seed=0, stop_token_ids=stops)
    t0 = time.perf_counter()
    warm = engine.generate(prompts, params)
    lengths = [len(t[0]) for t in warm.tokens]
    accept = warm.stats["mean_accept_length"]
    if not warm.stats["verify_steps"]:
        raise ValueError(
            f"no speculative chunk ran (live rows never <= {threshold} before the end): raise max_new "
            f"(now {max_new}, responses hit the cap together) or the threshold"
        )
    arm = ps.Arm(depth=depth, topk=topk, verify_tokens=n, accept=accept)
    policy_sim = ps.Policy(
        max_batch=prompts_n,
        max_len=max_len,
        chunk_size=engine.chunk_size,
        batch_buckets=engine.batch_buckets,
        length_buckets=engine.length_buckets,
        threshold=threshold,
        steps_per_call=spec.steps_per_call,
        arms=((1, arm),),
    )
    plens = [len(p) for p in prompts]
    keys = ps.simulate(lengths, plens, policy_sim, _KeysOnly()).keys
    print(f"[spec] warm-up {time.perf_counter() - t0:.1f}s, accept {accept:.2f}, {len(keys)} keys", flush=True)
    rounds_out = []
    for r in range(rounds):
        costs = measure_costs(engine, keys, prompts, reps)
        pred = ps.simulate(lengths, plens, policy_sim, costs)
        t0 = time.process_time()
        res = engine.generate(prompts, params)
        meas = time.process_time() - t0
        rounds_out.append(
            dict(
                predicted_s=pred.seconds,
                measured_s=meas,
                error=pred.seconds / meas - 1,
                predicted_spec_s=pred.spec_s,
                predicted_chunks=pred.chunks,
                measured_chunks=len(res.stats["chunks"]),
                predicted_verify_steps=pred.verify_steps,
                measured_verify_steps=res.stats["verify_steps"],
            )
        )
        print(
            f"[spec] round {r}: predicted {pred.seconds:.2f}s measured {meas:.2f}s (CPU) "
            f"error {100 * rounds_out[-1]['error']:+.1f}%  chunks {pred.chunks}/{len(res.stats['chunks'])} "
            f"verify steps {pred.verify_steps}/{res.stats['verify_steps']}",
            flush=True,
        )
    pred_med = statistics.median(x["predicted_s"] for x in rounds_out)
    meas_med = statistics.median(x["measured_s"] for x in rounds_out)
    return dict(
        model="smollm2+eagle",
        clock="process CPU seconds",
        tree=tree,
        threshold=threshold,
        prompts=prompts_n,
        max_new=max_new,
        lengths=lengths,
        accept=accept,
        predicted_median_s=pred_med,
        measured_median_s=meas_med,
        error_of_medians=pred_med / meas_med - 1,
        rounds=rounds_out,
    )
