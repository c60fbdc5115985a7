r"""GRPO training, the main job.

    python -m tlt_jax.main --config=configs/gsm8k.py [--config.key=value ...] [--workdir=DIR]

Builds the mesh, policy (+ frozen reference), tokenizer, prompt pipeline, reward, rollout engine (+ speculative
drafter), learner, checkpointer and metrics from the config; resumes from the newest readable checkpoint in
``--workdir``; runs the RL loop (one console row per step); ends with a greedy evaluation on held-out prompts.
Everything the run records lives in the workdir: config.json, metrics.jsonl, tensorboard/, checkpoints/.
"""

from __future__ import annotations

import dataclasses
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


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


def _enable_compilation_cache() -> None:
    import jax

    from tlt_jax.models.presets import cache_dir

    path = os.environ.get("TLT_JAX_COMPILATION_CACHE") or str(cache_dir() / "xla")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# ----- builders ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Data:
    train: list[dict]
    eval: list[dict]
    info: dict[str, float]


def synthetic_examples(cfg, vocab_size: int, avoid: Sequence[int], count: int, seed: int) -> list[dict]:
    """Random prompts (ids never equal to the target or special tokens) for the target-token task."""
    import numpy as np

    s = cfg.data.synthetic
    banned = {s.target_token, *avoid}
    candidates = np.array([t for t in range(vocab_size) if t not in banned])
    ids = np.random.default_rng(seed).choice(candidates, size=(count, s.prompt_len))
    return [
        {"prompt_ids": row.tolist(), "ground_truth": str(s.target_token), "id": f"synthetic-{seed}-{i}"}
        for i, row in enumerate(ids)
    ]


def tiny_model_config(cfg, **overrides):
    """The ModelConfig of ``model.source="tiny"`` (``overrides`` replace fields, e.g. for a mismatched drafter)."""
    from tlt_jax.models import tiny_config

    t = cfg.model.tiny
    shape = dict(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_layers=t.num_layers,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
    )
    return tiny_config(**{**shape, **overrides})


def build_model(cfg, mesh):
    """(policy model placed on the mesh, tokenizer or None)."""
    import jax.numpy as jnp
    from flax import nnx

    from tlt_jax.distributed import init_sharded, shard_module
    from tlt_jax.models import CausalLM, load_model_and_tokenizer
    from tlt_jax.models.presets import DEFAULT_MODEL

    dtype = jnp.dtype(cfg.model.dtype)
    if cfg.model.source == "tiny":
        mcfg = tiny_model_config(cfg)
        model = init_sharded(lambda: CausalLM(mcfg, dtype=dtype, rngs=nnx.Rngs(cfg.model.tiny.init_seed)), mesh)
        tokenizer = None
    else:
        path = DEFAULT_MODEL if cfg.model.source == "smollm2" else cfg.model.path
        # HF directories are read shard by shard into the mesh (each process only its devices' slices).
        model, tokenizer = load_model_and_tokenizer(path, dtype, jnp.float32, mesh=mesh)
        model = shard_module(model, mesh)  # GGUF loads whole; already-sharded HF params stay where they are
    model.remat = cfg.model.remat
    return model, tokenizer


