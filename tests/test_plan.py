"""``tlt_jax.plan`` on 8 simulated devices: collective bytes from HLO text, the abstract state against the real run's
objects, the plan's figures against the run's own compiled programs, the start-up check, the command line."""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import app, flags
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import config_flags

from tlt_jax.config import ConfigError, from_config_dict
from tlt_jax.distributed import MeshConfig, make_mesh
from tlt_jax.plan import GB, MEMORY_FRACTION, collective_stats, plan_run, shape_bytes, startup_check
from tlt_jax.plan import abstract as ab

REPO = pathlib.Path(__file__).resolve().parent.parent
# Tensor- and FSDP-sharded, speculative (n-gram verify steps), a reference model and two updates per step (an
# old-policy pass): every step of the plan but the online drafter's runs.
SHARDED = ("--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
           "--config.rollout.speculative=ngram", "--config.rollout.spec_depth=3", "--config.rollout.spec_topk=2",
           "--config.rollout.spec_verify_tokens=6", "--config.rl.mini_batch_prompts=4")


def _cfg(*overrides, name="tiny.py"):
    argv = ["prog", f"--config={REPO / 'configs' / name}", "--config.metrics.progress_bars=False", *overrides]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    return from_config_dict(fv.config)


HLO = """HloModule m, num_partitions=8

%body (p: (s32[], bf16[4,16])) -> (s32[], bf16[4,16]) {
  %p = (s32[], bf16[4,16]{1,0}) parameter(0)
  %x = bf16[1,16]{1,0} get-tuple-element(%p), index=1
  %ag = bf16[4,16]{1,0} all-gather(%x), channel_id=1, dimensions={0}
  ROOT %t = (s32[], bf16[4,16]{1,0}) tuple(%i, %ag)
}

%cond (p.1: (s32[], bf16[4,16])) -> pred[] {
  %p.1 = (s32[], bf16[4,16]{1,0}) parameter(0)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(%a, %b)
}

%dyn_body (q: (f32[10], f32[6])) -> (f32[10], f32[6]) {
  %q = (f32[10]{0}, f32[6]{0}) parameter(0)
  ROOT %ar = (f32[10]{0}, f32[6]{0}) all-reduce(%u, %v), channel_id=2, to_apply=%add
}

%branch0 (r: f32[100]) -> f32[100] {
  ROOT %cp = f32[100]{0} collective-permute(%r), channel_id=3, source_target_pairs={{0,1}}
}

%branch1 (r.1: f32[50]) -> f32[50] {
  ROOT %cp.1 = f32[50]{0} collective-permute(%r.1), channel_id=4, source_target_pairs={{1,0}}
}

ENTRY %main (a: f32[2]) -> f32[2,3] {
  %w = (s32[], bf16[4,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %w2 = (f32[10]{0}, f32[6]{0}) while(%init2), condition=%cond, body=%dyn_body
  %ags = ((f32[2]{0}), f32[16]{0}) all-gather-start(%y), channel_id=5, dimensions={0}
  %agd = f32[16]{0} all-gather-done(%ags)
  %c = f32[] conditional(%i, %a, %b), branch_computations={%branch0, %branch1}
  ROOT %rs = f32[2,3]{1,0} reduce-scatter(%z), channel_id=6, dimensions={0}, to_apply=%add
}
"""


def test_collective_bytes_from_hlo_text_count_loops_async_pairs_tuples_and_branches():
    assert shape_bytes("bf16[8,2560,3584]{2,1,0}") == 8 * 2560 * 3584 * 2
    assert shape_bytes("(f32[10]{0}, pred[3], token[])") == 43
    s = collective_stats(HLO)
    # all-gather bf16[4,16] (128 B) x 5 known trips + the async pair's f32[16] once; the tuple all-reduce in a loop
    # of unknown trip count once; the larger branch's permute; the reduce-scatter's f32[2,3].
    assert s.by_kind == {"all-gather": 5 * 128 + 64, "all-reduce": 64, "collective-permute": 400,
                         "reduce-scatter": 24}
    assert s.bytes == 640 + 64 + 64 + 400 + 24
    assert s.static_bytes == 128 + 64 + 64 + 400 + 200 + 24 and s.ops == 6 and s.unknown_trip_loops == 1


