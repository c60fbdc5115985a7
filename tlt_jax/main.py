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

import contextlib
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


_clock = time.monotonic  # the wall-clock checkpoint interval's clock (tests replace it)


class _Job:
    """What one run holds (built by :func:`_open_job`, closed by :func:`run`'s ExitStack) and its checkpoint
    decisions: every ``checkpoint.every_steps`` steps, every ``checkpoint.every_minutes``, at a stop and at the end."""

    def __init__(self, cfg, workdir: str, **parts):
        self.cfg, self.workdir, self.diff = cfg, workdir, []
        self.start, self.consecutive, self.saved = 0, 0, set()
        self.t_start = self.last_save = 0.0
        self.__dict__.update(parts)

    def save(self, step: int) -> None:
        """Checkpoint ``step``: the train state, run key, data iterator, controller (counters, the adaptive bandit)
        and the online drafter's state."""
        engine = self.engine
        controller = {"step": step, "consecutive_nonfinite": self.consecutive, "time": time.time()}
        controller["engine"] = engine.state_dict() if hasattr(engine, "state_dict") else {}  # adaptive: the bandit
        controller["ngram_history"] = engine.history_state()  # rollout.ngram_history_bytes: the n-gram store
        self.ckpt.save(step, self.learner.state, rng=self.learner.run_key, data_iter=self.train_iter,
                       controller=controller, extra=self.online.extra())
        self.online.save(step, self.cfg.checkpoint.max_to_keep)
        self.saved.add(step)
        self.last_save = _clock()

    def check_stop(self, step: int) -> None:
        """After ``step`` (``start``: before the first): one collective over the processes, for a stop request, a
        failed checkpoint write or a due wall-clock checkpoint on any of them (so all decide alike); saves ``step``
        when the interval is due, and on a stop saves it (once) and raises Stopped."""
        import jax

        from tlt_jax.checkpoint import CheckpointWriteError
        from tlt_jax.distributed.preemption import agree_max

        ckpt, minutes = self.ckpt, self.cfg.checkpoint.every_minutes
        error = ckpt.poll()
        due = int(minutes > 0 and _clock() - self.last_save >= 60.0 * minutes)
        signum, failed, due = agree_max(self.stop.signum, jax.process_index() + 1 if error is not None else 0, due)
        if failed:
            if error is not None:
                raise error
            raise CheckpointWriteError(
                f"process {failed - 1} could not write a checkpoint to {ckpt.directory} (its log line says why); the "
                "checkpoints saved before are intact. Fix it and resume with the same --workdir."
            )
        if (due or signum) and step > self.start and step not in self.saved:
            self.save(step)
        if signum:
            ckpt.wait()
            raise Stopped(signum, step, ckpt.directory, saved=step in self.saved)

    def settle(self) -> None:
        """Before an update: the pending checkpoint save ends, and the host memory it wrote from goes back to the OS
        (left to the end of the step it would sit under the update's own, the run's peak: issue 42)."""
        self.ckpt.settle()
        _trim_host_heap()


def run(cfg, workdir: str, stop=None) -> dict[str, float]:
    """Train (resuming from ``workdir`` when it holds a checkpoint) and evaluate; returns the final metrics.

    ``stop`` (a tlt_jax.distributed.preemption.StopSignal; main() installs one for SIGTERM / SIGINT): once it is
    requested, the step in flight finishes, its checkpoint is saved and :class:`Stopped` is raised. Whatever the
    run opened (reward workers, drafter threads, checkpointer, metrics writers) is closed in one place, however it
    ends."""
    from tlt_jax.distributed.preemption import StopSignal

    t_start = time.perf_counter()
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    with contextlib.ExitStack() as resources:
        job = _open_job(cfg, workdir, resources)
        job.t_start, job.stop = t_start, stop if stop is not None else StopSignal()  # not installed: never set
        _resume(job)
        _open_outputs(job, resources)
        _train(job)
        return _finish(job)