def build_data(cfg, tokenizer, model_config) -> Data:
    """Training and held-out evaluation examples, each with ``prompt_ids`` and ``ground_truth``."""
    from tlt_jax.config import ConfigError
    from tlt_jax.data import PromptFormatter, filter_by_prompt_length, gsm_symbolic_splits, load_gsm8k_file

    d = cfg.data
    info: dict[str, float] = {}
    if d.source == "synthetic":
        avoid = [
            *model_config.eos_token_ids,
            *([model_config.bos_token_id] if model_config.bos_token_id is not None else []),
        ]
        train = synthetic_examples(cfg, model_config.vocab_size, avoid, d.synthetic.num_prompts, d.synthetic.seed)
        evals = synthetic_examples(cfg, model_config.vocab_size, avoid, d.eval_size, d.synthetic.seed + 1_000_003)
        return Data(train, evals, info)
    template = tokenizer.apply_chat_template if d.chat_template else None
    formatter = PromptFormatter(chat_template=template)
    if d.source == "gsm_symbolic":
        splits = gsm_symbolic_splits(d.train_size, d.eval_size, d.train_seed, d.eval_seed, formatter)
        train, evals = splits.train, splits.eval
    else:
        f = load_gsm8k_file(d.train_path, formatter)
        info["data/malformed_rows"] = float(f.num_skipped)
        train = f.examples
        if d.eval_path:
            e = load_gsm8k_file(d.eval_path, formatter)
            info["data/eval_malformed_rows"] = float(e.num_skipped)
            evals = e.examples[: d.eval_size]
        else:  # hold out the last eval_size rows of the training file
            if len(train) <= d.eval_size:
                raise ConfigError(
                    f"{d.train_path}: {len(train)} usable rows cannot give {d.eval_size} held-out rows plus training "
                    "rows; set data.eval_path or lower data.eval_size"
                )
            train, evals = train[: -d.eval_size], train[-d.eval_size :]
    train, dropped = filter_by_prompt_length(train, tokenizer.encode, d.max_prompt_len)
    evals, dropped_eval = filter_by_prompt_length(evals, tokenizer.encode, d.max_prompt_len)
    info["data/dropped_long_prompts"] = float(dropped + dropped_eval)
    if len(train) < d.prompts_per_step or not evals:
        raise ConfigError(
            f"only {len(train)} training / {len(evals)} eval prompts fit data.max_prompt_len={d.max_prompt_len}; "
            f"need at least data.prompts_per_step={d.prompts_per_step} and 1"
        )
    for ex in train + evals:
        ex["prompt_ids"] = tokenizer.encode(ex["prompt_text"])
    info["data/train_examples"] = float(len(train))
    info["data/eval_examples"] = float(len(evals))
    return Data(train, evals, info)


def build_reward(cfg, tokenizer):
    from tlt_jax.rewards import GSM8KReward, TargetTokenReward

    if cfg.data.source == "synthetic":
        return TargetTokenReward(cfg.rollout.max_new_tokens)
    return GSM8KReward(tokenizer, cfg.reward.num_workers, cfg.reward.timeout_s)


def eval_max_new_tokens(cfg) -> int:
    return cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens


def load_eagle_drafter(cfg, model_config):
    """The EAGLE drafter in ``rollout.drafter_path`` (compute dtype of the policy), checked against the policy's
    shape; a ConfigError naming the path and how to write a drafter when it cannot serve this policy."""
    import pathlib

    import jax.numpy as jnp

    from tlt_jax.config import ConfigError
    from tlt_jax.drafter.export import CONFIG_FILE, load_drafter

    path = cfg.rollout.drafter_path
    model_flag = {"path": f" --model={cfg.model.path}", "smollm2": ""}.get(cfg.model.source, " --model=POLICY")
    how = f"write a drafter for this policy with `python -m tlt_jax.drafter.warmup{model_flag} --out={path}`"
    if not (pathlib.Path(path) / CONFIG_FILE).is_file():
        hint = ""
        if (pathlib.Path(path) / "config.json").is_file():
            hint = " (this looks like the EAGLE/SGLang export, DIR/eagle: give the warm-up's DIR itself)"
        raise ConfigError(f"config.rollout.drafter_path: {path} holds no {CONFIG_FILE}{hint}; {how}")
    try:
        drafter = load_drafter(path, jnp.dtype(cfg.model.dtype))
    except Exception as e:  # unreadable json / safetensors, missing or mis-shaped tensors
        raise ConfigError(f"config.rollout.drafter_path: cannot load the drafter in {path}: {e}; {how}") from e
    d = drafter.config
    for f in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
        if getattr(d, f) != getattr(model_config, f):
            raise ConfigError(
                f"config.rollout.drafter_path: the drafter in {path} was made for another policy ({f}="
                f"{getattr(d, f)}, the policy's is {getattr(model_config, f)}); {how}"
            )
    if cfg.rollout.spec_topk > model_config.vocab_size:
        raise ConfigError(
            f"config.rollout.spec_topk: {cfg.rollout.spec_topk} exceeds the policy's vocabulary "
            f"({model_config.vocab_size})"
        )
    return drafter


