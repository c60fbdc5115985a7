"""End-to-end RL step time breakdown: rollout (and its tail), log-prob recomputation, reward, policy update.

Runs the main job (``tlt_jax.main.run``) on each config for a few steps in a scratch workdir and reads back the
per-step metrics it records. Step 1 includes XLA compiles (persistent compilation cache on, so a second invocation is
closer to steady state); steps >= 2 are reported as steady state. Modes (``--modes``) change only how the rollout is
decoded, so every mode samples the same tokens: the script asserts identical rewards per step across modes.

- ``off``: plain decoding, no drafter.
- ``ngram``: the model-free n-gram drafter, one tree shape (``rollout.spec_*``).
- ``static``: TLT's baseline, a fixed EAGLE drafter (``--drafter``, default the shipped warmed-up one) with one
  tree shape (``--static_tree``), tree decoding once a wave has <= ``rollout.spec_threshold`` live rows.
- ``adaptive``: the bandit over ``--spec_arms`` with the drafter frozen.
- ``tlt``: the adaptive engine and the drafter trained online on the policy's rollouts (``drafter.online``).
- ``config``: the config file as it is (configs/gsm8k.py is ``tlt``).

Modes run one after the other, so a drift in the machine's speed lands in their ratios; ``--repeats N`` runs every
mode N times, alternating the order (A B, B A, ...), and reports each mode's ratios to "off" per repeat (the two ran
next to each other) and from each step's fastest rollout over the repeats (every repeat decodes the same tokens).

``--paired MODE`` runs one training run instead, in which every rollout is decoded twice, back to back, on the same
policy weights, prompts and seed: once by an "off" engine and once by MODE's engine (off / ngram / static / adaptive /
tlt; with tlt the "off" engine pairs with the controlled rollout's one slice, and the drafter's training after each
rollout stays outside both timings), alternating which goes first. It checks that both sampled the same tokens, trains
on MODE's result, and compares the two rollouts' seconds step by step, so a drift of the machine's speed over minutes
cancels. Background compiles and parameter updates still pending when the next timed rollout starts are waited for
first, outside both timings, and reported ("drain"); checkpoints are written synchronously (an asynchronous write
would overlap the next step's first rollout, always the same engine's at a given step).

    python benchmarks/e2e_step.py --configs gsm8k --modes off,static,tlt --steps 6   # the default run's table
    python benchmarks/e2e_step.py --configs gsm8k --modes off,adaptive --steps 8 --repeats 3
    python benchmarks/e2e_step.py --configs tiny --steps 10 --modes off,ngram
    python benchmarks/e2e_step.py --configs gsm8k --paired adaptive --steps 12
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

RESULTS = Path(__file__).parent / "results" / "e2e_step.json"
PHASES = ("time/rollout_s", "time/tail_s", "time/logprob_s", "time/reward_s", "time/train_s", "time/step_s")
DEFAULT_STEPS = {"tiny": 20, "gsm8k": 2}
# Keep the benchmark about the training step: no periodic evaluation (the final one stays). The data split is left
# as the config has it (data.eval_size picks the held-out seeds, so changing it would change the training prompts
# and the run would no longer follow the default run's trajectory).
OVERRIDES = {"gsm8k": {"eval.every_steps": 0}, "tiny": {}}


def load_config(name: str, overrides: dict):
    from tlt_jax.config import from_config_dict

    spec = importlib.util.spec_from_file_location(f"cfg_{name}", REPO / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cd = module.get_config()
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = cd
        for p in parents:
            node = node[p]
        node[leaf] = value
    return from_config_dict(cd)


def summarise(rows: list[dict]) -> dict:
    def med(key, rs):
        vals = [r[key] for r in rs if key in r]
        return statistics.median(vals) if vals else None

    steady = rows[1:] or rows
    out = {"first_step": {k: rows[0].get(k) for k in PHASES}, "steady_median": {k: med(k, steady) for k in PHASES}}
    # Steps differ in length (responses shorten or grow as the policy learns), so modes compare best on sums over
    # the same steps; compile seconds (new batch / length / arm shapes met mid-run) are inside the rollout seconds;
    # background compiles (the adaptive engine's new verify steps) ran beside the rollout, which did not wait for them.
    out["steady_sum"] = {
        k: sum(r.get(k) or 0.0 for r in steady) for k in (*PHASES, "rollout/compile_s", "rollout/background_compile_s")
    }
    s = out["steady_median"]
    total = s["time/step_s"] or 1.0
    out["steady_share"] = {
        "rollout": s["time/rollout_s"] / total,
        "rollout_tail": s["time/tail_s"] / total,
        "logprob": s["time/logprob_s"] / total,
        "reward": s["time/reward_s"] / total,
        "update": s["time/train_s"] / total,
    }
    out["rollout_tail_share"] = med("rollout/tail_share", steady)
    out["rollout_tokens_per_s"] = med("rollout/tokens_per_s", steady)
    out["response_len_p50_p90_max"] = [
        med(k, steady) for k in ("response/len_p50", "response/len_p90", "response/len_max")
    ]
    return out


ADAPTIVE_ARMS = "off,eagle:3x1x4,eagle:5x1x6"  # modes "adaptive" / "tlt": the bandit's arms (--spec_arms)
SHIPPED = "eagle-smollm2-gsm"


def mode_overrides(mode: str, arms: str, drafter: str, static_tree: str) -> dict:
    """Config overrides of one decoding mode (see the module docstring)."""
    if mode == "config":
        return {}
    online = {"drafter.online": mode == "tlt"}
    if mode in ("off", "ngram"):
        return {"rollout.speculative": mode, "rollout.spec_arms": "", **online}
    if mode == "static":
        depth, topk, n = (int(x) for x in static_tree.split("x"))
        return {"rollout.speculative": "eagle", "rollout.spec_arms": "", "rollout.drafter_path": drafter,
                "rollout.spec_depth": depth, "rollout.spec_topk": topk, "rollout.spec_verify_tokens": n, **online}
    if mode in ("adaptive", "tlt"):
        return {"rollout.speculative": "adaptive", "rollout.spec_arms": arms, "rollout.drafter_path": drafter, **online}
    raise ValueError(f"unknown mode {mode!r}")


def bench(name: str, steps: int, mode: str, arms: str = ADAPTIVE_ARMS, drafter: str = SHIPPED,
          static_tree: str = "5x1x6", extra: dict | None = None) -> dict:
    from tlt_jax.main import run
    from tlt_jax.metrics import read_metrics

    overrides = {
        **OVERRIDES.get(name, {}),
        **mode_overrides(mode, arms, drafter, static_tree),
        "train.num_steps": steps,
        "metrics.progress_bars": False,
        "eval.at_start": False,
        **(extra or {}),
    }
    cfg = load_config(name, overrides)
    with tempfile.TemporaryDirectory() as workdir:
        t0 = time.perf_counter()
        final = run(cfg, workdir)
        wall = time.perf_counter() - t0
        rows = [r for r in read_metrics(workdir) if r["kind"] == "train"]
    res = summarise(rows)
    res.update(
        config=f"configs/{name}.py",
        overrides=overrides,
        steps=steps,
        prompts_x_samples=[cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt],
        max_new_tokens=cfg.rollout.max_new_tokens,
        wall_s_including_setup_and_final_eval=wall,
        final_eval_s=final.get("eval/seconds"),
        speculative=mode,
        accept_length_per_step=[r.get("rollout/accept_length") for r in rows],
        reward_per_step=[r.get("reward/mean") for r in rows],
        per_step=[
            {k: r.get(k) for k in (*PHASES, *STEP_EXTRAS)} for r in rows
        ],
    )
    return res


STEP_EXTRAS = ("rollout/tail_share", "rollout/compile_s", "rollout/background_compile_s", "rollout/tokens",
               "rollout/accept_length", "drafter/steps", "drafter/top1", "controller/train_s", "reward/mean",
               "reward/accuracy", "response/len_max")


def repeat_record(res: dict) -> dict:
    """What one repeat of a mode keeps: its sums over the steady steps and each step's rollout seconds."""
    return {
        "steady_sum": res["steady_sum"],
        "rollout_s_per_step": [r["time/rollout_s"] for r in res["per_step"]],
        "compile_s_per_step": [r["rollout/compile_s"] or 0.0 for r in res["per_step"]],
        "background_compile_s_per_step": [r.get("rollout/background_compile_s") or 0.0 for r in res["per_step"]],
        "accept_length_per_step": res["accept_length_per_step"],
        "wall_s_including_setup_and_final_eval": res["wall_s_including_setup_and_final_eval"],
    }


