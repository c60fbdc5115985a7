"""Compiled-step pool: every jitted step is keyed by (phase, batch bucket, length bucket, arm[, extra]), compiled
once (lazily on first use, ahead of time from abstract arguments, or in the background on the pool's worker thread
while the caller runs something already compiled, or only once the caller is idle: ``hold`` / ``release``), and kept
under a count budget and an optional byte budget with LRU eviction. Counters (compiles, compile seconds, hits,
misses, evictions, bytes) go into the rollout stats.

The pool does not know what a step computes: a builder registered per (phase, arm) turns a key into a ``jax.jit``
function, so a speculative arm adds its own builders beside the plain ones.

Bytes of a pooled step: what the executable holds while it sits in the pool, i.e. its generated code (device + host,
from ``compiled.memory_analysis()``). Arguments and outputs belong to the caller and temporaries are allocated per run,
so neither counts. Backends that report no code size (XLA:CPU in jax 0.10.2 reports 0) get an estimate: the length
of the optimised HLO text, which grows with the program and, unlike the serialised executable (7x larger when freshly
compiled than when loaded from the persistent compilation cache), does not depend on how the executable was obtained.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax

from tlt_jax.adaptive.quiet import busy

Builder = Callable[["StepKey"], Callable]

# The worker thread's nice value (Linux), since on a CPU backend a background compile and the caller's decoding share
# the cores. The worker traces and lowers; XLA compiles a large program mostly on threads of its own (created at the
# priority of the thread that first compiled), which ``lower_compile_threads`` nices too (docs/architecture.md §4.5).
BACKGROUND_NICE = 19

# XLA:CPU runs programs on its "tf_XLAEigen" pool and the calling thread. Its compile threads are unnamed (they keep
# the process's name) or LLVM's "llvm-worker-N"; Python's own threads are unnamed too, and are left alone.
_COMPILE_THREAD_PREFIXES = ("llvm-worker",)
COMPILE = "compile"  # the kind ``thread_kinds`` gives XLA's compile threads


def lower_thread_priority() -> None:
    """Run the calling thread at BACKGROUND_NICE (Linux only: there a thread id takes a nice value of its own)."""
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def thread_kinds() -> dict[int, str]:
    """{thread id: kind} of this process's threads (Linux; {} elsewhere): a Python thread's name; COMPILE for a
    native thread that is unnamed (named as the process) or an LLVM worker, i.e. XLA's compile threads; otherwise
    the native thread's own name without its number (e.g. "tf_XLAEigen", XLA's execution pool)."""
    task = "/proc/self/task"
    try:
        with open("/proc/self/comm") as f:
            process_name = f.read().strip()
        tids = [int(t) for t in os.listdir(task)]
    except OSError:
        return {}
    python = {t.native_id: t.name for t in threading.enumerate()}
    kinds = {}
    for tid in tids:
        if tid in python:
            kinds[tid] = python[tid]
            continue
        try:
            with open(f"{task}/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        compile_thread = name == process_name or name.startswith(_COMPILE_THREAD_PREFIXES)
        kinds[tid] = COMPILE if compile_thread else name.rstrip("0123456789-_")
    return kinds


def lower_compile_threads() -> int:
    """Run XLA's compile threads (``thread_kinds``: COMPILE) at BACKGROUND_NICE, on a CPU backend; XLA's execution
    threads and every Python thread keep their priority. A compile in place then runs at that priority too, which
    costs nothing while the caller waits for it. Returns how many threads were lowered now."""
    if sys.platform != "linux" or jax.default_backend() != "cpu":
        return 0
    lowered = 0
    for tid, kind in thread_kinds().items():
        try:
            if kind == COMPILE and os.getpriority(os.PRIO_PROCESS, tid) < BACKGROUND_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
                lowered += 1
        except OSError:  # the thread ended meanwhile
            continue
    return lowered


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


def executable_bytes(exe: Any) -> tuple[int, str]:
    """(bytes, source) of a compiled executable: generated code from ``memory_analysis()`` ("measured"), or where the
    backend reports none, the length of its optimised HLO text ("estimate")."""
    try:
        stats = exe.memory_analysis()
    except Exception:  # backends without memory statistics
        stats = None
    code = 0
    if stats is not None:
        code = int(getattr(stats, "generated_code_size_in_bytes", 0) or 0)
        code += int(getattr(stats, "host_generated_code_size_in_bytes", 0) or 0)
    if code > 0:
        return code, "measured"
    return len(exe.as_text().encode()), "estimate"


class StepPool:
    """LRU pool of compiled executables; ``get(key, *args)`` compiles on a miss from the arguments' shapes.

    budget: most executables kept. max_bytes: most bytes kept (None = no byte bound; see the module docstring for
    what counts). An executable larger than max_bytes on its own is still kept (the rollout needs it) and evicts
    everything else; ``oversized`` counts those. compiler_options go to every ``.compile()`` (e.g.
    {"xla_backend_optimization_level": 0} for fast CPU tests). sizer: bytes of an executable, default
    ``executable_bytes`` (tests pass their own).
    """

    def __init__(
        self,
        budget: int = 64,
        compiler_options: dict[str, Any] | None = None,
        max_bytes: int | None = None,
        sizer: Callable[[Any], tuple[int, str]] = executable_bytes,
    ):
        if budget < 1:
            raise ValueError(f"pool_budget must be >= 1, got {budget}")
        if max_bytes is not None and (int(max_bytes) != max_bytes or max_bytes < 1):
            raise ValueError(f"pool max_bytes must be an integer >= 1 or None (no byte bound), got {max_bytes}")
        self.budget = budget
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.compiler_options = dict(compiler_options or {})
        self._sizer = sizer
        self._builders: dict[tuple[str, str], Builder] = {}
        self._compiled: collections.OrderedDict[StepKey, Any] = collections.OrderedDict()
        self._bytes: dict[StepKey, int] = {}
        self.bytes = 0
        self.peak_bytes = 0
        self.estimated = 0  # executables whose size is an estimate (the backend reported none)
        self.oversized = 0
        self.compiles = 0
        self.compile_seconds = 0.0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._ran: set[StepKey] = set()
        self._pending: dict[StepKey, concurrent.futures.Future] = {}
        self._args: dict[StepKey, tuple] = {}  # abstract arguments of the pending and deferred keys
        self._deferred: list[StepKey] = []  # background compiles held back until ``release``
        self._held = False
        self.activity = None  # a sliced rollout's Activity (its compiles disturb the other slices' timings)
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self.background_compiles = 0
        self.background_seconds = 0.0

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

    def nbytes(self, key: StepKey) -> int:
        """Bytes counted for a pooled key."""
        return self._bytes[key]

    def compile(self, key: StepKey, *abstract_args) -> Any:
        """Compile ``key`` ahead of time from abstract arguments (no-op if already pooled)."""
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        exe, seconds = self._build(key, abstract(abstract_args))
        return self._install(key, exe, seconds)

    def _build(self, key: StepKey, abstract_args: tuple, background: bool = False) -> tuple[Any, float]:
        """(executable, seconds): lowering and compiling only, no pool state (it runs on the worker thread too)."""
        builder = self._builders.get((key.phase, key.arm))
        if builder is None:
            raise KeyError(f"no step builder registered for phase {key.phase!r}, arm {key.arm!r}")
        t0 = time.perf_counter()
        with busy(self.activity, self):  # other slices' timings taken meanwhile are disturbed (adaptive/quiet.py)
            lowered = builder(key).lower(*abstract_args)
            if background:
                lower_compile_threads()  # XLA creates its compile threads lazily: lowered before each background one
            exe = lowered.compile(compiler_options=self.compiler_options or None)
        return exe, time.perf_counter() - t0

    def _install(self, key: StepKey, exe: Any, seconds: float, background: bool = False) -> Any:
        """Pool ``exe``; ``seconds`` count as the caller's compile time unless the compile ran in the background."""
        if background:
            self.background_compiles += 1
            self.background_seconds += seconds
        else:
            self.compile_seconds += seconds
        self.compiles += 1
        size, source = self._sizer(exe)
        self.estimated += source != "measured"
        self._compiled[key] = exe
        self._bytes[key] = int(size)
        self.bytes += int(size)
        if self.max_bytes is not None and size > self.max_bytes:
            self.oversized += 1
        while len(self._compiled) > 1 and (len(self._compiled) > self.budget or self._over_bytes()):
            old, _ = self._compiled.popitem(last=False)
            self.bytes -= self._bytes.pop(old)
            self._ran.discard(old)
            self.evictions += 1
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return exe

    def prepare(self, key: StepKey, make_args: Callable[[], tuple]) -> bool:
        """Whether ``key`` is pooled, i.e. runs without a compile on the caller's thread. If not, its compile (from
        the shapes of ``make_args()``) starts on the pool's worker thread (lowest CPU priority, XLA's compile threads
        too), once; while the pool is held, at ``release``. Finished background compiles enter the pool only in
        ``collect`` or ``get``, on the caller's thread, so the pool never changes under it: call ``collect`` first
        to see them."""
        if key in self._compiled:
            return True
        if key not in self._pending and key not in self._args:
            self._args[key] = abstract(make_args())
            if self._held:
                self._deferred.append(key)
            else:
                self._submit(key)
        return False

    def _submit(self, key: StepKey) -> None:
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="step-compile", initializer=lower_thread_priority
            )
        self._pending[key] = self._worker.submit(self._build, key, self._args[key], True)

    def hold(self) -> None:
        """Start no background compile until ``release``: ``prepare`` defers them, and those queued but not started
        go back to waiting (one already running finishes). For callers whose host CPU is busy meanwhile: a compile's
        tracing and lowering hold the GIL, which the caller's own Python (dispatch, host round trips) then waits for."""
        self._held = True
        for key, fut in list(self._pending.items()):
            if fut.cancel():
                del self._pending[key]
                self._deferred.append(key)

    def release(self) -> None:
        """Queue the compiles deferred since ``hold`` on the worker thread, in the order they were asked for."""
        self._held = False
        deferred, self._deferred = self._deferred, []
        for key in deferred:
            self._submit(key)

    @property
    def held(self) -> bool:
        return self._held

    @property
    def deferred(self) -> int:
        """Background compiles asked for while held, not started yet."""
        return len(self._deferred)

    def collect(self, wait: bool = False) -> None:
        """Pool the background compiles that have finished (``wait``: all of them, waiting for those still running).
        A background compile's error is raised here."""
        for key, fut in list(self._pending.items()):
            if wait or fut.done():
                del self._pending[key]
                self._args.pop(key, None)
                exe, seconds = fut.result()
                if key not in self._compiled:  # not compiled meanwhile on the caller's thread (``compile``)
                    self._install(key, exe, seconds, background=True)

    def close(self) -> None:
        """Stop the worker thread: background compiles not started are dropped, the running one is waited for, and
        none not yet collected enters the pool (a later ``prepare`` starts a new worker)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)
            self._worker = None
        self._pending.clear()
        self._deferred.clear()
        self._args.clear()

    @property
    def compiling(self) -> bool:
        """Whether a background compile is queued, running or finished but not yet collected (deferred ones are not
        compiling: ``outstanding``)."""
        return bool(self._pending)

    @property
    def outstanding(self) -> bool:
        """Whether a background compile was asked for and is not pooled yet (compiling or deferred)."""
        return bool(self._pending or self._deferred)

    def first_run(self, key: StepKey) -> bool:
        """Whether the pooled step ``key`` is about to run for the first time (and marks it run). A first execution
        pays one-off costs (``benchmarks/results/first_run_cost_smollm2_cpu.json``), so a timing of it says little
        about the step's speed."""
        first = key not in self._ran
        self._ran.add(key)
        return first

    def _over_bytes(self) -> bool:
        return self.max_bytes is not None and self.bytes > self.max_bytes

    def get(self, key: StepKey, *args) -> Any:
        """The compiled step for ``key`` (counts a hit, or a miss followed by a compile from ``args``' shapes; a key
        queued on the worker thread but not started compiles here rather than after the queue ahead of it)."""
        if key in self._compiled:
            self.hits += 1
            self._compiled.move_to_end(key)
            return self._compiled[key]
        self.misses += 1
        if key in self._deferred:  # deferred: compiles here, now
            self._deferred.remove(key)
        self._args.pop(key, None)
        fut = self._pending.pop(key, None)
        if fut is not None and not fut.cancel():  # compiling in the background: wait for it (the wait is compile time)
            t0 = time.perf_counter()
            exe, seconds = fut.result()
            self._install(key, exe, 0.0, background=True)
            self.background_seconds += seconds
            self.compile_seconds += time.perf_counter() - t0
            return exe
        return self.compile(key, *args)

    def precompile(self, plan: Iterable[tuple[StepKey, Callable[[], tuple]]]) -> dict[str, Any]:
        """Compile every (key, abstract-args thunk) of ``plan`` (e.g. each reachable (arm, bucket) × length bucket;
        the thunk builds the abstract arguments only for keys not yet pooled). Returns keys, compiled (new),
        bytes (of the plan's keys still pooled), evicted (plan keys pushed out again: the plan does not fit the
        budgets, so the rollout would recompile; raise pool_budget / max_bytes or reach fewer arms)."""
        keys, compiled = [], 0
        for key, make_args in plan:
            keys.append(key)
            if key not in self._compiled:
                self.compile(key, *make_args())
                compiled += 1
            else:
                self._compiled.move_to_end(key)
        kept = [k for k in dict.fromkeys(keys) if k in self._compiled]
        return dict(
            keys=len(set(keys)),
            compiled=compiled,
            bytes=sum(self._bytes[k] for k in kept),
            evicted=len(set(keys)) - len(kept),
        )

    def counters(self) -> dict[str, Any]:
        """compiles, compile_seconds, hits, misses, evictions (count or byte bound), size / budget (executables),
        bytes / peak_bytes (held now / most held after bounding), max_bytes, estimated (sizes not reported by the
        backend), oversized (executables over max_bytes on their own), background_compiles / background_seconds
        (of ``compiles``: those made on the worker thread, and their seconds; compile_seconds counts only what the
        caller waited for)."""
        return dict(
            compiles=self.compiles,
            compile_seconds=round(self.compile_seconds, 4),
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
            size=len(self._compiled),
            budget=self.budget,
            bytes=self.bytes,
            peak_bytes=self.peak_bytes,
            max_bytes=self.max_bytes,
            estimated=self.estimated,
            oversized=self.oversized,
            background_compiles=self.background_compiles,
            background_seconds=round(self.background_seconds, 4),
        )