def test_collective_bytes_of_compiled_programs_with_a_known_all_gather_all_reduce_and_scan():
    mesh = make_mesh(MeshConfig(data=-1))
    rep = NamedSharding(mesh, PartitionSpec())
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("data", None)))
    gather = jax.jit(lambda x: x * 2, out_shardings=rep).lower(x).compile()
    assert collective_stats(gather.as_text()).by_kind == {"all-gather": 64 * 128 * 4}
    reduce = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=rep).lower(x).compile()
    assert collective_stats(reduce.as_text()).by_kind == {"all-reduce": 128 * 4}

    def layers(ws, v):  # three layers, each gathering its [64, 64] weight
        return jax.lax.scan(lambda v, w: (jnp.tanh(v @ w), None), v, ws)[0]

    ws = jax.ShapeDtypeStruct((3, 64, 64), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "data")))
    v = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("data", None)))
    s = collective_stats(jax.jit(layers).lower(ws, v).compile().as_text())
    assert (s.bytes, s.static_bytes, s.unknown_trip_loops) == (3 * 64 * 64 * 4, 64 * 64 * 4, 0)


def _same(abstract, real):
    assert jax.tree.structure(abstract) == jax.tree.structure(real)
    for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(real), strict=True):
        assert (a.shape, a.dtype) == (r.shape, r.dtype)
        assert a.sharding.is_equivalent_to(r.sharding, len(a.shape)), (a.sharding, r.sharding)


def _copies(engine, model) -> bool:
    """Whether the engine's parameters live in other buffers than the model's (a rollout copy)."""
    def buffers(tree):
        return [s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for s in x.addressable_shards]

    return buffers(engine.params) != buffers(nnx.state(model))


def test_an_engine_decoding_on_the_training_arrays_holds_no_copy():
    from tlt_jax.builders import build_data, build_engine, build_model

    cfg = _cfg()  # data parallel: the decode layout is the training layout (everything replicated)
    mesh = make_mesh(cfg.mesh)
    model, _ = build_model(cfg, mesh)
    engine = build_engine(cfg, model, mesh, build_data(cfg, None, model.config))
    policy = ab.abstract_policy(cfg, ab.model_config(cfg), mesh)
    assert not _copies(engine, model) and not ab.abstract_engine(cfg, policy, mesh, "cpu").holds_copy
    assert ab.abstract_engine(cfg, policy, mesh, "gpu").holds_copy  # GPU: an unstacked copy


def _memory(compiled, group_size=None):
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes,
            collective_stats(compiled.as_text(), group_size))


def _figures(step):
    return (step.argument_bytes, step.output_bytes, step.alias_bytes, step.temp_bytes, step.collectives)


ENGINE_STEPS = {"prefill", "decode", "verify", "compact", "drafter"}
ALL_STEPS = ENGINE_STEPS | {"reshard", "train", "logprobs", "logprobs_old"}