def compare_to_off(off: list[dict], runs: list[dict]) -> dict:
    """Steady-step ratios of a mode against "off": per repeat (the two ran next to each other) and from each step's
    fastest rollout over the repeats (every repeat decodes the same tokens, so machine noise mostly adds seconds)."""
    def sums(res):
        s = res["steady_sum"]
        return s["time/step_s"], s["time/rollout_s"], s["time/rollout_s"] - s["rollout/compile_s"]

    def fastest(rs, compile_too):
        steps = [r["per_step"][1:] for r in rs]  # steady steps
        return sum(min(r[i]["time/rollout_s"] - (0.0 if compile_too else (r[i]["rollout/compile_s"] or 0.0))
                       for r in steps) for i in range(len(steps[0])))

    pairs = [(sums(o), sums(r)) for o, r in zip(off, runs, strict=True)]
    step = [o[0] / r[0] for o, r in pairs]
    roll = [o[1] / r[1] for o, r in pairs]
    roll_nc = [o[2] / r[2] for o, r in pairs]
    return {
        "steady_step_speedup_vs_off": step[0],
        "steady_rollout_speedup_vs_off": roll[0],
        "steady_rollout_speedup_vs_off_without_compile": roll_nc[0],
        "paired_step_speedup_vs_off": step,
        "paired_rollout_speedup_vs_off": roll,
        "paired_rollout_speedup_vs_off_without_compile": roll_nc,
        "paired_rollout_speedup_vs_off_median": statistics.median(roll),
        "min_rollout_speedup_vs_off": fastest(off, True) / fastest(runs, True),
        "min_rollout_speedup_vs_off_without_compile": fastest(off, False) / fastest(runs, False),
    }