def _open_job(cfg, workdir: str, resources: contextlib.ExitStack) -> _Job:
    """Mesh, start-up plan, policy, data, reward, engine, online drafter state, learner, prompt iterator and
    checkpointer; each one that holds threads or processes is registered with ``resources`` to be closed."""
    import jax

    from tlt_jax.checkpoint import Checkpointer, save_in_flight_bytes
    from tlt_jax.config import to_json
    from tlt_jax.controller.online import OnlineState
    from tlt_jax.data import prompt_dataset
    from tlt_jax.distributed import make_mesh
    from tlt_jax.distributed.multihost import ProcessShardedReward, is_primary
    from tlt_jax.plan import startup_check
    from tlt_jax.rl.learner import GRPOLearner, check_micro_batch

    job = _Job(cfg, workdir, config_json=to_json(cfg), old_config=os.path.join(workdir, "config.json"))
    if os.path.exists(job.old_config):
        with open(job.old_config) as f:
            job.diff = _config_diff(json.load(f), json.loads(job.config_json))
        if job.diff:
            log.warning("workdir %s was run with a different config: %s", workdir, "; ".join(job.diff))
    job.mesh = mesh = make_mesh(cfg.mesh)
    check_micro_batch(cfg, mesh)  # before the model loads: a micro-batch must split over the batch axes
    plan = startup_check(cfg, mesh)  # train.plan_check ("auto": GPU / TPU); a run that does not fit: ConfigError
    if plan is not None and jax.process_index() == 0:
        print(plan.summary(), flush=True)
    model, tokenizer = build_model(cfg, mesh)
    job.data = build_data(cfg, tokenizer, model.config)
    reward_fn = ProcessShardedReward(build_reward(cfg, tokenizer))  # each process scores the prompts it read
    if hasattr(reward_fn, "close"):
        resources.callback(reward_fn.close)
    job.primary = is_primary()  # only process 0 prints and writes; all take part in checkpoints
    job.engine = build_engine(cfg, model, mesh, job.data, workdir=workdir if job.primary else None)
    job.online = resources.enter_context(contextlib.closing(OnlineState(job.engine, mesh, workdir, job.primary)))
    job.learner = GRPOLearner(cfg, model, job.engine, reward_fn, mesh=mesh)
    del model
    job.train_iter = iter(prompt_dataset(job.data.train, cfg.data.prompts_per_step, seed=cfg.data.shuffle_seed,
                                         num_epochs=None, shard_index=jax.process_index(),
                                         shard_count=jax.process_count()))
    job.ckpt = resources.enter_context(contextlib.closing(Checkpointer(
        os.path.join(workdir, "checkpoints"),
        every_steps=cfg.checkpoint.every_steps,
        max_to_keep=cfg.checkpoint.max_to_keep,
        async_save=cfg.checkpoint.async_save,
        in_flight_bytes=save_in_flight_bytes(job.learner.state),  # the save beside the next rollout: bounded
    )))
    return job


def _resume(job: _Job) -> None:
    """Restore the newest readable checkpoint (if any) into the learner, online state and engine; a checkpoint of
    another model or layout is a ConfigError naming how this config differs from the workdir's."""
    import numpy as np

    from tlt_jax.checkpoint import IncompatibleCheckpointError, abstract_like
    from tlt_jax.config import ConfigError

    learner, cfg = job.learner, job.cfg
    try:
        restored = job.ckpt.restore(abstract_like(learner.state), data_iter=job.train_iter,
                                    abstract_extra=job.online.abstract_extra())
    except IncompatibleCheckpointError as e:
        changed = f" This config differs from {job.old_config} in: {'; '.join(job.diff)}." if job.diff else ""
        raise ConfigError(f"{e}{changed}") from e
    job.last_save = _clock()
    if restored is None:
        return
    if not np.array_equal(restored.rng, learner.run_key):
        log.warning(
            "train.seed=%d is not the seed this run started with (the checkpoint's run key %s): the resumed run "
            "keeps the checkpoint's key, so its steps are those of the uninterrupted run; to train with seed %d, "
            "start it in a new --workdir", cfg.train.seed, restored.rng.tolist(), cfg.train.seed)
    learner.load_state(restored.train_state, run_key=restored.rng)
    job.online.restore(restored.step, restored.extra)
    job.start = restored.step
    job.consecutive = int(restored.controller.get("consecutive_nonfinite", 0))
    job.saved = {job.start}
    restore_engine_state(job.engine, restored.controller)
    log.info("resumed from step %d in %s", job.start, job.ckpt.directory)


