"""``plan_run``: compile every program the run executes ahead of time from abstract state, and add up its memory.

Programs (each compiled as the run compiles it, from ``tlt_jax.plan.abstract``'s abstract arguments):

- global, on the run's mesh: ``train`` (one optimizer update, ``make_train_step``, on a mini-batch of
  ``rl.mini_batch_prompts x rollout.samples_per_prompt`` rows of the longest sequence, micro-batches of
  ``rl.micro_batch_size`` accumulated inside); ``logprobs`` (the reference pass, ``rl.kl_coef > 0``, else the
  old-policy pass of several updates per step) and ``logprobs_old`` (the latter when the run has both); ``reshard``
  (``rollout.reshard.Resharder``: float32 FSDP weights -> every engine's rollout copy, once per RL step);
- per engine, on engine 0's own mesh (``engine_meshes(mesh, rollout.num_slices)[0]``): ``prefill``, ``decode``,
  ``verify``, ``compact`` and the online ``drafter`` step (``tlt_jax.plan.rollout``: every reachable key listed, the
  largest of each phase compiled).

Per step, per device: ``argument_bytes``, ``output_bytes``, ``alias_bytes`` (outputs written into donated
arguments) and ``temp_bytes`` from ``compiled.memory_analysis()``; collective bytes per call from the HLO text
(``tlt_jax.plan.hlo``: loops of known trip count multiplied, on XLA:CPU, XLA:GPU and TPU alike; the decode chunk's
loop has none, so its figure is per token step). Resident: the train state (+ the model's non-parameter state), the
reference, the engines' rollout copy when they hold one, the EAGLE drafter the run loads (its draft vocabulary
included), the spot trainer's drafter state and replica (``drafter.online``), an engine's decode state at its largest
wave. Peaks per phase (rollout, update, reshard): ``tlt_jax.plan.report``.

The figures are those of the compiler that compiles: the main job's start-up plan compiles for its GPU / TPU; the
command line for XLA:CPU over simulated devices (``--devices``) or for real ones, compile-only (``--target``: XLA:GPU
or libtpu). XLA:CPU shards as XLA does everywhere, but it has no bfloat16 matmul and no bfloat16 scatter: in a
bfloat16 step with a policy forward it converts every layer's weights, and every layer's KV cache, to float32 copies,
and its schedule keeps them alive together (Qwen2.5-7B, 8 devices: 53.8 GB a decode step). So on CPU devices only, by
default (``bf16_temps="estimate"``), the prefill, decode and verify temporaries are taken from a second compile of
the same steps from a float32 rollout copy (no such copies; activations twice a bfloat16 step's): an estimate of a
GPU's, not a GPU's own; their arguments stay the bfloat16 step's, and the as-compiled figure is kept beside it
(``compiled_temp_bytes``). On a real target the compiled figures are used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from tlt_jax.config import Config, ConfigError
from tlt_jax.distributed import LogicalRules, engine_count, engine_meshes
from tlt_jax.plan import abstract as ab
from tlt_jax.plan.report import GB, Plan, StepPlan
from tlt_jax.plan.rollout import measure, rollout_steps

__all__ = ["BF16_TEMPS", "GB", "MEMORY_FRACTION", "Plan", "StepPlan", "device_budget", "plan_run", "startup_check"]

# The share of a GPU's memory JAX may take: launch/slurm/train.sbatch exports XLA_PYTHON_CLIENT_MEM_FRACTION with
# this value (JAX's own default is 0.75); the plan assumes it.
MEMORY_FRACTION = 0.90
BF16_TEMPS = ("estimate", "compiled")  # a bfloat16 rollout's step temporaries on CPU (``plan_run``)
STEP_ORDER = ("prefill", "decode", "verify", "compact", "drafter", "reshard", "train", "logprobs", "logprobs_old")


def plan_run(cfg: Config, mesh: Mesh, *, device_memory_bytes: int | None = None,
             memory_fraction: float = MEMORY_FRACTION, shape: str | None = None, backend: str | None = None,
             rules: LogicalRules = LogicalRules(), log: Callable[[str], None] | None = None,
             bf16_temps: str = "estimate") -> Plan:
    """Compile the run's programs ahead of time on ``mesh`` from abstract state and return its memory plan.

    shape: a model shape name (``abstract.SHAPES``) instead of reading it from the config. backend: the backend
    whose rollout layout is planned (resolves ``rollout.layers="auto"``; default: the mesh's devices' platform).
    device_memory_bytes: the usable bytes per device (memory x fraction), for ``Plan.fits``. bf16_temps: compiling
    for CPU devices with ``rollout.dtype="bfloat16"``, "estimate" takes the policy-forward steps' temporaries from a
    float32 rollout copy's compile, "compiled" keeps XLA:CPU's (see the module docstring)."""
    if bf16_temps not in BF16_TEMPS:
        raise ValueError(f"bf16_temps must be one of {BF16_TEMPS}, got {bf16_temps!r}")
    from tlt_jax.rl.learner import check_micro_batch

    say = log or (lambda line: None)
    check_micro_batch(cfg, mesh, rules)
    platform = mesh.devices.flat[0].platform
    backend = backend or {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    policy = ab.abstract_policy(cfg, ab.model_config(cfg, shape), mesh, rules)
    steps: dict[str, StepPlan | None] = {}
    notes: dict[str, str] = {}
    resident = _learner_steps(cfg, mesh, rules, policy, steps, notes, say)
    say("tracing the rollout engine over the abstract policy ...")
    eng = ab.abstract_engine(cfg, policy, mesh, backend, rules)
    if eng.holds_copy:
        resident["rollout_copy"] = ab.device_bytes(eng.engine.params)
    if eng.engine.drafter_params is not None:
        resident["drafter"] = ab.device_bytes(eng.engine.drafter_params)
    est = None
    if bf16_temps == "estimate" and cfg.rollout.dtype == "bfloat16" and platform == "cpu":
        say("tracing a float32 copy of the rollout engine (its steps' temporaries estimate the bfloat16 ones) ...")
        cfg32 = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, dtype="float32"))
        est = ab.abstract_engine(cfg32, policy, mesh, backend, rules)
    rollout_steps(cfg, mesh, rules, eng, steps, notes, resident, say, est)
    _reshard_step(cfg, mesh, rules, policy, eng, steps, notes, say)
    r, rl = cfg.rollout, cfg.rl
    resident_hint = ", ".join(filter(None, [
        "rollout.dtype=bfloat16 (the rollout copy)" if eng.holds_copy and not r.dtype else "",
        f"rl.kl_coef=0 (drops the reference, now {rl.kl_coef})" if "reference" in resident else "",
    ]))
    return Plan(devices=mesh.size, mesh=dict(mesh.shape), device_memory_bytes=device_memory_bytes,
                memory_fraction=memory_fraction, resident=resident, notes=notes, resident_hint=resident_hint,
                steps={k: steps[k] for k in STEP_ORDER if k in steps}, engines=engine_count(mesh, r.num_slices),
                engine_mesh=dict(eng.mesh.shape))


def _learner_steps(cfg: Config, mesh: Mesh, rules: LogicalRules, policy: ab.AbstractPolicy, steps: dict,
                   notes: dict, say: Callable[[str], None]) -> dict[str, int]:
    """Plan the update and the log-prob passes into ``steps``; returns the learner's resident bytes."""
    from tlt_jax.rl.logprobs import logprob_chunk_rows, make_logprob_fn
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
    steps["train"] = measure(what, hint, lambda: fn.lower(state, policy.rest, batch).compile(),
                             resident["train_state"])

    total = cfg.data.prompts_per_step * r.samples_per_prompt
    ids = ab.batch_sds((total, t), jnp.int32, mesh, rules)
    chunk = logprob_chunk_rows(cfg, mesh, policy.config, total, t, rules)  # as ``GRPOLearner.logprob_fn``
    lp = make_logprob_fn(policy.graphdef, chunk_size=chunk, temperature=r.temperature, mesh=mesh, rules=rules)
    passes = {"logprobs": ("reference", ref)} if ref is not None else {}
    if cfg.updates_per_step > 1:  # the old policy's pass (on the float32 parameters)
        passes["logprobs_old" if passes else "logprobs"] = ("old-policy", policy.params)
    if not passes:
        steps["logprobs"] = None
        notes["logprobs"] = "not run: rl.kl_coef = 0 and one update per step"
    for name, (kind, params) in passes.items():
        what = f"{kind} log-probs: {total} rows x {t} tokens, chunks of {chunk}"
        say(f"compiling {name} ({what}) ...")
        steps[name] = measure(what, f"rl.logprob_max_gb (now {rl.logprob_max_gb}), rl.logprob_chunk_rows",
                              lambda p=params: lp.lower(p, policy.rest, ids, ids).compile(),
                              ab.device_bytes(params) + rest_bytes)
    return resident