class PairedRollout:
    """Benchmark harness (``--paired``): decodes every rollout with both engines, on the same weights, prompts and
    seed, alternating which goes first; checks the tokens are the same; returns ``other``'s result. With ``chunks``
    each call's record keeps both engines' host round trips (``CHUNK_KEYS`` of ``stats["chunks"]``)."""

    CHUNK_KEYS = ("batch", "active", "length", "choice", "seconds", "tokens", "lag_tokens", "steps", "first_run",
                  "compile_overlap", "catchup_seconds", "waited_for")

    def __init__(self, base, other, chunks: bool = False):
        self.base, self.other, self.chunks = base, other, chunks
        self.calls: list[dict] = []
        self._threads = thread_cpu_seconds()

    @property
    def params(self):
        return (self.base.params, self.other.params)

    @property
    def bandit(self):
        return getattr(self.other, "bandit", None)

    def set_params(self, model) -> None:
        self.base.set_params(model)
        self.other.set_params(model)

    def state_dict(self) -> dict:
        return self.other.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.other.load_state_dict(state)

    def close(self) -> None:
        self.base.close()
        self.other.close()

    def generate(self, prompts, params, **kwargs):
        order = ("base", "other") if len(self.calls) % 2 == 0 else ("other", "base")
        rec, results = {"first": order[0], "temperature": params.temperature}, {}
        # What XLA's compile threads and the pool's worker ran since the last pair: the mode's background compiles
        # beside the policy update, whose cost lands there, outside both timings (an upper bound, in CPU seconds).
        now = thread_cpu_seconds()
        rec["between_thread_cpu_s"] = {k: round(v - self._threads.get(k, 0.0), 3) for k, v in now.items()
                                       if v - self._threads.get(k, 0.0) >= 0.005}
        # compile_between_calls: the mode's compiles wait for both rollouts of the pair (as for its own rollout in a
        # run), so none runs beside the "off" engine's either
        hold = getattr(self.other, "compile_between_calls", False) and not self.other.pool.held
        if hold:
            self.other.pool.hold()
        try:
            self._pair(order, rec, results, prompts, params, kwargs)
        finally:
            if hold:
                self.other.pool.release()
        self._threads = thread_cpu_seconds()
        if results["base"].tokens != results["other"].tokens:
            raise AssertionError(f"paired rollout {len(self.calls)}: the two engines sampled different tokens")
        rec["tokens"] = int(sum(len(c) for comps in results["other"].tokens for c in comps))
        rec["arm_steps"] = results["other"].stats.get("arm_steps")
        bandit = results["other"].stats.get("bandit")
        if bandit is not None:  # the bandit's own estimate of its cost against plain decoding, so far
            rec["ledger"] = bandit.get("ledger")
        self.calls.append(rec)
        return results["other"]

    def _pair(self, order, rec, results, prompts, params, kwargs) -> None:
        import jax

        for name in order:
            t = time.perf_counter()
            for engine in (self.base, self.other):  # work left from before finishes outside the timings:
                engine.pool.collect(wait=True)  # background compiles,
                jax.block_until_ready((engine.params, engine.drafter_params))  # updates still in flight
            jax.block_until_ready(jax.live_arrays())  # and any other computation still running
            rec[f"{name}_drain_s"] = time.perf_counter() - t
            threads = thread_cpu_seconds()
            t, ru = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            own = kwargs if name == "other" else {k: v for k, v in kwargs.items() if k != "on_chunk"}  # its callback
            results[name] = getattr(self, name).generate(prompts, params, **own)
            rec[f"{name}_s"] = time.perf_counter() - t
            ru2 = resource.getrusage(resource.RUSAGE_SELF)  # page faults and CPU seconds of the whole process
            rec[f"{name}_minflt"] = ru2.ru_minflt - ru.ru_minflt
            rec[f"{name}_cpu_s"] = ru2.ru_utime + ru2.ru_stime - ru.ru_utime - ru.ru_stime
            after = thread_cpu_seconds()  # which threads spent them
            rec[f"{name}_thread_cpu_s"] = {k: round(v - threads.get(k, 0.0), 3) for k, v in after.items()
                                           if v - threads.get(k, 0.0) >= 0.005}
            st = results[name].stats
            rec[f"{name}_compile_s"] = float(st.get("compile_seconds_this_call", 0.0))
            rec[f"{name}_background_compile_s"] = float(st.get("background_compile_seconds_this_call", 0.0))
            if self.chunks:
                rec[f"{name}_chunks"] = [{k: c[k] for k in self.CHUNK_KEYS if k in c} for c in st["chunks"]]


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds of this process's threads so far (Linux), summed by ``thread_kinds`` (a Python thread by its name,
    XLA's compile threads as "compile", its execution pool as "tf_XLAEigen", ...)."""
    from tlt_jax.rollout.pool import thread_kinds

    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid, kind in thread_kinds().items():
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class PairedSlice(PairedRollout):
    """``PairedRollout`` standing in for the one slice engine of a controlled rollout (``tlt``: the drafter trains
    online): every attribute but generate / set_params / close is the mode engine's (its params, drafter, pool)."""

    @property
    def params(self):
        return self.other.params

    def __getattr__(self, name):
        if name in ("base", "other"):  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.other, name)