def build_engine(cfg, model, mesh, data: Data):
    """The rollout engine on the training mesh (colocated). With ``rollout.speculative`` "ngram" or "eagle" (the
    drafter loaded from ``rollout.drafter_path``, fixed for the run) it decodes speculatively once a wave has at most
    ``rollout.spec_threshold`` live rows, with the ``rollout.spec_*`` tree shape."""
    from tlt_jax.rl.learner import bucket_length
    from tlt_jax.rollout import RolloutEngine, SpecConfig

    longest = max(len(ex["prompt_ids"]) for ex in data.train + data.eval)
    max_len = bucket_length(longest + max(cfg.rollout.max_new_tokens, eval_max_new_tokens(cfg)))
    rows = cfg.data.prompts_per_step * cfg.rollout.samples_per_prompt
    r = cfg.rollout
    spec = {}
    if r.speculative == "adaptive":
        spec = adaptive_spec(cfg, model.config)
    elif r.speculative != "off":
        tree = SpecConfig(
            depth=r.spec_depth, topk=r.spec_topk, verify_tokens=r.spec_verify_tokens, threshold=r.spec_threshold
        )
        drafter = "ngram" if r.speculative == "ngram" else load_eagle_drafter(cfg, model.config)
        spec = dict(drafter=drafter, spec=tree)
    return RolloutEngine(
        model,
        mesh,
        **spec,
        max_batch=max(rows, cfg.eval.batch_size),
        max_len=max_len,
        tail_threshold=max(1, rows // 4),
    )


def adaptive_spec(cfg, model_config) -> dict:
    """Engine arguments of ``rollout.speculative="adaptive"``: the bandit over ``rollout.spec_arms``, with the EAGLE
    drafter of ``rollout.drafter_path`` when an arm needs it. Seeded by train.seed, so every process (and a rerun)
    takes the same decisions from the same measurements."""
    from tlt_jax.adaptive import parse_arms
    from tlt_jax.rollout import SpecConfig

    r = cfg.rollout
    arms = parse_arms(r.spec_arms)
    spec = SpecConfig(
        arms=arms,
        epsilon=r.spec_epsilon,
        window=r.spec_window,
        patience=r.spec_patience,
        threshold=r.spec_threshold,
        seed=cfg.train.seed,
    )
    eagle = any(a.kind == "eagle" for a in arms)
    return dict(drafter=load_eagle_drafter(cfg, model_config) if eagle else None, spec=spec)


def restore_engine_state(engine, controller: dict) -> None:
    """Adaptive rollouts resume with the checkpoint's bandit (its measurements and exploration generator); a bandit
    over other arms is a ConfigError (the arms must match to resume)."""
    from tlt_jax.config import ConfigError

    saved = controller.get("engine") or {}
    if getattr(engine, "bandit", None) is None or not saved.get("bandit"):
        if getattr(engine, "bandit", None) is not None:
            log.info("the checkpoint holds no bandit state: the adaptive rollout starts its bandit afresh")
        return
    try:
        engine.load_state_dict(saved)
    except ValueError as e:
        raise ConfigError(f"config.rollout.spec_arms: {e}") from e


# ----- the run ----------------------------------------------------------------------------------------------------


def _config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def run(cfg, workdir: str) -> dict[str, float]:
    """Train (resuming from ``workdir`` when it holds a checkpoint) and evaluate; returns the final metrics."""
    import jax
    import numpy as np

    from tlt_jax.checkpoint import Checkpointer, IncompatibleCheckpointError, abstract_like
    from tlt_jax.config import ConfigError, to_json
    from tlt_jax.data import prompt_dataset
    from tlt_jax.distributed import make_mesh
    from tlt_jax.distributed.multihost import (
        NullWriter,
        ProcessShardedReward,
        gather_global_batch,
        is_primary,
        reduce_metrics,
    )
    from tlt_jax.metrics import ConsoleTable, MetricsWriter, Progress
    from tlt_jax.rl.learner import GRPOLearner

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
    model, tokenizer = build_model(cfg, mesh)
    data = build_data(cfg, tokenizer, model.config)
    reward_fn = ProcessShardedReward(build_reward(cfg, tokenizer))  # each process scores the prompts it read
    engine = build_engine(cfg, model, mesh, data)
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
    ckpt = Checkpointer(
        os.path.join(workdir, "checkpoints"),
        every_steps=cfg.checkpoint.every_steps,
        max_to_keep=cfg.checkpoint.max_to_keep,
        async_save=cfg.checkpoint.async_save,
    )
    try:
        restored = ckpt.restore(abstract_like(learner.state), data_iter=train_iter)
    except Exception as e:
        ckpt.close()
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
        start = restored.step
        consecutive = int(restored.controller.get("consecutive_nonfinite", 0))
        restore_engine_state(engine, restored.controller)
        log.info("resumed from step %d in %s", start, ckpt.directory)

    primary = is_primary()  # only process 0 prints and writes; all take part in checkpoints
    writer = MetricsWriter(workdir, tensorboard=cfg.metrics.tensorboard, resume_step=start) if primary else NullWriter()
    writer.write_config(config_json)
    table = ConsoleTable(speculative=cfg.rollout.speculative != "off")
    progress = Progress(cfg.train.num_steps, start, enabled=cfg.metrics.progress_bars and primary)
    if not primary:
        progress.write = lambda line: None
    progress.write(
        f"workdir {workdir} | {jax.device_count()} {jax.devices()[0].platform} devices, mesh {dict(mesh.shape)} | "
        f"policy {sum(x.size for x in jax.tree.leaves(learner.state.params)) / 1e6:.1f}M params | "
        f"{len(data.train)} train / {len(data.eval)} eval prompts | steps {start + 1}..{cfg.train.num_steps}"
    )
    eval_kwargs = dict(max_new_tokens=eval_max_new_tokens(cfg), batch_size=cfg.eval.batch_size)

    def save(step: int) -> None:
        controller = {"step": step, "consecutive_nonfinite": consecutive, "time": time.time()}
        controller["engine"] = engine.state_dict() if hasattr(engine, "state_dict") else {}  # adaptive: the bandit
        ckpt.save(step, learner.state, rng=learner.run_key, data_iter=train_iter, controller=controller)

    final: dict[str, float] = {}
    try:
        if cfg.eval.at_start and start == 0:
            m = learner.evaluate(data.eval, **eval_kwargs)
            writer.write(0, m, kind="eval")
            progress.write(f"eval at step 0: accuracy {m['eval/accuracy']:.3f} on {len(data.eval)} held-out prompts")
        for step in range(start + 1, cfg.train.num_steps + 1):
            examples = gather_global_batch(next(train_iter))  # this process's shard -> the global batch
            metrics = {**learner.step(step, examples, progress), **data.info}
            if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < cfg.train.num_steps:
                metrics.update(learner.evaluate(data.eval, **eval_kwargs))
            metrics["time/elapsed_s"] = time.perf_counter() - t_start
            metrics = reduce_metrics(metrics)
            writer.write(step, metrics)
            progress.end_step()
            table.print(dict(metrics, step=step), write=progress.write)
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
        final = learner.evaluate(data.eval, **eval_kwargs)
        final["time/total_s"] = time.perf_counter() - t_start
        writer.write(cfg.train.num_steps, final, kind="final")
        progress.write(
            f"final evaluation accuracy: {final['eval/accuracy']:.4f} on {len(data.eval)} held-out prompts "
            f"(greedy; total {final['time/total_s']:.0f} s)"
        )
    finally:
        progress.close()
        ckpt.close()
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

    from tlt_jax.checkpoint import UnreadableCheckpointError
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
    _enable_compilation_cache()
    workdir = FLAGS.workdir or _default_workdir(cfg.name)
    if launch is not None:  # one run directory for all processes: process 0's
        from tlt_jax.distributed.multihost import allgather_objects

        workdir = allgather_objects(workdir)[0]
    try:
        run(cfg, workdir)
    except (FileNotFoundError, ModelLoadError, ConfigError, UnreadableCheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_NONFINITE)


if __name__ == "__main__":
    from tlt_jax import cli

    define_flags()
    cli.run(main)
