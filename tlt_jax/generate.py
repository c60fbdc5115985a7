"""Sample from a model: ``python -m tlt_jax.generate --model=PATH --prompt=TEXT [--num_samples=N ...]``.

Plain (non-speculative) KV-cached decoding with a jitted prefill and a jitted one-token step, compiled ahead of time
so the reported tokens/s exclude compilation. The sampling here is deliberately minimal and local; the
RolloutEngine (tlt_jax.rollout) is the real implementation and will replace it.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from tlt_jax.models import DEFAULT_MODEL, CausalLM, KVCache, ModelLoadError, load_model_and_tokenizer

flags.DEFINE_string("model", DEFAULT_MODEL, "HF directory, .gguf file or alias (default: embedded SmolLM2-135M).")
flags.DEFINE_string("tokenizer", None, "Tokenizer path if not the model's own.")
flags.DEFINE_string("prompt", "What is 12 plus 30?", "Prompt text.")
flags.DEFINE_bool("chat", True, "Wrap the prompt in the model's ChatML chat template.")
flags.DEFINE_string("system", None, "System message (chat mode); default: the template's own default.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per sample.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = off).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = off).")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_integer("num_samples", 1, "Samples of the same prompt (one prefill, forked).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute and parameter dtype.")


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # per sample, EOS included when hit
    prompt_tokens: int
    compile_s: float
    prefill_s: float
    decode_s: float
    decode_steps: int

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by the decode steps (all samples) per second; the first token comes from the prefill."""
        return (self.new_tokens - len(self.tokens)) / max(self.decode_s, 1e-9)


def sample_logits(logits: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Next token [B] from logits [B, V]: greedy at temperature 0, else temperature / top-k / top-p sampling."""
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        srt = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(srt, axis=-1)
        drop = jnp.cumsum(probs, axis=-1) - probs > top_p  # mass before this token already exceeds top_p
        cutoff = jnp.min(jnp.where(drop, jnp.inf, srt), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(
    model: CausalLM,
    prompt_ids: list[int],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    num_samples: int = 1,
    eos_token_ids=(),
) -> Generation:
    """Prefill the prompt once, fork it into ``num_samples`` rows, decode until EOS or ``max_new_tokens``."""
    cfg = model.config
    eos = np.asarray(sorted(set(eos_token_ids) | set(cfg.eos_token_ids)) or [-1], np.int32)
    t = len(prompt_ids)
    max_len = -(-(t + max_new_tokens) // 128) * 128
    graphdef, state = nnx.split(model)
    pick = lambda logits, key: sample_logits(logits, key, temperature, top_k, top_p)

    def prefill(state, ids, key):
        m = nnx.merge(graphdef, state)
        cache = KVCache.zeros(cfg, 1, max_len, m.dtype)
        out = m(ids, cache=cache, logits_indices=jnp.full((1, 1), t - 1, jnp.int32))
        cache = cache.append(out.k_new, out.v_new).gather(jnp.zeros((num_samples,), jnp.int32))
        logits = jnp.broadcast_to(out.logits[:, 0], (num_samples, out.logits.shape[-1]))
        return pick(logits, jax.random.fold_in(key, 0)), cache

    def step(state, tok, cache, key, i):
        m = nnx.merge(graphdef, state)
        out = m(tok[:, None], cache=cache)
        return pick(out.logits[:, -1], jax.random.fold_in(key, i)), cache.append(out.k_new, out.v_new)

    key = jax.random.key(seed)
    ids = jnp.asarray([prompt_ids], jnp.int32)
    t0 = time.perf_counter()
    prefill_c = jax.jit(prefill).lower(state, ids, key).compile()
    tok_shape = jax.ShapeDtypeStruct((num_samples,), jnp.int32)
    cache_shape = jax.eval_shape(lambda: KVCache.zeros(cfg, num_samples, max_len, model.dtype))
    step_c = jax.jit(step, donate_argnums=(2,)).lower(state, tok_shape, cache_shape, key, jnp.int32(0)).compile()
    compile_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    tok, cache = prefill_c(state, ids, key)
    host = np.asarray(tok)
    prefill_s = time.perf_counter() - t0
    out = [host]
    done = np.isin(host, eos)
    t0 = time.perf_counter()
    steps = 0
    while len(out) < max_new_tokens and not done.all():
        steps += 1
        tok, cache = step_c(state, tok, cache, key, jnp.int32(steps))
        host = np.asarray(tok)
        out.append(host)
        done |= np.isin(host, eos)
    decode_s = time.perf_counter() - t0

    tokens = []
    for row in np.stack(out, axis=1).tolist():
        hit = next((i for i, x in enumerate(row) if x in eos), None)
        tokens.append(row if hit is None else row[: hit + 1])
    return Generation(tokens, t, compile_s, prefill_s, decode_s, steps)


def main(argv):
    del argv
    f = flags.FLAGS
    dtype = jnp.dtype(f.dtype)
    t0 = time.perf_counter()
    try:
        model, tok = load_model_and_tokenizer(f.model, dtype, tokenizer_path=f.tokenizer)
    except ModelLoadError as e:
        sys.exit(f"error: {e}")
    load_s = time.perf_counter() - t0
    text = f.prompt
    if f.chat:
        messages = ([{"role": "system", "content": f.system}] if f.system else []) + [
            {"role": "user", "content": f.prompt}
        ]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids = tok.encode(text)
    res = generate(
        model,
        ids,
        max_new_tokens=f.max_new_tokens,
        temperature=f.temperature,
        top_k=f.top_k,
        top_p=f.top_p,
        seed=f.seed,
        num_samples=f.num_samples,
        eos_token_ids=tok.eos_token_ids,
    )
    for i, row in enumerate(res.tokens):
        print(f"--- sample {i} ({len(row)} tokens)")
        print(tok.decode(row, skip_special_tokens=True))
    print(
        f"--- load {load_s:.2f} s | compile {res.compile_s:.2f} s (excluded below) | prefill {res.prompt_tokens} "
        f"tokens in {res.prefill_s * 1e3:.1f} ms | decode {res.new_tokens} new tokens, {res.decode_steps} steps in "
        f"{res.decode_s:.2f} s = {res.decode_tokens_per_s:.1f} tokens/s (batch {f.num_samples}, excluding compile)"
    )


if __name__ == "__main__":
    app.run(main)
