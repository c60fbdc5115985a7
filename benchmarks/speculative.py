"""Speculative vs plain decoding in the RolloutEngine, side by side: tokens per verify and tokens/s by active batch,
drafter and tree shape.

    python benchmarks/speculative.py [--model=PATH|tiny] [--drafter=DIR] [--batches=1,2,4,8,16,32]
        [--temperatures=0,0.9] [--out=benchmarks/results/speculative_smollm2_cpu.json]

Prompts: the held-out GSM-style split (``gsm_symbolic_splits`` eval; the drafter warm-up trains on the disjoint
training split), chat-templated. Batch b = the first b prompts decoded together from the start (generation stops at
EOS as in a rollout, so finished rows leave and b is the *starting* active batch); at batch 1, --b1_prompts prompts one
after the other. At most --tokens new tokens per row (shrinking with the batch to bound the runtime).

Every arm is the same RolloutEngine (chunk of K=8 plain steps, or ``steps_per_call`` verify steps, per host round
trip; compaction; cache-length buckets); the speculative engines have ``threshold`` >= every batch, so every step is a
tree step. For every (batch, temperature) and prompt group: plain decoding, each drafter (n-gram; the EAGLE drafter in
--drafter, a ``tlt_jax.drafter.warmup`` output, by default the committed SmolLM2 one in tlt_jax/assets) with each
tree config ``depth x topk x N`` of that batch (--configs_b1, --configs_small for batch 2-4, --configs_large above),
then plain again: interleaved, so a drift in the shared machine's load hits every arm alike (plain's time is the mean
of its two passes). Every speculative run is checked token for token against the plain run with the same seed
(lossless). Time = the engine's prefill + decode seconds (compilation happens before a step's clock starts, so it is
excluded); ``decode_speedup`` leaves out the prefill (the same work in every arm). Reports, per (temperature,
drafter), the best speedup by batch and the smallest batch from which no configuration beats plain.

Adaptive engine (--adaptive): one RolloutEngine holding both drafters, ``SpecConfig(arms=("off", every fixed arm of
the batch))`` with the engine's default speculation gate (at most 32 live rows, as in TLT; --adaptive_threshold), its
bandit fresh for every (batch, temperature), run after the fixed arms in every interleaved pass. Its first pass is
"cold" (it pays its learning; an extra pass before the --repeats ones); in the --repeats passes after it, it is "warm"
(the same bandit, the steady state, as in RL where the bandit carries across steps) and, like every arm, timed by the
median over those passes: side by side with plain and the best fixed arm on the same passes. The rows also keep
plain's A/A ratios (its second run of a pass over its first: how far two equal runs differ on this machine) and the
adaptive engine's speedup over plain pass by pass.

--ablate_coupling: every EAGLE tree also runs with ``SpecConfig(coupled=False)`` ("eagle_topk"): sampled rows
then draft the drafter's deterministic top-k instead of its sample coupled to the verifier's noise.
--off_overhead: only the "off" arm's cost in an adaptive engine with an EAGLE drafter (its plain steps record the
policy's hidden states for the drafter's later catch-up) against the plain engine, same prompts and forced lengths.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import platform
import time

import jax
import numpy as np
from absl import app, flags

from tlt_jax.adaptive import Bandit
from tlt_jax.assets import EMBEDDED_DRAFTER, resolve_drafter_path
from tlt_jax.drafter.export import load_drafter
from tlt_jax.drafter.warmup import load_policy_and_prompts
from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig

_F = flags.FLAGS
DEFAULT_DRAFTER = pathlib.Path(resolve_drafter_path(EMBEDDED_DRAFTER))
UNCOUPLED = "eagle_topk"  # --ablate_coupling: the EAGLE drafter's deterministic top-k trees for sampled rows too
flags.DEFINE_string("model", None, "policy (default: embedded SmolLM2; 'tiny' = random tiny model)")
flags.DEFINE_string("drafter", None, "trained drafter directory (save_drafter format); default with the embedded "
                    "SmolLM2: the committed warmed-up drafter shipped in tlt_jax/assets (eagle-smollm2-gsm)")
flags.DEFINE_list("batches", ["1", "2", "4", "8", "16", "32"], "starting active batch sizes")
flags.DEFINE_list("tokens", ["192", "128", "96", "64", "48", "32"], "new tokens per row, per batch entry")
flags.DEFINE_list("temperatures", ["0", "0.9"], "sampling temperatures")
flags.DEFINE_list("configs_b1", ["3x1x4", "4x1x5", "3x2x6", "5x1x6", "6x4x16", "8x4x48"],
                  "trees (depth x topk x N), batch 1")
flags.DEFINE_list("configs_small", ["3x1x4", "4x1x5", "3x2x6"], "trees at batch 2-4")
flags.DEFINE_list("configs_large", ["2x1x3", "3x1x4", "3x2x6"], "trees at batch > 4")
flags.DEFINE_list("drafters", ["ngram", "eagle"], "drafters to run (eagle needs --drafter)")
flags.DEFINE_integer("b1_prompts", 8, "at batch 1, run this many prompts one after the other (summed)")
flags.DEFINE_integer("steps_per_call", 4, "EAGLE verify steps per host round trip")
flags.DEFINE_integer("repeats", 1, "interleaved passes per cell; each arm's time is the median over the passes "
                     "(with --adaptive: after one more pass, the adaptive engine's cold one)")
flags.DEFINE_bool("breakdown", True, "time the parts of one step at batch 1 (plain step; EAGLE draft, verify, extend)")
flags.DEFINE_bool("adaptive", True, "also run the adaptive engine: a bandit over off + every fixed arm of the batch")
flags.DEFINE_float("epsilon", 0.1, "adaptive: exploration probability")
flags.DEFINE_integer("adaptive_threshold", None, "adaptive: the speculation gate's threshold (live rows at or under "
                     "which the bandit may speculate; default SpecConfig's, 32, as in TLT; 0 = never)")
flags.DEFINE_float("margin", 0.1, "adaptive: explore only arms within this fraction of the best (BanditConfig.margin)")
flags.DEFINE_bool("ablate_coupling", False, "also run every EAGLE tree with SpecConfig(coupled=False) (drafter "
                  "'eagle_topk': sampled rows draft the deterministic top-k, not the verifier-coupled sample)")
flags.DEFINE_bool("off_overhead", False, "only measure the adaptive engine's 'off' arm against plain (its plain "
                  "steps record hidden states for the drafter) at --batches, then exit")
flags.DEFINE_string("out", "benchmarks/results/speculative_smollm2_cpu.json", "JSON output")


def _median_ms(fn, reps: int = 15) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


def step_breakdown(policy, drafter, prompt, stops, configs, length: int = 256) -> list[dict]:
    """Milliseconds of one batch-1 step's parts after prefilling ``prompt``, on the RolloutEngine's own compiled steps
    and decode state: a plain decode step, and per tree config the EAGLE draft, the policy's tree verify, the drafter
    extend (the kernels the fused step runs) and the engine's fused verify step (draft → verify → commit → extend).
    Attention reads ``length`` cache slots. The engine's steps donate their state, so every timed call gets its own
    copy of it, made outside the clock; the undonated parts also copy the caches they update."""
    import jax.numpy as jnp

    from tlt_jax.rollout.pool import StepKey
    from tlt_jax.rollout.run import GenerateRun
    from tlt_jax.rollout.spec_steps import verify_rows
    from tlt_jax.speculative.tree import DraftState, drafter_extend, eagle_draft

    prompt = list(prompt)
    if len(prompt) >= length:
        raise ValueError(f"step_breakdown: the prompt ({len(prompt)} tokens) must be shorter than length={length}")
    kw = dict(max_batch=1, max_len=length, length_buckets=(length,), batch_buckets=(1,), chunk_size=1)
    params = SamplingParams(temperature=0.0, max_new_tokens=length - len(prompt), stop_token_ids=stops)

    def prefilled(engine):
        run = GenerateRun(engine, [prompt], [length - len(prompt)], [0], params, tuple(stops or ()))
        return run.prefill([(0, 0)])[0]

    copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s))

    def step_ms(engine, phase: str, arm: str, reps: int = 15) -> float:
        """The compiled step as the engine runs it (state donated): each call gets its own copy, made untimed. The
        copies are of the state after one untimed call, so an EAGLE step's drafter is already caught up over the
        prompt (the lazy drafter cache: a fresh prefill leaves that to the first verify step)."""
        state = prefilled(engine)
        eagle = engine.drafter_kind == "eagle" and phase == "verify"
        rounds = (jnp.int32(engine.spec.steps_per_call),) if eagle else ()  # the EAGLE step's rounds argument
        exe = engine.pool.get(StepKey(phase, 1, length, arm), engine.step_params(), state, *rounds)
        state = jax.block_until_ready(exe(engine.step_params(), copy(state), *rounds))[0]
        times = []
        for _ in range(reps):
            fresh = jax.block_until_ready(copy(state))
            t = time.perf_counter()
            jax.block_until_ready(exe(engine.step_params(), fresh, *rounds))
            times.append(time.perf_counter() - t)
        return 1000 * float(np.median(times))

    plain = RolloutEngine(policy, **kw)
    rows = [dict(part="plain_step", ms=step_ms(plain, "decode", "plain"))]
    cache = prefilled(plain).cache

    def parts(c: str) -> dict:
        d, k, n = (int(x) for x in c.split("x"))
        spec = SpecConfig(depth=d, topk=k, verify_tokens=n, threshold=1, steps_per_call=1)
        engine = RolloutEngine(policy, drafter=drafter, spec=spec, **kw)
        state = prefilled(engine)
        dlen = min(length + (d - 1) * k, engine.ctx.drafter_len)
        draft = jax.jit(lambda p, dr, s, r: eagle_draft(p, dr, DraftState(s.cache.view(dlen), s.feature), r, depth=d,
                                                        topk=k, num_nodes=n))
        verify = jax.jit(lambda p, s, t: verify_rows(p, s, t, spec, length))
        extend = jax.jit(lambda p, dr, s, h, t, m: drafter_extend(p, dr, s, h, t, m, attend_len=dlen))
        tree, _ = draft(policy, drafter, state.aux.draft, state.last_token)
        out = verify(policy, state, tree)
        tok = jnp.maximum(out.tokens, 0)
        return dict(
            part=c,
            draft_ms=_median_ms(lambda: draft(policy, drafter, state.aux.draft, state.last_token)),
            verify_ms=_median_ms(lambda: verify(policy, state, tree)),
            extend_ms=_median_ms(lambda: extend(policy, drafter, state.aux.draft, out.hidden, tok, out.num_emitted)),
            fused_ms=step_ms(engine, "verify", engine.spec_arm),
        )

    fwd = jax.jit(lambda p, c_, i, m: jnp.argmax(p(i, cache=c_, tree_mask=m, attend_len=length).logits, -1))
    for t in (1, 2, 4, 5, 7, 8, 16):  # the policy forward alone, over t chained tokens after the prompt
        ids = jnp.zeros((1, t), jnp.int32)
        mask = jnp.tril(jnp.ones((1, t, t), bool))
        ms = _median_ms(lambda i=ids, m=mask: fwd(policy, cache, i, m))
        rows.append(dict(part=f"forward_{t}_tokens", ms=ms))
        print(f"policy forward over {t} tokens: {rows[-1]['ms']:.1f} ms", flush=True)
    for c in configs:
        rows.append(r := parts(c))
        print(f"step parts {c}: draft {r['draft_ms']:.1f} ms, verify {r['verify_ms']:.1f} ms, extend "
              f"{r['extend_ms']:.1f} ms, fused {r['fused_ms']:.1f} ms (plain step {rows[0]['ms']:.1f} ms)", flush=True)
    return rows


def off_overhead(policy, drafter, prompts, batches, tokens, max_len: int, repeats: int) -> list[dict]:
    """Decode seconds of the adaptive engine pinned to "off" (threshold 0: the gate never opens) over plain decoding,
    same prompts and forced lengths (greedy, ignore_eos), interleaved passes, medians. Two adaptive engines: EAGLE arms
    only (its plain steps also record hidden states for the drafter) and EAGLE + n-gram arms (also report every
    emitted token for the host n-gram histories), as the benchmark's adaptive engine. Beside the timings, XLA's cost
    analysis of each compiled chunk (flops, bytes accessed: deterministic, unlike the timings on a shared CPU)."""
    max_batch = max(batches)
    kw = dict(max_batch=max_batch, max_len=max_len)
    engines = {"plain": RolloutEngine(policy, **kw)}
    pinned = {"off_eagle": ("off", "eagle:3x1x4"), "off_eagle_ngram": ("off", "ngram:3x1x4", "eagle:3x1x4")}
    for name, arms in pinned.items():
        engines[name] = RolloutEngine(policy, drafter=drafter, spec=SpecConfig(arms=arms, threshold=0), **kw)
    out = []
    for b, n_new in zip(batches, tokens, strict=False):
        params = SamplingParams(temperature=0.0, max_new_tokens=n_new, ignore_eos=True)
        group = prompts[:b]
        ref = {k: e.generate(group, params) for k, e in engines.items()}  # compiles
        secs: dict[str, list[float]] = {k: [] for k in engines}
        for r in range(repeats):  # the order alternates, so a drift in load does not favour one engine
            for k in list(engines)[:: 1 if r % 2 == 0 else -1]:
                res = engines[k].generate(group, params)
                if res.tokens != ref["plain"].tokens or any(c["choice"] != "off" for c in res.stats["chunks"]):
                    raise AssertionError(f"{k}: not plain decoding")
                secs[k].append(res.stats["decode_seconds"])
        med = {k: float(np.median(v)) for k, v in secs.items()}
        row = dict(batch=b, tokens=n_new, steps=ref["plain"].stats["steps"], repeats=repeats, decode_seconds=secs,
                   load_average=os.getloadavg())
        # per repeat the ratio to plain's run of the same repeat, then the median: robust to slow drift
        for k in list(engines)[1:]:
            row[f"{k}_over_plain"] = float(np.median(np.divide(secs[k], secs["plain"])))
        chunk, cost = _chunk_ms(engines, group, n_new, reps=31)
        row["chunk_ms"], row["chunk_cost"] = chunk, cost
        for k in list(engines)[1:]:
            row[f"{k}_chunk_over_plain"] = float(np.median(np.divide(chunk[k], chunk["plain"])))
        out.append(row)
        print(f"b={b}: plain {1000 * med['plain'] / row['steps']:.1f} ms/step; off with the EAGLE drafter "
              f"{row['off_eagle_over_plain']:.3f}x plain's time, EAGLE + n-gram arms "
              f"{row['off_eagle_ngram_over_plain']:.3f}x; one compiled K-step chunk alone: plain "
              f"{np.median(chunk['plain']):.1f} ms, off with the EAGLE drafter "
              f"{row['off_eagle_chunk_over_plain']:.3f}x, "
              f"EAGLE + n-gram {row['off_eagle_ngram_chunk_over_plain']:.3f}x (load {os.getloadavg()[0]:.1f}); "
              f"cost analysis flops / bytes over plain's: "
              + ", ".join(f"{k} {cost[k]['flops'] / cost['plain']['flops']:.4f} / "
                          f"{cost[k]['bytes'] / cost['plain']['bytes']:.3f}" for k in list(engines)[1:]),
              flush=True)
    return out


def _chunk_ms(engines: dict, prompts, n_new: int, reps: int) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """Milliseconds of each engine's compiled plain decode chunk (K steps, batch bucket of ``prompts``) right after
    prefilling the same prompts, without the host loop: every call on its own copy of the state (made untimed), the
    engines interleaved call by call, the order alternating. Isolates the device cost of what the drafter adds to a
    plain step from the host's round-trip work. Also each chunk's XLA cost analysis (flops, bytes accessed; XLA counts
    a loop body once, so these are per program, not per K steps)."""
    import jax.numpy as jnp

    from tlt_jax.rollout import buckets as bk
    from tlt_jax.rollout.pool import StepKey
    from tlt_jax.rollout.run import GenerateRun

    copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s))
    params = SamplingParams(temperature=0.0, max_new_tokens=n_new, ignore_eos=True)
    prepared, costs = {}, {}
    for k, e in engines.items():
        run = GenerateRun(e, prompts, [n_new] * len(prompts), list(range(len(prompts))), params, ())
        state, _, slots, plen, _ = run.prefill([(i, 0) for i in range(len(prompts))])
        length = bk.pick(e.length_buckets, int(plen.max()) + e.chunk_size)
        exe = e.pool.get(StepKey("decode", len(slots), length, "plain"), e.step_params(), state)
        jax.block_until_ready(exe(e.step_params(), copy(state)))
        prepared[k] = (e, exe, state)
        ca = exe.cost_analysis()
        ca = ca[0] if isinstance(ca, list) else ca
        costs[k] = dict(flops=float(ca["flops"]), bytes=float(ca["bytes accessed"]))
    times: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(reps):
        for k in list(engines)[:: 1 if r % 2 == 0 else -1]:
            e, exe, state = prepared[k]
            fresh = jax.block_until_ready(copy(state))
            t = time.perf_counter()
            jax.block_until_ready(exe(e.step_params(), fresh))
            times[k].append(1000 * (time.perf_counter() - t))
    return times, costs


class _Tally:
    """One arm's totals over the prompt groups of a (batch, temperature) cell."""

    def __init__(self):
        self.tokens, self.seconds, self.verifies, self.spec_tokens, self.compile_s, self.steps = [], 0.0, 0, 0, 0.0, 0
        self.decode_seconds, self.seconds_passes, self.arm_steps = 0.0, [], {}
        self.aa_ratios: list[float] = []  # plain only: its second run of each pass over its first

    def run(self, engine: RolloutEngine, group, params: SamplingParams) -> None:
        res = engine.generate(group, params)
        st = res.stats
        self.tokens += [s[0] for s in res.tokens]
        self.seconds += st["prefill_seconds"] + st["decode_seconds"]
        self.decode_seconds += st["decode_seconds"]
        self.verifies += st["spec"]["row_verifies"]
        self.spec_tokens += st["spec"]["tokens"]
        self.compile_s += st["compile_seconds_this_call"]
        self.steps += st["steps"]
        for per in st["arm_steps"].values():
            for a, n in per.items():
                self.arm_steps[a] = self.arm_steps.get(a, 0) + n

    def stats(self) -> dict:
        accept = self.spec_tokens / self.verifies if self.verifies else 1.0
        # Decode ms per step (a plain step or one verify step, host round trips included): at batch 1 the cost ratio
        # of a tree step to a plain step, which with the accept length gives the speedup.
        total = getattr(self, "decode_seconds_total", self.decode_seconds)  # adaptive warm: over all warm passes
        ms = 1000 * total / self.steps if self.steps else None
        aa = dict(aa_ratios=self.aa_ratios) if self.aa_ratios else {}
        return dict(mean_accept=accept, compile_seconds=self.compile_s, steps=self.steps, ms_per_step=ms,
                    seconds_passes=self.seconds_passes or [self.seconds], **aa)


