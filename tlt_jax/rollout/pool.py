"""Compiled-step pool: every jitted step is keyed by (phase, batch bucket, length bucket, arm[, extra]), compiled
once (lazily on first use, or ahead of time from abstract arguments), and kept under a count budget with LRU
eviction. Counters (compiles, compile seconds, hits, misses, evictions) go into the rollout stats.

The pool does not know what a step computes: a builder registered per (phase, arm) turns a key into a ``jax.jit``
function, so a speculative arm adds its own builders beside the plain ones.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax

Builder = Callable[["StepKey"], Callable]


@dataclasses.dataclass(frozen=True, order=True)
class StepKey:
    """phase: "prefill" | "decode" | "compact" | ...; batch: output batch bucket; length: cache-length bucket
    (prompt bucket for prefill); arm: "plain" or a speculative arm; extra: anything else the shape depends on
    (e.g. the prefill batch or the source batch of a compaction)."""

    phase: str
    batch: int
    length: int
    arm: str = "plain"
    extra: tuple = ()


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays, for ahead-of-time lowering."""

    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


class StepPool:
    """LRU pool of compiled executables; ``get(key, *args)`` compiles on a miss from the arguments' shapes.

    compiler_options go to every ``.compile()`` (e.g. {"xla_backend_optimization_level": 0} for fast CPU tests).
    """

    def __init__(self, budget: int = 64, compiler_options: dict[str, Any] | None = None):
        if budget < 1:
            raise ValueError(f"pool_budget must be >= 1, got {budget}")
        self.budget = budget
        self.compiler_options = dict(compiler_options or {})
        self._builders: dict[tuple[str, str], Builder] = {}
        self._compiled: collections.OrderedDict[StepKey, Any] = collections.OrderedDict()
        self.compiles = 0
        self.compile_seconds = 0.0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def register(self, phase: str, arm: str, builder: Builder) -> None:
        """Builder for every key with this (phase, arm): key -> jitted function (not yet compiled)."""
        self._builders[(phase, arm)] = builder

    def has_builder(self, phase: str, arm: str) -> bool:
        return (phase, arm) in self._builders

    def __contains__(self, key: StepKey) -> bool:
        return key in self._compiled

    def __len__(self) -> int:
        return len(self._compiled)

    def keys(self) -> list[StepKey]:
        return list(self._compiled)

    def compile(self, key: StepKey, *abstract_args) -> Any:
        """Compile ``key`` ahead of time from abstract arguments (no-op if already pooled)."""
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        builder = self._builders.get((key.phase, key.arm))
        if builder is None:
            raise KeyError(f"no step builder registered for phase {key.phase!r}, arm {key.arm!r}")
        t0 = time.perf_counter()
        exe = builder(key).lower(*abstract(abstract_args)).compile(compiler_options=self.compiler_options or None)
        self.compile_seconds += time.perf_counter() - t0
        self.compiles += 1
        self._compiled[key] = exe
        while len(self._compiled) > self.budget:
            self._compiled.popitem(last=False)
            self.evictions += 1
        return exe

    def get(self, key: StepKey, *args) -> Any:
        """The compiled step for ``key`` (counts a hit, or a miss followed by a compile from ``args``' shapes)."""
        if key in self._compiled:
            self.hits += 1
            self._compiled.move_to_end(key)
            return self._compiled[key]
        self.misses += 1
        return self.compile(key, *args)

    def counters(self) -> dict[str, Any]:
        return dict(
            compiles=self.compiles,
            compile_seconds=round(self.compile_seconds, 4),
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
            size=len(self._compiled),
            budget=self.budget,
        )
