"""Typed, frozen run configuration, validated from an ``ml_collections.ConfigDict`` with errors that name the key.

One dataclass per component; :func:`from_config_dict` checks every key against the dataclass fields (an unknown
key lists the valid names), every value against the field's type (naming key, expected type and value), then runs
each block's own range checks. :func:`to_config_dict` turns the defaults into the ConfigDict that ``configs/base.py``
starts from, so defaults live in one place. The rollout and drafter blocks are in :mod:`tlt_jax.rollout_config`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import pathlib
import types

import ml_collections

from tlt_jax.assets import EMBEDDED_DRAFTERS
from tlt_jax.mesh_config import MeshConfig
from tlt_jax.rollout_config import DTYPES, DrafterConfig, RolloutConfig
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
INSTRUCTION_NAMES = ("auto", "gsm8k", "answer_is")  # tlt_jax.data.prompts.INSTRUCTIONS, and "auto"
SCHEDULES = ("constant", "cosine", "linear")
PLAN_CHECKS = ("auto", "on", "off")  # train.plan_check (tlt_jax.plan.startup_check)
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
    instruction: str = "auto"  # gsm8k ('#### N') | answer_is ('The answer is N.') | auto (answer_is for arithmetic)
    synthetic: SyntheticDataConfig = SyntheticDataConfig()

    def validate(self, key: str) -> None:
        _require(self.source in DATA_SOURCES, f"{key}.source", f"must be one of {DATA_SOURCES}, got {self.source!r}")
        _require(self.prompts_per_step >= 1, f"{key}.prompts_per_step", "must be >= 1")
        _require(self.max_prompt_len >= 1, f"{key}.max_prompt_len", "must be >= 1")
        _require(self.eval_size >= 1, f"{key}.eval_size", "must be >= 1")
        _require(self.instruction in INSTRUCTION_NAMES, f"{key}.instruction", f"must be one of {INSTRUCTION_NAMES}")
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
    micro_batch_size: int = 8  # sequences per micro-batch of the update (gradient accumulation)
    # The old-policy and reference log-prob passes run over the step's rows in chunks of logprob_chunk_rows rows
    # (0 = auto: the largest chunk whose estimated temporaries fit logprob_max_gb per device,
    # tlt_jax.rl.logprobs.logprob_chunk_rows). With FSDP each chunk gathers the whole model once: few large chunks.
    logprob_chunk_rows: int = 0
    logprob_max_gb: float = 8.0

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
        _require(self.logprob_chunk_rows >= 0, f"{key}.logprob_chunk_rows", "must be >= 0 rows (0 = auto)")
        _require(self.logprob_max_gb > 0, f"{key}.logprob_max_gb", f"must be > 0 GB, got {self.logprob_max_gb}")


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
    """Orbax checkpoints under workdir/checkpoints, every N steps, after the first step that ends ``every_minutes``
    or more after the last save (0 = off; a bound on the work a killed run loses when its steps are long), and at the
    end. ``stop_lead_s``: launch/slurm/train.sbatch asks the tasks to save and stop this long before the job's time
    limit; it must exceed the longest RL step plus a save (``time/step_s`` in metrics.jsonl), or the stop is killed
    mid-step and the requeued run resumes from the save before."""

    every_steps: int = 5
    every_minutes: float = 0.0
    stop_lead_s: int = 1800
    max_to_keep: int = 3
    async_save: bool = True

    def validate(self, key: str) -> None:
        _require(self.every_steps >= 1, f"{key}.every_steps", "must be >= 1")
        _require(self.every_minutes >= 0 and math.isfinite(self.every_minutes), f"{key}.every_minutes",
                 f"must be >= 0 minutes (0 = no wall-clock checkpoints), got {self.every_minutes}")
        _require(self.stop_lead_s >= 0, f"{key}.stop_lead_s", f"must be >= 0 seconds, got {self.stop_lead_s}")
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
    # Start-up memory plan (tlt_jax.plan.startup_check): "auto" = on GPU / TPU backends, "on", "off". A run whose
    # plan exceeds device_memory_gb (x the memory fraction; 0 = the device's own limit) is refused.
    plan_check: str = "auto"
    device_memory_gb: float = 0.0

    def validate(self, key: str) -> None:
        _require(self.num_steps >= 1, f"{key}.num_steps", "must be >= 1")
        _require(self.max_nonfinite_steps >= 1, f"{key}.max_nonfinite_steps", "must be >= 1")
        _require(self.plan_check in PLAN_CHECKS, f"{key}.plan_check", f"must be one of {PLAN_CHECKS}")
        _require(self.device_memory_gb >= 0, f"{key}.device_memory_gb", "must be >= 0 (0 = the device's own limit)")


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
        rows = self.data.prompts_per_step * self.rollout.samples_per_prompt
        _require(
            rows % max(self.rl.logprob_chunk_rows, 1) == 0,
            "rl.logprob_chunk_rows",
            f"{self.rl.logprob_chunk_rows} must divide the step's sequences (prompts_per_step x samples_per_prompt = "
            f"{rows}), or be 0 (auto)",
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


def config_file(here: str, name: str) -> types.ModuleType:
    """The config file ``name`` (e.g. "base" or "tiny.py") in the folder of ``here`` (a config's ``__file__``), loaded
    by path: how configs/*.py derive from another, ``base = config_file(__file__, "base")``. Config files are loaded
    by path (``--config=FILE``), not imported as a package, so a plain ``import base`` would not find them."""
    path = pathlib.Path(here).resolve().with_name(name if name.endswith(".py") else f"{name}.py")
    if not path.is_file():
        raise ConfigError(f"{here} derives from {path.name}, which is not in {path.parent}: keep the config files "
                          "together, or derive from one that is there")
    spec = importlib.util.spec_from_file_location(f"tlt_jax_configs_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def to_json(cfg: Config) -> str:
    """The resolved configuration as JSON (written to workdir/config.json)."""
    return json.dumps(as_plain(cfg), indent=2, sort_keys=True, default=list)
