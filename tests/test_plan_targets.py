"""``tlt_jax.plan`` on real compilers, compile-only: target parsing, keeping JAX on the CPU with the plugins
installed, the command line's target errors, and plans of the tiny run on 8 H100s (XLA:GPU) and a TPU v5e slice
(libtpu), each skipped where its compiler is not installed."""

import os
import subprocess
import sys

import pytest
from test_plan import REPO, _cfg

from tlt_jax.distributed import make_mesh
from tlt_jax.plan import GB, MEMORY_FRACTION, plan_run


def test_targets_parse_and_name_their_compiler():
    from tlt_jax.plan.targets import parse_target

    t = parse_target("h100:4x8")
    assert (t.kind, t.topology, t.platform, t.processes, t.device_memory_gb) == ("h100", "4x8", "gpu", 4, 80.0)
    t = parse_target("v5p:4x4x2")
    assert (t.kind, t.topology, t.platform, t.processes, t.device_memory_gb) == ("v5p", "4x4x2", "tpu", None, 95.0)
    assert parse_target("H200:1x8").device_memory_gb == 141.0 and parse_target("v5e:16x16").topology == "16x16"
    for bad in ("h100:8", "a100:1x8", "v5p", "h100:0x8", "cpu:8"):
        with pytest.raises(ValueError, match="target"):
            parse_target(bad)


def test_quiet_platforms_keeps_a_fresh_process_on_the_cpu_and_respects_a_choice():
    code = ("import os; from tlt_jax.plan.targets import quiet_platforms; quiet_platforms(); import jax; "
            "print(os.environ['JAX_PLATFORMS'], jax.default_backend())")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["cpu", "cpu"], out.stderr[-2000:]
    env["JAX_PLATFORMS"] = "cpu,tpu"  # a user's choice is kept
    code = code.split("; import jax")[0] + "; print(os.environ['JAX_PLATFORMS'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["cpu,tpu"], out.stderr[-2000:]


def test_command_line_rejects_a_bad_target_and_a_missing_device_choice():
    proc = subprocess.run([sys.executable, "-m", "tlt_jax.plan", "--config=configs/tiny.py", "--target=a100:1x8"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown target 'a100:1x8'" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "tlt_jax.plan", "--config=configs/tiny.py"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--devices=N" in proc.stderr and "--target" in proc.stderr


def _plan_on(target: str, *overrides):
    from tlt_jax.plan.targets import compile_only_devices, parse_target

    t = parse_target(target)
    devices = compile_only_devices(t)
    cfg = _cfg(*overrides)
    mesh = make_mesh(cfg.mesh, devices)
    return plan_run(cfg, mesh, device_memory_bytes=int(t.device_memory_gb * GB * MEMORY_FRACTION)), devices


def test_tiny_plan_on_eight_h100s_uses_the_gpu_compilers_own_figures():
    pytest.importorskip("jax_plugins.xla_cuda12")
    plan, devices = _plan_on("h100:1x8", "--config.mesh.data=4", "--config.mesh.tensor=2",
                             "--config.rollout.dtype=bfloat16", "--config.rollout.speculative=ngram")
    assert devices[0].device_kind == "NVIDIA H100 80GB HBM3" and plan.fits and plan.devices == 8
    assert all(plan.steps[k] for k in ("prefill", "decode", "verify", "compact", "reshard", "train", "logprobs"))
    assert {s.temp_source for s in plan.steps.values() if s} == {"compiled"}  # no CPU estimate on a real target
    train = plan.steps["train"].collectives
    assert train.unknown_trip_loops == 0 and train.bytes > train.static_bytes  # the layer scan's trip count applied
    assert plan.engine_mesh == {"data": 4, "fsdp": 1, "tensor": 2}
    decode = plan.steps["decode"].collectives
    assert 0 < decode.bytes and decode.cross_group_bytes <= decode.bytes


def test_tiny_plan_on_a_tpu_v5e_slice():
    pytest.importorskip("libtpu")
    plan, devices = _plan_on("v5e:2x2")
    assert plan.devices == 4 and "v5" in devices[0].device_kind.lower() and plan.fits
    assert all(plan.steps[k] for k in ("prefill", "decode", "compact", "train", "logprobs"))
    assert plan.steps["train"].collectives.unknown_trip_loops == 0  # trip counts read from the loops' conditions