def _open_outputs(job: _Job, resources: contextlib.ExitStack) -> None:
    """The metrics writer (process 0's; the others' write nothing), the console table and the progress bars."""
    import jax

    from tlt_jax.distributed.multihost import NullWriter
    from tlt_jax.metrics import ConsoleTable, MetricsWriter, Progress
    from tlt_jax.metrics.plots import Plotter
    from tlt_jax.metrics.records import drop_steps_after
    from tlt_jax.metrics.writers import COLUMNS

    cfg, workdir, start = job.cfg, job.workdir, job.start
    writer = MetricsWriter(workdir, tensorboard=cfg.metrics.tensorboard, resume_step=start) if job.primary else None
    job.writer = resources.enter_context(contextlib.closing(writer or NullWriter()))
    job.writer.write_config(job.config_json)
    job.plots = Plotter(workdir)
    if job.primary:
        drop_steps_after(workdir, start)  # lengths / timeline rows of steps redone after a resume
    drafter_cols = (("drafter", "drafter/steps", "{:>7.0f}"), ("draft s", "controller/train_s", "{:>7.2f}"),
                    ("crit s", "drafter/critical_s", "{:>6.2f}"))
    format_col = (("format", "reward/format", "{:>6.3f}"),) if cfg.reward.format_weight > 0 else ()
    columns = COLUMNS[:3] + format_col + COLUMNS[3:] + (drafter_cols if cfg.drafter.online else ())
    job.table = ConsoleTable(
        speculative=cfg.rollout.speculative != "off", columns=columns, adaptive=cfg.rollout.speculative == "adaptive"
    )
    progress = Progress(cfg.train.num_steps, start, enabled=cfg.metrics.progress_bars and job.primary)
    job.progress = resources.enter_context(contextlib.closing(progress))
    if not job.primary:
        progress.write = lambda line: None
    data, params = job.data, job.learner.state.params
    progress.write(
        f"workdir {workdir} | {jax.device_count()} {jax.devices()[0].platform} devices, mesh {dict(job.mesh.shape)} | "
        f"policy {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M params | "
        f"{len(data.train)} train / {len(data.eval)} eval prompts | steps {start + 1}..{cfg.train.num_steps}"
    )
    job.eval_kwargs = dict(max_new_tokens=eval_max_new_tokens(cfg), batch_size=cfg.eval.batch_size)


def _train(job: _Job) -> None:
    """The RL steps from the one after ``job.start`` to ``train.num_steps`` (an evaluation first on a fresh run),
    each checkpointed when due; stops on too many non-finite steps in a row or a stop request."""
    cfg, ckpt, learner = job.cfg, job.ckpt, job.learner
    if cfg.eval.at_start and job.start == 0:
        m = learner.evaluate(job.data.eval, **job.eval_kwargs)
        job.writer.write(0, m, kind="eval")
        job.progress.write(f"eval at step 0: accuracy {m['eval/accuracy']:.3f} on {len(job.data.eval)} held-out "
                           "prompts")
    job.check_stop(job.start)
    for step in range(job.start + 1, cfg.train.num_steps + 1):
        metrics = _step(job, step)
        job.consecutive = job.consecutive + 1 if metrics["train/nonfinite_step"] else 0
        if job.consecutive >= cfg.train.max_nonfinite_steps:
            ckpt.wait()
            last = ckpt.latest_step()
            raise NonFiniteError(
                f"stopping at step {step}: {job.consecutive} consecutive steps had a non-finite loss or gradient "
                f"(their updates were skipped; {int(learner.state.skipped)} skipped in total). Checkpoints are "
                f"intact; the latest is step {last} in {ckpt.directory}. Lower optim.lr or check the data, then "
                f"resume with the same --workdir."
            )
        if ckpt.should_save(step) or step == cfg.train.num_steps:
            job.save(step)
        job.check_stop(step)


