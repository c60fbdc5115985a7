r"""Plan a run's per-device memory and collectives on N simulated devices or on real ones, without loading weights.

    python -m tlt_jax.plan --config=FILE [--config.key=value ...] (--devices=N | --target=TARGET)
        [--device_memory_gb=GB] [--json=PATH] [--shape=NAME] [--backend=gpu] [--bf16_temps=estimate]

The config is read as ``tlt_jax.main`` reads it. The run's mesh (``mesh.*``) is built over N simulated CPU devices
(``--devices``; set up before JAX starts, a process whose JAX already runs on fewer devices is refused) or over a
target's compile-only devices (``--target=h100:PxD`` / ``h200:PxD``: P processes x D GPUs for XLA:GPU;
``--target=v5p:AxBxC`` / ``v5e:AxB``: a TPU slice for libtpu; ``pip install -e '.[plan-gpu]'`` / ``'.[plan-tpu]'``;
no environment variable needed), its state abstractly, and every program the run executes is compiled ahead of time
by that compiler. XLA:CPU's temporaries for bfloat16 programs include float32 weight and cache copies, so on CPU a
bfloat16 rollout's prefill, decode and verify temporaries are by default estimated from a float32 copy's compile,
``--bf16_temps=compiled`` keeps XLA:CPU's (see ``tlt_jax.plan.core``); on a target the compiled figures are used.
Files the plan does not read may stay empty: data files (the prompt length is ``data.max_prompt_len``, or the
synthetic prompts' length) and, with ``--shape``, the model (``--shape=qwen2.5-7b`` gives Qwen2.5-7B's shape to a
config whose ``model.path`` is missing; ``tlt_jax.plan.SHAPES`` lists the names). ``--backend`` is the backend the
planned run uses (it resolves ``rollout.layers=auto``: unstacked on gpu; default: the target's platform, gpu with
``--devices``). Figures are decimal GB; the usable memory is ``device_memory_gb`` (default: the target's memory,
80 with ``--devices``) x MEMORY_FRACTION (0.9, the ``XLA_PYTHON_CLIENT_MEM_FRACTION`` that
launch/slurm/train.sbatch exports). Exit status: 0 fits, 1 does not fit (with one line naming config keys to
change), 2 bad command line or config.

``--json``: ``target`` ("h100:1x8", or "cpu:8" simulated), ``device_kind``, ``devices``, ``mesh``, ``engines``,
``engine_mesh``, ``device_memory_bytes``, ``peak_bytes``, ``peak_phase``, ``phases`` (rollout / update / reshard:
resident bytes, largest step, peak), ``fits``, ``resident`` (train_state, reference, rollout_copy, drafter,
decode_state, spot_trainer), ``steps`` (prefill, decode, verify, compact, drafter, reshard, train, logprobs,
logprobs_old; null with a ``notes`` entry when the run has none): argument / output / alias / temp / transient bytes,
``collective_bytes`` per call (loop trip counts applied) by kind, ``compile_s``, and for engine steps
``cross_engine_collective_bytes``, ``compiled_keys``, ``reachable_keys`` (a count) and ``other_keys``; then
``command``, ``config``, ``shape``, ``backend``, ``wall_s``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
UNREAD = "(not read by the plan)"


def define_flags() -> None:
    config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
    flags.DEFINE_integer("devices", None, "Simulated devices the run's mesh spans.")
    flags.DEFINE_string("target", None, "Real devices, compile-only: h100:PxD, h200:PxD, v5p:AxBxC, v5e:AxB.")
    flags.DEFINE_float("device_memory_gb", None, "Memory per device, GB (the usable share is x MEMORY_FRACTION; "
                       "default: the target's, 80 with --devices).")
    flags.DEFINE_string("json", None, "Write the plan as JSON here.")
    flags.DEFINE_string("shape", None, "A model shape name (tlt_jax.plan.SHAPES) instead of the config's model.")
    flags.DEFINE_enum("backend", None, ["gpu", "tpu", "cpu"],
                      "The backend of the planned run (its rollout layout; default: the target's platform, or gpu).")
    flags.DEFINE_enum("bf16_temps", "estimate", ["estimate", "compiled"],
                      "A bfloat16 rollout's decode / verify temporaries: estimated from a float32 compile, or "
                      "XLA:CPU's own (which hold float32 copies a GPU does not make).")


def setup_devices(n: int) -> list:
    """The first ``n`` of this process's CPU devices, after asking XLA for ``n`` simulated ones (effective only if
    JAX has not started its backend yet); an error when there are fewer."""
    flag = f"--xla_force_host_platform_device_count={n}"
    old = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{old} {flag}".strip()
    from tlt_jax.plan.targets import quiet_platforms

    quiet_platforms()
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
    except Exception:  # the backend already runs: keep its platform, check its devices below
        pass
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise app.UsageError(
            f"--devices={n}: JAX already runs with {len(devices)} CPU devices in this process, too few; run the plan "
            f"in a fresh process (python -m tlt_jax.plan) or start this one with XLA_FLAGS={flag}"
        )
    return devices[:n]


def setup_target(name: str):
    """(Target, its compile-only devices); a UsageError for an unknown target or a compiler not installed."""
    from tlt_jax.plan.targets import compile_only_devices, parse_target, quiet_platforms

    quiet_platforms()  # before JAX starts: with the plugins installed it would try to start their backends
    try:
        target = parse_target(name)
        return target, compile_only_devices(target)
    except (ValueError, ImportError) as e:
        raise app.UsageError(f"--target={name}: {e}") from e


def planning_config(config_dict, shape: str | None):
    """The run's Config, with the files the plan does not read filled in when empty (data.train_path; model.path
    when ``shape`` gives the model's shape)."""
    from tlt_jax.config import ConfigError, from_config_dict

    d = config_dict.to_dict()
    if d["data"]["source"] == "gsm8k_file" and not d["data"]["train_path"]:
        d["data"]["train_path"] = UNREAD
    if shape and d["model"]["source"] == "path" and not d["model"]["path"]:
        d["model"]["path"] = UNREAD
    try:
        return from_config_dict(d)
    except ConfigError as e:
        more = " (or give the plan the model's shape: --shape=NAME)" if "model.path" in str(e) else ""
        raise ConfigError(f"{e}{more}") from e


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag (see --helpfull)")
    if FLAGS.config is None:
        raise app.UsageError("--config=configs/<name>.py is required (e.g. --config=configs/tiny.py)")
    if (FLAGS.devices is None) == (FLAGS.target is None):
        raise app.UsageError("give one of --devices=N (N >= 1 simulated devices) or --target=h100:PxD | v5p:AxBxC ...")
    if FLAGS.devices is not None and FLAGS.devices < 1:
        raise app.UsageError("--devices=N (N >= 1 simulated devices) is required")
    if FLAGS.device_memory_gb is not None and FLAGS.device_memory_gb <= 0:
        raise app.UsageError(f"--device_memory_gb={FLAGS.device_memory_gb}: must be > 0")
    t0 = time.perf_counter()
    if FLAGS.target:
        target, devices = setup_target(FLAGS.target)
        name, memory_gb, backend = target.name, target.device_memory_gb, target.platform
    else:
        devices = setup_devices(FLAGS.devices)
        name, memory_gb, backend = f"cpu:{FLAGS.devices}", 80.0, "gpu"
    memory_gb = FLAGS.device_memory_gb or memory_gb
    backend = FLAGS.backend or backend
    from tlt_jax.config import ConfigError
    from tlt_jax.distributed import make_mesh
    from tlt_jax.plan import GB, MEMORY_FRACTION, plan_run

    cfg = planning_config(FLAGS.config, FLAGS.shape)
    try:
        mesh = make_mesh(cfg.mesh, devices)
    except ValueError as e:
        raise ConfigError(f"config.mesh: {e}") from e
    budget = int(memory_gb * GB * MEMORY_FRACTION)
    plan = plan_run(cfg, mesh, device_memory_bytes=budget, shape=FLAGS.shape, backend=backend,
                    log=lambda line: print(line, file=sys.stderr, flush=True), bf16_temps=FLAGS.bf16_temps)
    print(plan.table(), flush=True)
    if FLAGS.json:
        out = dict(plan.to_json(), target=name, device_kind=devices[0].device_kind, device_memory_gb=memory_gb,
                   backend=backend, shape=FLAGS.shape, config=cfg.name, wall_s=round(time.perf_counter() - t0, 1),
                   command=" ".join(["python -m tlt_jax.plan", *sys.argv[1:]]))
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
        with open(FLAGS.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    if plan.fits is False:
        print(f"error: {plan.refusal()}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    from tlt_jax import cli
    from tlt_jax.config import ConfigError
    from tlt_jax.models import ModelLoadError

    define_flags()
    cli.run(main, errors=(ConfigError, ModelLoadError))
