"""One GRPO iteration: prompts -> rollout -> rewards -> group advantages -> old / reference log-probs recomputed by
the policy / frozen reference where needed -> policy updates (mini-batches x epochs, each one sharded jitted step).
With one update per step the update takes the old log-probs from its own forward (no pass), and with
``rl.kl_coef = 0`` there is no reference pass.

The rollout engine only samples: its log-probs are never used (the engine may decode speculatively or in another
batch layout), so speculative decoding cannot leak into the loss. The host owns every decision; the device work is
three jitted pure functions (rollout steps inside the engine, :mod:`tlt_jax.rl.logprobs`, :mod:`tlt_jax.rl.train_step`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from tlt_jax.config import Config, ConfigError
from tlt_jax.distributed import LogicalRules, max_device_bytes
from tlt_jax.distributed.multihost import to_host
from tlt_jax.rewards import RewardFn, example_max_new_tokens
from tlt_jax.rl.advantages import compute_advantages
from tlt_jax.rl.logprobs import logprob_chunk_rows, make_logprob_fn
from tlt_jax.rl.train_step import LossConfig, TrainState, init_train_state, lr_schedule, make_optimizer, make_train_step
from tlt_jax.rollout import SamplingParams, arm_share_metrics

__all__ = [
    "GRPOLearner",
    "bucket_length",
    "build_sequences",
    "check_micro_batch",
]


def check_micro_batch(cfg: Config, mesh: Mesh, rules: LogicalRules = LogicalRules()) -> None:
    """A micro-batch (of the update and of the log-prob passes) is split over the batch axes (data x fsdp): one that
    does not divide over them would be replicated silently by XLA, so it is a config error, raised before any work."""
    axes = [a for a in rules.lookup("batch") if a in mesh.shape]
    size = int(np.prod([mesh.shape[a] for a in axes]))
    for key, rows in (("micro_batch_size", cfg.rl.micro_batch_size), ("logprob_chunk_rows", cfg.rl.logprob_chunk_rows)):
        if rows % size:
            raise ConfigError(
                f"config.rl.{key}: {rows} does not divide over the mesh's batch axes "
                f"{' x '.join(axes)} = {size} devices: use a multiple of {size} (or fewer devices)"
            )


def _bf16(x: jax.Array) -> jax.Array:
    return x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x


def bucket_length(n: int, minimum: int = 16) -> int:
    """Padded sequence length (few shapes, few compiles, little padding): powers of two up to 256, multiples of 128
    up to 1024, then multiples of 512."""
    b = minimum
    while b < n:
        b = b * 2 if b < 256 else b + 128 if b < 1024 else b + 512
    return b


def build_sequences(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[Sequence[int]]]
) -> dict[str, np.ndarray]:
    """``prompt ++ response`` rows (prompt-major: row i*n + j), right-padded to a bucketed length.

    Returns int32 input_ids and attention_mask [B, T] and float32 response_mask [B, T] (1 on response tokens).
    """
    rows = [(list(p), list(c)) for p, comps in zip(prompts, completions, strict=True) for c in comps]
    t = bucket_length(max(len(p) + len(c) for p, c in rows))
    ids = np.zeros((len(rows), t), np.int32)
    attn = np.zeros((len(rows), t), np.int32)
    resp = np.zeros((len(rows), t), np.float32)
    for r, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        ids[r, :n] = p + c
        attn[r, :n] = 1
        resp[r, len(p) : n] = 1.0
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp}


def _max_new_tokens(examples: Sequence[dict], cap: int) -> int | list[int]:
    """The rollout's length cap: ``cap``, or one per prompt when the examples carry their own (tiny task)."""
    if not any("max_new_tokens" in ex for ex in examples):
        return cap
    return [example_max_new_tokens(ex, cap) for ex in examples]


def _percentiles(lengths: np.ndarray) -> dict[str, float]:
    return {
        "response/len_mean": float(lengths.mean()),
        "response/len_p50": float(np.percentile(lengths, 50)),
        "response/len_p90": float(np.percentile(lengths, 90)),
        "response/len_max": float(lengths.max()),
    }