def _run_cell(arms: dict, groups, params: SamplingParams, repeats: int = 1, adaptive=None):
    """Run every arm on every prompt group, interleaved (per group: plain, each speculative arm, plain again; the
    arms in reverse order every other pass), so a drift in machine load hits every arm alike; plain's time is the mean
    of its two runs. The whole interleaved pass runs ``repeats`` times and each arm's seconds are the median over the
    passes (the shared machine's speed drifts by tens of percent between passes; the tokens must be identical in every
    pass). Returns the tallies of the
    speculative arms and plain's.

    ``adaptive`` (an adaptive engine, its bandit fresh) joins every pass after the speculative arms. One extra pass
    runs first: the adaptive engine's "cold" pass (it learns while it runs; compared with plain of that pass). The
    ``repeats`` passes after it are "warm" (the same bandit, as in RL where it carries across steps): the adaptive
    engine's and every fixed arm's seconds are medians over them, so it is compared side by side with the arms on the
    same passes. Its tallies come back under ("adaptive", "cold" | "warm") with ``ref_seconds`` /
    ``ref_decode_seconds``, plain's time of the same pass(es), and ``choices``, the bandit's choice counters at the
    end."""
    runs = [*arms, "adaptive"] if adaptive is not None else list(arms)
    engines = arms | ({"adaptive": adaptive} if adaptive is not None else {})
    passes = []
    for k in range(repeats + (adaptive is not None)):
        tallies, again = {key: _Tally() for key in runs}, _Tally()
        # Every other pass runs the arms between plain's two runs in reverse order, so no arm always follows the same
        # one (an order effect would otherwise favour one arm in every pass).
        order = runs if k % 2 == 0 else [runs[0], *runs[:0:-1]]
        for g in groups:
            for key in order:
                tallies[key].run(engines[key], g, params)
            again.run(arms["plain"], g, params)
        plain = tallies["plain"]
        if again.tokens != plain.tokens or (passes and plain.tokens != passes[0]["plain"].tokens):
            raise AssertionError("plain decoding is not deterministic across passes")
        plain.aa_ratio = again.seconds / plain.seconds  # an A/A pair: the machine's noise between two equal runs
        plain.seconds = (plain.seconds + again.seconds) / 2
        plain.decode_seconds = (plain.decode_seconds + again.decode_seconds) / 2
        if adaptive is not None:
            tallies["adaptive"].choices = adaptive.bandit.stats()["choices"]
        passes.append(tallies)
    extra = {}
    if adaptive is not None:
        cold = passes[0]["adaptive"]
        cold.ref_seconds, cold.ref_decode_seconds = passes[0]["plain"].seconds, passes[0]["plain"].decode_seconds
        extra["adaptive", "cold"] = cold
        passes = passes[1:]
    out = {}
    for key in runs:
        t = passes[-1][key]
        if any(p[key].tokens != passes[0][key].tokens for p in passes):
            raise AssertionError(f"{key}: tokens differ between repeated passes")
        t.seconds_passes = [p[key].seconds for p in passes]
        if key == "plain":
            t.aa_ratios = [p[key].aa_ratio for p in passes]
        t.seconds = float(np.median(t.seconds_passes))
        t.decode_seconds = float(np.median([p[key].decode_seconds for p in passes]))
        if key == "adaptive":  # the arm steps and verifies of every warm pass together
            for p in passes[:-1]:
                for a, n in p[key].arm_steps.items():
                    t.arm_steps[a] = t.arm_steps.get(a, 0) + n
                t.verifies, t.spec_tokens, t.steps = (
                    t.verifies + p[key].verifies, t.spec_tokens + p[key].spec_tokens, t.steps + p[key].steps)
            t.decode_seconds_total = sum(p[key].decode_seconds for p in passes)
        out[key] = t
    plain = out.pop("plain")
    if adaptive is not None:
        warm = out.pop("adaptive")
        warm.ref_seconds, warm.ref_decode_seconds = plain.seconds, plain.decode_seconds
        extra["adaptive", "warm"] = warm
    return out | extra, plain


