r"""GRPO training, the main job.

    python -m tlt_jax.main --config=configs/gsm8k.py [--config.key=value ...] [--workdir=DIR]

Builds the mesh, policy (+ frozen reference), tokenizer, prompt pipeline, reward, rollout engine (+ speculative
drafter), learner, checkpointer and metrics from the config; resumes from the newest readable checkpoint in
``--workdir``; runs the RL loop (one console row per step); ends with a greedy evaluation on held-out prompts.
Everything the run records lives in the workdir: config.json, metrics.jsonl, tensorboard/, checkpoints/.

SIGTERM / SIGINT (a scheduler's stop, Ctrl-C): the step in flight finishes, all processes agree on it, its
checkpoint is saved and the job exits with 128 + the signal (143 / 130) after one line saying where it saved; a
second signal exits at once (tlt_jax.distributed.preemption). Exit statuses: 0 done, 2 bad config / launch / data,
3 non-finite losses, 4 a checkpoint could not be written (disk full, directory not writable), 128 + signal stopped.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """--config (ml_collections file, locked: overrides of unknown keys fail) and --workdir; defined only when run as
    the entry point, so importing this module (tests, benchmarks) adds no global flags."""
    config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
    flags.DEFINE_string(
        "workdir", None, "Run directory (resumed if it holds checkpoints). Default: runs/<name>-<time>."
    )
    # Multi-process runs: all three, or none (then launch/local.sh's or SLURM's environment, else one process).
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0's jax.distributed coordinator.")
    flags.DEFINE_integer("num_processes", None, "Number of processes in the job.")
    flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")


log = logging.getLogger("tlt_jax")

EXIT_CONFIG_ERROR = 2
EXIT_NONFINITE = 3
EXIT_CHECKPOINT_WRITE = 4


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


class Stopped(Exception):
    """The run stopped on a signal after ``step`` (its checkpoint is in ``directory``); exit with ``status``."""

    def __init__(self, signum: int, step: int, directory: str, saved: bool):
        from tlt_jax.distributed.preemption import exit_status, signal_name

        self.signum, self.step, self.directory, self.status = signum, step, directory, exit_status(signum)
        name = signal_name(signum)
        super().__init__(
            f"stopped by {name} after step {step}: checkpoint in {directory}; resume with the same --workdir"
            if saved
            else f"stopped by {name} before step {step + 1}: nothing to save yet; start again with the same --workdir"
        )


def _quiet_failed_save_noise() -> None:
    """A failed background save is reported by the Checkpointer as one line (CheckpointWriteError); drop the noise
    the same failure makes on the console: orbax logs it with its traceback (several times), asyncio reports the
    failed writes' futures as "exception was never retrieved" when they are collected, tensorstore writes still in
    flight when orbax closes its event loop each print "RuntimeError: Event loop is closed" when they end, and Python
    warns about the save's coroutines that never ran."""
    import logging as std_logging

    class _Filter(std_logging.Filter):
        def filter(self, record):
            return not (record.exc_info and f"{os.sep}orbax{os.sep}" in (record.pathname or ""))

    std_logging.getLogger("absl").addFilter(_Filter())

    class _OrphanedWrites(std_logging.Filter):  # the failed writes' futures, reported when collected (at exit)
        def filter(self, record):
            text = record.getMessage()
            return not ("exception was never retrieved" in text and ".orbax-checkpoint-tmp" in text)

    std_logging.getLogger("asyncio").addFilter(_OrphanedWrites())
    # ... and the coroutines it had made for the save and never ran, reported when they are collected.
    import warnings

    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    previous = sys.unraisablehook

    def hook(info):
        tb, last = info.exc_traceback, None
        while tb is not None:
            last, tb = tb, tb.tb_next
        closed_loop = isinstance(info.exc_value, RuntimeError) and str(info.exc_value) == "Event loop is closed"
        if closed_loop and last is not None and f"asyncio{os.sep}" in last.tb_frame.f_code.co_filename:
            return
        previous(info)

    sys.unraisablehook = hook


def _enable_compilation_cache() -> None:
    import jax

    from tlt_jax.models.presets import cache_dir

    path = os.environ.get("TLT_JAX_COMPILATION_CACHE") or str(cache_dir() / "xla")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# The builders of the job (model, data, reward, engine) live in tlt_jax.builders.
from tlt_jax.builders import (  # noqa: E402
    build_data,
    build_engine,
    build_model,
    build_reward,
    eval_max_new_tokens,
    restore_engine_state,
)