def bench_paired(name: str, steps: int, mode: str, arms: str = ADAPTIVE_ARMS, drafter: str = SHIPPED,
                 static_tree: str = "5x1x6", extra: dict | None = None, chunks: bool = False) -> dict:
    """One training run of ``mode`` whose every rollout is also decoded by an "off" engine (``PairedRollout``)."""
    import tlt_jax.main as main_mod

    if mode not in ("off", "ngram", "static", "adaptive", "tlt"):
        raise ValueError(f"--paired takes off, ngram, static, adaptive or tlt, got {mode!r}")
    # checkpoints are written synchronously here: an asynchronous write would run beside the next step's first
    # rollout, and the alternation puts a given step's first rollout always on the same engine
    common = {**OVERRIDES.get(name, {}), "train.num_steps": steps, "metrics.progress_bars": False,
              "eval.at_start": False, "checkpoint.async_save": False, **(extra or {})}
    cfg_off = load_config(name, {**common, **mode_overrides("off", arms, drafter, static_tree)})
    cfg = load_config(name, {**common, **mode_overrides(mode, arms, drafter, static_tree)})
    build = main_mod.build_engine
    paired: list[PairedRollout] = []

    def build_both(cfg_, model, mesh, data, workdir=None):
        engines = build(cfg_off, model, mesh, data), build(cfg_, model, mesh, data, workdir)
        slices = getattr(getattr(engines[1], "rollout", None), "engines", None)
        if slices is not None and len(slices) == 1 and hasattr(engines[0], "pool"):
            # a controlled rollout (tlt: the drafter trains online): the "off" engine pairs with its one slice
            paired.append(PairedSlice(engines[0], slices[0], chunks=chunks))
            slices[0] = paired[-1]
            return engines[1]
        if not all(hasattr(e, "pool") for e in engines):
            raise ValueError("--paired compares two RolloutEngines (or a one-slice controlled rollout); "
                             "this config builds more slices")
        paired.append(PairedRollout(*engines, chunks=chunks))
        return paired[-1]

    main_mod.build_engine = build_both
    try:
        with tempfile.TemporaryDirectory() as workdir:
            t0 = time.perf_counter()
            main_mod.run(cfg, workdir)
            wall = time.perf_counter() - t0
    finally:
        main_mod.build_engine = build
    calls = paired[0].calls[:steps]  # the training rollouts (the final evaluation's calls come after)
    return {"config": f"configs/{name}.py", "mode": mode, "steps": steps, "wall_s": wall, "per_step": calls,
            "evaluation_calls": len(paired[0].calls) - len(calls), **summarise_paired(calls[1:])}