def main(argv):
    del argv
    split = None if _F.model == "tiny" else "eval"
    batches = [int(b) for b in _F.batches]
    tokens = [int(t) for t in _F.tokens]
    policy, prompts, stops = load_policy_and_prompts(_F.model, max(batches + [_F.b1_prompts]), 1000, split)
    drafters = {}
    if "ngram" in _F.drafters:
        drafters["ngram"] = "ngram"
    if "eagle" in _F.drafters and _drafter_dir():
        drafters["eagle"] = load_drafter(_drafter_dir())
        if _F.ablate_coupling:
            drafters[UNCOUPLED] = drafters["eagle"]
    max_len = max(len(p) for p in prompts) + max(tokens) + 64
    if _F.off_overhead:
        res = off_overhead(policy, drafters["eagle"], prompts, batches, tokens, max_len, _F.repeats)
        pathlib.Path(_F.out).write_text(json.dumps(dict(off_overhead=res), indent=1, default=_np))
        return
    max_batch = max(batches)
    plain = RolloutEngine(policy, max_batch=max_batch, max_len=max_len)
    engines: dict[tuple[str, str], RolloutEngine] = {}

    def engine(name: str, config: str) -> RolloutEngine:
        if (name, config) not in engines:
            depth, topk, n = (int(x) for x in config.split("x"))
            spec = SpecConfig(depth=depth, topk=topk, verify_tokens=n, threshold=max_batch,
                              steps_per_call=_F.steps_per_call, coupled=name != UNCOUPLED)
            engines[name, config] = RolloutEngine(policy, drafter=drafters[name], spec=spec, max_batch=max_batch,
                                                  max_len=max_len)
        return engines[name, config]

    rows = []
    t_start = time.perf_counter()
    breakdown = None
    if _F.breakdown and "eagle" in drafters:
        breakdown = step_breakdown(policy, drafters["eagle"], prompts[0], stops, _F.configs_b1)
    for b, n_new in zip(batches, tokens, strict=False):
        engines.clear()  # each batch compiles its own shapes anyway; keeping every engine's executables ran out of
        gc.collect()  # memory (24 GB) by batch 32
        groups = [prompts[i: i + 1] for i in range(_F.b1_prompts)] if b == 1 else [prompts[:b]]
        configs = _F.configs_b1 if b == 1 else _F.configs_small if b <= 4 else _F.configs_large
        arms = {"plain": plain} | {(name, c): engine(name, c) for c in configs for name in drafters}
        ada = None
        if _F.adaptive:  # one engine per batch, a fresh bandit per (batch, temperature): see _run_cell
            bandit_arms = ("off", *(f"{name}:{c}" for name in drafters if name != UNCOUPLED for c in configs))
            spec = SpecConfig(
                arms=bandit_arms,
                epsilon=_F.epsilon,
                margin=_F.margin,
                steps_per_call=_F.steps_per_call,
                **({} if _F.adaptive_threshold is None else dict(threshold=_F.adaptive_threshold)),
            )
            ada = RolloutEngine(policy, drafter=drafters.get("eagle"), spec=spec, max_batch=max_batch, max_len=max_len)
        for temp in (float(t) for t in _F.temperatures):
            params = SamplingParams(temperature=temp, max_new_tokens=n_new, seed=0, stop_token_ids=stops)
            if ada is not None:
                ada.bandit = Bandit(ada.spec.bandit_config())
            tallies, pt = _run_cell(arms, groups, params, _F.repeats, ada)
            n_tok, t_plain, d_plain = sum(len(t) for t in pt.tokens), pt.seconds, pt.decode_seconds
            base = dict(batch=b, prompts=sum(len(g) for g in groups), temperature=temp, tokens=n_tok,
                        plain_seconds=t_plain, plain_tokens_per_s=n_tok / t_plain, load_average=os.getloadavg())
            rows.append(dict(base, drafter="none", config="plain", seconds=t_plain, tokens_per_s=n_tok / t_plain,
                             speedup=1.0, decode_seconds=d_plain, decode_speedup=1.0, lossless=True, **pt.stats()))
            print(f"b={b:2d} T={temp}: plain {n_tok / t_plain:7.1f} tok/s ({n_tok} tokens); A/A (plain's 2nd run / "
                  f"1st, per pass) {', '.join(f'{r:.3f}' for r in pt.stats()['aa_ratios'])}", flush=True)
            for (name, c), tl in tallies.items():
                t, lossless = tl.seconds, tl.tokens == pt.tokens
                ref, dref = (tl.ref_seconds, tl.ref_decode_seconds) if name == "adaptive" else (t_plain, d_plain)
                rows.append(dict(base, drafter=name, config=c, seconds=t, tokens_per_s=n_tok / t,
                                 speedup=ref / t, decode_seconds=tl.decode_seconds,
                                 decode_speedup=dref / tl.decode_seconds, lossless=lossless, **tl.stats()))
                label = f"{name:>5} {c:>7}"
                if name == "adaptive":  # speedups against plain of the same pass
                    rows[-1].update(arm_steps=tl.arm_steps, bandit_choices=tl.choices, plain_seconds_pass=ref,
                                    bandit_best=ada.bandit.stats()["best"], arms=list(bandit_arms))
                    if c == "warm":  # plain's time over the adaptive engine's, pass by pass
                        rows[-1]["speedup_passes"] = [p / a for p, a in zip(pt.seconds_passes, tl.seconds_passes,
                                                                            strict=True)]
                    label = ("adaptive, cold (1st pass, fresh bandit)" if c == "cold"
                             else f"adaptive, warm (median of {_F.repeats} passes)")
                print(f"b={b:2d} T={temp}: {label}: accept {tl.stats()['mean_accept']:.2f} tok/verify, "
                      f"{tl.stats()['ms_per_step']:.1f} ms/step (plain {pt.stats()['ms_per_step']:.1f}), "
                      f"{n_tok / t:7.1f} tok/s, {ref / t:.2f}x plain "
                      f"(decode only {dref / tl.decode_seconds:.2f}x), lossless={lossless}", flush=True)
                if name == "adaptive":
                    per = rows[-1].get("speedup_passes")
                    print(f"    arm steps {tl.arm_steps}; bandit choices {tl.choices}"
                          + (f"; x plain per pass {', '.join(f'{r:.3f}' for r in per)}" if per else ""), flush=True)
                write(rows, breakdown, drafters, split, t_start, final=False)  # partial results survive a kill
    write(rows, breakdown, drafters, split, t_start, final=True)