def test_plan_equals_the_runs_own_state_and_compiled_programs():
    from tlt_jax.adaptive import Arm
    from tlt_jax.builders import build_data, build_engine, build_model
    from tlt_jax.rl.learner import GRPOLearner, build_sequences
    from tlt_jax.rollout import StepKey
    from tlt_jax.rollout.plan import step_key

    cfg = _cfg(*SHARDED)
    mesh = make_mesh(cfg.mesh)
    model, _ = build_model(cfg, mesh)
    data = build_data(cfg, None, model.config)
    engine = build_engine(cfg, model, mesh, data)
    learner = GRPOLearner(cfg, model, engine, reward_fn=None, mesh=mesh)
    backend = jax.default_backend()

    # The abstract state is the learner's and the engine's (shapes, dtypes, shardings; the engine's step context).
    policy = ab.abstract_policy(cfg, ab.model_config(cfg), mesh)
    _same(ab.abstract_train_state(policy.params, ab.optimizer(cfg)), learner.state)
    _same(ab.reference_params(cfg, policy.params), learner.ref_params)
    eng = ab.abstract_engine(cfg, policy, mesh, backend)
    assert eng.engine.ctx == engine.ctx
    _same(eng.engine.params, engine.params)
    # The engine decodes on a copy (weights not split over the data axes), resident beside the train state.
    assert eng.holds_copy and _copies(engine, model)

    plan = plan_run(cfg, mesh, backend=backend)
    assert set(plan.steps) == ALL_STEPS and plan.steps["drafter"] is None  # no online drafter here
    assert all(plan.steps[k] for k in ALL_STEPS - {"drafter"})
    # Each figure is the compiled program's own: the run's train step on a mini-batch as the learner builds it, ...
    t = ab.sequence_length(cfg)
    rows = cfg.data.prompts_per_step * cfg.rollout.samples_per_prompt
    seqs = build_sequences([[3] * (t - 1)] * cfg.data.prompts_per_step, [[[4]] * cfg.rollout.samples_per_prompt]
                           * cfg.data.prompts_per_step)
    assert seqs["input_ids"].shape == (rows, t)
    put, mini = learner._put, slice(0, cfg.rl.mini_batch_prompts * cfg.rollout.samples_per_prompt)
    batch = {**{k: put(v[mini]) for k, v in seqs.items()}, "advantages": put(np.zeros(rows, np.float32)[mini]),
             "old_logp": put(np.zeros((rows, t), np.float32)[mini]),
             "ref_logp": put(np.zeros((rows, t), np.float32)[mini]), "loss_scale": jnp.asarray(np.float32(1.0))}
    real = learner._train_step.lower(learner.state, learner.rest, batch).compile()
    assert _figures(plan.steps["train"]) == _memory(real)
    ids, attn = put(seqs["input_ids"]), put(seqs["attention_mask"])
    real = learner.logprob_fn(ids.shape).lower(learner.ref_params, learner.rest, ids, attn).compile()
    assert _figures(plan.steps["logprobs"]) == _memory(real)
    real = learner.logprob_fn(ids.shape).lower(learner.state.params, learner.rest, ids, attn).compile()
    assert _figures(plan.steps["logprobs_old"]) == _memory(real)
    assert plan.steps["logprobs_old"].argument_bytes > plan.steps["logprobs"].argument_bytes  # float32 vs bfloat16
    # ... and the engine's decode and verify steps compiled from its own (real) parameters.
    length = engine.length_buckets[-1]
    tp = cfg.mesh.tensor
    real = engine.pool.compile(StepKey("decode", rows, length), *engine.abstract_args(Arm("off"), rows, length))
    assert _figures(plan.steps["decode"]) == _memory(real, tp)
    arm = next(iter(engine.arm_specs))
    vb = [b for b in engine.batch_buckets if b >= cfg.rollout.spec_threshold or b == engine.batch_buckets[-1]][0]
    real = engine.pool.compile(step_key(arm, vb, length), *engine.abstract_args(arm, vb, length))
    assert _figures(plan.steps["verify"]) == _memory(real, tp) and str(arm) in plan.steps["verify"].what
    # The reshard is the engine's own program (``Resharder``) on the learner's float32 model.
    from tlt_jax.rollout.reshard import Resharder

    program, state = Resharder([engine.mesh], engine.rollout_layout).program_for(model)
    assert _figures(plan.steps["reshard"]) == _memory(program.lower(state).compile())

    # Resident: the train state, the reference, the rollout copy, the decode state at the largest wave; each
    # phase's peak adds its largest step's transient bytes to the buffers it holds.
    state_bytes = ab.device_bytes(engine.ctx.abstract_state(rows))
    assert plan.resident == {"train_state": ab.device_bytes(learner.state), "reference":
                             ab.device_bytes(learner.ref_params), "rollout_copy": ab.device_bytes(engine.params),
                             "decode_state": state_bytes}
    rollout = max(plan.steps[k].transient_bytes for k in ENGINE_STEPS if plan.steps[k])
    update = max(plan.steps[k].transient_bytes for k in ("train", "logprobs", "logprobs_old"))
    assert plan.phase_peak("rollout") == plan.resident_bytes + rollout
    assert plan.phase_peak("update") == plan.resident_bytes - state_bytes + update
    assert plan.phase_peak("reshard") == (plan.resident_bytes - state_bytes - plan.resident["rollout_copy"]
                                          + plan.steps["reshard"].transient_bytes)
    assert plan.peak_bytes == max(plan.phase_peak(p) for p in ("rollout", "update", "reshard"))
    d = plan.steps["decode"]  # its donated state is resident (aliased): the transient is temporaries + its info
    assert d.transient_bytes == d.temp_bytes + d.output_bytes - d.alias_bytes < d.temp_bytes + state_bytes / 4
    assert plan.steps["train"].collective_bytes > 0 and plan.fits is None


