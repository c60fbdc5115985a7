"""The plan's figures: ``StepPlan`` (one compiled program, per device), ``Plan`` (the run: resident buffers, steps, the
peak of each phase), their JSON, table and one-line refusal.

Phases: ``rollout`` (every resident buffer, the engines' decode state at the largest wave included; the engine steps
and the drafter's), ``update`` (no decode state; the train and log-prob passes: the rollout copy stays alive until the
next publish) and ``reshard`` (no decode state and no rollout copy: the engines drop theirs before the new one is
made). A phase's peak is its resident bytes + its largest step's transient bytes; the plan's peak is the largest.
"""

from __future__ import annotations

import dataclasses
import re

from tlt_jax.plan.hlo import CollectiveStats

__all__ = ["GB", "PHASES", "Plan", "StepPlan", "gb"]

GB = 10**9  # figures are in decimal GB, as GPU memory is quoted (80 GB)
# The resident buffers a phase does not hold.
PHASES = {"rollout": (), "update": ("decode_state",), "reshard": ("decode_state", "rollout_copy")}


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One compiled step's per-device figures (bytes). Engine steps: ``key`` the compiled pool key, ``keys`` every
    key the engine's pool can reach for this phase (the compiled one among them)."""

    what: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    resident_argument_bytes: int  # of the arguments, buffers that stay resident across steps (counted once)
    collectives: CollectiveStats
    compile_seconds: float
    hint: str  # the config keys that size this step
    temp_source: str = "compiled"  # or "float32 estimate" (see ``tlt_jax.plan.core``)
    compiled_temp_bytes: int | None = None  # with an estimate: the temporaries as compiled
    phase: str = "update"  # rollout | update | reshard
    resident_output_bytes: int = 0  # of the outputs, buffers counted as resident (a prefill's decode state)
    key: str | None = None
    keys: tuple[str, ...] = ()
    also_compiled: dict[str, int] = dataclasses.field(default_factory=dict)  # other keys compiled: their transient

    @property
    def collective_bytes(self) -> int:
        return self.collectives.bytes

    @property
    def transient_bytes(self) -> int:
        """What the step adds to its phase's resident state while it runs."""
        args = max(0, self.argument_bytes - self.resident_argument_bytes)
        return args + self.temp_bytes + max(0, self.output_bytes - self.alias_bytes - self.resident_output_bytes)

    def to_json(self) -> dict:
        c = self.collectives
        out = dict(what=self.what, phase=self.phase, argument_bytes=self.argument_bytes, temp_bytes=self.temp_bytes,
                   collective_bytes=c.bytes, output_bytes=self.output_bytes, alias_bytes=self.alias_bytes,
                   resident_argument_bytes=self.resident_argument_bytes,
                   resident_output_bytes=self.resident_output_bytes, transient_bytes=self.transient_bytes,
                   collective_bytes_static=c.static_bytes, collectives=c.by_kind, collective_ops=c.ops,
                   unknown_trip_loops=c.unknown_trip_loops, compile_s=round(self.compile_seconds, 2),
                   temp_source=self.temp_source, compiled_temp_bytes=self.compiled_temp_bytes)
        if self.phase == "rollout":
            out["cross_engine_collective_bytes"] = c.cross_group_bytes
        if self.key is not None:
            compiled = [self.key, *self.also_compiled]
            out.update(compiled_keys=compiled, also_compiled_transient_bytes=self.also_compiled,
                       reachable_keys=len(self.keys), other_keys=[k for k in self.keys if k not in compiled])
        return out