def _drafter_dir():
    """--drafter, else the committed drafter when the policy is the embedded SmolLM2 it was trained for."""
    return _F.drafter or (DEFAULT_DRAFTER if _F.model is None else None)


def write(rows, breakdown, drafters, split, t_start, final: bool) -> None:
    summary = _summarise(rows, list(drafters), log=final)
    if _F.adaptive:
        summary.append(dict(adaptive_vs_fixed=_adaptive_vs_fixed(rows, log=final)))
    out = pathlib.Path(_F.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": _F.model or "SmolLM2-135M-Instruct (embedded)", "drafter": str(_drafter_dir() or ""),
            "prompts": split or "tiny",
            "device": str(jax.devices()[0]), "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
            "jax": jax.__version__, "dtype": "float32", "steps_per_call": _F.steps_per_call,
            "adaptive_threshold": SpecConfig.threshold if _F.adaptive_threshold is None else _F.adaptive_threshold,
            "complete": final,
            "total_seconds": time.perf_counter() - t_start, "load_average_end": os.getloadavg()}
    if "eagle" in drafters and (pathlib.Path(_drafter_dir()) / "warmup.json").exists():
        meta["warmup"] = json.loads((pathlib.Path(_drafter_dir()) / "warmup.json").read_text())
    out.write_text(json.dumps({"meta": meta, "summary": summary, "step_breakdown_b1": breakdown, "rows": rows},
                              indent=1, default=_np))
    if final:
        print(f"wrote {out} in {meta['total_seconds']:.0f}s")


