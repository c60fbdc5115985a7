"""``plan_run``: compile the run's programs ahead of time on its mesh from abstract state, and add up its memory.

Steps (each compiled as the run compiles it, from ``tlt_jax.plan.abstract``'s abstract arguments):

- ``train``: one optimizer update (``make_train_step``) on a mini-batch of ``rl.mini_batch_prompts x
  rollout.samples_per_prompt`` rows of the longest sequence (longest prompt + ``rollout.max_new_tokens``, bucketed),
  micro-batches of ``rl.micro_batch_size`` accumulated inside;
- ``logprobs``: the reference pass (``make_logprob_fn``, ``rl.kl_coef > 0``) over the step's rows, else the
  old-policy pass (several updates per step); ``logprobs_old``: the latter when the run has both;
- ``decode``: the engine's K-step decode chunk at the largest wave's batch bucket and the longest cache bucket;
- ``verify``: the speculative arm with the largest tree, at the largest batch bucket its threshold reaches;
- ``drafter``: the online drafter's train step (``drafter.online``).

Per step, per device: ``argument_bytes``, ``output_bytes``, ``alias_bytes`` (outputs written into donated
arguments) and ``temp_bytes`` from ``compiled.memory_analysis()``; collective bytes per call from the HLO text
(``tlt_jax.plan.hlo``: loops of known trip count multiplied; the decode chunk's loop has none, so its figure is per
token step). Resident across steps: the train state (+ the model's non-parameter state), the reference, the
engine's rollout copy when it holds one, the EAGLE drafter. The peak is resident + the largest step's transient
bytes (its arguments that are not resident, its temporaries and its outputs that do not alias an argument).

The figures are those of the backend that compiles: the main job's start-up plan compiles for its GPU / TPU, the
command line (``python -m tlt_jax.plan``) for XLA:CPU over simulated devices. XLA:CPU shards as XLA does everywhere,
but it has no bfloat16 matmul and no bfloat16 scatter: in a bfloat16 decode step it converts every layer's weights,
and every layer's KV cache (to write one position into it, then back), to float32 copies, and its schedule keeps them
alive together inside the token loop (the decode module's buffer assignment under ``XLA_FLAGS=--xla_dump_to=DIR``).
Its temporaries for bfloat16 programs (a bfloat16 rollout copy's decode and verify steps) thus include float32 copies
a GPU compile does not make (Qwen2.5-7B, 8 devices: 53.8 GB a decode step). So on CPU, by default
(``bf16_temps="estimate"``), those two steps' temporaries are taken from a second compile of the same steps from a
float32 rollout copy, which has no such copies and whose activations are twice a bfloat16 step's (2.3 GB there):
an estimate of a GPU's, not a GPU's own figure; their arguments stay the bfloat16 step's, and the as-compiled
figure is kept beside it (``compiled_temp_bytes``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from tlt_jax.config import Config, ConfigError
from tlt_jax.distributed import LogicalRules
from tlt_jax.plan import abstract as ab
from tlt_jax.plan.hlo import CollectiveStats, collective_stats

__all__ = ["BF16_TEMPS", "GB", "MEMORY_FRACTION", "Plan", "StepPlan", "device_budget", "plan_run", "startup_check"]

# The share of a GPU's memory JAX may take: launch/slurm/train.sbatch exports XLA_PYTHON_CLIENT_MEM_FRACTION with
# this value (JAX's own default is 0.75); the plan assumes it.
MEMORY_FRACTION = 0.90
GB = 10**9  # figures are in decimal GB, as GPU memory is quoted (80 GB)
BF16_TEMPS = ("estimate", "compiled")  # a bfloat16 rollout's step temporaries on CPU (``plan_run``)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One compiled step's per-device figures (bytes)."""

    what: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    resident_argument_bytes: int  # of the arguments, buffers that stay resident across steps (counted once)
    collectives: CollectiveStats
    compile_seconds: float
    hint: str  # the config keys that size this step
    temp_source: str = "compiled"  # or "float32 estimate" (see the module docstring)
    compiled_temp_bytes: int | None = None  # with an estimate: the temporaries as compiled

    @property
    def collective_bytes(self) -> int:
        return self.collectives.bytes

    @property
    def transient_bytes(self) -> int:
        """What the step adds to the resident state while it runs."""
        args = max(0, self.argument_bytes - self.resident_argument_bytes)
        return args + self.temp_bytes + max(0, self.output_bytes - self.alias_bytes)

    def to_json(self) -> dict:
        c = self.collectives
        return dict(what=self.what, argument_bytes=self.argument_bytes, temp_bytes=self.temp_bytes,
                    collective_bytes=c.bytes, output_bytes=self.output_bytes, alias_bytes=self.alias_bytes,
                    resident_argument_bytes=self.resident_argument_bytes, transient_bytes=self.transient_bytes,
                    collective_bytes_static=c.static_bytes, collectives=c.by_kind, collective_ops=c.ops,
                    unknown_trip_loops=c.unknown_trip_loops, compile_s=round(self.compile_seconds, 2),
                    temp_source=self.temp_source, compiled_temp_bytes=self.compiled_temp_bytes)


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

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    @property
    def largest_step(self) -> str:
        return max((k for k, s in self.steps.items() if s is not None), key=lambda k: self.steps[k].transient_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.steps[self.largest_step].transient_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory_bytes is None else self.peak_bytes <= self.device_memory_bytes

    def to_json(self) -> dict:
        return dict(devices=self.devices, mesh=self.mesh, device_memory_bytes=self.device_memory_bytes,
                    memory_fraction=self.memory_fraction, peak_bytes=self.peak_bytes, fits=self.fits,
                    resident_bytes=self.resident_bytes, resident=self.resident, largest_step=self.largest_step,
                    steps={k: None if s is None else s.to_json() for k, s in self.steps.items()}, notes=self.notes)

    def summary(self) -> str:
        """The plan in one line."""
        mesh = "x".join(str(v) for v in self.mesh.values())
        steps = ", ".join(f"{k} {_gb(s.transient_bytes)}" for k, s in self.steps.items() if s is not None)
        budget = "" if self.device_memory_bytes is None else f" of {_gb(self.device_memory_bytes)} usable"
        verdict = {None: "", True: ": fits", False: ": DOES NOT FIT"}[self.fits]
        return (f"plan: {self.devices} devices (mesh {mesh}), peak {_gb(self.peak_bytes)}/device{budget}{verdict} "
                f"(resident {_gb(self.resident_bytes)}; step transients {steps})")

    def table(self) -> str:
        """A table of the steps and the resident state, then the summary line."""
        w = max(len(k) for k in self.steps)
        rows = [f"{'step':<{w}} {'arguments':>10} {'temporaries':>12} {'collectives/call':>17}  what"]
        for k, s in self.steps.items():
            if s is None:
                rows.append(f"{k:<{w}} {'-':>10} {'-':>12} {'-':>17}  {self.notes.get(k, '')}")
                continue
            n = s.collectives.unknown_trip_loops
            loops = f" ({n} loop{'s' * (n > 1)} of unknown trip count counted once)" if n else ""
            mark = "*" if s.compiled_temp_bytes is not None else ""
            rows.append(f"{k:<{w}} {_gb(s.argument_bytes):>10} {_gb(s.temp_bytes) + mark:>12} "
                        f"{_gb(s.collective_bytes):>17}  {s.what}{loops}")
        rows.append("resident: " + ", ".join(f"{k} {_gb(v)}" for k, v in self.resident.items()))
        if self.steps.get("decode") is not None:
            rows.append("(decode: the chunk's loop has no static trip count, so its collectives are per token step)")
        estimated = {k: s for k, s in self.steps.items() if s is not None and s.compiled_temp_bytes is not None}
        if estimated:
            compiled = ", ".join(f"{k} {_gb(s.compiled_temp_bytes)}" for k, s in estimated.items())
            rows.append(f"(* estimated from a float32 compile; XLA:CPU's bfloat16 compile holds float32 copies of the "
                        f"weights and KV cache: {compiled})")
        return "\n".join([*rows, self.summary()])

    def refusal(self) -> str:
        """One line: why the run does not fit and which config keys to change."""
        step = self.largest_step
        s = self.steps[step]
        hints = [self.resident_hint, s.hint] if self.resident_bytes >= s.transient_bytes else \
            [s.hint, self.resident_hint]
        keys: dict[str, str] = {}  # the first mention of each config key, the larger share's first
        for part in ", ".join(h for h in hints if h).split(", "):
            keys.setdefault(re.split(r"[ =]", part, maxsplit=1)[0], part)
        parts = ", ".join(f"{k} {_gb(v)}" for k, v in self.resident.items())
        return (f"the run does not fit: the plan needs {_gb(self.peak_bytes)} per device on {self.devices} devices "
                f"(resident {_gb(self.resident_bytes)}: {parts}; largest step {step}: {_gb(s.transient_bytes)}) but "
                f"{_gb(self.device_memory_bytes)} is usable (x memory fraction {self.memory_fraction}); change "
                f"{', '.join(keys.values())}, or shard over more devices (mesh.fsdp)")


def _gb(n: int | None) -> str:
    """Decimal units: GB for the figures a device's memory is quoted in, MB / kB / B below."""
    if n is None:
        return "?"
    for unit, size in (("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _measure(what: str, hint: str, build: Callable[[], Any], resident: int) -> StepPlan:
    t0 = time.perf_counter()
    compiled = build()
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    return StepPlan(what=what, argument_bytes=int(m.argument_size_in_bytes), output_bytes=int(m.output_size_in_bytes),
                    alias_bytes=int(m.alias_size_in_bytes), temp_bytes=int(m.temp_size_in_bytes),
                    resident_argument_bytes=resident, collectives=collective_stats(compiled.as_text()),
                    compile_seconds=seconds, hint=hint)


def decode_batch(cfg: Config, engine) -> int:
    """The batch bucket of an engine's largest wave: its share of the step's rows, or of an evaluation batch."""
    from tlt_jax.rollout.buckets import pick

    slices = cfg.rollout.num_slices
    rows = math.ceil(cfg.data.prompts_per_step / slices) * cfg.rollout.samples_per_prompt
    wave = min(engine.max_batch, max(rows, math.ceil(cfg.eval.batch_size / slices)))
    return pick(engine.batch_buckets, wave)


def _verify_arm(engine, wave: int) -> tuple[Any, int] | None:
    """(the speculative arm with the largest tree, the largest batch bucket up to ``wave`` it can verify at)."""
    from tlt_jax.adaptive.bandit import BanditConfig

    if not engine.arm_specs:
        return None
    arm = max(engine.arm_specs, key=lambda a: (engine.arm_specs[a].verify_tokens, str(a)))
    reach = BanditConfig(engine.arms).reachable(engine.batch_buckets, engine.spec.threshold)
    batches = [b for a, b in reach if a == arm and b <= wave]
    return (arm, max(batches)) if batches else None


def plan_run(cfg: Config, mesh: Mesh, *, device_memory_bytes: int | None = None,
             memory_fraction: float = MEMORY_FRACTION, shape: str | None = None, backend: str | None = None,
             rules: LogicalRules = LogicalRules(), log: Callable[[str], None] | None = None,
             bf16_temps: str = "estimate") -> Plan:
    """Compile the run's steps ahead of time on ``mesh`` from abstract state and return its memory plan.

    shape: a model shape name (``abstract.SHAPES``) instead of reading it from the config. backend: the backend
    whose rollout layout is planned (resolves ``rollout.layers="auto"``; default: this process's).
    device_memory_bytes: the usable bytes per device (memory x fraction), for ``Plan.fits``. bf16_temps: compiling
    for CPU devices with ``rollout.dtype="bfloat16"``, "estimate" takes the decode and verify steps' temporaries from a
    float32 rollout copy's compile, "compiled" keeps XLA:CPU's (see the module docstring)."""
    if bf16_temps not in BF16_TEMPS:
        raise ValueError(f"bf16_temps must be one of {BF16_TEMPS}, got {bf16_temps!r}")
    from tlt_jax.rl.learner import check_micro_batch

    say = log or (lambda line: None)
    check_micro_batch(cfg, mesh, rules)
    policy = ab.abstract_policy(cfg, ab.model_config(cfg, shape), mesh, rules)
    steps: dict[str, StepPlan | None] = {}
    notes: dict[str, str] = {}
    resident = _learner_steps(cfg, mesh, rules, policy, steps, notes, say)
    say("tracing the rollout engine over the abstract policy ...")
    eng = ab.abstract_engine(cfg, policy, mesh, backend or jax.default_backend(), rules)
    if eng.holds_copy:
        resident["rollout_copy"] = ab.device_bytes(eng.engine.params)
    if eng.engine.drafter_params is not None:
        resident["drafter"] = ab.device_bytes(eng.engine.drafter_params)
    est = None
    if bf16_temps == "estimate" and cfg.rollout.dtype == "bfloat16" and mesh.devices.flat[0].platform == "cpu":
        say("tracing a float32 copy of the rollout engine (its steps' temporaries estimate the bfloat16 ones) ...")
        cfg32 = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, dtype="float32"))
        est = ab.abstract_engine(cfg32, policy, mesh, backend or jax.default_backend(), rules)
    _rollout_steps(cfg, rules, eng, steps, notes, say, est)
    r, rl = cfg.rollout, cfg.rl
    resident_hint = ", ".join(filter(None, [
        "rollout.dtype=bfloat16 (the rollout copy)" if eng.holds_copy and not r.dtype else "",
        f"rl.kl_coef=0 (drops the reference, now {rl.kl_coef})" if "reference" in resident else "",
    ]))
    return Plan(devices=mesh.size, mesh=dict(mesh.shape), device_memory_bytes=device_memory_bytes,
                memory_fraction=memory_fraction, resident=resident, steps=steps, notes=notes,
                resident_hint=resident_hint)


def _learner_steps(cfg: Config, mesh: Mesh, rules: LogicalRules, policy: ab.AbstractPolicy, steps: dict,
                   notes: dict, say: Callable[[str], None]) -> dict[str, int]:
    """Plan the update and the log-prob passes into ``steps``; returns the learner's resident bytes."""
    from tlt_jax.rl.logprobs import make_logprob_fn
    from tlt_jax.rl.train_step import make_train_step

    r, rl = cfg.rollout, cfg.rl
    tx = ab.optimizer(cfg)
    state = ab.abstract_train_state(policy.params, tx)
    ref = ab.reference_params(cfg, policy.params)
    rest_bytes = ab.device_bytes(policy.rest)
    resident = {"train_state": ab.device_bytes(state) + rest_bytes}
    if ref is not None:
        resident["reference"] = ab.device_bytes(ref)
    t = ab.sequence_length(cfg)
    batch = ab.train_batch(cfg, mesh, rules)
    what = f"one update: {batch['input_ids'].shape[0]} rows x {t} tokens, micro-batches of {rl.micro_batch_size}"
    say(f"compiling train ({what}) ...")
    fn = make_train_step(policy.graphdef, tx, ab.loss_config(cfg), state, mesh=mesh, rules=rules)
    hint = f"rl.micro_batch_size (now {rl.micro_batch_size})" + ("" if cfg.model.remat else ", model.remat=True")
    steps["train"] = _measure(what, hint, lambda: fn.lower(state, policy.rest, batch).compile(),
                              resident["train_state"])

    total = cfg.data.prompts_per_step * r.samples_per_prompt
    ids = ab.batch_sds((total, t), jnp.int32, mesh, rules)
    lp = make_logprob_fn(policy.graphdef, chunk_size=rl.micro_batch_size, temperature=r.temperature, mesh=mesh,
                         rules=rules)
    passes = {"logprobs": ("reference", ref)} if ref is not None else {}
    if cfg.updates_per_step > 1:  # the old policy's pass (on the float32 parameters)
        passes["logprobs_old" if passes else "logprobs"] = ("old-policy", policy.params)
    if not passes:
        steps["logprobs"] = None
        notes["logprobs"] = "not run: rl.kl_coef = 0 and one update per step"
    for name, (kind, params) in passes.items():
        what = f"{kind} log-probs: {total} rows x {t} tokens, chunks of {rl.micro_batch_size}"
        say(f"compiling {name} ({what}) ...")
        steps[name] = _measure(what, f"rl.micro_batch_size (now {rl.micro_batch_size})",
                               lambda p=params: lp.lower(p, policy.rest, ids, ids).compile(),
                               ab.device_bytes(params) + rest_bytes)
    return resident


def _rollout_steps(cfg: Config, rules: LogicalRules, eng: ab.AbstractEngine, steps: dict, notes: dict,
                   say: Callable[[str], None], est: ab.AbstractEngine | None = None) -> None:
    """Plan the engine's decode and verify steps and the online drafter's step into ``steps``; with ``est`` (a
    float32 copy's engine), the decode and verify steps' temporaries are its steps'."""
    from tlt_jax.adaptive import Arm
    from tlt_jax.rollout import StepKey
    from tlt_jax.rollout.plan import step_key

    r, engine = cfg.rollout, eng.engine
    step_resident = ab.device_bytes(engine.step_params())
    length = engine.length_buckets[-1]
    b = decode_batch(cfg, engine)
    what = f"decode chunk: batch {b}, cache {length}, up to {engine.chunk_size} token steps"
    say(f"compiling decode ({what}) ...")
    dtype_hint = "" if r.dtype else ", rollout.dtype=bfloat16"
    hint = (f"data.prompts_per_step / rollout.samples_per_prompt (batch {b}), rollout.max_new_tokens (cache {length})"
            f"{dtype_hint}")
    steps["decode"] = _estimated(_measure(what, hint, lambda: engine.pool.compile(
        StepKey("decode", b, length), *engine.abstract_args(Arm("off"), b, length)), step_resident),
        est, lambda e: e.pool.compile(StepKey("decode", b, length), *e.abstract_args(Arm("off"), b, length)))

    verify = _verify_arm(engine, b)
    if verify is None:
        steps["verify"] = None
        notes["verify"] = f"not run: rollout.speculative={r.speculative!r}"
    else:
        arm, vb = verify
        what = f"verify ({arm}): batch {vb}, cache {length}"
        say(f"compiling verify ({what}) ...")
        steps["verify"] = _estimated(_measure(
            what, f"rollout.spec_threshold (batch {vb}), rollout.spec_verify_tokens / spec_arms{dtype_hint}",
            lambda: engine.pool.compile(step_key(arm, vb, length), *engine.abstract_args(arm, vb, length)),
            step_resident), est, lambda e: e.pool.compile(step_key(arm, vb, length), *e.abstract_args(arm, vb, length)))

    if cfg.drafter.online:
        dfn, dargs = ab.drafter_trainer(cfg, eng, rules)
        what = f"drafter update: {cfg.drafter.rows} rows x {cfg.drafter.row_len} positions"
        say(f"compiling drafter ({what}) ...")
        steps["drafter"] = _measure(what, "drafter.rows / drafter.row_len", lambda: dfn.lower(*dargs).compile(),
                                    ab.device_bytes(engine.params))


def _estimated(step: StepPlan, est: ab.AbstractEngine | None, compile_on: Callable[[Any], Any]) -> StepPlan:
    """``step`` with its temporaries from the same step compiled on ``est``'s (float32) engine, when given."""
    if est is None:
        return step
    temps = int(compile_on(est.engine).memory_analysis().temp_size_in_bytes)
    return dataclasses.replace(step, temp_bytes=temps, temp_source="float32 estimate",
                               compiled_temp_bytes=step.temp_bytes)


def device_budget(cfg: Config) -> int | None:
    """Usable bytes per device: ``train.device_memory_gb`` x MEMORY_FRACTION, else the device's own limit (GPU /
    TPU report it, already under JAX's memory fraction), else None (CPU)."""
    if cfg.train.device_memory_gb > 0:
        return int(cfg.train.device_memory_gb * GB * MEMORY_FRACTION)
    stats = jax.local_devices()[0].memory_stats() or {}
    return int(stats["bytes_limit"]) if stats.get("bytes_limit") else None


def startup_check(cfg: Config, mesh: Mesh, log: Callable[[str], None] | None = None) -> Plan | None:
    """The main job's start-up check (``train.plan_check``): "auto" plans on GPU / TPU backends only (on CPU the
    compiles would cost more than the run's first steps), "on" always, "off" never. Returns the plan (None when not
    planned); raises ConfigError with ``Plan.refusal()`` when the run does not fit ``device_budget``."""
    mode = cfg.train.plan_check
    if mode == "off" or (mode == "auto" and jax.default_backend() == "cpu"):
        return None
    plan = plan_run(cfg, mesh, device_memory_bytes=device_budget(cfg), log=log)
    if plan.fits is False:
        raise ConfigError(plan.refusal())
    return plan