def summarise_paired(steady: list[dict]) -> dict:
    """Ratios of "off" seconds over the mode's, from paired steps (``PairedRollout.calls``, steady steps only)."""
    def total(key, sel=steady):
        return sum(c[key] for c in sel)

    from tlt_jax.rollout.pool import COMPILE

    off_s, mode_s = total("base_s"), total("other_s")
    drain = total("base_drain_s") + total("other_drain_s")
    off_nc, mode_nc = off_s - total("base_compile_s"), mode_s - total("other_compile_s")
    # Whichever engine goes first may run on a different machine state (right after the update): the ratio over
    # the steps where "off" went first and over those where the mode did, and their geometric mean, which cancels
    # an order effect that scales both rollouts alike (a crossover design).
    by_order = {}
    for first in ("base", "other"):
        sel = [c for c in steady if c["first"] == first]
        by_order[first] = total("base_s", sel) / total("other_s", sel) if sel else None
    crossover = math.sqrt(by_order["base"] * by_order["other"]) if all(by_order.values()) else None
    # A 90 % bootstrap interval of the sum ratio over the steps (resampled with a fixed seed): steps are the unit
    # of noise here, not runs.
    rng = random.Random(0)
    boot = sorted(
        total("base_s", sample) / total("other_s", sample)
        for sample in ([rng.choice(steady) for _ in steady] for _ in range(2000))
    )
    # With --chunks: decode seconds and tokens per engine, batch bucket and arm, and the part of them in round trips
    # that ran a step for the first time or beside a background compile (what the bandit does not observe).
    split = {}
    for name in ("base", "other"):
        for c in (x for rec in steady for x in rec.get(f"{name}_chunks", ())):
            d = split.setdefault(name, {}).setdefault(str(c["batch"]), {}).setdefault(
                c["choice"], dict(seconds=0.0, tokens=0, chunks=0, unobserved_seconds=0.0))
            d["seconds"] += c["seconds"]
            d["tokens"] += c["tokens"]
            d["chunks"] += 1
            d["unobserved_seconds"] += c["seconds"] if c["first_run"] or c.get("compile_overlap") else 0.0
    # ... and what those round trips cost beyond the same engine's other round trips of their bucket and arm (at the
    # others' seconds per token): beside a background compile, and a step's first run
    rate, excess = {}, {"compile_overlap": 0.0, "first_run": 0.0}
    for name in ("base", "other"):
        for c in (x for rec in steady for x in rec.get(f"{name}_chunks", ())):
            if not (c["first_run"] or c.get("compile_overlap")):
                r = rate.setdefault((name, c["batch"], c["choice"]), [0.0, 0])
                r[0] += c["seconds"]
                r[1] += c["tokens"]
    for c in (x for rec in steady for x in rec.get("other_chunks", ())):
        r = rate.get(("other", c["batch"], c["choice"]))
        if r and r[1] and (c["first_run"] or c.get("compile_overlap")):
            excess["first_run" if c["first_run"] else "compile_overlap"] += c["seconds"] - c["tokens"] * r[0] / r[1]
    return {
        **({"steady_chunk_split": split, "steady_mode_unobserved_excess_s": excess} if split else {}),
        "steady_steps": len(steady),
        "steady_off_s": off_s,
        "steady_mode_s": mode_s,
        "steady_speedup_vs_off": off_s / mode_s,
        "steady_speedup_vs_off_without_compile": off_nc / mode_nc,
        "steady_per_step_speedup": [c["base_s"] / c["other_s"] for c in steady],
        "steady_per_step_speedup_median": statistics.median(c["base_s"] / c["other_s"] for c in steady),
        "steady_speedup_vs_off_off_first": by_order["base"],
        "steady_speedup_vs_off_mode_first": by_order["other"],
        "steady_speedup_vs_off_crossover": crossover,
        "steady_speedup_vs_off_bootstrap_90": [boot[100], boot[1899]],
        "steady_steps_mode_faster": sum(c["other_s"] < c["base_s"] for c in steady),
        "steady_background_compile_s": total("other_background_compile_s"),
        "steady_drain_s": drain,
        # every drain (leftover compiles, updates in flight) charged to the mode, as if it had waited for them
        "steady_speedup_vs_off_drain_charged": off_s / (mode_s + drain),
        # CPU seconds of XLA's compile threads and the pool's worker between pairs (beside the policy update)
        "steady_between_compile_cpu_s": sum(v for c in steady for k, v in c.get("between_thread_cpu_s", {}).items()
                                            if k == COMPILE or k.startswith("step-compile")),
    }