def _reshard_step(cfg: Config, mesh: Mesh, rules: LogicalRules, policy: ab.AbstractPolicy, eng: ab.AbstractEngine,
                  steps: dict, notes: dict, say: Callable[[str], None]) -> None:
    """Plan the per-RL-step reshard (``Resharder``: the trained policy into every engine's rollout copy) into
    ``steps`` (phase "reshard": the engines' previous copies are dropped before it runs)."""
    from tlt_jax.rollout.reshard import Resharder

    if not eng.holds_copy:
        steps["reshard"] = None
        notes["reshard"] = "not run: the engine decodes on the training arrays (no rollout copy)"
        return
    meshes = engine_meshes(mesh, cfg.rollout.num_slices) if cfg.rollout.num_slices != 1 else [mesh]
    resharder = Resharder(meshes, eng.engine.rollout_layout, rules)
    program, state = resharder.program_for(nnx.merge(policy.graphdef, policy.params, policy.rest))
    what = f"reshard: float32 training layout -> {len(meshes)} engine copies ({cfg.rollout.dtype or 'same dtype'})"
    say(f"compiling reshard ({what}) ...")
    steps["reshard"] = measure(what, "rollout.dtype=bfloat16, mesh.tensor", lambda: program.lower(state).compile(),
                               ab.device_bytes(state), phase="reshard")


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