def test_online_drafter_step_and_slice_engine_are_the_runs_own():
    from tlt_jax.builders import build_data, build_engine, build_model
    cfg = _cfg("--config.rollout.speculative=eagle", "--config.drafter.online=True", "--config.rollout.num_slices=2")
    mesh = make_mesh(cfg.mesh)
    model, _ = build_model(cfg, mesh)
    ctl = build_engine(cfg, model, mesh, build_data(cfg, None, model.config))
    try:
        engine, trainer = ctl.rollout.engines[0], ctl.trainer
        policy = ab.abstract_policy(cfg, ab.model_config(cfg), mesh)
        eng = ab.abstract_engine(cfg, policy, mesh, jax.default_backend())
        assert eng.engine.ctx == engine.ctx and eng.mesh.size == 4  # slice 0: half the data axis
        _same(eng.engine.params, engine.params)
        _same(eng.engine.drafter_params, engine.drafter_params)
        plan = plan_run(cfg, mesh, backend=jax.default_backend())
        real = trainer._steps[0]  # compiled ahead of time when the engine was built (``SpotTrainer.compile``)
        assert isinstance(real, jax.stages.Compiled)
        assert _figures(plan.steps["drafter"]) == _memory(real, cfg.mesh.tensor)
        assert plan.resident["drafter"] == ab.device_bytes(engine.drafter_params) > 0
        # The spot trainer's state (drafter + Adam moments) and a replica, on slice 0's devices.
        assert plan.resident["spot_trainer"] == 2 * ab.device_bytes(trainer._placed[0]) > plan.resident["drafter"]
    finally:
        ctl.close()


def test_bfloat16_rollout_temporaries_on_cpu_are_estimated_from_a_float32_compile():
    """XLA:CPU's bfloat16 decode and verify steps hold float32 copies of the weights and KV cache that a GPU compile
    does not make: by default the plan takes those steps' temporaries from a float32 rollout copy's compile (that
    run's own figures), keeps the bfloat16 arguments and reports the compiled figure beside the estimate;
    bf16_temps="compiled" keeps XLA:CPU's."""
    bf16 = _cfg(*SHARDED, "--config.rollout.dtype=bfloat16")
    mesh = make_mesh(bf16.mesh)
    est = plan_run(bf16, mesh, backend="cpu")
    raw = plan_run(bf16, mesh, backend="cpu", bf16_temps="compiled")
    f32 = plan_run(_cfg(*SHARDED, "--config.rollout.dtype=float32"), mesh, backend="cpu")
    for k in ("decode", "verify"):
        e, r, f = est.steps[k], raw.steps[k], f32.steps[k]
        assert (e.temp_source, r.temp_source, f.temp_source) == ("float32 estimate", "compiled", "compiled")
        assert e.temp_bytes == f.temp_bytes and e.compiled_temp_bytes == r.temp_bytes > e.temp_bytes, (e, r)
        assert e.argument_bytes == r.argument_bytes < f.argument_bytes  # the bfloat16 copy's weights and cache
        assert e.to_json()["compiled_temp_bytes"] == r.temp_bytes
    train = est.steps["train"]
    assert train == dataclasses.replace(raw.steps["train"], compile_seconds=train.compile_seconds)
    assert est.steps["decode"].transient_bytes < raw.steps["decode"].transient_bytes  # what the peak adds up
    assert "* estimated from a float32 compile" in est.table() and "estimated" not in raw.table()
    with pytest.raises(ValueError, match="bf16_temps must be one of"):
        plan_run(bf16, mesh, bf16_temps="gpu")


