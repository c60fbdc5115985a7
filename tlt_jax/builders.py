"""Builders of the main job: model, prompt data, reward and rollout engine (plain, speculative, adaptive or driven by
the controller), each from the typed run configuration. Kept apart from ``tlt_jax.main`` (the loop and the CLI)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

log = logging.getLogger("tlt_jax.main")


@dataclasses.dataclass
class Data:
    train: list[dict]
    eval: list[dict]
    info: dict[str, float]


def synthetic_examples(cfg, vocab_size: int, avoid: Sequence[int], count: int, seed: int) -> list[dict]:
    """Random prompts (ids never equal to the target or special tokens) for the target-token task; with
    ``answer_len_sigma`` each also carries its own long-tailed answer length (``max_new_tokens``)."""
    import numpy as np

    s = cfg.data.synthetic
    banned = {s.target_token, *avoid}
    candidates = np.array([t for t in range(vocab_size) if t not in banned])
    rng = np.random.default_rng(seed)
    ids = rng.choice(candidates, size=(count, s.prompt_len))
    examples = [
        {"prompt_ids": row.tolist(), "ground_truth": str(s.target_token), "id": f"synthetic-{seed}-{i}"}
        for i, row in enumerate(ids)
    ]
    if s.answer_len_sigma > 0:
        cap = cfg.rollout.max_new_tokens
        lengths = np.clip(np.round(cap / 4 * np.exp(rng.normal(0.0, s.answer_len_sigma, count))), 1, cap)
        for ex, n in zip(examples, lengths.astype(int).tolist(), strict=True):
            ex["max_new_tokens"] = n
    return examples


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
    from tlt_jax.data import (
        GENERATED_TASKS,
        PromptFormatter,
        filter_by_prompt_length,
        generated_splits,
        instruction_for,
        load_gsm8k_file,
    )

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
    formatter = PromptFormatter(chat_template=template, instruction=instruction_for(d.source, d.instruction))
    if d.source in GENERATED_TASKS:
        splits = generated_splits(d.source, d.train_size, d.eval_size, d.train_seed, d.eval_seed, formatter)
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
    return GSM8KReward(tokenizer, cfg.reward.num_workers, cfg.reward.timeout_s, cfg.reward.format_weight)


def eval_max_new_tokens(cfg) -> int:
    return cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens


def load_eagle_drafter(cfg, model_config):
    """The EAGLE drafter in ``rollout.drafter_path`` (compute dtype of the policy), checked against the policy's
    shape; a ConfigError naming the path and how to write a drafter when it cannot serve this policy."""
    import pathlib

    import jax.numpy as jnp

    from tlt_jax.assets import resolve_drafter_path
    from tlt_jax.config import ConfigError
    from tlt_jax.drafter.export import CONFIG_FILE, load_drafter

    path = resolve_drafter_path(cfg.rollout.drafter_path)
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


def build_engine(cfg, model, mesh, data: Data, workdir: str | None = None):
    """The rollout engine on the training mesh (colocated). With ``rollout.speculative`` "ngram" or "eagle" (the
    drafter loaded from ``rollout.drafter_path``, fixed for the run unless ``drafter.online``) it decodes
    speculatively once a wave has at most ``rollout.spec_threshold`` live rows, with the ``rollout.spec_*`` tree
    shape. With ``rollout.num_slices`` != 1 or ``drafter.online``: a ControlledRollout (see build_controlled)."""
    import jax

    from tlt_jax.rollout import RolloutEngine

    r = cfg.rollout
    drafter = None
    if r.needs_eagle:  # an empty drafter_path (drafter.online, config-checked): a fresh drafter that learns during RL
        drafter = load_eagle_drafter(cfg, model.config) if r.drafter_path else fresh_eagle_drafter(cfg, model.config)
    longest = max(len(ex["prompt_ids"]) for ex in data.train + data.eval)
    kwargs = engine_kwargs(cfg, jax.default_backend(), drafter, longest)
    if r.num_slices != 1 or cfg.drafter.online:
        from tlt_jax.controller.online import build_controlled

        return build_controlled(cfg, model, mesh, kwargs, workdir)
    return RolloutEngine(model, mesh, **kwargs)


def longest_prompt(cfg) -> int:
    """The longest prompt the config admits: the synthetic prompts' length, else data.max_prompt_len."""
    return cfg.data.synthetic.prompt_len if cfg.data.source == "synthetic" else cfg.data.max_prompt_len


