"""One value of the run's resolved config, for launch scripts: the main job's own flags, overrides and validation.

    python -m tlt_jax.config_value --key=checkpoint.stop_lead_s --config=configs/qwen2p5_7b_gsm8k.py [--config.k=v]

prints the value (JSON for anything but a string or a number). ``launch/slurm/train.sbatch`` reads the stop lead
this way from the same command line it gives the tasks, so the config is the one place that sets it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from absl import app, flags

from tlt_jax import main as main_job
from tlt_jax.config import ConfigError, from_config_dict
from tlt_jax.typed_config import as_plain

FLAGS = flags.FLAGS


def lookup(cfg, key: str):
    """The value at dotted ``key`` of a typed config; a ConfigError naming the first unknown part."""
    node, done = cfg, ""
    for part in key.split("."):
        if not hasattr(node, part):
            raise ConfigError(f"--key={key}: {done or 'the config'} has no key {part!r}")
        node, done = getattr(node, part), f"{done}.{part}".lstrip(".")
    return node


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
    if FLAGS.config is None or not FLAGS.key:
        raise app.UsageError("--config=configs/<name>.py and --key=<dotted key> are required")
    value = lookup(from_config_dict(FLAGS.config), FLAGS.key)
    print(value if isinstance(value, str | int | float) else json.dumps(as_plain(value)))


if __name__ == "__main__":
    from tlt_jax import cli

    main_job.define_flags()  # the tasks' command line parses here too (--workdir and the launch flags included)
    flags.DEFINE_string("key", None, "Dotted config key to print, e.g. checkpoint.stop_lead_s.")
    cli.run(main, errors=(ConfigError,))
