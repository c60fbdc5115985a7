"""The rollout and drafter blocks of the run configuration: sampling, speculation (fixed tree or the adaptive
bandit's arms), rollout slices and TLT's online drafter. Part of :mod:`tlt_jax.config`, which composes and
re-exports them."""

from __future__ import annotations

import dataclasses
import math
import os

from tlt_jax.adaptive.arms import parse_arms
from tlt_jax.assets import EMBEDDED_DRAFTERS, resolve_drafter_path
from tlt_jax.typed_config import ConfigError
from tlt_jax.typed_config import require as _require

DTYPES = ("float32", "bfloat16")
SPECULATIVE = ("off", "ngram", "eagle", "adaptive")
LAYERS = ("auto", "stacked", "unstacked")


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
    # n-gram arms (speculative="ngram" or an "ngram:" adaptive arm) also draft from each prompt's responses in
    # earlier RL steps: a host store of at most this many token bytes per engine (4 per token, oldest out, 16 per
    # prompt), checkpointed with the run. 0 = off: it pays only once prompts recur (a second epoch).
    ngram_history_bytes: int = 0
    # Rollout layout: the engines decode a copy of the policy in ``dtype`` ("" = the policy's own; "bfloat16" halves
    # weight and KV traffic while the trainer keeps float32 masters; the copy is re-made after every update, timed as
    # time/reshard_s, its per-device bytes rollout/reshard_bytes; weights split over mesh.tensor only, so decode steps
    # gather none) with attention by "xla" or the "pallas" tree-attention kernel (decode / verify only).
    dtype: str = ""
    attention_impl: str = "xla"
    # "stacked" (scanned, as the trainer holds them), "unstacked" (one array per layer, the layers run unrolled: on
    # GPU no per-step copies of stacked weight slices) or "auto" (unstacked on GPU, stacked elsewhere).
    layers: str = "auto"
    # Rollout engines (slices): the mesh's data x fsdp groups split into this many engines, each on whole TP
    # groups with its own requests, KV cache and host loop; -1: one engine per tensor-parallel group (a pod's layout:
    # no rollout step has a collective outside its TP group). Idle engines train the drafter (see drafter).
    num_slices: int = 1
    # speculative="adaptive": a bandit per batch bucket picks one of spec_arms (comma-separated: "off" = plain, and
    # "ngram:DxKxN" / "eagle:DxKxN" tree shapes; eagle needs drafter_path) per chunk from measured tokens/s; epsilon:
    # exploration; window: round trips of its median; patience: chunks under spec_threshold before speculating;
    # max_loss: the most time exploration and background compiles may cost against plain decoding, as a fraction
    # of plain's time (a conservative bandit; needs the "off" arm; 0 = no bound).
    spec_arms: str = ""  # e.g. "off,ngram:4x2x8,eagle:5x1x6"; the bandit state is checkpointed
    spec_epsilon: float = 0.1
    spec_window: int = 300
    spec_patience: int = 0
    spec_max_loss: float = 0.05

    def layer_layout(self, backend: str) -> str:
        """The engines' layer layout on ``backend`` (jax.default_backend()): "auto" resolved."""
        if self.layers != "auto":
            return self.layers
        return "unstacked" if backend == "gpu" else "stacked"

    def validate(self, key: str) -> None:
        self._validate_adaptive(key)
        _require(self.dtype in ("",) + DTYPES, f"{key}.dtype", f"must be '' (the policy's) or one of {DTYPES}")
        _require(self.attention_impl in ("xla", "pallas"), f"{key}.attention_impl", "must be 'xla' or 'pallas'")
        _require(self.layers in LAYERS, f"{key}.layers", f"must be one of {LAYERS}, got {self.layers!r}")
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
        _require(self.ngram_history_bytes >= 0, f"{key}.ngram_history_bytes",
                 f"must be >= 0 bytes (0 = off), got {self.ngram_history_bytes}")
        _require(self.spec_depth >= 1, f"{key}.spec_depth", f"must be >= 1, got {self.spec_depth}")
        _require(self.spec_topk >= 1, f"{key}.spec_topk", f"must be >= 1, got {self.spec_topk}")
        top = 1 + self.spec_topk + (self.spec_depth - 1) * self.spec_topk**2
        _require(
            2 <= self.spec_verify_tokens <= top,
            f"{key}.spec_verify_tokens",
            f"must be in [2, {top}] (1 + spec_topk + (spec_depth - 1) * spec_topk^2 for spec_depth={self.spec_depth}, "
            f"spec_topk={self.spec_topk}), got {self.spec_verify_tokens}; lower it or raise spec_depth / spec_topk",
        )
        _require(self.num_slices >= 1 or self.num_slices == -1, f"{key}.num_slices",
                 f"must be >= 1 engines, or -1 for one per tensor-parallel group; got {self.num_slices}")
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
        _require(
            0.0 <= self.spec_max_loss <= 1.0,
            f"{key}.spec_max_loss",
            f"must be in [0, 1] (a fraction of plain decoding's time; 0 = no bound), got {self.spec_max_loss}",
        )
        _require(
            self.spec_max_loss == 0 or "off" in [str(a) for a in parse_arms(self.spec_arms)],
            f"{key}.spec_max_loss",
            "bounds the loss against plain decoding, so spec_arms must include 'off'; add it, or set spec_max_loss=0",
        )


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """TLT's adaptive drafter: with ``online`` the EAGLE drafter of the rollout trains during RL on the policy's
    hidden states of the current and previous step's responses (a buffer of ``buffer_bytes``), on slices that
    finished their rollout share early, plus ``steps_without_idle`` steps after the rollout on slice 0 (one slice
    is never idle; -1, the default, means 4 with one slice and 0 with several, so that with several slices drafter
    work adds at most the drafter step in flight to the RL step: ``drafter/critical_s``). Each drafter step packs
    ``rows`` x ``row_len`` tokens of the last ``window`` positions of each response; a response that fits the window
    comes with up to ``prompt_context`` positions of its prompt before it, attended to but not trained on (when
    drafting, the drafter attends to the prompt too; without it, short responses that copy numbers from the question
    train the drafter to guess them). Rollout samples do not change (verification is lossless); only the accept
    length does."""

    online: bool = False
    lr: float = 3e-4
    buffer_bytes: int = 64 * 2**20
    window: int = 64
    steps_without_idle: int = -1
    rows: int = 8
    row_len: int = 256
    prompt_context: int = 128
    hot_swap: bool = False  # publish each drafter step to the slices still decoding (at their next chunk)

    def validate(self, key: str) -> None:
        _require(self.lr > 0 and not math.isnan(self.lr), f"{key}.lr", f"must be > 0, got {self.lr}")
        _require(self.buffer_bytes > 0, f"{key}.buffer_bytes", f"must be > 0 bytes, got {self.buffer_bytes}")
        _require(self.window >= 2, f"{key}.window", f"must be >= 2 positions (one training pair), got {self.window}")
        _require(self.steps_without_idle >= -1, f"{key}.steps_without_idle",
                 f"must be >= 0 drafter steps, or -1 (4 with one slice, 0 with several), got {self.steps_without_idle}")
        _require(self.rows >= 1, f"{key}.rows", f"must be >= 1, got {self.rows}")
        _require(self.row_len >= 2, f"{key}.row_len", f"must be >= 2, got {self.row_len}")
        _require(self.prompt_context >= 0, f"{key}.prompt_context",
                 f"must be >= 0 prompt positions (0 = responses only), got {self.prompt_context}")

    def resolved_steps_without_idle(self, num_slices: int) -> int:
        """``steps_without_idle`` with -1 resolved: 4 with one rollout slice (never idle mid-rollout), 0 with several
        (they train while others decode; after the rollout only the drafter step in flight finishes)."""
        if self.steps_without_idle >= 0:
            return self.steps_without_idle
        return 4 if num_slices == 1 else 0
