"""Roofline step costs for 7B / 32B policies on GPU pods, and the pod-level projection of one RL step.

A forward over b rows x q tokens each, reading a cache of L positions, on a tensor-parallel group of tp GPUs costs
max(bytes / (HBM bandwidth x bw_eff), FLOPs / (peak x flop_eff)) + 2 x layers all-reduces (tp > 1), with bytes =
bf16 weights / tp + b x L x KV bytes per token / tp and FLOPs = (2 x params x b x q + 4 x layers x heads x head_dim
x b x q x L) / tp. The engine's calls are built from such forwards: a plain step (policy, plus the EAGLE layer that
kept the drafter cache current when a drafter is loaded, as the engine did when this model was validated; the engine
now runs that layer only at the next EAGLE verify and only for rows still live, so this charge is an upper bound),
a verify step (depth - 1 drafter forwards over top-k
tokens with the full LM head, a policy forward over the N-node tree, a drafter extend), prefill, compaction (a
gather of the dense KV rows), and one host round trip per call.
"""

from __future__ import annotations

import dataclasses
import statistics

import pod_sim_model as ps


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Transformer shape (bf16 weights and KV). Figures: the Hugging Face config.json of each model."""

    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def drafter_params(self) -> int:
        """TLT's EAGLE-2 drafter: one decoder layer + fc(2H -> H); embedding and LM head shared, frozen."""
        h, hd = self.hidden, self.head_dim
        attn = 2 * h * self.heads * hd + 2 * h * self.kv_heads * hd
        return attn + 3 * h * self.intermediate + 2 * h * h

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden


