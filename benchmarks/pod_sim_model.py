"""Discrete-event model of one RL step on a pod: the rollout engine's policy, step costs, acceptance, spot training.

The rollout model replays ``tlt_jax.rollout.engine``'s host loop on per-request lengths instead of a model: a wave of
at most ``max_batch`` rows is prefilled, then runs K-step plain chunks (early exit when every row is done); after each
chunk finished rows leave and the survivors are compacted into the smallest batch bucket that holds them; once at most
``threshold`` rows are live a chunk is a speculative call of up to ``steps_per_call`` verify steps, each emitting
``accept`` tokens per row on average (a fluid approximation: a row's remaining tokens shrink by ``accept`` per verify);
every call reads the cache-length bucket covering its longest live row, as the engine does. Costs come from a
``StepCosts``: measured tables (``TableCosts``, filled by ``pod_sim_measure``) or a roofline
(``pod_sim_roofline.Roofline``). The drafter's acceptance falls with its staleness (policy updates since the data it
was trained on): ``Staleness`` and ``mean_staleness``.

This module imports nothing from the other ``pod_sim_*`` modules; they import it, and ``pod_sim.py`` (the command
line) imports them all.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tlt_jax, also when run as a script

from tlt_jax.rollout import buckets as bk  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Arm:
    """A speculative tree and the tokens it emits per verify step and row (bonus included)."""

    depth: int
    topk: int
    verify_tokens: int
    accept: float

    def __post_init__(self):
        if self.accept < 1.0:
            raise ValueError(f"Arm.accept is tokens emitted per verify (bonus included), so >= 1; got {self.accept}")
        if min(self.depth, self.topk, self.verify_tokens) < 1:
            raise ValueError(f"Arm depth/topk/verify_tokens must be >= 1, got {self}")

    @property
    def name(self) -> str:
        return f"{self.depth}x{self.topk}x{self.verify_tokens}"


@dataclasses.dataclass(frozen=True)
class Policy:
    """The engine's scheduling policy (RolloutEngine arguments of the same names).

    arms: ((min_live, Arm), ...) ascending min_live: a speculative chunk with n live rows uses the arm with the largest
    min_live <= n (one entry = the engine's single compiled tree; several = a TLT-style batch-size schedule).
    threshold: speculative chunks once at most this many rows are live (0 = never)."""

    max_batch: int = 64
    max_len: int = 1024
    chunk_size: int = 8
    batch_buckets: tuple[int, ...] = bk.DEFAULT_BATCH_BUCKETS
    length_buckets: tuple[int, ...] | None = None
    compaction: bool = True
    threshold: int = 0
    steps_per_call: int = 4
    arms: tuple[tuple[int, Arm], ...] = ()

    def __post_init__(self):
        if self.chunk_size < 1 or self.steps_per_call < 1:
            raise ValueError("Policy.chunk_size and steps_per_call must be >= 1")
        if self.threshold and not self.arms:
            raise ValueError("Policy.threshold > 0 needs at least one speculative arm: pass arms=((1, Arm(...)),)")
        if self.arms and (self.arms[0][0] != 1 or list(self.arms) != sorted(self.arms, key=lambda a: a[0])):
            raise ValueError(
                "Policy.arms must be sorted by min_live and start at min_live=1 (each live count needs an arm)"
            )

    @property
    def batches(self) -> tuple[int, ...]:
        return bk.batch_buckets(self.max_batch, self.batch_buckets)

    @property
    def lengths(self) -> tuple[int, ...]:
        return bk.length_buckets(self.max_len, self.length_buckets)

    def arm_for(self, live: int) -> Arm | None:
        """The speculative arm for a chunk with ``live`` rows, None for a plain chunk (the engine's arm_for)."""
        if not self.threshold or live > self.threshold:
            return None
        return [a for m, a in self.arms if m <= live][-1]


class StepCosts(Protocol):
    """Seconds of each compiled call the engine makes (one host round trip each)."""

    def prefill(self, batch: int, prompts: int, length: int) -> float: ...

    def decode(self, batch: int, length: int, steps: int) -> float: ...

    def verify(self, batch: int, length: int, steps: int, arm: Arm) -> float: ...

    def compact(self, src: int, dst: int) -> float: ...


@dataclasses.dataclass
class TableCosts:
    """Measured costs: a call of s steps costs fixed + s * per_step (two points measured per key), prefill and
    compaction one figure per key. Keys: ("decode", batch, length) / ("verify", batch, length, arm name)."""

    steps: dict[tuple, tuple[float, float]] = dataclasses.field(default_factory=dict)
    prefills: dict[tuple[int, int, int], float] = dataclasses.field(default_factory=dict)
    compactions: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)

    def _get(self, table: dict, key: tuple) -> float | tuple[float, float]:
        if key not in table:
            raise KeyError(f"no measured cost for {key}; measure every key simulate() lists in Trace.keys first")
        return table[key]

    def prefill(self, batch, prompts, length):
        return self._get(self.prefills, (batch, prompts, length))

    def decode(self, batch, length, steps):
        fixed, per = self._get(self.steps, ("decode", batch, length))
        return fixed + steps * per

    def verify(self, batch, length, steps, arm):
        fixed, per = self._get(self.steps, ("verify", batch, length, arm.name))
        return fixed + steps * per

    def compact(self, src, dst):
        return self._get(self.compactions, (src, dst))


@dataclasses.dataclass
class Trace:
    """What a simulated rollout spent: seconds by part, per batch bucket, the speculative share, and the set of cost
    keys it used (so a calibration measures exactly those)."""

    seconds: float = 0.0
    prefill_s: float = 0.0
    plain_s: float = 0.0
    spec_s: float = 0.0
    compact_s: float = 0.0
    chunks: int = 0
    verify_steps: int = 0
    tokens: float = 0.0
    spec_tokens: float = 0.0
    switch_s: list[float] = dataclasses.field(default_factory=list)
    by_batch: dict[int, float] = dataclasses.field(default_factory=dict)
    keys: set[tuple] = dataclasses.field(default_factory=set)

    def add(self, other: Trace) -> None:
        for f in ("prefill_s", "plain_s", "spec_s", "compact_s", "chunks", "verify_steps", "tokens", "spec_tokens"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.switch_s += [self.seconds + s for s in other.switch_s]
        self.seconds += other.seconds
        for b, s in other.by_batch.items():
            self.by_batch[b] = self.by_batch.get(b, 0.0) + s
        self.keys |= other.keys


def simulate_wave(
    max_new: Sequence[int], prompt_lens: Sequence[int], policy: Policy, costs: StepCosts, group: int = 1
) -> Trace:
    """One wave (<= max_batch rows; ``group`` consecutive rows share a prompt, the GRPO fork). max_new counts every
    generated token including the prefill's first one, as SamplingParams.max_new_tokens does."""
    r = len(max_new)
    if not 1 <= r <= policy.max_batch:
        raise ValueError(f"a wave holds 1..max_batch={policy.max_batch} rows, got {r}")
    cap = np.asarray(max_new, np.float64)
    plen = np.asarray(prompt_lens, np.float64)
    if cap.min() < 1 or plen.min() < 1 or (plen + cap).max() > policy.max_len:
        raise ValueError("every row needs max_new >= 1, a prompt >= 1 token, and prompt + max_new <= max_len")
    tr = Trace()
    batches, lengths, k = policy.batches, policy.lengths, policy.chunk_size
    b = bk.pick(batches, r)
    prompts = bk.pick(batches, -(-r // group))
    p_bucket = bk.pick(lengths, int(plen.max()))
    tr.keys.add(("prefill", b, prompts, p_bucket))
    t = costs.prefill(b, prompts, p_bucket)
    tr.prefill_s = t
    gen = np.ones(r)  # the prefill emits each row's first token
    spec_on = False
    while True:
        live = gen < cap - 1e-9
        n_live = int(live.sum())
        if n_live == 0:
            break
        if policy.compaction and bk.pick(batches, n_live) < b:
            nb = bk.pick(batches, n_live)
            tr.keys.add(("compact", b, nb))
            dt = costs.compact(b, nb)
            t, tr.compact_s = t + dt, tr.compact_s + dt
            cap, plen, gen, b = cap[live], plen[live], gen[live], nb
            live = np.ones(n_live, bool)
        arm = policy.arm_for(n_live)
        if arm is not None and not spec_on:
            spec_on = True
            tr.switch_s.append(t)
        rem = (cap - gen)[live]
        per_step = 1.0 if arm is None else arm.accept
        calls = np.ceil(rem / per_step - 1e-9)  # steps each live row still needs
        steps_max = k if arm is None else policy.steps_per_call
        ahead = k - 1 if arm is None else (policy.steps_per_call - 1) * (arm.depth + 1)
        committed = plen + gen - 1
        need = int(np.max(np.minimum(committed + ahead, plen + cap - 1)[live]))
        length = bk.pick(lengths, max(math.ceil(need - 1e-9), 1))
        # Jump over the run of identical chunks: nobody finishes and the length bucket stays the same.
        same_rows = int((calls.min() - 1) // steps_max)
        same_len = int((length - need) // (steps_max * per_step)) + 1
        reps = max(1, min(same_rows, same_len))
        steps = min(steps_max, int(calls.max())) if reps == 1 else steps_max
        if arm is None:
            tr.keys.add(("decode", b, length))
            dt = costs.decode(b, length, steps)
            tr.plain_s += dt * reps
        else:
            tr.keys.add(("verify", b, length, arm.name))
            dt = costs.verify(b, length, steps, arm)
            tr.spec_s += dt * reps
            tr.verify_steps += steps * reps
        adv = np.minimum(cap - gen, steps * reps * per_step)
        adv[~live] = 0.0
        if arm is not None:
            tr.spec_tokens += float(adv.sum())
        gen = gen + adv
        t += dt * reps
        tr.chunks += reps
        tr.by_batch[b] = tr.by_batch.get(b, 0.0) + dt * reps
    tr.seconds = t
    tr.tokens = float(np.sum(np.asarray(max_new, np.float64)))
    return tr


def simulate(
    max_new: Sequence[int], prompt_lens: Sequence[int], policy: Policy, costs: StepCosts, group: int = 1
) -> Trace:
    """An engine's generate call: consecutive waves of at most max_batch rows (rows in request order)."""
    if len(max_new) != len(prompt_lens) or not max_new:
        raise ValueError(f"max_new ({len(max_new)}) and prompt_lens ({len(prompt_lens)}) need one entry per row")
    total = Trace()
    for w in range(0, len(max_new), policy.max_batch):
        sl = slice(w, w + policy.max_batch)
        total.add(simulate_wave(max_new[sl], prompt_lens[sl], policy, costs, group))
    return total


# ---- acceptance vs staleness, spot training -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Staleness:
    """Acceptance of a drafter trained on data s policy updates old: stale + (fresh - stale) * exp(-(s - 1) / tau).
    s = 1 is TLT's steady state (trained in step t's idle time, used in step t + 1); s -> inf is a static drafter."""

    fresh: float = 6.53
    stale: float = 4.59
    tau: float = 10.0

    def accept(self, s: float) -> float:
        if s < 1:
            raise ValueError(f"staleness counts policy updates since the drafter's data, >= 1; got {s}")
        if not math.isfinite(s):
            return self.stale
        return self.stale + (self.fresh - self.stale) * math.exp(-(s - 1) / self.tau)


def mean_staleness(idle_s: float, demand_s: float, run_steps: int) -> float:
    """Mean staleness over a run when each step's idle device-seconds buy idle/demand of the pass over one step's
    data that keeps the drafter one update behind: with a shortfall the lag grows by 1 - idle/demand per step."""
    if demand_s <= 0 or idle_s >= demand_s:
        return 1.0
    behind = 1.0 - idle_s / demand_s
    return 1.0 + behind * (run_steps - 1) / 2.0


def scale_accept(arms: Sequence[tuple[int, Arm]], accept_at: Callable[[Arm], float]) -> tuple[tuple[int, Arm], ...]:
    """The same schedule with each arm's acceptance replaced by accept_at(arm)."""
    return tuple((m, dataclasses.replace(a, accept=accept_at(a))) for m, a in arms)