def engine_kwargs(cfg, backend: str, drafter=None, longest: int | None = None) -> dict:
    """RolloutEngine keyword arguments of the run (``build_engine``'s; the plan's abstract engine takes the same):
    a cache for the ``longest`` prompt (default ``longest_prompt``) and the longest response, the rollout layout on
    ``backend``, the speculative tree or adaptive arms with ``drafter`` (the EAGLE drafter module where the run drafts
    with one), the n-gram history, RL sampling (top-k / top-p refused by the config, so not compiled: a
    tensor-parallel engine samples its split logits where they lie) and, with ``drafter.online``, the hidden-state
    capture of every response.

    Adaptive: the bandit over ``rollout.spec_arms``, seeded by train.seed (offset per slice:
    ``controller.slices.slice_spec``), so every process (and a rerun) takes the same decisions from the same
    measurements. A speculative step met for the first time is compiled in the background once the rollout has
    returned (``background_compile``, ``compile_between_calls``: beside the policy update), so the rollout never
    waits for, nor shares its host with, a program that plain decoding does not need; the arm is usable from the
    next rollout."""
    import jax.numpy as jnp

    from tlt_jax.adaptive import parse_arms
    from tlt_jax.rl.learner import bucket_length
    from tlt_jax.rollout import HiddenCapture, SpecConfig

    r, d = cfg.rollout, cfg.drafter
    rows = cfg.data.prompts_per_step * r.samples_per_prompt
    longest = longest_prompt(cfg) if longest is None else longest
    kwargs = dict(max_batch=max(rows, cfg.eval.batch_size),
                  max_len=bucket_length(longest + max(r.max_new_tokens, eval_max_new_tokens(cfg))),
                  tail_threshold=max(1, rows // 4), attention_impl=r.attention_impl, layers=r.layer_layout(backend),
                  sampling_filters=False)
    if r.dtype:
        kwargs["dtype"] = jnp.dtype(r.dtype)
    if r.speculative == "adaptive":
        spec = SpecConfig(arms=parse_arms(r.spec_arms), epsilon=r.spec_epsilon, window=r.spec_window,
                          patience=r.spec_patience, threshold=r.spec_threshold, seed=cfg.train.seed,
                          max_loss=r.spec_max_loss or None)
        kwargs.update(spec=spec, drafter=drafter, background_compile=True, compile_between_calls=True)
    elif r.speculative != "off":
        spec = SpecConfig(depth=r.spec_depth, topk=r.spec_topk, verify_tokens=r.spec_verify_tokens,
                          threshold=r.spec_threshold)
        kwargs.update(spec=spec, drafter="ngram" if r.speculative == "ngram" else drafter)
    if r.ngram_history_bytes:  # n-gram arms draft from earlier steps' responses too (a store per engine)
        kwargs["ngram_history_bytes"] = r.ngram_history_bytes
    if d.online:
        kwargs["capture"] = HiddenCapture(window=d.window, max_bytes=d.buffer_bytes, prompt=d.prompt_context)
    return kwargs


def fresh_eagle_drafter(cfg, model_config):
    """A freshly initialised EAGLE drafter of the policy's shape (seeded by train.seed)."""
    import jax.numpy as jnp
    from flax import nnx

    from tlt_jax.drafter.eagle import EagleDrafter

    return EagleDrafter(model_config, dtype=jnp.dtype(cfg.model.dtype), rngs=nnx.Rngs(cfg.train.seed))


def restore_engine_state(engine, controller: dict) -> None:
    """Adaptive rollouts resume with the checkpoint's bandit (its measurements and exploration generator); a bandit
    over other arms (or other slices) is a ConfigError (they must match to resume). The n-gram history
    (``rollout.ngram_history_bytes``) resumes with the checkpoint's store."""
    from tlt_jax.config import ConfigError

    try:
        engine.load_history_state(controller.get("ngram_history"))
    except ValueError as e:
        raise ConfigError(f"config.rollout.num_slices: {e}") from e
    saved = controller.get("engine") or {}
    if getattr(engine, "bandit", None) is None or not saved:
        if getattr(engine, "bandit", None) is not None:
            log.info("the checkpoint holds no bandit state: the adaptive rollout starts its bandit afresh")
        return
    try:
        engine.load_state_dict(saved)
    except ValueError as e:
        raise ConfigError(f"config.rollout.spec_arms: {e}") from e