QWEN25_7B = ModelSpec("Qwen2.5-7B", 7.62e9, 28, 3584, 28, 4, 128, 152064, 18944)
QWEN25_32B = ModelSpec("Qwen2.5-32B", 32.8e9, 64, 5120, 40, 8, 128, 152064, 27648)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator. bw_eff 0.75: the paper's Table 2 (Qwen-7B, H100, batch 1, no SD: 164.65 tok/s = 6.07 ms per
    token) over the bf16 weight-read roofline (15.2 GB / 3.35 TB/s = 4.55 ms). draft_s 0.81 ms per tree-drafting
    forward: the paper's Qwen-32B, TP 4, batch-1 point (depth 10, top-4, 64 tokens: accept 8.29 at 3.51x, so a verify
    step costs 2.36 plain steps, the bare roofline 1.33). flop_eff, train_mfu, allreduce_s and roundtrip_s are
    assumptions (stated in benchmarks/README.md). verify_scale multiplies the policy's verify pass (1: the roofline;
    pod_sim_gpu.calibrated_hardware fits it, bw_eff and draft_s to GPU-measured costs)."""

    name: str
    hbm_bytes_s: float
    flops_s: float
    hbm_bytes: float
    bw_eff: float = 0.75
    flop_eff: float = 0.6
    train_mfu: float = 0.4
    allreduce_s: float = 8e-6
    roundtrip_s: float = 3e-4
    draft_s: float = 8.1e-4
    verify_scale: float = 1.0


H100 = Hardware("H100 SXM5 80GB (3.35 TB/s HBM3, 989 TFLOP/s dense bf16: NVIDIA datasheet)", 3.35e12, 989e12, 80e9)
H200 = Hardware("H200 SXM 141GB (4.8 TB/s HBM3e, 989 TFLOP/s dense bf16: NVIDIA datasheet)", 4.8e12, 989e12, 141e9)


@dataclasses.dataclass(frozen=True)
class Roofline:
    """StepCosts of one engine (a tp-GPU tensor-parallel group) for ``model`` on ``hw``."""

    model: ModelSpec
    hw: Hardware
    tp: int
    max_len: int
    drafter: bool = False

    def forward(self, b: int, q: float, length: int, weights: float, flops_params: float, attn: bool = True) -> float:
        m, hw = self.model, self.hw
        kv = b * length * m.kv_bytes_per_token if attn else 0.0
        byt = (weights + kv) / self.tp
        flops = 2 * flops_params * b * q + (4 * m.layers * m.heads * m.head_dim * b * q * length if attn else 0.0)
        t = max(byt / (hw.hbm_bytes_s * hw.bw_eff), flops / self.tp / (hw.flops_s * hw.flop_eff))
        return t + (2 * m.layers * hw.allreduce_s if self.tp > 1 and attn else 0.0)

    def policy(self, b: int, q: float, length: int) -> float:
        return self.forward(b, q, length, 2 * self.model.params, self.model.params)

    def drafter_fwd(self, b: int, q: float, head: bool) -> float:
        p = self.model.drafter_params + (self.model.head_params if head else 0)
        return self.forward(b, q, 0, 2 * p, p, attn=False)

    def prefill(self, batch, prompts, length):
        return self.policy(prompts, length, length) + self.hw.roundtrip_s

    def decode(self, batch, length, steps):
        step = self.policy(batch, 1, length) + (self.drafter_fwd(batch, 1, head=False) if self.drafter else 0.0)
        return steps * step + self.hw.roundtrip_s

    def verify(self, batch, length, steps, arm):
        draft = (arm.depth - 1) * self.drafter_fwd(batch, arm.topk, head=True)
        extend = self.drafter_fwd(batch, arm.accept, head=True)
        verify = self.hw.verify_scale * self.policy(batch, arm.verify_tokens, length)
        step = draft + verify + extend + arm.depth * self.hw.draft_s
        return steps * step + self.hw.roundtrip_s

    def compact(self, src, dst):
        return 2 * dst * self.max_len * self.model.kv_bytes_per_token / self.tp / (self.hw.hbm_bytes_s * self.hw.bw_eff)

    def max_rows(self, cap: int = 256) -> int:
        """Rows a dense slot-major KV cache of max_len positions fits in 90 % of HBM next to the weights."""
        m = self.model
        free = 0.9 * self.hw.hbm_bytes - 2 * (m.params + (m.drafter_params if self.drafter else 0)) / self.tp
        rows = int(free // (self.max_len * m.kv_bytes_per_token / self.tp))
        if rows < 1:
            raise ValueError(f"{m.name} on tp={self.tp} {self.hw.name}: no room for one {self.max_len}-token row")
        return min(rows, cap)


def train_seconds(model: ModelSpec, hw: Hardware, devices: int, tokens: float) -> float:
    """Old + reference log-probs (2 forwards) and one update (forward + backward): 10 x params FLOPs per token."""
    return 10 * model.params * tokens / (devices * hw.flops_s * hw.train_mfu)


def drafter_demand(model: ModelSpec, hw: Hardware, response_tokens: float) -> float:
    """Device-seconds of one pass of drafter training over a step's responses: the layer (6 x params per token) and
    the frozen LM head (target soft labels, forward and input gradient: 6 x vocab x hidden per token)."""
    return response_tokens * 6 * (model.drafter_params + model.head_params) / (hw.flops_s * hw.train_mfu)


DRAFTER_STEP_TOKENS = 8 * 256  # one drafter step's batch: the config defaults drafter.rows x drafter.row_len


def drafter_step_seconds(model: ModelSpec, hw: Hardware, tp: int, tokens: int = DRAFTER_STEP_TOKENS) -> float:
    """Seconds of one drafter step of ``tokens`` tokens on one engine's ``tp`` devices (as ``drafter_demand``)."""
    return drafter_demand(model, hw, float(tokens)) / tp


def spot_training(times: list[float], step_s: float) -> dict[str, float]:
    """What the built controller does with the engines' rollout times (``tlt_jax.controller.scheduler.simulate``):
    an engine that finished trains whole drafter steps while any engine decodes, the step in flight at the rollout's
    end finishes (the RL step waits for it: ``overhang_s``), none run after it (``steps_without_idle`` = 0)."""
    from tlt_jax.controller.scheduler import ControllerConfig, simulate

    _, m = simulate([t if t > 0 else None for t in times], step_s, ControllerConfig(steps_without_idle=0))
    return dict(train_engine_s=m["controller/train_s"], overhang_s=m["controller/overhang_s"],
                drafter_steps=m["controller/train_steps"])


