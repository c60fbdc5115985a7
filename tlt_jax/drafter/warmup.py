"""Offline drafter warm-up on the policy's own generations.

    python -m tlt_jax.drafter.warmup --model=PATH --out=DIR [--num_prompts=64 --max_new_tokens=128 --steps=200]
        [--temperatures=0,0.9 --draft_vocab=4096 --unroll=2 --engine_batch=64 --samples=F[,F...] --init=DIR]
        [--eval_prompts=16]

Generates the policy's responses to GSM-style prompts (reasoning-gym ``gsm_symbolic`` training split, chat-templated
as the policy sees them in RL) on the RolloutEngine (``--engine_batch`` rows per wave, default ``--batch_size``),
once per generation temperature, computes the policy's final-normed features of prompt + response with one forward,
packs (prompt, response) samples with segment ids, trains the EAGLE drafter (loss masked to response tokens; optional
draft vocabulary of the most frequent tokens and training-time-test unroll, warm-up + cosine learning rate) and
writes DIR/ (our format, ``load_drafter``, with the draft vocabulary) and DIR/eagle/ (EAGLE/SGLang layout).
``--model`` defaults to the embedded SmolLM2-135M-Instruct; ``--model=tiny`` runs a random tiny model on synthetic
prompts (seconds, for smoke tests). ``--samples`` keeps generations in pickles to reuse (several files are
concatenated); ``--init`` continues an earlier drafter (its warmup.json is kept as ``init_summary``).
``--eval_prompts`` measures the trained drafter on held-out prompts (the eval split): the exact greedy chain accept
length by draft depth (``tlt_jax.drafter.evaluate``), logged and kept in warmup.json.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import pickle
import time
from collections.abc import Sequence

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from tlt_jax.drafter.eagle import EagleDrafter, frequent_tokens, num_trainable_params
from tlt_jax.drafter.export import export_eagle, load_drafter, save_drafter
from tlt_jax.drafter.hidden import policy_hidden_states
from tlt_jax.drafter.train import DrafterLossConfig, DrafterOptimConfig, pack_sequences, train_drafter


def generate_samples(policy, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, batch_size: int,
                     temperatures: Sequence[float], seed: int, stop_tokens, engine_batch: int = 0, log=print):
    """(prompt, response, features [T, H] of prompt + response) per prompt and temperature (policy generations).

    The RolloutEngine generates (``engine_batch`` rows per wave, default ``batch_size``; compaction, one compiled
    program per bucket), then one policy forward per ``batch_size`` sequences gives the features."""
    from tlt_jax.rollout import RolloutEngine, SamplingParams

    t0 = time.perf_counter()
    out = []
    max_len = max(len(p) for p in prompts) + max_new_tokens + 1
    engine = RolloutEngine(policy, max_batch=engine_batch or batch_size, max_len=max_len)
    for ti, temp in enumerate(temperatures):
        res = engine.generate(prompts, SamplingParams(temperature=temp, max_new_tokens=max_new_tokens,
                                                      seed=seed + ti, stop_token_ids=stop_tokens))
        out += [(list(p), list(r[0])) for p, r in zip(prompts, res.tokens, strict=True)]
        log(f"engine: {sum(len(r[0]) for r in res.tokens)} tokens at temperature {temp}, "
            f"{res.stats['tokens_per_s']:.1f} tok/s")
    n_tok = sum(len(r) for _, r in out)
    log(f"generated {len(out)} responses ({n_tok} tokens) at temperatures {list(temperatures)} in "
        f"{time.perf_counter() - t0:.1f}s")
    hidden = policy_hidden_states(policy, [p + r for p, r in out], batch_size)
    return [(p, r, h) for (p, r), h in zip(out, hidden, strict=True)]


def draft_vocabulary(sequences, size: int, vocab_size: int) -> np.ndarray:
    """The ``size`` most frequent tokens of ``sequences``, topped up with the lowest unused ids (BPE: frequent)."""
    ids = frequent_tokens(sequences, size)
    if len(ids) < size:
        rest = np.setdiff1d(np.arange(min(vocab_size, size + len(ids))), ids)[: size - len(ids)]
        ids = np.union1d(ids, rest)
    return ids


def run_warmup(policy, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128, steps: int = 200,
               batch_size: int = 8, row_len: int = 512, rows_per_batch: int = 4, temperature: float = 0.7,
               seed: int = 0, stop_tokens: Sequence[int] | None = None,
               optim: DrafterOptimConfig = DrafterOptimConfig(), loss_cfg: DrafterLossConfig = DrafterLossConfig(),
               drafter: EagleDrafter | None = None, log=print, temperatures: Sequence[float] | None = None,
               draft_vocab_size: int | None = None, engine_batch: int = 0, generated=None):
    """Generate, keep features, pack, train. Returns (drafter, loss history, (prompt, response) samples).

    ``temperatures``: generate every prompt once per temperature (default: ``(temperature,)``);
    ``draft_vocab_size``: give the drafter a draft vocabulary of that many frequent tokens of the generated data (the
    token loss is then computed over it too); ``generated``: reuse ``generate_samples`` output instead of generating."""
    temps = tuple(temperatures) if temperatures is not None else (temperature,)
    gen = generated if generated is not None else generate_samples(
        policy, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, temperatures=temps, seed=seed,
        stop_tokens=stop_tokens, engine_batch=engine_batch, log=log)
    samples = [(p, r) for p, r, _ in gen]
    packed = [(np.asarray(p + r)[: len(h)], h, len(p)) for p, r, h in gen]
    drafter = drafter or EagleDrafter(policy.config, rngs=nnx.Rngs(seed))
    if draft_vocab_size:
        ids = draft_vocabulary([p + r for p, r in samples], draft_vocab_size, policy.config.vocab_size)
        resp = np.concatenate([np.asarray(r) for _, r in samples])
        log(f"draft vocabulary: {len(ids)} tokens, covering {np.isin(resp, ids).mean():.4f} of the response tokens")
        drafter.set_draft_vocab(ids)
        loss_cfg = dataclasses.replace(loss_cfg, vocab=tuple(int(x) for x in ids))
    order = np.random.default_rng(seed).permutation(len(packed))
    rows = pack_sequences([packed[k] for k in order], row_len)
    n_rows = rows.next_tokens.shape[0]
    reps = -(-max(n_rows, rows_per_batch) // n_rows)  # too few rows: repeat them to fill a batch
    rows = jax.tree.map(lambda x: np.concatenate([x] * reps), rows)
    batches = [jax.tree.map(lambda x, j=j: x[j: j + rows_per_batch], rows)
               for j in range(0, rows.next_tokens.shape[0] - rows_per_batch + 1, rows_per_batch)]
    log(f"drafter: {num_trainable_params(drafter):,} trainable params; {len(batches)} packed batches of "
        f"{rows_per_batch}x{row_len}")
    t0 = time.perf_counter()
    drafter, history = train_drafter(drafter, policy, batches, steps, optim=optim, loss_cfg=loss_cfg, seed=seed,
                                     log_every=max(1, steps // 10), log=log)
    log(f"trained {steps} steps in {time.perf_counter() - t0:.1f}s")
    return drafter, history, samples


_FLAGS = flags.FLAGS


_OWN_FLAGS = ("model", "num_prompts", "max_new_tokens", "steps", "batch_size", "engine_batch", "row_len",
              "rows_per_batch", "samples", "eval_prompts",
              "temperature", "temperatures", "learning_rate", "warmup_steps", "draft_vocab", "unroll", "value_weight",
              "prob_weight", "init", "seed")


def define_flags():
    """CLI flags (defined only when run as a program, so importing this module never clashes with other flags)."""
    flags.DEFINE_string("model", None, "policy: HF dir, .gguf, alias, or 'tiny' (default: embedded SmolLM2)")
    flags.DEFINE_string("out", None, "output directory", required=True)
    flags.DEFINE_integer("num_prompts", 64, "GSM-style prompts to generate responses for")
    flags.DEFINE_integer("max_new_tokens", 128, "response length cap")
    flags.DEFINE_integer("steps", 200, "drafter optimiser steps")
    flags.DEFINE_integer("batch_size", 8, "feature-forward batch (and generation batch when --engine_batch=0)")
    flags.DEFINE_integer("engine_batch", 0, "RolloutEngine rows per wave (0 = --batch_size)")
    flags.DEFINE_integer("row_len", 512, "packed row length (pairs)")
    flags.DEFINE_integer("rows_per_batch", 4, "packed rows per training batch")
    flags.DEFINE_float("temperature", 0.7, "generation temperature (0 = greedy), unless --temperatures")
    flags.DEFINE_list("temperatures", None, "generate every prompt at each of these temperatures")
    flags.DEFINE_float("learning_rate", 3e-4, "AdamW peak learning rate")
    flags.DEFINE_integer("warmup_steps", 0, "linear learning-rate warm-up steps (then cosine decay to 10%)")
    flags.DEFINE_integer("draft_vocab", 0, "draft vocabulary size (0 = full vocabulary)")
    flags.DEFINE_integer("unroll", 1, "training-time-test passes (1 = plain EAGLE loss)")
    flags.DEFINE_float("value_weight", DrafterLossConfig.value_weight, "weight of the feature regression loss")
    flags.DEFINE_float("prob_weight", DrafterLossConfig.prob_weight,
                       "weight of the soft-target token loss (cross-entropy against the policy's distribution)")
    flags.DEFINE_string("init", None, "start from this drafter directory (continue training)")
    flags.DEFINE_list("samples", None, "pickles of generated samples: read (and concatenated) if they all exist; "
                      "a single missing path is generated and written")
    flags.DEFINE_integer("seed", 0, "seed for prompts, sampling and init")
    flags.DEFINE_integer("eval_prompts", 16, "held-out prompts whose greedy responses measure the trained drafter's "
                         "chain acceptance (tlt_jax.drafter.evaluate; 0 = skip)")


EVAL_SIZE = 64  # held-out GSM prompts for benchmarks (split="eval"); the training split excludes them


def load_policy_and_prompts(model: str | None, num_prompts: int, seed: int, split: str | None = None):
    """(policy, prompt token lists, stop tokens). ``split``: None = ``num_prompts`` problems from ``seed``;
    "train" / "eval" = the disjoint training / held-out splits (``gsm_symbolic_splits``, eval size EVAL_SIZE)."""
    if model == "tiny":
        from tlt_jax.models import CausalLM, tiny_config

        policy = CausalLM(tiny_config(), rngs=nnx.Rngs(seed))
        rng = np.random.default_rng(seed)
        return policy, [list(rng.integers(2, 256, size=int(rng.integers(8, 24)))) for _ in range(num_prompts)], None
    from tlt_jax.data.prompts import PromptFormatter
    from tlt_jax.data.sources import gsm_symbolic_examples, gsm_symbolic_splits
    from tlt_jax.models import load_model_and_tokenizer

    if model is None:
        try:
            from tlt_jax.models.presets import default_model_path

            model = str(default_model_path())
        except Exception as e:  # noqa: BLE001 - report why the default is unavailable
            raise app.UsageError(f"no --model given and the embedded SmolLM2 is unavailable ({e}); pass --model") from e
    policy, tok = load_model_and_tokenizer(model)
    fmt = PromptFormatter(chat_template=tok.apply_chat_template if tok.chat_template else None)
    if split is None:
        examples = gsm_symbolic_examples(num_prompts, seed, fmt)
    elif split == "train":
        examples = gsm_symbolic_splits(num_prompts, EVAL_SIZE, train_seed=seed, formatter=fmt).train
    elif split == "eval":
        if num_prompts > EVAL_SIZE:
            raise ValueError(f"at most {EVAL_SIZE} held-out prompts")
        examples = gsm_symbolic_splits(1, EVAL_SIZE, formatter=fmt).eval[:num_prompts]
    else:
        raise ValueError(f"split must be None, 'train' or 'eval', got {split!r}")
    return policy, [tok.encode(ex["prompt_text"]) for ex in examples], tuple(tok.eos_token_ids) or None


def heldout_acceptance(policy, drafter, model: str | None, num_prompts: int, *, max_new_tokens: int, seed: int,
                       stop_tokens, depth: int = 6, log=print) -> dict:
    """Chain-acceptance profile of ``drafter`` on the policy's greedy responses to held-out prompts (the eval split;
    synthetic prompts of another seed for the tiny model)."""
    from tlt_jax.drafter.evaluate import chain_acceptance
    from tlt_jax.rollout import RolloutEngine, SamplingParams

    if model == "tiny":
        rng = np.random.default_rng(seed + 1)
        prompts = [list(rng.integers(2, 256, size=int(rng.integers(8, 24)))) for _ in range(num_prompts)]
    else:
        prompts = load_policy_and_prompts(model, num_prompts, seed, "eval")[1]
    engine = RolloutEngine(policy, max_batch=min(len(prompts), 64),
                           max_len=max(len(p) for p in prompts) + max_new_tokens + 1)
    res = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                                  stop_token_ids=stop_tokens))
    seqs = [list(p) + list(r[0]) for p, r in zip(prompts, res.tokens, strict=True)]
    prof = chain_acceptance(policy, drafter, seqs, [len(p) for p in prompts], depth=depth)
    out = dict(prompts=len(prompts), **prof.summary())
    log(f"held-out greedy chain acceptance ({out['positions']} positions): tokens per verify by chain depth "
        + ", ".join(f"{d}: {a:.2f}" for d, a in enumerate(out["expected_accept"], start=1)))
    return out


def main(argv):
    del argv
    try:  # checked before the policy loads
        loss_cfg = DrafterLossConfig(unroll=_FLAGS.unroll, value_weight=_FLAGS.value_weight,
                                     prob_weight=_FLAGS.prob_weight)
    except ValueError as e:
        raise app.UsageError(f"--value_weight / --prob_weight: {e}") from e
    split = None if _FLAGS.model == "tiny" else "train"
    policy, prompts, stops = load_policy_and_prompts(_FLAGS.model, _FLAGS.num_prompts, _FLAGS.seed, split)
    temps = None if _FLAGS.temperatures is None else [float(t) for t in _FLAGS.temperatures]
    optim = DrafterOptimConfig(learning_rate=_FLAGS.learning_rate, warmup_steps=_FLAGS.warmup_steps,
                        decay_steps=max(_FLAGS.steps - _FLAGS.warmup_steps, 0) if _FLAGS.warmup_steps else 0)
    files = [pathlib.Path(f) for f in _FLAGS.samples or ()]
    generated, cache = None, None
    if files and all(f.exists() for f in files):
        generated = [s for f in files for s in pickle.loads(f.read_bytes())]
    elif len(files) == 1:
        cache = files[0]
    elif files:
        raise app.UsageError(f"--samples: {[str(f) for f in files if not f.exists()]} missing (several files are only "
                             "read; pass one path to generate and write it)")
    if cache is not None:
        generated = generate_samples(policy, prompts, max_new_tokens=_FLAGS.max_new_tokens,
                                     batch_size=_FLAGS.batch_size, temperatures=temps or (_FLAGS.temperature,),
                                     seed=_FLAGS.seed, stop_tokens=stops, engine_batch=_FLAGS.engine_batch)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_bytes(pickle.dumps(generated))
    drafter, history, samples = run_warmup(
        policy, prompts, max_new_tokens=_FLAGS.max_new_tokens, steps=_FLAGS.steps, batch_size=_FLAGS.batch_size,
        row_len=_FLAGS.row_len, rows_per_batch=_FLAGS.rows_per_batch, temperature=_FLAGS.temperature,
        seed=_FLAGS.seed, stop_tokens=stops, optim=optim, temperatures=temps, engine_batch=_FLAGS.engine_batch,
        draft_vocab_size=_FLAGS.draft_vocab or None, loss_cfg=loss_cfg,
        drafter=load_drafter(_FLAGS.init) if _FLAGS.init else None, generated=generated)
    out = pathlib.Path(_FLAGS.out)
    save_drafter(drafter, out)
    export_eagle(drafter, out / "eagle")
    summary = {"model": _FLAGS.model or "default", "num_samples": len(samples), "steps": _FLAGS.steps,
               "response_tokens": sum(len(r) for _, r in samples), "flags": {k: _FLAGS[k].value for k in _OWN_FLAGS},
               "first": history[0], "last": history[-1],
               "last10_top1": float(np.mean([h["top1"] for h in history[-10:]]))}
    if _FLAGS.eval_prompts:
        summary["heldout_chain_acceptance"] = heldout_acceptance(
            policy, drafter, _FLAGS.model, _FLAGS.eval_prompts, max_new_tokens=_FLAGS.max_new_tokens,
            seed=_FLAGS.seed, stop_tokens=stops)
    if _FLAGS.init and (pathlib.Path(_FLAGS.init) / "warmup.json").exists():  # provenance of a continued drafter
        summary["init_summary"] = json.loads((pathlib.Path(_FLAGS.init) / "warmup.json").read_text())
    (out / "warmup.json").write_text(json.dumps(summary, indent=1))
    print(f"saved drafter to {out} (EAGLE layout in {out / 'eagle'}); loss {history[0]['loss']:.4f} -> "
          f"{history[-1]['loss']:.4f}, top-1 {history[0]['top1']:.3f} -> {history[-1]['top1']:.3f}")


if __name__ == "__main__":
    from tlt_jax import cli

    define_flags()
    cli.run(main)