def _step(job: _Job, step: int) -> dict[str, float]:
    """One RL step on the next global batch: rollout, update, an evaluation when due; its metrics (reduced over the
    processes) written, plotted and printed."""
    from tlt_jax.distributed.multihost import gather_global_batch, reduce_metrics
    from tlt_jax.metrics.records import append_lengths

    cfg, progress, n_eval = job.cfg, job.progress, len(job.data.eval)
    examples = gather_global_batch(next(job.train_iter))  # this process's shard -> the global batch
    job.online.begin(step)
    # The previous step's checkpoint save ends before this step's update donates the state it reads.
    metrics = {**job.learner.step(step, examples, progress, before_update=job.settle), **job.online.metrics(),
               **job.data.info}
    if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < cfg.train.num_steps:
        metrics.update(job.learner.evaluate(job.data.eval, **job.eval_kwargs))
    metrics["time/elapsed_s"] = time.perf_counter() - job.t_start
    metrics = reduce_metrics(metrics)
    job.writer.write(step, metrics)
    if job.primary:
        append_lengths(job.workdir, step, job.learner.last_lengths)
        job.plots()  # at most once a minute
    progress.end_step()
    _trim_host_heap()
    job.table.print(dict(metrics, step=step), write=progress.write)
    if "eval/accuracy" in metrics:
        progress.write(f"eval at step {step}: accuracy {metrics['eval/accuracy']:.3f} on {n_eval} held-out prompts")
    return metrics


def _finish(job: _Job) -> dict[str, float]:
    """The final greedy evaluation, the adapted drafter's export, the final row (peak memory over the processes)."""
    from tlt_jax.distributed.multihost import reduce_metrics

    job.settle()  # the last save's host copies are gone before the final evaluation's rollout
    final = job.learner.evaluate(job.data.eval, **job.eval_kwargs)
    exported = job.online.export()
    if exported:
        job.progress.write(f"adapted drafter (EAGLE layout): {exported}")
    final["time/total_s"] = time.perf_counter() - job.t_start
    final.update(reduce_metrics({"memory/peak_rss_gib": _peak_rss_gib()}))  # the largest over the processes
    job.writer.write(job.cfg.train.num_steps, final, kind="final")
    if job.primary:
        job.plots(final=True)  # the final evaluation joins the held-out accuracy curve
    job.progress.write(
        f"final evaluation accuracy: {final['eval/accuracy']:.4f} on {len(job.data.eval)} held-out prompts "
        f"(greedy; total {final['time/total_s']:.0f} s; peak resident memory "
        f"{final['memory/peak_rss_gib']:.2f} GiB); plots in {os.path.join(job.workdir, 'plots')}"
    )
    return final


def _default_workdir(name: str) -> str:
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag (see --helpfull)")
    if FLAGS.config is None:
        raise app.UsageError("--config=configs/<name>.py is required (e.g. --config=configs/tiny.py)")
    from absl import logging as absl_logging

    from tlt_jax.checkpoint import CheckpointWriteError, UnreadableCheckpointError
    from tlt_jax.config import ConfigError, from_config_dict
    from tlt_jax.models import ModelLoadError

    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax / grain log every save at INFO
    log.setLevel(logging.INFO)
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
