"""Typed, frozen run configuration, validated from an ``ml_collections.ConfigDict`` with errors that name the key.

One dataclass per component; :func:`from_config_dict` checks every key against the dataclass fields (an unknown
key lists the valid names), every value against the field's type (naming key, expected type and value), then runs
each block's own range checks. :func:`to_config_dict` turns the defaults into the ConfigDict that ``configs/base.py``
starts from, so defaults live in one place.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import ml_collections

from tlt_jax.adaptive.arms import parse_arms
from tlt_jax.assets import EMBEDDED_DRAFTERS, resolve_drafter_path
from tlt_jax.distributed.mesh import MeshConfig
from tlt_jax.typed_config import ConfigError, as_plain, build
from tlt_jax.typed_config import require as _require

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DrafterConfig",
    "EvalConfig",
    "MeshConfig",
    "MetricsConfig",
    "ModelConfigSpec",
    "OptimConfig",
    "RLConfig",
    "RewardConfig",
    "RolloutConfig",
    "SyntheticDataConfig",
    "TinyModelConfig",
    "TrainConfig",
    "from_config_dict",
    "to_config_dict",
    "to_json",
]

MODEL_SOURCES = ("tiny", "smollm2", "path")
DATA_SOURCES = ("synthetic", "gsm_symbolic", "arithmetic", "gsm8k_file")
SCHEDULES = ("constant", "cosine", "linear")
DTYPES = ("float32", "bfloat16")
SPECULATIVE = ("off", "ngram", "eagle", "adaptive")
# Names the RL blocks accept. The config owns these lists (it imports nothing from tlt_jax.rl, which imports the
# config: no package cycle); tlt_jax.rl's registries must hold exactly these names (tests/test_config.py checks).
ADVANTAGES = ("drgrpo", "grpo", "rloo")
POLICY_LOSSES = ("ppo_clip",)
LOSS_AGG_MODES = ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean")
KL_KINDS = ("abs", "k1", "k2", "k3", "kl", "low_var_kl", "mse")


@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
    """A random tiny decoder (source='tiny'): seconds-scale CPU runs and tests."""

    vocab_size: int = 64
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    init_seed: int = 0


@dataclasses.dataclass(frozen=True)
class ModelConfigSpec:
    """Which policy to train. source: 'tiny' (random), 'smollm2' (embedded SmolLM2-135M-Instruct GGUF) or 'path'
    (an HF safetensors directory or a .gguf file given by ``path``)."""

    source: str = "tiny"
    path: str = ""
    dtype: str = "float32"  # compute dtype; parameters and optimizer state stay float32
    remat: bool = False  # rematerialise decoder layers in the backward pass (memory for compute)
    tiny: TinyModelConfig = TinyModelConfig()

    def validate(self, key: str) -> None:
        _require(self.source in MODEL_SOURCES, f"{key}.source", f"must be one of {MODEL_SOURCES}, got {self.source!r}")
        _require(self.dtype in DTYPES, f"{key}.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(
            (self.source == "path") == bool(self.path),
            f"{key}.path",
            "give a path exactly when source='path' (an HF directory or a .gguf file)",
        )


@dataclasses.dataclass(frozen=True)
class SyntheticDataConfig:
    """The tiny task: random prompts; the reward is the fraction of the response that is ``target_token``.

    answer_len_sigma > 0 gives every prompt its own answer length (its response-length cap, log-normal with median
    rollout.max_new_tokens / 4 and this sigma, clipped to [1, rollout.max_new_tokens]): a long-tailed length
    distribution fixed by the task, so rollout slices finish at different times. 0: every answer is
    rollout.max_new_tokens long."""

    num_prompts: int = 256
    prompt_len: int = 8
    target_token: int = 5
    seed: int = 0
    answer_len_sigma: float = 0.0


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training / evaluation prompts. source: 'synthetic' (tiny task), 'gsm_symbolic' (reasoning-gym GSM-style word
    problems) or 'arithmetic' (reasoning-gym a + b, 1-2 digits, answered "The answer is N."), both generated with
    disjoint train/eval seeds, or 'gsm8k_file' (GSM8K .jsonl/.parquet at ``train_path`` / ``eval_path``)."""

    source: str = "synthetic"
    prompts_per_step: int = 8
    train_path: str = ""
    eval_path: str = ""
    train_size: int = 2000  # generated sources (gsm_symbolic, arithmetic)
    eval_size: int = 32  # generated sources; the first eval_size rows of eval_path for gsm8k_file
    train_seed: int = 0
    eval_seed: int = 1_000_000
    shuffle_seed: int = 0
    max_prompt_len: int = 256  # longer prompts are dropped (counted in the metrics)
    chat_template: bool = True  # format prompts with the tokenizer's chat template
    synthetic: SyntheticDataConfig = SyntheticDataConfig()

    def validate(self, key: str) -> None:
        _require(self.source in DATA_SOURCES, f"{key}.source", f"must be one of {DATA_SOURCES}, got {self.source!r}")
        _require(self.prompts_per_step >= 1, f"{key}.prompts_per_step", "must be >= 1")
        _require(self.max_prompt_len >= 1, f"{key}.max_prompt_len", "must be >= 1")
        _require(self.eval_size >= 1, f"{key}.eval_size", "must be >= 1")
        if self.source == "gsm8k_file":
            _require(bool(self.train_path), f"{key}.train_path", "source='gsm8k_file' needs a .jsonl/.parquet file")
        if self.source in ("gsm_symbolic", "arithmetic"):
            _require(self.train_size >= self.prompts_per_step, f"{key}.train_size", "must be >= prompts_per_step")
        s = self.synthetic
        _require(s.num_prompts >= self.prompts_per_step, f"{key}.synthetic.num_prompts", "must be >= prompts_per_step")
        _require(s.prompt_len >= 1, f"{key}.synthetic.prompt_len", "must be >= 1")
        _require(s.target_token >= 0, f"{key}.synthetic.target_token", "must be a token id >= 0")
        _require(s.answer_len_sigma >= 0, f"{key}.synthetic.answer_len_sigma", "must be >= 0 (0 = fixed lengths)")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Sampling for training rollouts (GRPO group size n = samples_per_prompt)."""

    samples_per_prompt: int = 4
    temperature: float = 1.0
    # Truncated sampling is rejected in RL (kept as fields so a setting gets that explanation, not "unknown key"):
    # the old / reference / current log-probs of the loss are those of the full distribution at ``temperature``;
    # sampling from a top-k / top-p truncation of it would make the PPO ratio and the KL refer to another policy.
    top_k: int = 0  # must stay 0 (off)
    top_p: float = 1.0  # must stay 1.0 (off)
    max_new_tokens: int = 16
    # Lossless tree speculative decoding in the rollout tail: "off", "ngram" (model-free drafter over the prompt, the
    # row's output and its GRPO siblings) or "eagle" (the trained EAGLE drafter in drafter_path, written by
    # `python -m tlt_jax.drafter.warmup --out=DIR`; fixed during RL unless drafter.online). Rollout samples are
    # identical either way; only their speed changes.
    speculative: str = "off"
    # EAGLE drafting: a drafter directory (save_drafter format) or a shipped drafter's name ("eagle-smollm2-gsm", the
    # warmed-up drafter of the embedded SmolLM2); empty with drafter.online = a fresh drafter. Ignored otherwise.
    drafter_path: str = ""
    spec_threshold: int = 32  # decode speculatively once a wave has at most this many live rows
    # Draft tree shape (TLT defaults), ngram and eagle: depth (most draft tokens accepted per verify), topk (children
    # per expanded node) and verify_tokens (tree size incl. the root, <= 1 + topk + (depth - 1) * topk^2).
    spec_depth: int = 8
    spec_topk: int = 4
    spec_verify_tokens: int = 48
    # Rollout layout: the engines decode a copy of the policy in ``dtype`` ("" = the policy's own; "bfloat16" halves
    # weight and KV traffic while the trainer keeps float32 masters; the copy is re-made after every update, timed as
    # time/reshard_s) with attention by "xla" or the "pallas" tree-attention kernel (decode / verify only).
    dtype: str = ""
    attention_impl: str = "xla"
    num_slices: int = 1  # split the mesh's data axis into this many rollout slices (one engine each; see drafter)
    # speculative="adaptive": a bandit per batch bucket picks one of spec_arms (comma-separated: "off" = plain, and
    # "ngram:DxKxN" / "eagle:DxKxN" tree shapes; eagle needs drafter_path) per chunk from measured tokens/s; epsilon:
    # exploration; window: round trips of its median; patience: chunks under spec_threshold before speculating.
    spec_arms: str = ""  # e.g. "off,ngram:4x2x8,eagle:5x1x6"; the bandit state is checkpointed
    spec_epsilon: float = 0.1
    spec_window: int = 300
    spec_patience: int = 0

    def validate(self, key: str) -> None:
        self._validate_adaptive(key)
        _require(self.dtype in ("",) + DTYPES, f"{key}.dtype", f"must be '' (the policy's) or one of {DTYPES}")
        _require(self.attention_impl in ("xla", "pallas"), f"{key}.attention_impl", "must be 'xla' or 'pallas'")
        _require(
            self.speculative in SPECULATIVE,
            f"{key}.speculative",
            f"must be one of {SPECULATIVE}, got {self.speculative!r}",
        )
        if self.needs_eagle and self.drafter_path:  # an empty path: see Config.validate (drafter.online)
            _require(
                os.path.isdir(resolve_drafter_path(self.drafter_path)),
                f"{key}.drafter_path",
                f"{self.drafter_path!r} is neither a directory nor a shipped drafter ({sorted(EMBEDDED_DRAFTERS)}); "
                "write a drafter there with `python -m tlt_jax.drafter.warmup --model=POLICY "
                f"--out={self.drafter_path}`",
            )
        _require(self.spec_threshold >= 1, f"{key}.spec_threshold", "must be >= 1")
        _require(self.spec_depth >= 1, f"{key}.spec_depth", f"must be >= 1, got {self.spec_depth}")
        _require(self.spec_topk >= 1, f"{key}.spec_topk", f"must be >= 1, got {self.spec_topk}")
        top = 1 + self.spec_topk + (self.spec_depth - 1) * self.spec_topk**2
        _require(
            2 <= self.spec_verify_tokens <= top,
            f"{key}.spec_verify_tokens",
            f"must be in [2, {top}] (1 + spec_topk + (spec_depth - 1) * spec_topk^2 for spec_depth={self.spec_depth}, "
            f"spec_topk={self.spec_topk}), got {self.spec_verify_tokens}; lower it or raise spec_depth / spec_topk",
        )
        _require(self.num_slices >= 1, f"{key}.num_slices", f"must be >= 1, got {self.num_slices}")
        _require(self.samples_per_prompt >= 2, f"{key}.samples_per_prompt", "GRPO groups need >= 2 samples")
        _require(self.temperature > 0, f"{key}.temperature", "must be > 0 for training rollouts")
        why = (
            "GRPO's old, reference and current log-probs are computed on the full distribution at "
            "rollout.temperature, so rollouts must sample from it too (a truncated sampler would make the PPO ratio "
            "and the KL refer to another policy); remove the override (top-k / top-p sampling is available in "
            "`python -m tlt_jax.generate`)"
        )
        _require(self.top_k == 0, f"{key}.top_k", f"must be 0 (off) for RL rollouts, got {self.top_k}: {why}")
        _require(self.top_p == 1.0, f"{key}.top_p", f"must be 1.0 (off) for RL rollouts, got {self.top_p}: {why}")
        _require(self.max_new_tokens >= 1, f"{key}.max_new_tokens", "must be >= 1")


    @property
    def needs_eagle(self) -> bool:
        """Whether the rollout drafts with an EAGLE drafter (speculative='eagle', or an 'eagle:' adaptive arm)."""
        return self.speculative == "eagle" or (self.speculative == "adaptive" and "eagle:" in self.spec_arms.lower())

    def _validate_adaptive(self, key: str) -> None:
        adaptive = self.speculative == "adaptive"
        why = f"is only used with speculative='adaptive' (it is {self.speculative!r}); set both or neither"
        _require(adaptive or not self.spec_arms, f"{key}.spec_arms", why)
        why = "speculative='adaptive' needs the bandit's arms, e.g. --config.rollout.spec_arms=off,ngram:4x2x8"
        _require(not adaptive or bool(self.spec_arms), f"{key}.spec_arms", why)
        if not adaptive:
            return
        try:
            parse_arms(self.spec_arms)
        except ValueError as e:
            raise ConfigError(f"config.{key}.spec_arms: {e}") from None
        _require(0.0 <= self.spec_epsilon <= 1.0, f"{key}.spec_epsilon", f"must be in [0, 1], got {self.spec_epsilon}")
        _require(self.spec_window >= 1, f"{key}.spec_window", f"must be >= 1, got {self.spec_window}")
        _require(self.spec_patience >= 0, f"{key}.spec_patience", f"must be >= 0, got {self.spec_patience}")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """TLT's adaptive drafter: with ``online`` the EAGLE drafter of the rollout trains during RL on the policy's
    hidden states of the current and previous step's responses (a buffer of ``buffer_bytes``), on slices that
    finished their rollout share early, plus ``steps_without_idle`` steps after the rollout on slice 0 (one slice
    is never idle). Each drafter step packs ``rows`` x ``row_len`` tokens of the last ``window`` positions of each
    response; a response that fits the window comes with up to ``prompt_context`` positions of its prompt before it,
    attended to but not trained on (when drafting, the drafter attends to the prompt too; without it, short
    responses that copy numbers from the question train the drafter to guess them). Rollout samples do not change
    (verification is lossless); only the accept length does."""

    online: bool = False
    lr: float = 3e-4
    buffer_bytes: int = 64 * 2**20
    window: int = 64
    steps_without_idle: int = 4
    rows: int = 8
    row_len: int = 256
    prompt_context: int = 128
    hot_swap: bool = False  # publish each drafter step to the slices still decoding (at their next chunk)

    def validate(self, key: str) -> None:
        _require(self.lr > 0 and not math.isnan(self.lr), f"{key}.lr", f"must be > 0, got {self.lr}")
        _require(self.buffer_bytes > 0, f"{key}.buffer_bytes", f"must be > 0 bytes, got {self.buffer_bytes}")
        _require(self.window >= 2, f"{key}.window", f"must be >= 2 positions (one training pair), got {self.window}")
        _require(self.steps_without_idle >= 0, f"{key}.steps_without_idle", "must be >= 0")
        _require(self.rows >= 1, f"{key}.rows", f"must be >= 1, got {self.rows}")
        _require(self.row_len >= 2, f"{key}.row_len", f"must be >= 2, got {self.row_len}")
        _require(self.prompt_context >= 0, f"{key}.prompt_context",
                 f"must be >= 0 prompt positions (0 = responses only), got {self.prompt_context}")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """GRPO objective and how a step's rollouts are split into updates (VeRL's names in comments)."""

    advantage: str = "grpo"  # adv_estimator
    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2  # clip_ratio_low
    clip_high: float = 0.2  # clip_ratio_high
    loss_agg_mode: str = "token-mean"
    kl_coef: float = 0.001  # kl_loss_coef (use_kl_loss); 0 disables the reference policy
    kl_kind: str = "low_var_kl"  # kl_loss_type
    mini_batch_prompts: int = 0  # ppo_mini_batch_size in prompts; 0 = all prompts of the step (one update)
    epochs: int = 1  # ppo_epochs
    micro_batch_size: int = 8  # sequences per micro-batch (gradient accumulation and log-prob chunks)

    def validate(self, key: str) -> None:
        for name, reg in (
            ("advantage", ADVANTAGES),
            ("policy_loss", POLICY_LOSSES),
            ("loss_agg_mode", LOSS_AGG_MODES),
            ("kl_kind", KL_KINDS),
        ):
            val = getattr(self, name)
            _require(val in reg, f"{key}.{name}", f"unknown {val!r}; choose from {list(reg)}")
        _require(0 <= self.clip_low < 1, f"{key}.clip_low", "must be in [0, 1)")
        _require(self.clip_high >= 0, f"{key}.clip_high", "must be >= 0")
        _require(self.kl_coef >= 0, f"{key}.kl_coef", "must be >= 0")
        _require(self.mini_batch_prompts >= 0, f"{key}.mini_batch_prompts", "must be >= 0 (0 = all)")
        _require(self.epochs >= 1, f"{key}.epochs", "must be >= 1")
        _require(self.micro_batch_size >= 1, f"{key}.micro_batch_size", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up, then a constant / cosine / linear schedule, and global-norm clipping."""

    lr: float = 1e-6
    warmup_steps: int = 0  # in optimizer updates
    schedule: str = "constant"
    final_lr_ratio: float = 0.0  # cosine / linear decay to lr * final_lr_ratio at the last update
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 = no clipping

    def validate(self, key: str) -> None:
        _require(self.lr > 0 and not math.isnan(self.lr), f"{key}.lr", f"must be > 0, got {self.lr}")
        _require(self.warmup_steps >= 0, f"{key}.warmup_steps", "must be >= 0")
        _require(self.schedule in SCHEDULES, f"{key}.schedule", f"must be one of {SCHEDULES}, got {self.schedule!r}")
        _require(0 <= self.final_lr_ratio <= 1, f"{key}.final_lr_ratio", "must be in [0, 1]")
        _require(self.weight_decay >= 0, f"{key}.weight_decay", "must be >= 0")
        _require(0 <= self.b1 < 1 and 0 <= self.b2 < 1, f"{key}.b1/b2", "must be in [0, 1)")
        _require(self.max_grad_norm >= 0, f"{key}.max_grad_norm", "must be >= 0 (0 = off)")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Rule-based GSM8K scoring in worker processes (synthetic data scores in-process). format_weight: reward =
    correct + format_weight * (the response states its final answer, e.g. "The answer is 42."); accuracy stays
    exact match alone."""

    num_workers: int = 2
    timeout_s: float = 5.0
    format_weight: float = 0.0

    def validate(self, key: str) -> None:
        _require(self.num_workers >= 1, f"{key}.num_workers", "must be >= 1")
        _require(self.timeout_s > 0, f"{key}.timeout_s", "must be > 0")
        _require(self.format_weight >= 0, f"{key}.format_weight", "must be >= 0 (0 = correctness alone)")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Greedy evaluation on held-out prompts: at the end, every ``every_steps`` steps (0 = never in between), and
    before the first step when ``at_start``."""

    every_steps: int = 0
    at_start: bool = False
    max_new_tokens: int = 0  # 0 = rollout.max_new_tokens
    batch_size: int = 32

    def validate(self, key: str) -> None:
        _require(self.every_steps >= 0, f"{key}.every_steps", "must be >= 0")
        _require(self.max_new_tokens >= 0, f"{key}.max_new_tokens", "must be >= 0")
        _require(self.batch_size >= 1, f"{key}.batch_size", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under workdir/checkpoints, every N steps and at the end."""

    every_steps: int = 5
    max_to_keep: int = 3
    async_save: bool = True

    def validate(self, key: str) -> None:
        _require(self.every_steps >= 1, f"{key}.every_steps", "must be >= 1")
        _require(self.max_to_keep >= 2, f"{key}.max_to_keep", "keep >= 2 so a corrupt latest can fall back")


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """What the user sees: tqdm progress bars (off for logs / tests) and TensorBoard event files."""

    progress_bars: bool = True
    tensorboard: bool = True


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The RL loop. A step whose loss or gradients are non-finite is skipped; ``max_nonfinite_steps`` such steps in
    a row stop the run. ``debug_nan_steps`` injects a NaN loss at those steps (tests of that path)."""

    num_steps: int = 20
    seed: int = 0
    max_nonfinite_steps: int = 3
    debug_nan_steps: tuple[int, ...] = ()

    def validate(self, key: str) -> None:
        _require(self.num_steps >= 1, f"{key}.num_steps", "must be >= 1")
        _require(self.max_nonfinite_steps >= 1, f"{key}.max_nonfinite_steps", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run."""

    name: str = "run"
    model: ModelConfigSpec = ModelConfigSpec()
    mesh: MeshConfig = MeshConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    drafter: DrafterConfig = DrafterConfig()
    rl: RLConfig = RLConfig()
    optim: OptimConfig = OptimConfig()
    reward: RewardConfig = RewardConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    train: TrainConfig = TrainConfig()

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            block = getattr(self, f.name)
            if hasattr(block, "validate"):
                block.validate(f.name)
        if self.model.source == "tiny":
            _require(self.data.source == "synthetic", "data.source", "a random tiny model only fits 'synthetic' data")
            _require(
                self.data.synthetic.target_token < self.model.tiny.vocab_size,
                "data.synthetic.target_token",
                f"must be < model.tiny.vocab_size ({self.model.tiny.vocab_size})",
            )
        self._validate_drafter()
        _require(
            not (self.rollout.dtype and self.drafter.online),
            "rollout.dtype",
            "online drafter training reads the rollout's hidden states in the policy's dtype; leave rollout.dtype "
            "empty with drafter.online=True",
        )
        mini = self.rl.mini_batch_prompts or self.data.prompts_per_step
        _require(
            self.data.prompts_per_step % mini == 0,
            "rl.mini_batch_prompts",
            f"{mini} must divide data.prompts_per_step ({self.data.prompts_per_step})",
        )
        seqs = mini * self.rollout.samples_per_prompt
        _require(
            seqs % self.rl.micro_batch_size == 0,
            "rl.micro_batch_size",
            f"{self.rl.micro_batch_size} must divide the sequences per update "
            f"(mini_batch_prompts x samples_per_prompt = {seqs})",
        )

    def _validate_drafter(self) -> None:
        """The EAGLE drafter's source: a directory or a shipped drafter's name, or (online training only) a fresh
        one."""
        r = self.rollout
        if r.needs_eagle and not r.drafter_path:
            what = "speculative='eagle'" if r.speculative == "eagle" else "an 'eagle:' arm"
            _require(
                self.drafter.online,
                "rollout.drafter_path",
                f"{what} needs a drafter: a shipped one ({sorted(EMBEDDED_DRAFTERS)}, for the embedded SmolLM2) or a "
                "directory written by `python -m tlt_jax.drafter.warmup --model=POLICY --out=DIR`; set "
                "--config.rollout.drafter_path=NAME_OR_DIR (or set --config.drafter.online=True to start from a fresh "
                "drafter that trains during RL, or use 'ngram', which needs none)",
            )
        if self.drafter.online:
            _require(
                r.needs_eagle,
                "drafter.online",
                f"trains the rollout's EAGLE drafter, but rollout.speculative={r.speculative!r}"
                + (f" with spec_arms={r.spec_arms!r}" if r.speculative == "adaptive" else "")
                + " drafts with none; set --config.rollout.speculative=eagle (drafter_path empty = a fresh drafter) or "
                "an adaptive 'eagle:' arm, or drafter.online=False",
            )

    @property
    def updates_per_step(self) -> int:
        mini = self.rl.mini_batch_prompts or self.data.prompts_per_step
        return self.rl.epochs * (self.data.prompts_per_step // mini)


def from_config_dict(cd: ml_collections.ConfigDict | dict) -> Config:
    """Validated, frozen :class:`Config` from a ConfigDict (or plain dict); missing keys take the defaults."""
    cfg = build(Config, cd, "")
    cfg.validate()
    # MeshConfig has no validate(): check its shape is well-formed (the device count is checked at mesh build).
    dims = [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor]
    _require(dims.count(-1) <= 1 and all(d >= 1 or d == -1 for d in dims), "mesh", f"invalid mesh shape {dims}")
    return cfg


def to_config_dict(cfg: Config | None = None) -> ml_collections.ConfigDict:
    """The ConfigDict of ``cfg`` (defaults when None): what configs/*.py start from and override."""
    return ml_collections.ConfigDict(as_plain(cfg or Config()))


def to_json(cfg: Config) -> str:
    """The resolved configuration as JSON (written to workdir/config.json)."""
    return json.dumps(as_plain(cfg), indent=2, sort_keys=True, default=list)
