"""Host-side controller: sliced rollout (one engine per mesh slice), the busy / idle / training state machine,
drafter dispatch on idle slices and the per-step timeline."""

from tlt_jax.controller.controller import TIMELINE_FILE, Controller
from tlt_jax.controller.scheduler import BUSY, IDLE, TRAINING, ControllerConfig, SliceScheduler, simulate
from tlt_jax.controller.slices import SlicedRollout, SliceJob, assign_prompts, merge_results

__all__ = [
    "BUSY",
    "IDLE",
    "TIMELINE_FILE",
    "TRAINING",
    "Controller",
    "ControllerConfig",
    "SliceJob",
    "SliceScheduler",
    "SlicedRollout",
    "assign_prompts",
    "merge_results",
    "simulate",
]