@dataclasses.dataclass(frozen=True)
class Plan:
    """The run's per-device memory plan on ``devices`` devices. ``device_memory_bytes``: the usable bytes per device
    (device memory x memory fraction), None when unknown (then ``fits`` is None)."""

    devices: int
    mesh: dict[str, int]
    device_memory_bytes: int | None
    memory_fraction: float
    resident: dict[str, int]
    steps: dict[str, StepPlan | None]
    notes: dict[str, str]  # why a step is absent
    resident_hint: str
    engines: int = 1
    engine_mesh: dict[str, int] | None = None

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    def phase_resident(self, phase: str) -> int:
        return sum(v for k, v in self.resident.items() if k not in PHASES[phase])

    def phase_step(self, phase: str) -> str | None:
        """The phase's step with the most transient bytes (None: the phase plans no step)."""
        names = [k for k, s in self.steps.items() if s is not None and s.phase == phase]
        return max(names, key=lambda k: self.steps[k].transient_bytes, default=None)

    def phase_peak(self, phase: str) -> int:
        step = self.phase_step(phase)
        return self.phase_resident(phase) + (0 if step is None else self.steps[step].transient_bytes)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.phase_peak)

    @property
    def largest_step(self) -> str:
        return self.phase_step(self.peak_phase) or max(
            (k for k, s in self.steps.items() if s is not None), key=lambda k: self.steps[k].transient_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.phase_peak(self.peak_phase)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory_bytes is None else self.peak_bytes <= self.device_memory_bytes

    def to_json(self) -> dict:
        phases = {p: dict(resident_bytes=self.phase_resident(p), step=self.phase_step(p), peak_bytes=self.phase_peak(p))
                  for p in PHASES}
        return dict(devices=self.devices, mesh=self.mesh, device_memory_bytes=self.device_memory_bytes,
                    memory_fraction=self.memory_fraction, peak_bytes=self.peak_bytes, fits=self.fits,
                    resident_bytes=self.resident_bytes, resident=self.resident, largest_step=self.largest_step,
                    peak_phase=self.peak_phase, phases=phases, engines=self.engines, engine_mesh=self.engine_mesh,
                    steps={k: None if s is None else s.to_json() for k, s in self.steps.items()}, notes=self.notes)

    def summary(self) -> str:
        """The plan in one line."""
        mesh = "x".join(str(v) for v in self.mesh.values())
        phases = ", ".join(f"{p} {gb(self.phase_peak(p))}" for p in PHASES)
        budget = "" if self.device_memory_bytes is None else f" of {gb(self.device_memory_bytes)} usable"
        verdict = {None: "", True: ": fits", False: ": DOES NOT FIT"}[self.fits]
        return (f"plan: {self.devices} devices (mesh {mesh}, {self.engines} engine{'s' * (self.engines > 1)}), peak "
                f"{gb(self.peak_bytes)}/device{budget}{verdict} (resident {gb(self.resident_bytes)}; peak per phase "
                f"{phases})")

    def table(self) -> str:
        """A table of the steps and the resident state, then the summary line."""
        w = max(len(k) for k in self.steps)
        rows = [f"{'step':<{w}} {'arguments':>10} {'temporaries':>12} {'transient':>10} {'collectives/call':>17} "
                f"{'cross-TP':>10}  what"]
        for k, s in self.steps.items():
            if s is None:
                rows.append(f"{k:<{w}} {'-':>10} {'-':>12} {'-':>10} {'-':>17} {'-':>10}  {self.notes.get(k, '')}")
                continue
            n = s.collectives.unknown_trip_loops
            loops = f" ({n} loop{'s' * (n > 1)} of unknown trip count counted once)" if n else ""
            keys = f" [1 of {len(s.keys)} reachable keys]" if len(s.keys) > 1 else ""
            mark = "*" if s.compiled_temp_bytes is not None else ""
            cross = "" if s.phase != "rollout" else gb(s.collectives.cross_group_bytes)
            rows.append(f"{k:<{w}} {gb(s.argument_bytes):>10} {gb(s.temp_bytes) + mark:>12} "
                        f"{gb(s.transient_bytes):>10} {gb(s.collective_bytes):>17} {cross:>10}  {s.what}{loops}{keys}")
        rows.append("resident: " + ", ".join(f"{k} {gb(v)}" for k, v in self.resident.items()))
        if self.steps.get("decode") is not None:
            rows.append("(decode: the chunk's loop has no static trip count, so its collectives are per token step; "
                        "cross-TP: bytes of collectives spanning several of an engine's tensor-parallel groups)")
        estimated = {k: s for k, s in self.steps.items() if s is not None and s.compiled_temp_bytes is not None}
        if estimated:
            compiled = ", ".join(f"{k} {gb(s.compiled_temp_bytes)}" for k, s in estimated.items())
            rows.append(f"(* estimated from a float32 compile; XLA:CPU's bfloat16 compile holds float32 copies of the "
                        f"weights and KV cache: {compiled})")
        return "\n".join([*rows, self.summary()])

    def refusal(self) -> str:
        """One line: why the run does not fit and which config keys to change."""
        step, phase = self.largest_step, self.peak_phase
        s = self.steps[step]
        resident = self.phase_resident(phase)
        hints = [self.resident_hint, s.hint] if resident >= s.transient_bytes else [s.hint, self.resident_hint]
        keys: dict[str, str] = {}  # the first mention of each config key, the larger share's first
        for part in ", ".join(h for h in hints if h).split(", "):
            keys.setdefault(re.split(r"[ =]", part, maxsplit=1)[0], part)
        parts = ", ".join(f"{k} {gb(v)}" for k, v in self.resident.items() if k not in PHASES[phase])
        return (f"the run does not fit: the plan needs {gb(self.peak_bytes)} per device on {self.devices} devices "
                f"({phase}: resident {gb(resident)}: {parts}; largest step {step}: {gb(s.transient_bytes)}) but "
                f"{gb(self.device_memory_bytes)} is usable (x memory fraction {self.memory_fraction}); change "
                f"{', '.join(keys.values())}, or shard over more devices (mesh.fsdp)")


def gb(n: int | None) -> str:
    """Decimal units: GB for the figures a device's memory is quoted in, MB / kB / B below."""
    if n is None:
        return "?"
    for unit, size in (("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
