"""Offline drafter warm-up on the policy's own generations.

    python -m tlt_jax.drafter.warmup --model=PATH --out=DIR [--num_prompts=64 --max_new_tokens=128 --steps=200]

Generates the policy's responses to GSM-style prompts (reasoning-gym ``gsm_symbolic``), recomputes the final-normed
hidden states with one policy forward per batch, packs (prompt, response) samples with segment ids, trains the EAGLE
drafter (loss masked to response tokens) and writes DIR/ (our format, ``load_drafter``) and DIR/eagle/ (EAGLE/SGLang
layout). ``--model`` defaults to the embedded SmolLM2-135M-Instruct; ``--model=tiny`` runs a random tiny model on
synthetic prompts (seconds, for smoke tests).
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from tlt_jax.drafter.eagle import EagleDrafter, num_trainable_params
from tlt_jax.drafter.export import export_eagle, save_drafter
from tlt_jax.drafter.train import LossConfig, OptimConfig, pack_sequences, train_drafter
from tlt_jax.speculative.generate import pad_prompts, plain_generate


@jax.jit
def _hidden(policy, ids, lengths):
    valid = jnp.arange(ids.shape[1])[None, :] < lengths[:, None]
    return policy(ids, attention_mask=valid, return_logits=False).hidden


def policy_hidden_states(policy, sequences: Sequence[Sequence[int]], batch_size: int = 8) -> list[np.ndarray]:
    """Final-normed policy features [T, H] of each full sequence (prompt + response), one forward per batch."""
    out = []
    for i in range(0, len(sequences), batch_size):
        chunk = list(sequences[i: i + batch_size])
        ids, lens = pad_prompts(chunk)
        pad_to = 1 << int(np.ceil(np.log2(ids.shape[1])))  # few distinct shapes -> few compiles
        ids = np.pad(ids, ((0, batch_size - len(chunk)), (0, pad_to - ids.shape[1])))
        lens = np.pad(lens, (0, batch_size - len(chunk)), constant_values=1)
        h = np.asarray(_hidden(policy, jnp.asarray(ids), jnp.asarray(lens)))
        out += [h[j, : len(s)] for j, s in enumerate(chunk)]
    return out


def run_warmup(policy, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128, steps: int = 200,
               batch_size: int = 8, row_len: int = 512, rows_per_batch: int = 4, temperature: float = 0.7,
               seed: int = 0, stop_tokens: Sequence[int] | None = None, optim: OptimConfig = OptimConfig(),
               loss_cfg: LossConfig = LossConfig(), drafter: EagleDrafter | None = None, log=print):
    """Generate, recompute features, pack, train. Returns (drafter, loss history, generated samples)."""
    t0 = time.perf_counter()
    samples = []
    for i in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[i: i + batch_size]]
        res = plain_generate(policy, chunk, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                             request_ids=list(range(i, i + len(chunk))), stop_tokens=stop_tokens)
        samples += [(p, r) for p, r in zip(chunk, res.tokens, strict=True)]
    n_tok = sum(len(r) for _, r in samples)
    log(f"generated {len(samples)} responses ({n_tok} tokens) in {time.perf_counter() - t0:.1f}s")
    seqs = [p + r for p, r in samples]
    hidden = policy_hidden_states(policy, seqs, batch_size)
    packed = [(np.asarray(s), h, len(p)) for s, h, (p, _) in zip(seqs, hidden, samples, strict=True)]
    order = np.random.default_rng(seed).permutation(len(packed))
    rows = pack_sequences([packed[k] for k in order], row_len)
    n_rows = rows.next_tokens.shape[0]
    reps = -(-max(n_rows, rows_per_batch) // n_rows)  # too few rows: repeat them to fill a batch
    rows = jax.tree.map(lambda x: np.concatenate([x] * reps), rows)
    batches = [jax.tree.map(lambda x, j=j: x[j: j + rows_per_batch], rows)
               for j in range(0, rows.next_tokens.shape[0] - rows_per_batch + 1, rows_per_batch)]
    drafter = drafter or EagleDrafter(policy.config, rngs=nnx.Rngs(seed))
    log(f"drafter: {num_trainable_params(drafter):,} trainable params; {len(batches)} packed batches of "
        f"{rows_per_batch}x{row_len}")
    drafter, history = train_drafter(drafter, policy, batches, steps, optim=optim, loss_cfg=loss_cfg, seed=seed,
                                     log_every=max(1, steps // 10), log=log)
    return drafter, history, samples


_FLAGS = flags.FLAGS


def define_flags():
    """CLI flags (defined only when run as a program, so importing this module never clashes with other flags)."""
    flags.DEFINE_string("model", None, "policy: HF dir, .gguf, alias, or 'tiny' (default: embedded SmolLM2)")
    flags.DEFINE_string("out", None, "output directory", required=True)
    flags.DEFINE_integer("num_prompts", 64, "GSM-style prompts to generate responses for")
    flags.DEFINE_integer("max_new_tokens", 128, "response length cap")
    flags.DEFINE_integer("steps", 200, "drafter optimiser steps")
    flags.DEFINE_integer("batch_size", 8, "generation batch size")
    flags.DEFINE_integer("row_len", 512, "packed row length (pairs)")
    flags.DEFINE_integer("rows_per_batch", 4, "packed rows per training batch")
    flags.DEFINE_float("temperature", 0.7, "generation temperature (0 = greedy)")
    flags.DEFINE_float("learning_rate", 3e-4, "AdamW learning rate")
    flags.DEFINE_integer("seed", 0, "seed for prompts, sampling and init")


def load_policy_and_prompts(model: str | None, num_prompts: int, seed: int):
    """(policy, prompt token lists, stop tokens)."""
    if model == "tiny":
        from tlt_jax.models import CausalLM, tiny_config

        policy = CausalLM(tiny_config(), rngs=nnx.Rngs(seed))
        rng = np.random.default_rng(seed)
        return policy, [list(rng.integers(2, 256, size=int(rng.integers(8, 24)))) for _ in range(num_prompts)], None
    from tlt_jax.data.prompts import PromptFormatter
    from tlt_jax.data.sources import gsm_symbolic_examples
    from tlt_jax.models import load_model_and_tokenizer

    if model is None:
        try:
            from tlt_jax.models.presets import default_model_path

            model = str(default_model_path())
        except Exception as e:  # noqa: BLE001 - report why the default is unavailable
            raise app.UsageError(f"no --model given and the embedded SmolLM2 is unavailable ({e}); pass --model") from e
    policy, tok = load_model_and_tokenizer(model)
    fmt = PromptFormatter(chat_template=tok.apply_chat_template if tok.chat_template else None)
    examples = gsm_symbolic_examples(num_prompts, seed, fmt)
    return policy, [tok.encode(ex["prompt_text"]) for ex in examples], tuple(tok.eos_token_ids) or None


def main(argv):
    del argv
    policy, prompts, stops = load_policy_and_prompts(_FLAGS.model, _FLAGS.num_prompts, _FLAGS.seed)
    drafter, history, samples = run_warmup(
        policy, prompts, max_new_tokens=_FLAGS.max_new_tokens, steps=_FLAGS.steps, batch_size=_FLAGS.batch_size,
        row_len=_FLAGS.row_len, rows_per_batch=_FLAGS.rows_per_batch, temperature=_FLAGS.temperature,
        seed=_FLAGS.seed, stop_tokens=stops, optim=OptimConfig(learning_rate=_FLAGS.learning_rate))
    out = pathlib.Path(_FLAGS.out)
    save_drafter(drafter, out)
    export_eagle(drafter, out / "eagle")
    summary = {"model": _FLAGS.model or "default", "num_samples": len(samples), "steps": _FLAGS.steps,
               "first": history[0], "last": history[-1]}
    (out / "warmup.json").write_text(json.dumps(summary, indent=1))
    print(f"saved drafter to {out} (EAGLE layout in {out / 'eagle'}); loss {history[0]['loss']:.4f} -> "
          f"{history[-1]['loss']:.4f}, top-1 {history[0]['top1']:.3f} -> {history[-1]['top1']:.3f}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
