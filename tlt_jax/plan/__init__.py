"""The run's memory and collective plan, compiled ahead of time from abstract state (no weights are loaded).

    python -m tlt_jax.plan --config=configs/qwen2p5_7b_gsm8k.py --shape=qwen2.5-7b --target=h100:1x8 [--json=PATH]
    python -m tlt_jax.plan --config=... --devices=8    # XLA:CPU over 8 simulated devices

``plan_run(cfg, mesh)`` compiles every program the run executes on the run's mesh (per engine: prefill, decode,
verify, compact, the online drafter's step; globally: reshard, train, log-prob passes) and returns a :class:`Plan`:
per-device argument, temporary and collective bytes per step, the resident buffers, the peak per phase and whether it
fits. ``startup_check`` is the main job's use of it (``train.plan_check``). See ``core`` (the programs),
``rollout`` (the engine's steps and reachable keys), ``report`` (the figures and phases), ``abstract`` (the abstract
state), ``hlo`` (collective bytes from the compiled HLO text) and ``targets`` (compile-only GPUs and TPUs).
"""

from tlt_jax.plan.abstract import SHAPES
from tlt_jax.plan.core import BF16_TEMPS, GB, MEMORY_FRACTION, Plan, StepPlan, device_budget, plan_run, startup_check
from tlt_jax.plan.hlo import COLLECTIVES, CollectiveStats, collective_stats, shape_bytes

__all__ = [
    "BF16_TEMPS",
    "COLLECTIVES",
    "GB",
    "MEMORY_FRACTION",
    "SHAPES",
    "CollectiveStats",
    "Plan",
    "StepPlan",
    "collective_stats",
    "device_budget",
    "plan_run",
    "shape_bytes",
    "startup_check",
]
