"""The run's memory and collective plan, compiled ahead of time from abstract state (no weights are loaded).

    python -m tlt_jax.plan --config=configs/qwen2p5_7b_gsm8k.py --shape=qwen2.5-7b --devices=8 [--json=PATH]

``plan_run(cfg, mesh)`` compiles the train step, the log-prob pass, the rollout engine's decode and verify steps (and
the online drafter's step) on the run's mesh and returns a :class:`Plan`: per-device argument, temporary and
collective bytes per step, the resident state, the peak and whether it fits. ``startup_check`` is the main job's
use of it (``train.plan_check``). See ``core`` (the steps, the peak), ``abstract`` (the abstract state) and ``hlo``
(collective bytes from the compiled HLO text).
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