def test_startup_check_follows_train_plan_check_and_refuses_a_run_that_does_not_fit():
    mesh = make_mesh(MeshConfig(data=-1))
    assert startup_check(_cfg("--config.train.plan_check=off"), mesh) is None
    assert startup_check(_cfg(), mesh) is None  # "auto": not on a CPU backend
    plan = startup_check(_cfg("--config.train.plan_check=on", "--config.train.device_memory_gb=80"), mesh)
    assert plan.fits and plan.device_memory_bytes == int(80 * GB * MEMORY_FRACTION)
    assert plan.summary().startswith("plan: 8 devices (mesh 8x1x1, 1 engine), peak ") and ": fits" in plan.summary()
    tight = _cfg("--config.train.plan_check=on", f"--config.train.device_memory_gb={plan.peak_bytes / 2 / GB}")
    with pytest.raises(ConfigError) as e:
        startup_check(tight, mesh)
    line = str(e.value)
    assert "\n" not in line and line.startswith("the run does not fit: the plan needs ")
    assert "rl.micro_batch_size" in line and "rl.kl_coef=0" in line and "mesh.fsdp" in line
    with pytest.raises(ConfigError, match="config.train.plan_check: must be one of"):
        _cfg("--config.train.plan_check=maybe")


def test_model_shape_from_a_config_json_a_preset_or_a_clear_error(tmp_path):
    from tlt_jax.models.hf_io import config_to_hf

    qwen = ab.SHAPES["qwen2.5-7b"]
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(qwen)))  # a checkpoint directory without weights
    got = ab.model_config(_cfg("--config.model.source=path", f"--config.model.path={tmp_path}",
                               "--config.data.source=arithmetic"))
    assert (got.hidden_size, got.num_layers, got.vocab_size) == (3584, 28, 152064)
    missing = _cfg("--config.model.source=path", f"--config.model.path={tmp_path / 'nope'}",
                   "--config.data.source=arithmetic")
    with pytest.raises(ConfigError, match="--shape=NAME"):
        ab.model_config(missing)
    assert ab.model_config(missing, "qwen2.5-7b") is qwen
    with pytest.raises(ConfigError, match="unknown model shape"):
        ab.model_config(missing, "gpt-5")


def test_too_few_devices_is_a_clear_error(monkeypatch):
    from tlt_jax.plan.__main__ import setup_devices

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    assert len(jax.devices("cpu")) == 8  # the backend runs first (the conftest's 8): setup_devices can't change it
    assert len(setup_devices(4)) == 4
    with pytest.raises(app.UsageError, match="JAX already runs with 8 CPU devices in this process"):
        setup_devices(16)


def test_the_launch_exports_the_memory_fraction_the_plan_assumes():
    text = (REPO / "launch" / "slurm" / "train.sbatch").read_text()
    export = r'^export XLA_PYTHON_CLIENT_MEM_FRACTION="\$\{XLA_PYTHON_CLIENT_MEM_FRACTION:-([0-9.]+)\}"$'
    m = re.search(export, text, re.M)
    assert m and float(m.group(1)) == MEMORY_FRACTION