def _peak_rss_gib() -> float:
    """This process's peak resident set size so far, in GiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def _trim_host_heap() -> None:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim``; a no-op elsewhere): compiles and host copies
    of a step leave freed memory that the allocator keeps, which would count in every later phase's resident set."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def run(cfg, workdir: str, stop=None) -> dict[str, float]:
    """Train (resuming from ``workdir`` when it holds a checkpoint) and evaluate; returns the final metrics.

    ``stop`` (a tlt_jax.distributed.preemption.StopSignal; main() installs one for SIGTERM / SIGINT): once it is
    requested, the step in flight finishes, its checkpoint is saved and :class:`Stopped` is raised."""
    import jax
    import numpy as np

    from tlt_jax.checkpoint import (
        Checkpointer,
        CheckpointWriteError,
        IncompatibleCheckpointError,
        abstract_like,
        save_in_flight_bytes,
    )
    from tlt_jax.config import ConfigError, to_json
    from tlt_jax.controller.online import OnlineState
    from tlt_jax.data import prompt_dataset
    from tlt_jax.distributed import make_mesh
    from tlt_jax.distributed.multihost import (
        NullWriter,
        ProcessShardedReward,
        gather_global_batch,
        is_primary,
        reduce_metrics,
    )
    from tlt_jax.distributed.preemption import StopSignal, agree_max
    from tlt_jax.metrics import ConsoleTable, MetricsWriter, Progress
    from tlt_jax.metrics.plots import write_plots
    from tlt_jax.metrics.records import append_lengths, drop_steps_after
    from tlt_jax.metrics.writers import COLUMNS
    from tlt_jax.plan import startup_check
    from tlt_jax.rl.learner import GRPOLearner, check_micro_batch

    t_start = time.perf_counter()
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    config_json = to_json(cfg)
    old_config = os.path.join(workdir, "config.json")
    diff = []
    if os.path.exists(old_config):
        with open(old_config) as f:
            diff = _config_diff(json.load(f), json.loads(config_json))
        if diff:
            log.warning("workdir %s was run with a different config: %s", workdir, "; ".join(diff))

    mesh = make_mesh(cfg.mesh)
    check_micro_batch(cfg, mesh)  # before the model loads: a micro-batch must split over the batch axes
    plan = startup_check(cfg, mesh)  # train.plan_check ("auto": GPU / TPU); a run that does not fit: ConfigError
    if plan is not None and jax.process_index() == 0:
        print(plan.summary(), flush=True)
    model, tokenizer = build_model(cfg, mesh)
    data = build_data(cfg, tokenizer, model.config)
    reward_fn = ProcessShardedReward(build_reward(cfg, tokenizer))  # each process scores the prompts it read
    primary = is_primary()  # only process 0 prints and writes; all take part in checkpoints
    engine = build_engine(cfg, model, mesh, data, workdir=workdir if primary else None)
    online = OnlineState(engine, mesh, workdir, primary)
    learner = GRPOLearner(cfg, model, engine, reward_fn, mesh=mesh)
    del model
    train_iter = iter(
        prompt_dataset(
            data.train,
            cfg.data.prompts_per_step,
            seed=cfg.data.shuffle_seed,
            num_epochs=None,
            shard_index=jax.process_index(),
            shard_count=jax.process_count(),
        )
    )
    stop = stop if stop is not None else StopSignal()  # not installed: never set (in-process runs, tests)
    try:
        ckpt = Checkpointer(
            os.path.join(workdir, "checkpoints"),
            every_steps=cfg.checkpoint.every_steps,
            max_to_keep=cfg.checkpoint.max_to_keep,
            async_save=cfg.checkpoint.async_save,
            in_flight_bytes=save_in_flight_bytes(learner.state),  # the save beside the next rollout: bounded
        )
    except Exception:
        online.close()
        if hasattr(reward_fn, "close"):
            reward_fn.close()
        raise
    try:
        restored = ckpt.restore(
            abstract_like(learner.state), data_iter=train_iter, abstract_extra=online.abstract_extra()
        )
    except Exception as e:
        ckpt.close()
        online.close()
        if hasattr(reward_fn, "close"):
            reward_fn.close()
        if isinstance(e, IncompatibleCheckpointError):
            changed = f" This config differs from {old_config} in: {'; '.join(diff)}." if diff else ""
            raise ConfigError(f"{e}{changed}") from e
        raise
    start, consecutive = 0, 0
    if restored is not None:
        if not np.array_equal(restored.rng, learner.run_key):
            log.warning(
                "train.seed=%d is not the seed this run started with (the checkpoint's run key %s): the resumed run "
                "keeps the checkpoint's key, so its steps are those of the uninterrupted run; to train with seed %d, "
                "start it in a new --workdir",
                cfg.train.seed,
                restored.rng.tolist(),
                cfg.train.seed,
            )
        learner.load_state(restored.train_state, run_key=restored.rng)
        online.restore(restored.step, restored.extra)
        start = restored.step
        consecutive = int(restored.controller.get("consecutive_nonfinite", 0))
        restore_engine_state(engine, restored.controller)
        log.info("resumed from step %d in %s", start, ckpt.directory)

    writer = MetricsWriter(workdir, tensorboard=cfg.metrics.tensorboard, resume_step=start) if primary else NullWriter()
    writer.write_config(config_json)
    if primary:
        drop_steps_after(workdir, start)  # lengths / timeline rows of steps redone after a resume
    drafter_cols = (("drafter", "drafter/steps", "{:>7.0f}"), ("draft s", "controller/train_s", "{:>7.2f}"),
                    ("crit s", "drafter/critical_s", "{:>6.2f}"))
    format_col = (("format", "reward/format", "{:>6.3f}"),) if cfg.reward.format_weight > 0 else ()
    columns = COLUMNS[:3] + format_col + COLUMNS[3:] + (drafter_cols if cfg.drafter.online else ())
    table = ConsoleTable(
        speculative=cfg.rollout.speculative != "off", columns=columns, adaptive=cfg.rollout.speculative == "adaptive"
    )
    progress = Progress(cfg.train.num_steps, start, enabled=cfg.metrics.progress_bars and primary)
    if not primary:
        progress.write = lambda line: None
    progress.write(
        f"workdir {workdir} | {jax.device_count()} {jax.devices()[0].platform} devices, mesh {dict(mesh.shape)} | "
        f"policy {sum(x.size for x in jax.tree.leaves(learner.state.params)) / 1e6:.1f}M params | "
        f"{len(data.train)} train / {len(data.eval)} eval prompts | steps {start + 1}..{cfg.train.num_steps}"
    )
    eval_kwargs = dict(max_new_tokens=eval_max_new_tokens(cfg), batch_size=cfg.eval.batch_size)

    saved = {start} if restored is not None else set()

    def save(step: int) -> None:
        controller = {"step": step, "consecutive_nonfinite": consecutive, "time": time.time()}
        controller["engine"] = engine.state_dict() if hasattr(engine, "state_dict") else {}  # adaptive: the bandit
        ckpt.save(
            step, learner.state, rng=learner.run_key, data_iter=train_iter, controller=controller,
            extra=online.extra(),
        )
        online.save(step, cfg.checkpoint.max_to_keep)
        saved.add(step)

    def check_stop(step: int) -> None:
        """After ``step`` (``start``: before the first): one collective over the processes, for a stop request or a
        failed checkpoint write on any of them; on a stop, save ``step`` (once) and raise Stopped."""
        error = ckpt.poll()
        signum, failed = agree_max(stop.signum, jax.process_index() + 1 if error is not None else 0)
        if failed:
            if error is not None:
                raise error
            raise CheckpointWriteError(
                f"process {failed - 1} could not write a checkpoint to {ckpt.directory} (its log line says why); the "
                "checkpoints saved before are intact. Fix it and resume with the same --workdir."
            )
        if signum:
            if step > start and step not in saved:
                save(step)
            ckpt.wait()
            raise Stopped(signum, step, ckpt.directory, saved=step in saved)

    def settle() -> None:
        """Before an update: the pending checkpoint save ends, and the host memory it wrote from goes back to the OS
        (left to the end of the step it would sit under the update's own, the run's peak: issue 42)."""
        ckpt.settle()
        _trim_host_heap()

    final: dict[str, float] = {}
    try:
        if cfg.eval.at_start and start == 0:
            m = learner.evaluate(data.eval, **eval_kwargs)
            writer.write(0, m, kind="eval")
            progress.write(f"eval at step 0: accuracy {m['eval/accuracy']:.3f} on {len(data.eval)} held-out prompts")
        check_stop(start)
        for step in range(start + 1, cfg.train.num_steps + 1):
            examples = gather_global_batch(next(train_iter))  # this process's shard -> the global batch
            online.begin(step)
            # The previous step's checkpoint save ends before this step's update donates the state it reads.
            metrics = {**learner.step(step, examples, progress, before_update=settle), **online.metrics(),
                       **data.info}
            if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < cfg.train.num_steps:
                metrics.update(learner.evaluate(data.eval, **eval_kwargs))
            metrics["time/elapsed_s"] = time.perf_counter() - t_start
            metrics = reduce_metrics(metrics)
            writer.write(step, metrics)
            if primary:
                append_lengths(workdir, step, learner.last_lengths)
                write_plots(workdir)
            progress.end_step()
            _trim_host_heap()
            table.print(dict(metrics, step=step), write=progress.write)
            if "eval/accuracy" in metrics:
                progress.write(f"eval at step {step}: accuracy {metrics['eval/accuracy']:.3f} on {len(data.eval)} "
                               "held-out prompts")
            consecutive = consecutive + 1 if metrics["train/nonfinite_step"] else 0
            if consecutive >= cfg.train.max_nonfinite_steps:
                ckpt.wait()
                last = ckpt.latest_step()
                raise NonFiniteError(
                    f"stopping at step {step}: {consecutive} consecutive steps had a non-finite loss or gradient "
                    f"(their updates were skipped; {int(learner.state.skipped)} skipped in total). Checkpoints are "
                    f"intact; the latest is step {last} in {ckpt.directory}. Lower optim.lr or check the data, then "
                    f"resume with the same --workdir."
                )
            if ckpt.should_save(step) or step == cfg.train.num_steps:
                save(step)
            check_stop(step)
        settle()  # the last save's host copies are gone before the final evaluation's rollout
        final = learner.evaluate(data.eval, **eval_kwargs)
        exported = online.export()
        if exported:
            progress.write(f"adapted drafter (EAGLE layout): {exported}")
        final["time/total_s"] = time.perf_counter() - t_start
        final.update(reduce_metrics({"memory/peak_rss_gib": _peak_rss_gib()}))  # the largest over the processes
        writer.write(cfg.train.num_steps, final, kind="final")
        if primary:
            write_plots(workdir)  # the final evaluation joins the held-out accuracy curve
        progress.write(
            f"final evaluation accuracy: {final['eval/accuracy']:.4f} on {len(data.eval)} held-out prompts "
            f"(greedy; total {final['time/total_s']:.0f} s; peak resident memory "
            f"{final['memory/peak_rss_gib']:.2f} GiB); plots in {os.path.join(workdir, 'plots')}"
        )
    finally:
        progress.close()
        ckpt.close()
        online.close()
        writer.close()
        if hasattr(reward_fn, "close"):
            reward_fn.close()
    return final


def _default_workdir(name: str) -> str:
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag (see --helpfull)")
    from absl import logging as absl_logging

    from tlt_jax.checkpoint import CheckpointWriteError, UnreadableCheckpointError
    from tlt_jax.config import ConfigError, from_config_dict
    from tlt_jax.models import ModelLoadError

    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax / grain log every save at INFO
    log.setLevel(logging.INFO)
    if FLAGS.config is None:
        raise app.UsageError("--config=configs/<name>.py is required (e.g. --config=configs/tiny.py)")
    try:
        cfg = from_config_dict(FLAGS.config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    from tlt_jax.distributed.runtime import initialize, resolve_launch

    try:
        launch = resolve_launch(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    except ValueError as e:
        print(f"launch error: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    initialize(launch)
    # After jax.distributed's start-up (its preemption notifier takes SIGTERM): from here a first SIGTERM / SIGINT
    # finishes the step and saves, a second exits at once.
    from tlt_jax.distributed.preemption import StopSignal

    stop = StopSignal().install()
    _quiet_failed_save_noise()
    _enable_compilation_cache()
    workdir = FLAGS.workdir or _default_workdir(cfg.name)
    if launch is not None:  # one run directory for all processes: process 0's
        from tlt_jax.distributed.multihost import allgather_objects

        workdir = allgather_objects(workdir)[0]
    try:
        run(cfg, workdir, stop=stop)
    except Stopped as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(e.status)
    except (FileNotFoundError, ModelLoadError, ConfigError, UnreadableCheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_NONFINITE)
    except CheckpointWriteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_CHECKPOINT_WRITE)


if __name__ == "__main__":
    from tlt_jax import cli

    define_flags()
    cli.run(main)
