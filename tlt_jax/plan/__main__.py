r"""Plan a run's per-device memory and collectives on N simulated devices, without loading weights.

    python -m tlt_jax.plan --config=FILE [--config.key=value ...] --devices=N [--device_memory_gb=80]
        [--json=PATH] [--shape=NAME] [--backend=gpu] [--bf16_temps=estimate]

The config is read as ``tlt_jax.main`` reads it. The run's mesh (``mesh.*``) is built over N simulated CPU devices
(set up before JAX starts; a process whose JAX already runs on fewer devices is refused), its state abstractly, and
its steps are compiled ahead of time by XLA:CPU (whose sharding passes are XLA's own; its temporaries for bfloat16
programs include float32 weight and cache copies, so a bfloat16 rollout's decode and verify temporaries are by
default estimated from a float32 copy's compile, ``--bf16_temps=compiled`` keeps XLA:CPU's; see ``tlt_jax.plan.core``).
Files the plan does not read may stay empty: data files (the prompt length is ``data.max_prompt_len``, or the
synthetic prompts' length) and, with ``--shape``, the model (``--shape=qwen2.5-7b`` gives Qwen2.5-7B's shape to a
config whose ``model.path`` is missing; ``tlt_jax.plan.SHAPES`` lists the names). ``--backend`` is the backend the
planned run uses (it resolves ``rollout.layers=auto``: unstacked on gpu). Figures are decimal GB; the usable memory
is ``device_memory_gb`` x MEMORY_FRACTION (0.9, the ``XLA_PYTHON_CLIENT_MEM_FRACTION`` that
launch/slurm/train.sbatch exports). Exit status: 0 fits, 1 does not fit (with one line naming config keys to
change), 2 bad command line or config.
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
    flags.DEFINE_float("device_memory_gb", 80.0, "Memory per device, GB (the usable share is x MEMORY_FRACTION).")
    flags.DEFINE_string("json", None, "Write the plan as JSON here.")
    flags.DEFINE_string("shape", None, "A model shape name (tlt_jax.plan.SHAPES) instead of the config's model.")
    flags.DEFINE_enum("backend", "gpu", ["gpu", "tpu", "cpu"], "The backend of the planned run (its rollout layout).")
    flags.DEFINE_enum("bf16_temps", "estimate", ["estimate", "compiled"],
                      "A bfloat16 rollout's decode / verify temporaries: estimated from a float32 compile, or "
                      "XLA:CPU's own (which hold float32 copies a GPU does not make).")


def setup_devices(n: int) -> list:
    """The first ``n`` of this process's CPU devices, after asking XLA for ``n`` simulated ones (effective only if
    JAX has not started its backend yet); an error when there are fewer."""
    flag = f"--xla_force_host_platform_device_count={n}"
    old = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{old} {flag}".strip()
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
    if FLAGS.devices is None or FLAGS.devices < 1:
        raise app.UsageError("--devices=N (N >= 1 simulated devices) is required")
    if FLAGS.device_memory_gb <= 0:
        raise app.UsageError(f"--device_memory_gb={FLAGS.device_memory_gb}: must be > 0")
    t0 = time.perf_counter()
    devices = setup_devices(FLAGS.devices)
    from tlt_jax.config import ConfigError
    from tlt_jax.distributed import make_mesh
    from tlt_jax.plan import GB, MEMORY_FRACTION, plan_run

    cfg = planning_config(FLAGS.config, FLAGS.shape)
    try:
        mesh = make_mesh(cfg.mesh, devices)
    except ValueError as e:
        raise ConfigError(f"config.mesh: {e}") from e
    budget = int(FLAGS.device_memory_gb * GB * MEMORY_FRACTION)
    plan = plan_run(cfg, mesh, device_memory_bytes=budget, shape=FLAGS.shape, backend=FLAGS.backend,
                    log=lambda line: print(line, file=sys.stderr, flush=True), bf16_temps=FLAGS.bf16_temps)
    print(plan.table(), flush=True)
    if FLAGS.json:
        out = dict(plan.to_json(), device_memory_gb=FLAGS.device_memory_gb, backend=FLAGS.backend,
                   shape=FLAGS.shape, config=cfg.name, wall_s=round(time.perf_counter() - t0, 1),
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
