"""The compile plan of an adaptive rollout: every decode / verify step a (arm, batch bucket) the bandit can choose may
run, times every cache-length bucket, as (StepKey, abstract-argument thunk) pairs for ``StepPool.precompile``.

The engine supplies the abstract arguments (its decode state and, for host-drafted n-gram trees, the [B, N] tree
arrays), so this module knows the pool's key convention only: "decode" steps of arm "plain", "verify" steps of the
arm's ``pool_name``. Compaction steps do not depend on the arm and stay the engine's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from tlt_jax.adaptive.arms import Arm
from tlt_jax.adaptive.bandit import BanditConfig
from tlt_jax.rollout.pool import StepKey


def step_key(arm: Arm, batch: int, length: int) -> StepKey:
    """The pool key of one decode (arm "off") or verify step."""
    if arm.speculative:
        return StepKey("verify", int(batch), int(length), arm.pool_name)
    return StepKey("decode", int(batch), int(length), "plain")


def reachable_plan(
    config: BanditConfig,
    batch_buckets: Sequence[int],
    length_buckets: Sequence[int],
    threshold: int,
    abstract_args: Callable[[Arm, int, int], tuple],
    compaction: bool = True,
) -> list[tuple[StepKey, Callable[[], tuple]]]:
    """(key, thunk) for every reachable (arm, batch bucket) (``BanditConfig.reachable``) and length bucket;
    ``abstract_args(arm, batch, length)`` gives the step's abstract arguments and is called only for keys the pool
    does not hold yet."""
    plan = []
    for arm, b in config.reachable(batch_buckets, threshold, compaction):
        for length in sorted(int(x) for x in length_buckets):
            plan.append((step_key(arm, b, length), functools.partial(abstract_args, arm, b, length)))
    return plan