def rollout(lengths, prompt_len: int, engines: int, policy: ps.Policy, costs: ps.StepCosts) -> tuple[float, list]:
    """Responses dealt round-robin to ``engines`` identical engines; (slowest engine's seconds, every engine's)."""
    times = []
    for e in range(min(engines, len(lengths))):
        mine = list(lengths[e::engines])
        times.append(ps.simulate(mine, [prompt_len] * len(mine), policy, costs).seconds)
    times += [0.0] * (engines - len(times))
    return max(times), times


def project(
    model: ModelSpec,
    hw: Hardware,
    tp: int,
    devices: int,
    lengths,
    prompt_len: int,
    arm: ps.Arm,
    staleness: ps.Staleness,
    threshold: int = 32,
    run_steps: int = 100,
    max_batch: int | None = None,
) -> dict:
    """One RL step's time without speculation, with a static drafter and with TLT (spot-trained drafter).
    max_batch: rows per wave (default: what a dense KV cache of the step's longest sequence fits in HBM)."""
    if devices % tp:
        raise ValueError(f"devices={devices} is not a multiple of the tensor-parallel size tp={tp}")
    engines = devices // tp
    max_len = prompt_len + int(max(lengths))
    tokens = float(sum(lengths)) + prompt_len * len(lengths)
    train_s = train_seconds(model, hw, devices, tokens)
    demand = drafter_demand(model, hw, float(sum(lengths)))
    out = dict(devices=devices, engines=engines, responses=len(lengths), train_s=train_s, drafter_demand_s=demand)
    for mode in ("plain", "static", "tlt"):
        costs = Roofline(model, hw, tp, max_len, drafter=mode != "plain")
        base = dict(max_batch=max_batch or costs.max_rows(), max_len=max_len, chunk_size=8, steps_per_call=4)
        accept = staleness.stale if mode == "static" else staleness.fresh
        stale = float("inf") if mode == "static" else 1.0
        for _ in range(4 if mode == "tlt" else 1):  # acceptance <-> idle time fixed point
            pol = (
                ps.Policy(**base)
                if mode == "plain"
                else ps.Policy(**base, threshold=threshold, arms=((1, dataclasses.replace(arm, accept=accept)),))
            )
            roll, times = rollout(lengths, prompt_len, engines, pol, costs)
            idle = sum(roll - t for t in times) * tp
            if mode != "tlt":
                break
            spot = spot_training(times, drafter_step_seconds(model, hw, tp))
            stale = ps.mean_staleness(spot["train_engine_s"] * tp, demand, run_steps)  # whole steps, as dispatched
            accept = staleness.accept(stale)
        extra = dict(spot, drafter_step_s=drafter_step_seconds(model, hw, tp)) if mode == "tlt" else {}
        out[mode] = dict(
            rollout_s=roll,
            step_s=roll + train_s + (spot["overhang_s"] if mode == "tlt" else 0.0),  # + the drafter step in flight
            idle_device_s=idle,
            **extra,
            max_batch=base["max_batch"],
            accept=accept if mode != "plain" else 1.0,
            staleness=stale if mode != "plain" else None,
        )
    for mode in ("static", "tlt"):
        out[mode]["rollout_speedup"] = out["plain"]["rollout_s"] / out[mode]["rollout_s"]
        out[mode]["step_speedup"] = out["plain"]["step_s"] / out[mode]["step_s"]
    out["rollout_share_plain"] = out["plain"]["rollout_s"] / out["plain"]["step_s"]
    return out