def _summarise(rows, names, log: bool = True):
    """Best configuration per (temperature, drafter, batch) and the batch from which none beats plain."""
    summary = []
    for temp in sorted({r["temperature"] for r in rows}):
        for name in names:
            best = {}
            for r in rows:
                if r["temperature"] == temp and r["drafter"] == name:
                    if r["batch"] not in best or r["speedup"] > best[r["batch"]]["speedup"]:
                        best[r["batch"]] = r
            stop_at = next((b for b in sorted(best) if best[b]["speedup"] < 1.0), None)
            summary.append(dict(temperature=temp, drafter=name, stops_paying_off_at_batch=stop_at,
                                best={b: dict(config=r["config"], speedup=r["speedup"], mean_accept=r["mean_accept"],
                                              decode_speedup=r.get("decode_speedup"),
                                              tokens_per_s=r["tokens_per_s"]) for b, r in sorted(best.items())}))
            if not log:
                continue
            print(f"T={temp} {name}: best speedup by batch "
                  + ", ".join(f"{b}: {r['speedup']:.2f}x ({r['config']}, accept {r['mean_accept']:.2f})"
                              for b, r in sorted(best.items()))
                  + f"; no configuration beats plain from batch {stop_at}")
    return summary


def _adaptive_vs_fixed(rows, log: bool = True) -> list[dict]:
    """Per (temperature, batch) and adaptive pass (cold: the first, with a fresh bandit; warm: the passes after it):
    the adaptive engine's speedup over plain (plain of the same passes) and its ratio to the best fixed arm's speedup
    (goals: >= 1.0x plain, >= 0.95x the best fixed arm); for several warm passes also the paired ratios."""
    out = []
    for temp, b in sorted({(r["temperature"], r["batch"]) for r in rows}):
        cell = [r for r in rows if r["temperature"] == temp and r["batch"] == b]
        fixed = [r for r in cell if r["drafter"] not in ("adaptive", UNCOUPLED)]  # the adaptive engine's arms
        best = max(fixed, key=lambda r: r["speedup"])
        plain = next(r for r in fixed if r["config"] == "plain")
        for ada in (r for r in cell if r["drafter"] == "adaptive"):
            row = dict(
                temperature=temp,
                batch=b,
                adaptive_pass=ada["config"],
                adaptive_vs_plain=ada["speedup"],
                best_fixed=f"{best['drafter']} {best['config']}",
                best_fixed_vs_plain=best["speedup"],
                adaptive_vs_best=ada["speedup"] / best["speedup"],
                arm_steps=ada.get("arm_steps"),
                bandit_choices=ada.get("bandit_choices"),
            )
            paired = ""
            if ada["config"] == "warm" and len(ada["seconds_passes"]) > 1:
                # Paired: per warm pass the ratio to plain's / the best arm's time in the same pass, then the median
                # (a pass on a slow stretch of the shared machine slows every arm of that pass alike).
                a_s = np.asarray(ada["seconds_passes"])
                row["adaptive_vs_plain_paired"] = float(np.median(np.asarray(plain["seconds_passes"]) / a_s))
                row["adaptive_vs_best_paired"] = float(np.median(np.asarray(best["seconds_passes"]) / a_s))
                paired = (f"; paired per pass (median): {row['adaptive_vs_plain_paired']:.2f}x plain, "
                          f"{row['adaptive_vs_best_paired']:.2f}x the best")
            out.append(row)
            if log:
                print(
                    f"T={temp} b={b}: adaptive {ada['config']:>4}: {ada['speedup']:.2f}x plain, "
                    f"{ada['speedup'] / best['speedup']:.2f}x the best fixed arm ({best['drafter']} {best['config']} "
                    f"{best['speedup']:.2f}x){paired}"
                )
    return out


def _np(x):
    return x.item() if isinstance(x, np.generic) else str(x)


if __name__ == "__main__":
    app.run(main)