def _plan_cli(*args):
    cmd = [sys.executable, "-m", "tlt_jax.plan", "--config=configs/tiny.py", "--devices=8", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_command_line_writes_the_documented_json_and_refuses_a_run_that_does_not_fit(tmp_path):
    out = tmp_path / "plan.json"
    proc = _plan_cli(*SHARDED, f"--json={out}")
    assert proc.returncode == 0, proc.stderr
    assert "verify" in proc.stdout and ": fits" in proc.stdout.splitlines()[-1]
    plan = json.loads(out.read_text())
    assert plan["devices"] == 8 and plan["fits"] is True and plan["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert plan["device_memory_bytes"] == int(80 * GB * MEMORY_FRACTION) and 0 < plan["peak_bytes"] < 10**8
    assert set(plan["steps"]) == ALL_STEPS and plan["steps"]["drafter"] is None
    assert (plan["target"], plan["device_kind"], plan["engines"]) == ("cpu:8", "cpu", 1)
    assert set(plan["phases"]) == {"rollout", "update", "reshard"} and plan["peak_bytes"] == max(
        p["peak_bytes"] for p in plan["phases"].values())
    for name, step in plan["steps"].items():
        if step is None:
            continue
        assert {"argument_bytes", "temp_bytes", "collective_bytes"} <= set(step) and step["argument_bytes"] > 0
        assert ("cross_engine_collective_bytes" in step) == (name in ENGINE_STEPS)
        if name in ENGINE_STEPS:
            assert 0 <= step["cross_engine_collective_bytes"] <= step["collective_bytes"]
            assert step["compiled_keys"][0] not in step["other_keys"] and step["reachable_keys"] == len(
                step["compiled_keys"]) + len(step["other_keys"])
    assert plan["command"].startswith("python -m tlt_jax.plan --config=configs/tiny.py --devices=8")

    proc = _plan_cli("--device_memory_gb=0.0001")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the run does not fit: the plan needs ") and "rl.micro_batch_size" in last
    assert "DOES NOT FIT" in proc.stdout

    proc = _plan_cli(*SHARDED, "--config.rollout.dtype=bfloat16", "--bf16_temps=compiled", f"--json={out}")
    assert proc.returncode == 0, proc.stderr
    assert {json.loads(out.read_text())["steps"][k]["temp_source"] for k in ("decode", "verify")} == {"compiled"}

    proc = _plan_cli("--config.rl.micro_batch_size=12")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: config.rl.micro_batch_size")


@pytest.fixture
def no_persistent_cache():
    """Compile afresh: on XLA:CPU's simulated devices, a sharded step reloaded from the persistent compilation cache
    (written by the plans of the same programs earlier in the process) deadlocked in a collective."""
    from jax._src import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


def test_a_tiny_job_compiles_only_programs_the_plan_lists_and_the_plans_figures_are_theirs(no_persistent_cache):
    """A rollout and an evaluation of the sharded tiny run: every key its pool compiled is one the plan lists for
    that phase, and each step the plan compiled at a key the job compiled too has that executable's figures."""
    from tlt_jax.builders import build_data, build_engine, build_model
    from tlt_jax.plan.rollout import key_name
    from tlt_jax.rollout import SamplingParams

    cfg = _cfg(*SHARDED)
    mesh = make_mesh(cfg.mesh)
    model, _ = build_model(cfg, mesh)
    data = build_data(cfg, None, model.config)
    engine = build_engine(cfg, model, mesh, data)
    r = cfg.rollout
    prompts = [list(ex["prompt_ids"]) for ex in data.train[: cfg.data.prompts_per_step]]
    engine.generate(prompts, SamplingParams(temperature=r.temperature, n=r.samples_per_prompt, seed=3,
                                            max_new_tokens=r.max_new_tokens))
    evals = [list(ex["prompt_ids"]) for ex in data.eval[: cfg.eval.batch_size]]
    engine.generate(evals, SamplingParams(temperature=0.0, n=1, seed=0, max_new_tokens=r.max_new_tokens))
    plan = plan_run(cfg, mesh, backend=jax.default_backend())
    ran = {key_name(k): k for k in engine.pool.keys()}
    assert {k.phase for k in ran.values()} >= {"prefill", "verify", "compact"}  # threshold 32: every chunk verifies
    for name, key in ran.items():
        assert name in plan.steps[key.phase].keys, (name, plan.steps[key.phase].keys)
    compared = set()
    for phase in ENGINE_STEPS - {"drafter"}:
        step = plan.steps[phase]
        compiled = [step.key, *step.also_compiled]
        assert len(set(compiled) & set(step.keys)) == len(compiled)  # the compiled keys are reachable ones
        if step.key in ran:
            assert _figures(step) == _memory(engine.pool._compiled[ran[step.key]], cfg.mesh.tensor), phase
            compared.add(phase)
        assert all(t <= step.transient_bytes for t in step.also_compiled.values())  # the largest is kept
    assert compared == {"prefill", "verify", "compact"}, compared
    # The job's prefill waves: a training wave (32 rows of 8 prompts) and an evaluation wave (one row per prompt).
    assert {ran[k].extra[0] for k in ran if k.startswith("prefill")} == {8, 32}
    assert set(plan.steps["prefill"].also_compiled) | {plan.steps["prefill"].key} == {
        k for k in ran if k.startswith("prefill")}


def test_cross_engine_bytes_are_those_of_collectives_spanning_an_engines_tensor_parallel_groups():
    """Engines of one TP group each (4 engines of tensor 2): every collective of an engine step stays inside its TP
    group (0 bytes across, but TP all-reduces); one engine over 8 devices with tensor 1: every collective spans TP
    groups (of one device), so all its bytes cross."""
    tp = plan_run(_cfg("--config.mesh.data=4", "--config.mesh.tensor=2", "--config.rollout.num_slices=-1"),
                  make_mesh(MeshConfig(data=4, fsdp=1, tensor=2)), backend="cpu")
    assert tp.engines == 4 and tp.engine_mesh == {"data": 1, "fsdp": 1, "tensor": 2}
    for k in ("prefill", "decode", "compact"):
        c = tp.steps[k].collectives
        assert c.cross_group_bytes == 0, (k, c)
    assert tp.steps["decode"].collectives.by_kind.get("all-reduce", 0) > 0  # the TP group's own
    dp = plan_run(_cfg(), make_mesh(MeshConfig(data=-1)), backend="cpu")
    assert dp.engines == 1 and dp.engine_mesh == {"data": 8, "fsdp": 1, "tensor": 1}
    for k in ("prefill", "decode", "compact"):
        c = dp.steps[k].collectives
        assert c.cross_group_bytes == c.bytes > 0, (k, c)


def test_the_plan_loads_the_runs_drafter_shape_with_its_draft_vocabulary(tmp_path):
    from flax import nnx as _nnx

    from tlt_jax.builders import build_data, build_engine, build_model
    from tlt_jax.drafter.eagle import EagleDrafter
    from tlt_jax.drafter.export import save_drafter

    base = _cfg()
    mcfg = ab.model_config(base)
    drafter = EagleDrafter(mcfg, rngs=_nnx.Rngs(0))
    drafter.set_draft_vocab(np.arange(3, 19))
    save_drafter(drafter, tmp_path / "d")
    np.save(tmp_path / "d" / "draft_vocab.npy", np.arange(3, 19, dtype=np.int32))
    cfg = _cfg("--config.rollout.speculative=eagle", f"--config.rollout.drafter_path={tmp_path / 'd'}",
               "--config.rollout.spec_depth=2", "--config.rollout.spec_topk=2", "--config.rollout.spec_verify_tokens=4")
    assert ab.eagle_drafter(cfg, mcfg)[1] == tuple(range(3, 19)) and ab.eagle_drafter(base, mcfg)[1] is None
    mesh = make_mesh(cfg.mesh)
    model, _ = build_model(cfg, mesh)
    engine = build_engine(cfg, model, mesh, build_data(cfg, None, model.config))
    eng = ab.abstract_engine(cfg, ab.abstract_policy(cfg, mcfg, mesh), mesh, jax.default_backend())
    _same(eng.engine.drafter_params, engine.drafter_params)
    assert any(x.shape == (16,) for x in jax.tree.leaves(eng.engine.drafter_params))  # the draft vocabulary