def projection_table(
    model: ModelSpec,
    tp: int,
    responses: int,
    cap: int,
    prompt_len: int,
    seeds=(0, 1, 2),
    device_counts=(8, 16, 32, 64, 128, 256, 512, 1024),
    hw: Hardware = H100,
    **kw,
) -> list[dict]:
    """project() for every device count, averaged over length samples (rollout_tail's log-normal, median cap/8)."""
    import rollout_tail as rt

    rows = []
    for p in device_counts:
        if p < tp:
            continue
        runs = [project(model, hw, tp, p, rt.tail_lengths(responses, cap, seed=s), prompt_len, **kw) for s in seeds]
        row = dict(model=model.name, tp=tp, devices=p, engines=p // tp, responses=responses)
        for key in ("train_s", "drafter_demand_s", "rollout_share_plain"):
            row[key] = statistics.mean(r[key] for r in runs)
        for mode in ("plain", "static", "tlt"):
            row[mode] = {
                k: (statistics.mean(r[mode][k] for r in runs) if runs[0][mode][k] is not None else None)
                for k in runs[0][mode]
            }
        rows.append(row)
    return rows


def sensitivity(devices: int = 64, seeds=(0, 1, 2), **kw) -> list[dict]:
    """TLT's step speedup at one pod size when one assumption changes (the reasons the projection differs from the
    paper): one wave per engine (a paged cache holding every request, as SGLang does), 7B on TP 1, flop_eff 0.8,
    threshold 8, a shorter length distribution (median max/16)."""
    import rollout_tail as rt

    out = []
    for model, tp, responses in ((QWEN25_7B, 4, 512), (QWEN25_32B, 8, 2048)):
        variants = {
            "as projected": {},
            "one wave per engine": dict(max_batch=responses // (devices // tp)),
            "flop_eff 0.8": dict(hw=dataclasses.replace(H100, flop_eff=0.8)),
            "threshold 8": dict(threshold=8),
        }
        if model is QWEN25_7B:
            variants["TP 1"] = dict(tp=1)
        for name, over in variants.items():
            args = dict(hw=H100, tp=tp) | kw | over
            runs = [
                project(
                    model, devices=devices, lengths=rt.tail_lengths(responses, 32768, seed=s), prompt_len=256, **args
                )
                for s in seeds
            ]
            out.append(
                dict(
                    model=model.name,
                    devices=devices,
                    variant=name,
                    plain_rollout_s=statistics.mean(r["plain"]["rollout_s"] for r in runs),
                    static_step_speedup=statistics.mean(r["static"]["step_speedup"] for r in runs),
                    tlt_rollout_speedup=statistics.mean(r["tlt"]["rollout_speedup"] for r in runs),
                    tlt_step_speedup=statistics.mean(r["tlt"]["step_speedup"] for r in runs),
                )
            )
    return out


def sd_speedup_check(
    model: ModelSpec, tp: int, batch: int, arm: ps.Arm, length: int = 2048, hw: Hardware = H100
) -> float:
    """Decode-only SD speedup the roofline predicts for a fixed batch (the paper's Tables 2 and 4 set-up)."""
    c = Roofline(model, hw, tp, length, drafter=True)
    plain = Roofline(model, hw, tp, length).decode(batch, length, 1)
    return float(arm.accept * plain / c.verify(batch, length, 1, arm))


def verify_step_cost(
    model: ModelSpec,
    tp: int,
    arm: ps.Arm,
    length: int,
    batch: int = 1,
    chunk_size: int = 8,
    steps_per_call: int = 4,
    hw: Hardware = H100,
) -> dict:
    """One verify step against one plain step as the engine calls them (a call of ``steps_per_call`` verify steps,
    a plain chunk of ``chunk_size`` steps, a host round trip each), and the decode speedup at ``arm.accept``."""
    spec = Roofline(model, hw, tp, length, drafter=True).verify(batch, length, steps_per_call, arm) / steps_per_call
    plain = Roofline(model, hw, tp, length).decode(batch, length, chunk_size) / chunk_size
    return dict(
        model=model.name,
        tp=tp,
        length=length,
        batch=batch,
        tree=arm.name,
        accept=arm.accept,
        verify_over_plain=spec / plain,
        speedup=arm.accept * plain / spec,
    )