class GRPOLearner:
    """Owns the policy's train state, the frozen reference, and the step functions; ``step`` runs one iteration.

    The model passed in is the initial policy; when ``kl_coef > 0`` a bfloat16 copy of its parameters is the reference.
    ``engine`` is a RolloutEngine (``set_params(model)``, ``generate(prompts, SamplingParams)``).
    """

    def __init__(self, cfg: Config, model, engine, reward_fn: RewardFn, *, mesh: Mesh, rules=LogicalRules()):
        check_micro_batch(cfg, mesh, rules)
        self.cfg, self.engine, self.reward_fn, self.mesh, self.rules = cfg, engine, reward_fn, mesh, rules
        # The run's key (key data): every rollout seed derives from it. A resumed run takes the checkpoint's.
        self.run_key = np.asarray(jax.random.key_data(jax.random.key(cfg.train.seed)))
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        # The reference policy is never trained: kept in bfloat16 (half the memory of a float32 copy; its log-probs
        # are still computed in the policy's dtype from these weights).
        to_ref = jax.jit(lambda t: jax.tree.map(_bf16, t), out_shardings=jax.tree.map(lambda x: x.sharding, params))
        self.ref_params = to_ref(params) if cfg.rl.kl_coef > 0 else None
        self.total_updates = cfg.train.num_steps * cfg.updates_per_step
        self.schedule = lr_schedule(cfg.optim, self.total_updates)
        self.tx = make_optimizer(cfg.optim, self.total_updates)
        self.state: TrainState = init_train_state(params, self.tx)
        rl = cfg.rl
        self.loss_cfg = LossConfig(
            micro_batch_size=rl.micro_batch_size,
            temperature=cfg.rollout.temperature,
            policy_loss=rl.policy_loss,
            clip_low=rl.clip_low,
            clip_high=rl.clip_high,
            agg_mode=rl.loss_agg_mode,
            norm_len=cfg.rollout.max_new_tokens,
            kl_coef=rl.kl_coef,
            kl_kind=rl.kl_kind,
            on_policy=cfg.updates_per_step == 1,  # one update per step: old log-probs = the update's own forward
        )
        self._train_step = make_train_step(self.graphdef, self.tx, self.loss_cfg, self.state, mesh=mesh, rules=rules)
        self.model_config = model.config
        self._logprob_fns: dict[int, object] = {}  # by rows per chunk (logprob_chunk_rows: per sequence length)

    # ---- helpers ----------------------------------------------------------------------------------------------

    def policy_model(self):
        """The current policy as a module (shares the train state's arrays; no copy)."""
        return nnx.merge(self.graphdef, self.state.params, self.rest)

    def rollout_seed(self, step: int) -> int:
        """The sampling seed of step ``step``'s rollouts: a hash of (run key, step), computed on the host."""
        words = [int(w) for w in np.asarray(self.run_key, np.uint32).ravel()]
        return int(np.random.SeedSequence([*words, step]).generate_state(1, np.uint32)[0])

    def logprob_fn(self, shape: tuple[int, int]):
        """The jitted log-prob pass (old policy or reference, ``make_logprob_fn``) for ``shape`` = (rows, sequence
        length), in chunks of ``logprob_chunk_rows`` rows for that shape (few chunks: with FSDP each gathers the whole
        model once)."""
        rows = logprob_chunk_rows(self.cfg, self.mesh, self.model_config, *shape, self.rules)
        if rows not in self._logprob_fns:
            self._logprob_fns[rows] = make_logprob_fn(self.graphdef, chunk_size=rows, mesh=self.mesh, rules=self.rules,
                                                      temperature=self.cfg.rollout.temperature)
        return self._logprob_fns[rows]

    def _logprobs(self, params: nnx.State, ids: jax.Array, attn: jax.Array) -> np.ndarray:
        return to_host(self.logprob_fn(ids.shape)(params, self.rest, ids, attn))

    def _put(self, x: np.ndarray) -> jax.Array:
        logical = ("batch",) + (None,) * (x.ndim - 1)
        return jax.device_put(x, NamedSharding(self.mesh, self.rules.spec(logical, self.mesh, x.shape)))

    def _publish(self) -> None:
        # The engine reads these arrays only inside generate; the next train step donates them, and every
        # generate is preceded by a fresh publish, so no copy is needed.
        self.engine.set_params(self.policy_model())

    # ---- one iteration ----------------------------------------------------------------------------------------

    def step(self, step: int, examples: Sequence[dict], progress=None, before_update=None) -> dict[str, float]:
        """Run iteration ``step`` (1-based) on a batch of examples (dicts with prompt_ids and ground_truth).
        ``before_update()``, when given, runs just before the policy update donates the train state (the main loop
        lets a checkpoint save of that state end first: ``Checkpointer.settle``)."""
        cfg, ro = self.cfg, self.cfg.rollout
        n = ro.samples_per_prompt
        t0 = time.perf_counter()
        prompts = [list(ex["prompt_ids"]) for ex in examples]
        if progress is not None:
            progress.start_rollout(len(prompts) * n)
        res, t_reshard, reshard_bytes = self._rollout(step, examples, prompts, progress)
        t_rollout = time.perf_counter() - t0

        t1 = time.perf_counter()
        rewards = self.reward_fn(examples, res.tokens)
        t_reward = time.perf_counter() - t1

        adv = np.asarray(compute_advantages(cfg.rl.advantage, jnp.asarray(rewards.scores))).reshape(-1)
        seqs = build_sequences(prompts, res.tokens)
        t2 = time.perf_counter()
        old, ref = self._old_ref_logprobs(seqs)
        t_logprob = time.perf_counter() - t2

        if before_update is not None:
            before_update()
        t3 = time.perf_counter()
        train_metrics = self._update(step, {**seqs, "advantages": adv, "old_logp": old, "ref_logp": ref}, progress)
        t_train = time.perf_counter() - t3

        lengths = np.array([len(c) for comps in res.tokens for c in comps], np.float64)
        self.last_lengths = lengths.astype(int).tolist()  # every response length of this step (lengths.jsonl)
        stats = res.stats
        total_tokens = float(stats.get("total_tokens", lengths.sum()))
        metrics = {
            "reward/mean": float(rewards.scores.mean()),
            "reward/std": float(rewards.scores.std()),
            "reward/accuracy": float(rewards.correct.mean()),
            "reward/groups_all_same": float(np.mean(rewards.scores.std(axis=1) == 0)),
            **rewards.info,
            **_percentiles(lengths),
            "response/stopped_frac": float(np.mean([r == "stop" for rs in res.finish_reason for r in rs])),
            "time/rollout_s": t_rollout,
            "time/reshard_s": t_reshard,
            "rollout/reshard_bytes": float(reshard_bytes),
            "time/tail_s": float(stats.get("tail_seconds", 0.0)),
            "rollout/tail_share": float(stats.get("tail_share", 0.0)),
            "rollout/compile_s": float(stats.get("compile_seconds_this_call", 0.0)),
            "rollout/background_compile_s": float(stats.get("background_compile_seconds_this_call", 0.0)),
            "rollout/tokens": total_tokens,
            "rollout/tokens_per_s": total_tokens / max(t_rollout, 1e-9),
            "time/reward_s": t_reward,
            "time/logprob_s": t_logprob,
            "time/train_s": t_train,
            "time/step_s": time.perf_counter() - t0,
            "train/seq_len": float(seqs["input_ids"].shape[1]),
            **train_metrics,
        }
        if self.cfg.rollout.speculative != "off":
            metrics["rollout/accept_length"] = float(stats["mean_accept_length"])  # tokens per verify and row
            metrics["rollout/sd_on_s"] = float(stats["sd_on_seconds"])
            metrics["rollout/verify_steps"] = float(stats["verify_steps"])
        metrics.update(arm_share_metrics(stats))  # adaptive engines: the share of decode steps each arm ran
        return metrics

    def _rollout(self, step: int, examples: Sequence[dict], prompts: list[list[int]], progress):
        """Publish the policy to the engine and sample the step's groups: (result, reshard seconds, reshard bytes)."""
        ro = self.cfg.rollout
        t_reshard = time.perf_counter()
        self._publish()  # training layout -> rollout layout
        jax.block_until_ready(self.engine.params)
        t_reshard = time.perf_counter() - t_reshard
        reshard_bytes = max_device_bytes(self.engine.params)  # now: the train step may donate shared arrays
        sampling = SamplingParams(
            temperature=ro.temperature,
            top_k=ro.top_k,
            top_p=ro.top_p,
            max_new_tokens=_max_new_tokens(examples, ro.max_new_tokens),
            n=ro.samples_per_prompt,
            seed=self.rollout_seed(step),
        )
        res = self.engine.generate(
            prompts, sampling, on_chunk=None if progress is None else progress.rollout_update
        )
        return res, t_reshard, reshard_bytes

    def _old_ref_logprobs(self, seqs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The old policy's and the reference's log-probs of the sequences (zeros where no pass is needed)."""
        ids, attn = self._put(seqs["input_ids"]), self._put(seqs["attention_mask"])
        shape = seqs["input_ids"].shape
        # On-policy (one update per step): the update takes the old log-probs from its own forward, no pass here.
        old = np.zeros(shape, np.float32) if self.loss_cfg.on_policy else self._logprobs(self.state.params, ids, attn)
        ref = np.zeros(shape, np.float32) if self.ref_params is None else self._logprobs(self.ref_params, ids, attn)
        return old, ref

    def _update(self, step: int, batch: dict[str, np.ndarray], progress) -> dict[str, float]:
        cfg = self.cfg
        n = cfg.rollout.samples_per_prompt
        mini_rows = (cfg.rl.mini_batch_prompts or cfg.data.prompts_per_step) * n
        num_rows = batch["input_ids"].shape[0]
        loss_scale = np.float32(np.nan if step in cfg.train.debug_nan_steps else 1.0)
        if progress is not None:
            progress.start_train(cfg.updates_per_step)
        per_update = []
        for _ in range(cfg.rl.epochs):
            for lo in range(0, num_rows, mini_rows):
                mb = {k: self._put(v[lo : lo + mini_rows]) for k, v in batch.items()}
                mb["loss_scale"] = jnp.asarray(loss_scale)
                lr = float(self.schedule(int(self.state.step) - int(self.state.skipped)))
                self.state, m = self._train_step(self.state, self.rest, mb)
                m = {k: float(v) for k, v in jax.device_get(m).items()}
                m["lr"] = lr
                per_update.append(m)
                if progress is not None:
                    progress.train_update(m["loss"])
        finite = np.array([m["finite"] for m in per_update]) > 0
        keys = per_update[0].keys()
        # Averages over the updates that were applied (all of them when none was skipped).
        use = [m for m, f in zip(per_update, finite, strict=True) if f] or per_update
        out = {f"train/{k}": float(np.mean([m[k] for m in use])) for k in keys if k not in ("finite",)}
        out["train/skipped_updates"] = float((~finite).sum())
        out["train/skipped_total"] = float(self.state.skipped)
        out["train/nonfinite_step"] = float(not finite.all())
        out["train/updates"] = float(self.state.step)
        return out

    # ---- evaluation -------------------------------------------------------------------------------------------

    def evaluate(self, examples: Sequence[dict], *, max_new_tokens: int, batch_size: int) -> dict[str, float]:
        """Greedy decoding of every example; accuracy = fraction judged correct by the reward. A speculative engine
        also reports ``eval/accept_length`` (tokens per verify and row): the same held-out prompts every time, so it
        compares drafters across steps and runs on equal footing."""
        self._publish()
        t0 = time.perf_counter()
        scores, correct, lengths = [], [], []
        spec_tokens = row_verifies = 0
        for lo in range(0, len(examples), batch_size):
            chunk = list(examples[lo : lo + batch_size])
            res = self.engine.generate(
                [list(ex["prompt_ids"]) for ex in chunk],
                SamplingParams(temperature=0.0, max_new_tokens=_max_new_tokens(chunk, max_new_tokens), n=1, seed=0),
            )
            r = self.reward_fn(chunk, res.tokens)
            scores.append(r.scores[:, 0])
            correct.append(r.correct[:, 0])
            lengths += [len(c[0]) for c in res.tokens]
            for spec in [s.get("spec") or {} for s in res.stats.get("slices", [res.stats])]:  # one engine or slices
                spec_tokens += spec.get("tokens", 0)
                row_verifies += spec.get("row_verifies", 0)
        out = {
            "eval/accuracy": float(np.concatenate(correct).mean()),
            "eval/reward": float(np.concatenate(scores).mean()),
            "eval/num_examples": float(len(examples)),
            "eval/len_mean": float(np.mean(lengths)),
            "eval/seconds": time.perf_counter() - t0,
        }
        if row_verifies:
            out["eval/accept_length"] = spec_tokens / row_verifies
        return out

    # ---- checkpointed state -----------------------------------------------------------------------------------

    def load_state(self, state: TrainState, run_key: np.ndarray | None = None) -> None:
        """Continue from a restored train state (same structure and shardings as ``self.state``) and, when given,
        the run key the checkpoint saved (so the resumed steps sample what the uninterrupted run would have)."""
        self.state = state
        if run_key is not None:
            self.run_key = np.asarray(run_key)
