"""Sample from a model: ``python -m tlt_jax.generate --model=PATH --prompt=TEXT [--num_samples=N]
[--drafter=PATH|ngram --spec_depth=8 --spec_topk=4 --spec_verify_tokens=48 --spec_threshold=32 --spec_arms=auto]``.

Generation runs on the RolloutEngine (prompt once, fork n, K-step chunks; with a drafter, tree speculative decoding
once at most ``--spec_threshold`` samples are live). With a drafter the engine is adaptive by default
(``--spec_arms=auto``): a bandit chooses per chunk between plain decoding ("off") and the ``--spec_*`` tree from
measured tokens/s, so a drafter that does not pay off costs a few exploratory chunks, not the whole run;
``--spec_arms=fixed`` always speculates with that tree, and a comma-separated list ("off,eagle:4x2x8,...") sets the
arms. Prints the samples, tokens/s (compilation excluded) and, with a drafter, the mean accept length (tokens
emitted per verify step and sample) and the arms' steps and tokens/s.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from absl import flags

from tlt_jax.assets import resolve_drafter_path
from tlt_jax.drafter import load_drafter
from tlt_jax.models import DEFAULT_MODEL, CausalLM, ModelLoadError, load_model_and_tokenizer
from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig

_SPEC = SpecConfig()

flags.DEFINE_string("model", DEFAULT_MODEL, "HF directory, .gguf file or alias (default: embedded SmolLM2-135M).")
flags.DEFINE_string("tokenizer", None, "Tokenizer path if not the model's own.")
flags.DEFINE_string("prompt", "What is 12 plus 30?", "Prompt text.")
flags.DEFINE_bool("chat", True, "Wrap the prompt in the model's ChatML chat template.")
flags.DEFINE_string("system", None, "System message (chat mode); default: the template's own default.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per sample.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "0 = greedy.", lower_bound=0.0)
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = off).", lower_bound=0)
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = off).")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_integer("num_samples", 1, "Samples of the same prompt (one prefill, forked).", lower_bound=1)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute and parameter dtype.")
flags.DEFINE_string(
    "drafter", None, "Speculative decoding: a saved EAGLE drafter directory, a shipped drafter's name "
    "(eagle-smollm2-gsm), or 'ngram'."
)
flags.DEFINE_integer("spec_depth", _SPEC.depth, "Draft tree depth.")
flags.DEFINE_integer("spec_topk", _SPEC.topk, "Children per expanded draft node (EAGLE-2).")
flags.DEFINE_integer("spec_verify_tokens", _SPEC.verify_tokens, "Tree tokens verified per step, root included.")
flags.DEFINE_integer("spec_threshold", _SPEC.threshold, "Speculative once at most this many samples are live.")
flags.DEFINE_integer("spec_steps_per_call", _SPEC.steps_per_call, "EAGLE verify steps per host round trip.")
flags.DEFINE_string(
    "spec_arms", "auto", "'auto' (bandit over 'off' and the --spec_* tree), 'fixed' (that tree only), or a list."
)
flags.DEFINE_float("spec_epsilon", 0.1, "Adaptive: exploration probability of the bandit.")
flags.DEFINE_integer("chunk_size", 8, "Plain decode steps per host round trip.")


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # per sample, EOS included when hit
    prompt_tokens: int
    compile_s: float
    prefill_s: float
    decode_s: float
    decode_steps: int
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)  # the RolloutEngine's stats

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by the decode steps (all samples) per second; the first token comes from the prefill."""
        return (self.new_tokens - len(self.tokens)) / max(self.decode_s, 1e-9)


def sample_logits(logits: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Next token [B] from logits [B, V]: greedy at temperature 0, else temperature / top-k / top-p sampling (a small
    standalone helper; generation itself samples with tlt_jax.sampling)."""
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
    drafter=None,
    spec: SpecConfig | None = None,
    chunk_size: int = 8,
) -> Generation:
    """Prefill the prompt once, fork it into ``num_samples`` rows, decode until EOS or ``max_new_tokens`` with the
    RolloutEngine (tree speculative decoding with ``drafter`` = an EagleDrafter or "ngram" once at most
    ``spec.threshold`` rows are live). Timings exclude compilation."""
    cfg = model.config
    eos = sorted(set(eos_token_ids) | set(cfg.eos_token_ids))
    t = len(prompt_ids)
    engine = RolloutEngine(
        model,
        drafter=drafter,
        spec=spec,
        max_batch=num_samples,
        max_len=-(-(t + max_new_tokens) // 128) * 128,
        chunk_size=chunk_size,
        max_stop_tokens=max(1, len(eos)),
    )
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        n=num_samples,
        stop_token_ids=eos,
        seed=seed,
    )
    res = engine.generate([prompt_ids], params)
    st = res.stats
    return Generation(
        res.tokens[0], t, st["compile_seconds_this_call"], st["prefill_seconds"], st["decode_seconds"], st["steps"], st
    )


def cli_spec(f) -> SpecConfig:
    """The SpecConfig of the --spec_* flags: adaptive over "off" and the flags' tree unless --spec_arms=fixed."""
    kind = "ngram" if f.drafter == "ngram" else "eagle"
    tree = f"{kind}:{f.spec_depth}x{f.spec_topk}x{f.spec_verify_tokens}"
    fixed = SpecConfig(f.spec_depth, f.spec_topk, f.spec_verify_tokens, f.spec_threshold, f.spec_steps_per_call)
    if f.spec_arms == "fixed":
        return fixed
    arms = ("off", tree) if f.spec_arms == "auto" else f.spec_arms
    return dataclasses.replace(fixed, arms=arms, epsilon=f.spec_epsilon, seed=f.seed)


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
    drafter, spec = None, None
    if f.drafter:
        try:
            spec = cli_spec(f)
            drafter = "ngram" if f.drafter == "ngram" else load_drafter(resolve_drafter_path(f.drafter), dtype)
        except (ValueError, OSError) as e:
            sys.exit(f"error: --drafter={f.drafter}: {e}")
    try:
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
            drafter=drafter,
            spec=spec,
            chunk_size=f.chunk_size,
        )
    except ValueError as e:
        sys.exit(f"error: {e}")
    for i, row in enumerate(res.tokens):
        print(f"--- sample {i} ({len(row)} tokens)")
        print(tok.decode(row, skip_special_tokens=True))
    st = res.stats
    print(
        f"--- load {load_s:.2f} s | compile {res.compile_s:.2f} s (excluded below) | prefill {res.prompt_tokens} "
        f"tokens in {res.prefill_s * 1e3:.1f} ms | decode {res.new_tokens} new tokens, {res.decode_steps} steps in "
        f"{res.decode_s:.2f} s = {res.decode_tokens_per_s:.1f} tokens/s (batch {f.num_samples}, excluding compile)"
    )
    if spec is not None:
        rates = ", ".join(f"{a} {v:.1f}" for a, v in st["arm_tokens_per_s"].items())
        arms = st["spec"]["arm"] if st["bandit"] is None else f"adaptive, tokens/s per arm: {rates}"
        print(
            f"--- speculative ({arms}): mean accept length {st['mean_accept_length']:.2f} tokens per "
            f"verify step and sample, {st['verify_steps']} verify steps | SD on {st['sd_on_seconds']:.2f} s, off "
            f"{st['sd_off_seconds']:.2f} s | {st['tokens_per_s']:.1f} tokens/s overall (prefill + decode)"
        )


if __name__ == "__main__":
    from tlt_jax import cli

    cli.run(main)
