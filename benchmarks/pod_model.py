"""Pod model of one RL step: the rollout engine's own host loop on simulated steps, charged by a cost model.

``SimEngine`` runs ``tlt_jax.rollout.run.GenerateRun`` itself (waves, K-step chunks, compaction, length buckets,
speculative calls at <= threshold live rows) with host functions in place of compiled steps: a row stops at its drawn
length, a verify step emits the accept length per row on average (a fractional carry, at most depth + 1), and each
call's cost goes to a virtual clock that the loop's own timing reads. Costs: ``Roofline`` (Qwen2.5-7B / 32B on H100)
or ``GpuCosts``. The pod: one step's responses dealt round-robin to its engines, the slowest engine's rollout, then
the log-prob and update passes. Accept lengths are this project's CPU measurements (``accept.py``; a static drafter's
x the static / adaptive ratio ``drafter_adaptation.py`` measured after the policy drifted); TLT's drafter trains in
the other engines' idle time (``tlt_jax.controller.scheduler.simulate``).

    python benchmarks/pod_model.py [--accept=PATH] [--tasks=gsm_symbolic,arithmetic] [--draft_s=S] [--out=PATH]
        # -> results/pod_model.json; --draft_s: drafting seconds per tree depth (default 0.81 ms, fitted to the TLT
        # paper's Qwen-32B measurement; 0: the drafter at its roofline)
    python benchmarks/pod_model.py --gpu_costs=PATH[#KEY] --gpu_run=RESULT [--gpu_arm=5x1x6]
        # a gpu_tlt.py run's rollouts predicted from GPU-measured costs (goal: +-15 %) -> results/gpu/pod_model_gpu.json

``--gpu_costs``: JSON of milliseconds by batch (keys as strings): "decode_ms" (required: one plain step), and
"spec_step_ms" {"5x1x6": {...}} (a speculative step of a tree) or "verify_ms" {"64": {...}} (the policy's pass over N
tree tokens) with "draft_ms" (a drafter forward); "prefill_ms", "roundtrip_ms" (per call), "compact_ms"; "source",
"device", "model", "length", "notes". gpu_tlt.py writes "step_costs" so; gpu_suite.py's suite.json is read too. Linear
between measured batches (and tree sizes), flat below the smallest, the last segment extended above the largest.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import types
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tlt_jax, also when run as a script

from rollout_tail import tail_lengths  # noqa: E402

import tlt_jax.rollout.run as run_module  # noqa: E402
from tlt_jax.adaptive import Arm, parse_arm  # noqa: E402
from tlt_jax.rollout import SamplingParams, SpecConfig  # noqa: E402
from tlt_jax.rollout import buckets as bk  # noqa: E402

HERE = Path(__file__).resolve().parent
ACCEPT = HERE / "results" / "accept_smollm2_cpu.json"
DRIFT = HERE / "results" / "drafter_adaptation_ctx80.json"
TOLERANCE = 0.15  # the goal: the pod model within +-15 % of a measured GPU run
PAPER_STEP_SPEEDUP = {"Qwen2.5-7B": {8: 1.21, 16: 1.45, 32: 1.62, 64: 1.76}, "Qwen2.5-32B": {32: 1.83, 64: 2.12}}


class ModelSpec(collections.namedtuple("ModelSpec", "name params layers hidden heads kv_heads head_dim vocab ffn "
                                       "draft_vocab", defaults=(32768,))):
    """Transformer shape (bf16 weights and KV), from each model's config.json. Drafter: TLT's EAGLE-2 layer (a decoder
    layer + fc(2H -> H); embedding and LM head shared, frozen). Drafting reads ``draft_vocab`` rows of the LM head (the
    GPU recipes' ``--draft_vocab=32768``, as EAGLE-3); the policy's verify forward and drafter training read all."""

    kv_bytes_per_token = property(lambda m: 2 * m.layers * m.kv_heads * m.head_dim * 2)
    drafter_params = property(lambda m: 2 * m.hidden * ((m.heads + m.kv_heads) * m.head_dim + 1.5 * m.ffn + m.hidden))
    head_params = property(lambda m: m.vocab * m.hidden)
    draft_head_params = property(lambda m: min(m.draft_vocab, m.vocab) * m.hidden)


QWEN25_7B = ModelSpec("Qwen2.5-7B", 7.62e9, 28, 3584, 28, 4, 128, 152064, 18944)
QWEN25_32B = ModelSpec("Qwen2.5-32B", 32.8e9, 64, 5120, 40, 8, 128, 152064, 27648)
SETUPS = ((QWEN25_7B, 4, 512), (QWEN25_32B, 8, 2048))  # (model, tp, responses per RL step)

# bw_eff 0.75: the TLT paper's Table 2 (Qwen-7B, H100, batch 1, no SD: 164.65 tok/s = 6.07 ms per token) over the bf16
# weight-read roofline (15.2 GB / 3.35 TB/s = 4.55 ms). draft_s 0.81 ms per tree depth: a drafting charge above the
# roofline, fitted to the paper's Qwen-32B, TP 4, batch-1 point (depth 10, top-4, 64 tokens: accept 8.29 at 3.51x, so
# a verify step costs 2.36 plain steps, the bare roofline 1.33); --draft_s=0 projects without it. Assumed: flop_eff
# 0.6, train_mfu 0.4, 8 us per all-reduce, 0.3 ms per host round trip.
Hardware = collections.namedtuple("Hardware", "name hbm_bytes_s flops_s hbm_bytes bw_eff flop_eff train_mfu "
                                  "allreduce_s roundtrip_s draft_s", defaults=(0.75, 0.6, 0.4, 8e-6, 3e-4, 8.1e-4))
H100 = Hardware("H100 SXM5 80GB (3.35 TB/s HBM3, 989 TFLOP/s dense bf16: NVIDIA datasheet)", 3.35e12, 989e12, 80e9)
DRAFT_S_NOTE = ("seconds per tree depth charged above the drafter's roofline; the default 0.81 ms is fitted to the "
                "TLT paper's Qwen-32B measurement (TP 4, batch 1), not measured here; --draft_s=0: the drafter at its "
                "roofline")


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Costs of one engine's calls (a tp-GPU tensor-parallel group). A forward over b rows x q tokens reading L cache
    positions costs max(bytes / (HBM x bw_eff), FLOPs / (peak x flop_eff)) + 2 x layers all-reduces (tp > 1): bytes =
    (bf16 weights + b x L x KV bytes) / tp, FLOPs = (2 x params x b x q + 4 x layers x heads x head_dim x b x q x L) /
    tp. Plain step: a policy forward. Verify step: depth - 1 drafter forwards over top-k tokens (draft-vocabulary head),
    depth x draft_s (paper-fitted), the policy over the tree (full head), a drafter extend; after plain steps a catch-up
    over their positions (pieces of 8). Compaction: a gather of the dense KV rows. Each call: one round trip."""

    model: ModelSpec
    hw: Hardware
    tp: int
    max_len: int

    def forward(self, b, q, length, params, attn=True) -> float:
        m, hw = self.model, self.hw
        byt = (2 * params + (b * length * m.kv_bytes_per_token if attn else 0.0)) / self.tp
        flops = 2 * params * b * q + (4 * m.layers * m.heads * m.head_dim * b * q * length if attn else 0.0)
        t = max(byt / (hw.hbm_bytes_s * hw.bw_eff), flops / self.tp / (hw.flops_s * hw.flop_eff))
        return t + (2 * m.layers * hw.allreduce_s if self.tp > 1 and attn else 0.0)

    def drafter(self, b, q, head: bool) -> float:
        head_params = self.model.draft_head_params if head else 0
        return self.forward(b, q, 0, self.model.drafter_params + head_params, attn=False)

    def prefill(self, batch, prompts, length):
        return self.forward(prompts, length, length, self.model.params) + self.hw.roundtrip_s

    def decode(self, batch, length, steps):
        return steps * self.forward(batch, 1, length, self.model.params) + self.hw.roundtrip_s

    def verify(self, batch, length, steps, arm: Arm, accept: float, behind: int = 0):
        step = (arm.depth - 1) * self.drafter(batch, arm.topk, True) + arm.depth * self.hw.draft_s
        step += self.forward(batch, arm.verify_tokens, length, self.model.params) + self.drafter(batch, accept, True)
        return steps * step + -(-behind // 8) * self.drafter(batch, 8, False) + self.hw.roundtrip_s

    def compact(self, src, dst):
        return 2 * dst * self.max_len * self.model.kv_bytes_per_token / self.tp / (self.hw.hbm_bytes_s * self.hw.bw_eff)

    def max_rows(self, cap: int = 256) -> int:
        """Rows a dense slot-major KV cache of max_len positions fits in 90 % of HBM beside policy and drafter."""
        m = self.model
        rows = (0.9 * self.hw.hbm_bytes - 2 * (m.params + m.drafter_params) / self.tp) // (
            self.max_len * m.kv_bytes_per_token / self.tp)
        if rows < 1:
            raise ValueError(f"{m.name} on tp={self.tp} {self.hw.name}: no room for one {self.max_len}-token row")
        return int(min(rows, cap))


def interpolate(points: dict, x: float) -> float:
    """Piecewise-linear in x through the measured points; flat below the first, the last segment extended above."""
    pts = sorted((float(k), float(v)) for k, v in points.items())
    if not pts:
        raise ValueError("a cost curve needs at least one measured point")
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return max(y1, y1 + (y1 - y0) * (x - x1) / (x1 - x0))


class GpuCosts:
    """Costs from GPU-measured milliseconds (the module docstring's format; ``load_costs`` reads a file)."""

    KEYS = {"decode_ms", "verify_ms", "draft_ms", "spec_step_ms", "prefill_ms", "roundtrip_ms", "compact_ms", "source",
            "device", "model", "length", "notes"}

    def __init__(self, data: dict):
        if set(data) - self.KEYS:
            raise ValueError(f"unknown keys {sorted(set(data) - self.KEYS)} (the format: benchmarks/pod_model.py)")
        self.data = data
        interpolate(data.get("decode_ms", {}), 1)

    def step_ms(self, batch) -> float:
        return interpolate(self.data["decode_ms"], batch)

    def spec_step(self, batch, arm: Arm) -> float:
        """Milliseconds of one speculative step of ``arm`` (drafting, verify, drafter extend)."""
        d, name = self.data, f"{arm.depth}x{arm.topk}x{arm.verify_tokens}"
        if name in d.get("spec_step_ms", {}):
            return interpolate(d["spec_step_ms"][name], batch)
        if not d.get("draft_ms") or not d.get("verify_ms"):
            raise KeyError(f"no spec_step_ms for {name} and no draft_ms + verify_ms: its cost is unknown")
        tree = {1: self.step_ms(batch)} | {int(n): interpolate(v, batch) for n, v in d["verify_ms"].items()}
        return interpolate(tree, arm.verify_tokens) + arm.depth * interpolate(d["draft_ms"], batch)

    def prefill(self, batch, prompts, length):  # seconds of one engine call, a round trip included
        return (interpolate(self.data.get("prefill_ms") or {0: 0.0}, batch) + self.data.get("roundtrip_ms", 0)) / 1e3

    def decode(self, batch, length, steps):
        return (steps * self.step_ms(batch) + self.data.get("roundtrip_ms", 0.0)) / 1e3

    def verify(self, batch, length, steps, arm, accept, behind=0):
        return (steps * self.spec_step(batch, arm) + self.data.get("roundtrip_ms", 0.0)) / 1e3

    def compact(self, src, dst):
        return self.data.get("compact_ms", 0.0) / 1e3


def load_costs(path: str, variant: str | None = None) -> GpuCosts:
    """GpuCosts from PATH (this format, or gpu_suite.py's suite.json: ``variant`` of its decode section, default the
    fastest at batch 1); PATH#KEY reads that key of the file."""
    file, _, key = str(path).partition("#")
    data = json.loads(Path(file).read_text())
    data = data[key] if key else data
    if "decode_ms" not in data and data.get("decode"):
        dec = data["decode"]
        variant = variant or min((v for v in dec if "decode_bs1" in dec[v]), key=lambda v: dec[v]["decode_bs1"]["ms"])
        data = dict(source=f"gpu_suite.py decode, variant {variant}", device=data.get("device_kind", ""),
                    model="Qwen2.5-7B", decode_ms={}, verify_ms={})
        for row in dec[variant].values():
            n, b = int(row.get("tree_tokens", 1)), str(row["batch"])
            (data["decode_ms"] if n == 1 else data["verify_ms"].setdefault(str(n), {}))[b] = row["ms"]
            data["length"] = row.get("attend_len", data.get("length"))
    return GpuCosts(data)


@dataclasses.dataclass
class SimState:
    """Host decode state of a batch bucket, per row: where it stops (its response length, capped by its budget), tokens
    emitted, the fraction of a token its verify steps carry, positions the drafter is behind, done. No buffers."""

    stop_at: np.ndarray
    ngen: np.ndarray
    carry: np.ndarray
    behind: np.ndarray
    done: np.ndarray
    tokens = logprobs = hidden = aux = None


class SimEngine:
    """What ``GenerateRun`` reads from its engine (``EngineParts`` and the rest of ``RolloutEngine`` it touches), with
    one fixed EAGLE arm or none. The engine is its own step pool: ``get(key)`` hands out the host step of the key's
    phase, which charges ``costs`` for the call to ``clock.now`` and logs (phase, batch, length, steps) in ``calls``."""

    bandit = ngram = ngram_history = capture = activity = None
    background_compile = spans_processes = False
    compile_seconds = 0.0
    max_stop_tokens, tail_threshold, drafter_kind = 1, 32, "eagle"

    def __init__(self, costs, max_batch, max_len, chunk_size=8, arm: Arm | None = None, accept=1.0, threshold=32,
                 steps_per_call=4, compaction=True):
        if arm is not None and not 1.0 <= accept <= arm.depth + 1:
            raise ValueError(f"accept length {accept} is outside [1, depth + 1 = {arm.depth + 1}] for {arm}")
        self.costs, self.max_batch, self.max_len, self.chunk_size = costs, max_batch, max_len, chunk_size
        self.batch_buckets, self.length_buckets = bk.batch_buckets(max_batch), bk.length_buckets(max_len)
        self.arm, self.accept, self.compaction = arm, float(accept), compaction
        kw = dict(threshold=threshold, steps_per_call=steps_per_call)
        self.spec = None if arm is None else SpecConfig(arm.depth, arm.topk, arm.verify_tokens, **kw)
        self.arm_specs = {} if arm is None else {arm: self.spec}
        self.arms, self.spec_arm = [run_module.OFF, *self.arm_specs], None if arm is None else arm.pool_name
        self.ctx, self.pool = types.SimpleNamespace(replicated=lambda: None, batch_sharding=lambda s: None), self
        self.clock, self.calls = types.SimpleNamespace(now=0.0), []
        self.clock.perf_counter = lambda: self.clock.now

    def step_params(self):
        return ("policy", "drafter")  # the same drafter object every call: no hot swap

    def choose_arm(self, speculate: bool, batch: int) -> Arm:
        return next(iter(self.arm_specs)) if speculate else run_module.OFF

    def get(self, key, *args):
        return functools.partial(getattr(self, "_" + key.phase), key)

    def first_run(self, key) -> bool:
        return False  # no compiles, nothing to warm up

    def _out(self, key, steps: int, seconds: float, st: SimState, *extra):
        """Charge the call, return (state, StepInfo packed: done, num_generated[, verifies, accepted])."""
        self.clock.now += seconds
        self.calls.append((key.phase, key.batch, key.length, steps))
        return st, np.stack([st.done, st.ngen, *extra]).astype(np.int32)

    def _prefill(self, key, params, ids, lens, init):
        valid, cap, src = np.asarray(init.valid), np.asarray(init.max_new), np.asarray(init.src)
        stop = np.where(valid, self.stop_at[np.asarray(init.request_id), np.asarray(init.sample_id)], 1)
        stop, ones = np.minimum(stop, cap), np.ones(len(cap), np.int64)
        st = SimState(stop, ones, np.zeros(len(cap)), np.asarray(lens)[src].astype(np.int64), ~valid | (ones >= stop))
        return self._out(key, 1, self.costs.prefill(key.batch, key.extra[0], key.length), st)

    def _decode(self, key, params, st: SimState):
        emit = np.where(st.done, 0, np.minimum(self.chunk_size, st.stop_at - st.ngen))
        steps, ngen = int(emit.max()), st.ngen + emit  # the chunk ends early once every row is done
        st = SimState(st.stop_at, ngen, st.carry, st.behind + emit, st.done | (ngen >= st.stop_at))
        return self._out(key, steps, self.costs.decode(key.batch, key.length, steps), st)

    def _verify(self, key, params, st: SimState, rounds):
        ngen, carry, done = st.ngen, st.carry, st.done
        verifies, accepted, steps = np.zeros_like(ngen), np.zeros_like(ngen), 0
        behind = int(st.behind[~done].max(initial=0))  # the drafter catches up over the plain steps' positions first
        while steps < min(int(np.asarray(rounds)), self.spec.steps_per_call) and not done.all():
            live = ~done
            carry = carry + np.where(live, self.accept, 0.0)
            full = np.where(live, np.minimum(np.floor(carry), self.arm.depth + 1), 0).astype(np.int64)
            emit = np.minimum(full, st.stop_at - ngen)  # a stop (or the budget) ends the accepted path
            carry, ngen = carry - full, ngen + emit
            verifies, accepted = verifies + live, accepted + np.maximum(emit - 1, 0)
            done, steps = done | (ngen >= st.stop_at), steps + 1
        st = SimState(st.stop_at, ngen, carry, np.zeros_like(ngen), done)
        cost = self.costs.verify(key.batch, key.length, steps, self.arm, self.accept, behind)
        return self._out(key, steps, cost, st, verifies, accepted)

    def _compact(self, key, st: SimState, idx, ok):
        idx, cost = np.asarray(idx), self.costs.compact(key.extra[0], key.batch)
        st = SimState(st.stop_at[idx], st.ngen[idx], st.carry[idx], st.behind[idx], np.where(ok, st.done[idx], True))
        return self._out(key, 0, cost, st)[0], None

    def generate(self, lengths, prompt_len: int, group: int = 1, max_new: int | None = None) -> run_module.GenerateRun:
        """``RolloutEngine.generate``'s waves of ``GenerateRun``: len(lengths) / group prompts of prompt_len tokens,
        ``group`` samples each; sample j of prompt i stops after lengths[i * group + j] tokens (or max_new, default
        the longest). Seconds: ``clock.now``, every call's cost added up."""
        max_new = int(max_new or max(lengths))
        if len(lengths) % group or prompt_len + max_new > self.max_len:
            raise ValueError(f"{len(lengths)} lengths in groups of {group}, prompt {prompt_len} + {max_new} tokens "
                             f"> max_len {self.max_len}: not a workload of this engine")
        self.stop_at = np.asarray(lengths, np.int64).reshape(-1, group)
        prompts = [[1] * prompt_len] * len(self.stop_at)
        params = SamplingParams(max_new_tokens=max_new, n=group, stop_token_ids=(0,))
        run = run_module.GenerateRun(self, prompts, [max_new] * len(prompts), list(range(len(prompts))), params, (0,))
        rows = [(i, j) for i in range(len(prompts)) for j in range(group)]
        with mock.patch.object(run_module, "time", self.clock):
            for w0 in range(0, len(rows), self.max_batch):
                run.wave(rows[w0 : w0 + self.max_batch])
        return run


def seconds(costs, lengths, prompt_len, group=1, max_new=None, **kw) -> float:
    """Rollout seconds of one engine's generate call on these responses (0 for none)."""
    if not len(lengths):
        return 0.0
    eng = SimEngine(costs, **kw)
    eng.generate(lengths, prompt_len, group, max_new)
    return eng.clock.now


def measured_accept(path=ACCEPT, tree: str = "8x4x48", task: str = "gsm_symbolic", temperature: float = 0.9) -> float:
    """The EAGLE accept length (tokens per verify step and row) ``accept.py`` measured for this tree, task and T."""
    for r in json.loads(Path(path).read_text())["table"]:
        if (r["drafter"], r["arm"], r["task"], float(r["temperature"])) == ("eagle", tree, task, temperature):
            return float(r["accept"])
    raise KeyError(f"{path}: no EAGLE {tree} row for task {task!r} at T={temperature}")


def measured_drift(path=DRIFT) -> float:
    """A static drafter's held-out accept length over the adaptive one's, the policy drifted (drafter_adaptation.py)."""
    modes = json.loads(Path(path).read_text())["modes"]
    return modes["static"]["final_eval"]["accept_length"] / modes["adaptive"]["final_eval"]["accept_length"]


def stale_accept(fresh: float, stale: float, s: float, tau: float = 10.0) -> float:
    """Accept length of a drafter trained on data s policy updates old: stale + (fresh - stale) x exp(-(s - 1) / tau);
    s = 1 is TLT's steady state (trained in step t's idle time, used in step t + 1), s = inf a static drafter (tau:
    assumed)."""
    return stale + (fresh - stale) * (math.exp(-(s - 1) / tau) if math.isfinite(s) else 0.0)


def mean_staleness(idle_s: float, demand_s: float, run_steps: int) -> float:
    """Mean staleness over a run when each step's idle device-seconds buy idle / demand of the drafter's pass over a
    step's data: with a shortfall the lag grows by 1 - idle / demand per step."""
    return 1.0 if demand_s <= 0 or idle_s >= demand_s else 1.0 + (1.0 - idle_s / demand_s) * (run_steps - 1) / 2.0


def train_seconds(model: ModelSpec, hw: Hardware, devices: int, tokens: float) -> float:
    """Old + reference log-probs (2 forwards) and one update (forward + backward): 10 x params FLOPs per token."""
    return 10 * model.params * tokens / (devices * hw.flops_s * hw.train_mfu)


def drafter_demand(model: ModelSpec, hw: Hardware, tokens: float) -> float:
    """Device-seconds of drafter training over ``tokens``: the layer (6 x params per token) and the frozen LM head
    (soft labels, forward and input gradient: 6 x vocab x hidden per token)."""
    return tokens * 6 * (model.drafter_params + model.head_params) / (hw.flops_s * hw.train_mfu)


@functools.cache
def engine_times(model, hw, tp, devices, lengths: tuple, prompt_len, max_batch=None, **spec) -> tuple:
    """Every engine's rollout seconds, the responses dealt round-robin (cached: plain is the same for every
    accept length). max_batch: rows per wave (default: what a dense KV cache fits)."""
    costs, engines = Roofline(model, hw, tp, prompt_len + max(lengths)), devices // tp
    kw = dict(max_batch=max_batch or costs.max_rows(), max_len=costs.max_len)
    return tuple(seconds(costs, lengths[e::engines], prompt_len, **kw, **spec) for e in range(engines))


def project(model, hw, tp, devices, lengths, prompt_len, arm: Arm, accept: tuple[float, float], threshold=32,
            run_steps=100, max_batch=None) -> dict:
    """One RL step without speculation, with a static drafter and with TLT (its accept length and the idle time
    solved together); accept: (fresh, stale) accept lengths."""
    from tlt_jax.controller.scheduler import ControllerConfig, simulate

    if devices % tp:
        raise ValueError(f"devices={devices} is not a multiple of the tensor-parallel size tp={tp}")
    train_s = train_seconds(model, hw, devices, float(sum(lengths)) + prompt_len * len(lengths))
    demand = drafter_demand(model, hw, float(sum(lengths)))
    step_s = drafter_demand(model, hw, 8 * 256) / tp  # a drafter step: drafter.rows x drafter.row_len tokens
    out = dict(devices=devices, engines=devices // tp, responses=len(lengths), train_s=train_s, drafter_demand_s=demand)
    args = (model, hw, tp, devices, tuple(lengths), prompt_len, max_batch)
    for mode, stale in (("plain", None), ("static", math.inf), ("tlt", 1.0)):
        spot = {}
        for i in range(4):  # TLT: accept length -> idle time -> drafter steps -> staleness -> accept length
            spec = {} if stale is None else dict(arm=arm, accept=stale_accept(*accept, stale), threshold=threshold)
            times = engine_times(*args, **spec)
            if mode != "tlt":
                break
            _, m = simulate([t or None for t in times], step_s, ControllerConfig(steps_without_idle=0))
            spot = dict(train_engine_s=m["controller/train_s"], overhang_s=m["controller/overhang_s"],
                        drafter_steps=m["controller/train_steps"], drafter_step_s=step_s)
            new = mean_staleness(spot["train_engine_s"] * tp, demand, run_steps)  # whole steps, as dispatched
            if new == stale or i == 3:
                break
            stale = new
        roll = max(times)
        out[mode] = dict(rollout_s=roll, step_s=roll + train_s + spot.get("overhang_s", 0.0), times=list(times),
                         idle_device_s=sum(roll - t for t in times) * tp, accept=spec.get("accept", 1.0),
                         staleness=stale, **spot)
    for mode in ("static", "tlt"):
        out[mode]["rollout_speedup"] = out["plain"]["rollout_s"] / out[mode]["rollout_s"]
        out[mode]["step_speedup"] = out["plain"]["step_s"] / out[mode]["step_s"]
    return out


def projection_table(model, tp, responses, accept, devices, seeds=(0, 1, 2), cap=32768, prompt_len=256, hw=H100,
                     **kw) -> list[dict]:
    """``project`` per pod size, each figure the mean over the length samples of ``seeds``."""
    rows = []
    for p in (p for p in devices if p >= tp):
        runs = [project(model, hw, tp, p, tail_lengths(responses, cap, s), prompt_len, accept=accept, **kw)
                for s in seeds]
        row = dict(model=model.name, tp=tp, devices=p, engines=p // tp, responses=responses, seeds=list(seeds),
                   max_batch=Roofline(model, hw, tp, prompt_len + cap).max_rows(),
                   paper_step_speedup=PAPER_STEP_SPEEDUP[model.name].get(p))
        row |= {k: statistics.mean(r[k] for r in runs) for k in ("train_s", "drafter_demand_s")}
        for m in ("plain", "static", "tlt"):
            row[m] = {k: statistics.mean(r[m][k] for r in runs) for k, v in runs[0][m].items()
                      if isinstance(v, float | int) and math.isfinite(v)}
        rows.append(row)
    return rows


def compare(predicted: float, measured: float, tolerance: float = TOLERANCE) -> dict:
    if not measured > 0:
        raise ValueError(f"the measured figure must be > 0, got {measured}")
    err = predicted / measured - 1.0
    return dict(predicted=predicted, measured=measured, error=err, tolerance=tolerance, within=abs(err) <= tolerance)


def validate_run(costs, record: dict, arm: Arm | None = None, threshold=32, tolerance=TOLERANCE) -> dict:
    """Predicted against measured rollout seconds of one e2e mode of ``gpu_tlt.py`` (``e2e[mode]``: its steps'
    ``lengths``, ``rollout_s``, ``compile_s``, ``accept_length``; ``prompt_len``, ``group``, ``max_batch``,
    ``max_len``) over the steps after the first, compiles left out; with ``arm``, speculating at <= threshold rows."""
    rows, plen = [], int(round(record["prompt_len"]))
    for s in record["steps"][1:] if len(record["steps"]) > 1 else record["steps"]:
        spec = {} if arm is None else dict(arm=arm, accept=max(1.0, s.get("accept_length") or 1.0), threshold=threshold)
        cap = min(max(s["lengths"]), record["max_len"] - plen)
        pred = seconds(costs, np.minimum(s["lengths"], cap), plen, record.get("group", 1), cap,
                       max_batch=record["max_batch"], max_len=record["max_len"], **spec)
        rows.append(dict(step=s.get("step"), predicted_s=pred, measured_s=s["rollout_s"] - (s.get("compile_s") or 0)))
    res = compare(sum(r["predicted_s"] for r in rows), sum(r["measured_s"] for r in rows), tolerance)
    return dict(res, steps=rows, arm=None if arm is None else str(arm))


def gpu_report(costs: GpuCosts, run: dict, arm_name="5x1x6") -> dict:
    """A gpu_tlt.py run's e2e rollouts predicted from ``costs`` against measured: mode off plain, the speculative
    modes with ``arm_name`` at each step's measured accept length (``failed`` where a cost is missing)."""
    out: dict = dict(costs=costs.data, tolerance=TOLERANCE, e2e_rollout={})
    for mode, rec in (run.get("e2e") or {}).items():
        if isinstance(rec, dict) and rec.get("steps"):
            try:
                arm = None if mode == "off" else parse_arm(f"eagle:{arm_name}")
                out["e2e_rollout"][mode] = validate_run(costs, rec, arm)
            except (KeyError, ValueError) as e:
                out["e2e_rollout"][mode] = dict(failed=str(e))
    return out


def print_table(rows: list[dict]) -> None:
    print("| model, TP | task: accept static / TLT | GPUs (engines) | plain rollout / step s | static: rollout x, "
          "step x | TLT: rollout x, step x | idle device-s: plain / TLT |\n" + "| --- " * 7 + "|")
    for r in rows:
        p, s, t = r["plain"], r["static"], r["tlt"]
        print(f"| {r['model']}, {r['tp']} | {r['task']}: {s['accept']:.2f} / {t['accept']:.2f} | {r['devices']} "
              f"({r['engines']}) | {p['rollout_s']:.0f} / {p['step_s']:.0f} | {s['rollout_speedup']:.2f}x, "
              f"{s['step_speedup']:.2f}x | {t['rollout_speedup']:.2f}x, {t['step_speedup']:.2f}x | "
              f"{p['idle_device_s']:.0f} / {t['idle_device_s']:.0f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--accept", default=str(ACCEPT), help="accept.py result: the EAGLE accept lengths (TLT's)")
    ap.add_argument("--drift", default=str(DRIFT), help="drafter_adaptation.py result: static / adaptive accept")
    ap.add_argument("--tasks", default="gsm_symbolic,arithmetic", help="accept.py tasks: a projection each")
    ap.add_argument("--tree", default="8x4x48", help="the EAGLE tree (TLT's default), at <= --threshold live rows")
    ap.add_argument("--threshold", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--devices", default="", help="pod sizes in GPUs (default the paper's: 7B 8-64, 32B 32, 64)")
    ap.add_argument("--seeds", default="0,1,2", help="length samples per pod size (figures: their mean)")
    ap.add_argument("--gpu_costs", default="", help="GPU-measured step costs (PATH or PATH#KEY; the format above)")
    ap.add_argument("--gpu_variant", default=None, help="with a suite.json: its decode variant (default the fastest)")
    ap.add_argument("--gpu_run", default="", help="with --gpu_costs: the gpu_tlt.py result to predict")
    ap.add_argument("--gpu_arm", default="5x1x6", help="tree of the speculative e2e modes in that check")
    ap.add_argument("--draft_s", type=float, default=H100.draft_s, help="drafting s per depth (default: paper-fitted)")
    ap.add_argument("--out", default=None, help="default results/pod_model.json (--gpu_costs: results/gpu/...)")
    a = ap.parse_args(argv)
    res = dict(command="python benchmarks/pod_model.py " + " ".join(sys.argv[1:] if argv is None else argv))
    if a.gpu_costs:
        res |= dict(inputs=dict(gpu_costs=a.gpu_costs, gpu_run=a.gpu_run, gpu_arm=a.gpu_arm))
        res |= gpu_report(load_costs(a.gpu_costs, a.gpu_variant), json.loads(Path(a.gpu_run).read_text()), a.gpu_arm)
        for mode, r in res["e2e_rollout"].items():
            print(f"e2e {mode}: " + (r["failed"] if "failed" in r else f"predicted {r['predicted']:.2f} s, measured "
                  f"{r['measured']:.2f} s ({100 * r['error']:+.1f} %, within +-15 %: {r['within']})"))
    else:
        files = [os.path.relpath(f, HERE.parent) for f in (a.accept, a.drift)]
        hw = H100._replace(draft_s=a.draft_s)
        print(f"draft_s = {1e3 * a.draft_s:.2f} ms of drafting per tree depth ({DRAFT_S_NOTE})")
        tasks, drift = a.tasks.split(","), measured_drift(a.drift)
        accept = {t: measured_accept(a.accept, a.tree, t, a.temperature) for t in tasks}
        print(f"accept lengths from {files[0]} (EAGLE {a.tree}, T = {a.temperature}): {accept}; static: {drift:.3f} x "
              f"those ({files[1]})")
        proj = dict(arm=parse_arm(f"eagle:{a.tree}"), threshold=a.threshold, seeds=[int(s) for s in a.seeds.split(",")],
                    hw=hw)
        res["inputs"] = dict(accept_file=files[0], accept=accept, temperature=a.temperature, drift_file=files[1],
                             static_over_fresh=drift, tree=a.tree, threshold=a.threshold, chunk_size=8,
                             steps_per_call=4, staleness_tau=10.0, run_steps=100, prompt_len=256, group=1,
                             lengths="log-normal, median 32768 / 8, sigma 1, the longest at 32768 (rollout_tail.py)",
                             draft_vocab=QWEN25_7B.draft_vocab, draft_s=a.draft_s, draft_s_note=DRAFT_S_NOTE,
                             hardware=hw._asdict())
        r = {f"{m.name}, TP {tp}": Roofline(m, hw, tp, 4096) for m, tp, _ in SETUPS}  # a verify step over a plain
        res["inputs"]["verify_over_plain_step_b1"] = {  # one, as the engine calls them (4 / 8 per call), 4,096 cached
            k: 2 * c.verify(1, 4096, 4, proj["arm"], accept[tasks[0]]) / c.decode(1, 4096, 8) for k, c in r.items()}
        res["rows"] = []
        for task, (model, tp, n) in ((t, setup) for t in tasks for setup in SETUPS):
            pods = [int(d) for d in a.devices.split(",")] if a.devices else sorted(PAPER_STEP_SPEEDUP[model.name])
            rows = projection_table(model, tp, n, (accept[task], accept[task] * drift), pods, **proj)
            res["rows"] += [dict(r, task=task) for r in rows]
        print_table(res["rows"])
    out = Path(a.out or HERE / "results" / ("gpu/pod_model_gpu.json" if a.gpu_costs else "pod_model.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