def combine_paired(paths: list[str], skip_steps: tuple[int, ...] = ()) -> dict:
    """Pool the steady paired steps of several ``--paired`` result files (same config; different modes are pooled
    too, and the summary's mode names them all, e.g. "adaptive+tlt") into one summary, leaving out the steps
    numbered in ``skip_steps`` (1-based, in every file)."""
    runs = [json.loads(Path(p).read_text())["configs"] for p in paths]
    out = {}
    for name in runs[0]:
        res = [r[name]["paired"] for r in runs]
        mode = "+".join(dict.fromkeys(r["mode"] for r in res))
        steady = [c for r in res for i, c in enumerate(r["per_step"][1:], 2) if i not in skip_steps]
        out[name] = {"mode": mode, "files": paths, "skipped_steps": list(skip_steps),
                     **summarise_paired(steady)}
    return out


def print_paired(name: str, mode: str, res: dict) -> None:
    print(f"{name}: {mode} vs off over {res['steady_steps']} steady steps, paired step by step: "
          f"{res['steady_off_s']:.1f} / {res['steady_mode_s']:.1f} s = {res['steady_speedup_vs_off']:.3f}x "
          f"(without in-place compiles {res['steady_speedup_vs_off_without_compile']:.3f}x; per-step median "
          f"{res['steady_per_step_speedup_median']:.3f}x; off first {res['steady_speedup_vs_off_off_first']:.3f}x, "
          f"{mode} first {res['steady_speedup_vs_off_mode_first']:.3f}x, crossover "
          f"{res['steady_speedup_vs_off_crossover']:.3f}x; 90 % bootstrap interval "
          f"{res['steady_speedup_vs_off_bootstrap_90'][0]:.3f}-{res['steady_speedup_vs_off_bootstrap_90'][1]:.3f}x; "
          f"{mode} faster in {res['steady_steps_mode_faster']} of {res['steady_steps']} steps); background compiles "
          f"{res['steady_background_compile_s']:.1f} s, drained before a timed rollout "
          f"{res['steady_drain_s']:.1f} s ({res['steady_speedup_vs_off_drain_charged']:.3f}x charged to {mode}); "
          f"compile CPU between pairs {res['steady_between_compile_cpu_s']:.1f} s", flush=True)
    excess = res.get("steady_mode_unobserved_excess_s")
    if excess:
        print(f"{name}: {mode}'s round trips beside a background compile took {excess['compile_overlap']:+.2f} s and "
              f"first runs {excess['first_run']:+.2f} s more than its others of the same bucket and arm", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny,gsm8k")
    ap.add_argument("--steps", type=int, default=0, help="steps per config (0: tiny 20, gsm8k 2)")
    ap.add_argument("--modes", default="off,ngram", help="decoding modes: off,ngram,static,adaptive,tlt,config")
    ap.add_argument("--spec_arms", default=ADAPTIVE_ARMS, help="arms of modes adaptive / tlt (off,eagle:DxKxN,...)")
    ap.add_argument("--drafter", default=SHIPPED, help="EAGLE drafter of static / adaptive / tlt (name or dir)")
    ap.add_argument("--static_tree", default="5x1x6", help="tree of mode static (depth x topk x verify tokens)")
    ap.add_argument("--set", action="append", default=[], help="extra config override KEY=VALUE (repeatable)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every mode this many times, alternating the order, and pair the ratios per repeat")
    ap.add_argument("--paired", default="",
                    help="one run of this mode with every rollout also decoded by an off engine, step by step")
    ap.add_argument("--combine", default="",
                    help="comma-separated --paired result files: pool their steady steps into one summary")
    ap.add_argument("--chunks", action="store_true",
                    help="with --paired: keep both engines' host round trips of every rollout in the result file")
    ap.add_argument("--skip_steps", default="",
                    help="with --combine: comma-separated step numbers to leave out (e.g. 5,9)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")

    import jax

    from tlt_jax.main import _enable_compilation_cache

    _enable_compilation_cache()
    results = {
        "benchmark": "e2e_step",
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "devices": jax.device_count(),
            "device_kind": jax.devices()[0].device_kind,
        },
        "configs": {},
    }
    extra = {}
    for kv in args.set:
        key, value = kv.split("=", 1)
        try:
            extra[key] = json.loads(value)  # numbers, true / false
        except json.JSONDecodeError:
            extra[key] = value
    results["extra_overrides"] = extra
    if args.combine:
        skip = tuple(int(x) for x in args.skip_steps.split(",") if x.strip())
        results["combined"] = combine_paired(args.combine.split(","), skip)
        for name, res in results["combined"].items():
            print_paired(name, res["mode"], res)
    elif args.paired:
        for name in args.configs.split(","):
            res = bench_paired(name, args.steps or DEFAULT_STEPS.get(name, 2), args.paired, args.spec_arms,
                               args.drafter, args.static_tree, extra, args.chunks)
            results["configs"][name] = {"paired": res}
            for i, c in enumerate(res["per_step"]):
                print(f"{name} step {i + 1}: off {c['base_s']:.2f} s, {args.paired} {c['other_s']:.2f} s "
                      f"({c['base_s'] / c['other_s']:.3f}x; {c['first']} first; in-place compile "
                      f"{c['base_compile_s']:.2f} / {c['other_compile_s']:.2f} s, background "
                      f"{c['other_background_compile_s']:.2f} s, drain {c['base_drain_s'] + c['other_drain_s']:.2f} "
                      f"s); arm steps {c['arm_steps']}", flush=True)
            print_paired(name, args.paired, res)
    if args.paired or args.combine:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
        return
    for name in args.configs.split(","):
        modes_list = args.modes.split(",")
        runs: dict[str, list[dict]] = {m: [] for m in modes_list}
        for rep in range(args.repeats):
            # Alternate the order (A B, B A, ...) so a drift in the machine's speed lands on both sides.
            for mode in modes_list if rep % 2 == 0 else modes_list[::-1]:
                res = bench(name, args.steps or DEFAULT_STEPS.get(name, 2), mode, args.spec_arms, args.drafter,
                            args.static_tree, extra)
                runs[mode].append(res)
                s, ss = res["steady_median"], res["steady_sum"]
                print(
                    f"{name} (SD {mode}, repeat {rep + 1}/{args.repeats}): steady step {s['time/step_s']:.2f} s = "
                    f"rollout {s['time/rollout_s']:.2f} (tail {s['time/tail_s']:.2f}) + logprob "
                    f"{s['time/logprob_s']:.2f} + reward {s['time/reward_s']:.2f} + update {s['time/train_s']:.2f}; "
                    f"first step {res['first_step']['time/step_s']:.2f} s; steady rollout sum "
                    f"{ss['time/rollout_s']:.2f} s (compile {ss['rollout/compile_s']:.2f}, in the background "
                    f"{ss['rollout/background_compile_s']:.2f}); "
                    f"{res['rollout_tokens_per_s']:.1f} rollout tok/s; accept lengths {res['accept_length_per_step']}",
                    flush=True,
                )
        modes = results["configs"].setdefault(name, {})
        for mode, rs in runs.items():
            modes[mode] = {**rs[0], "repeats": [repeat_record(r) for r in rs]}
        rewards = {f"{m}#{i}": r["reward_per_step"] for m, rs in runs.items() for i, r in enumerate(rs)}
        same = all(v == next(iter(rewards.values())) for v in rewards.values())
        modes["_rewards_identical_across_modes"] = same
        if "off" in runs:
            for mode, rs in runs.items():
                modes[mode].update(compare_to_off(runs["off"], rs))
                if mode != "off":
                    c = modes[mode]
                    print(
                        f"{name}: {mode} vs off, steady rollout: paired per repeat "
                        f"{[round(x, 3) for x in c['paired_rollout_speedup_vs_off']]} (median "
                        f"{c['paired_rollout_speedup_vs_off_median']:.3f}; without compile "
                        f"{[round(x, 3) for x in c['paired_rollout_speedup_vs_off_without_compile']]}); "
                        f"per-step fastest over repeats {c['min_rollout_speedup_vs_off']:.3f} (without compile "
                        f"{c['min_rollout_speedup_vs_off_without_compile']:.3f})",
                        flush=True,
                    )
        print(f"{name}: rewards identical across modes: {same}", flush=True)
        if not same:
            raise AssertionError(f"{name}: the modes sampled different rewards per step: {rewards}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
