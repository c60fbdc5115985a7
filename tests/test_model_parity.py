"""Numerical parity with transformers (fixtures from tests/fixtures/make_fixtures.py; no torch needed here)."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax import generate as gen
from tlt_jax.models import DEFAULT_MODEL, KVCache, from_pretrained

FIXTURES = Path(__file__).parent / "fixtures"
SMOL = json.loads((FIXTURES / "smollm2_gguf_reference.json").read_text())


@pytest.mark.parametrize("name", ["tiny_qwen2", "tiny_llama"])
def test_tiny_logits_match_transformers(name):
    d = FIXTURES / name
    model = from_pretrained(d)
    ids = np.load(d / "ref_input_ids.npy")
    want = np.load(d / "ref_logits.npy")
    got = np.asarray(model(jnp.asarray(ids)).logits)
    assert got.shape == want.shape == (2, ids.shape[1], model.config.vocab_size)
    assert np.abs(got - want).max() <= 1e-4


def test_tiny_configs_parsed():
    q = from_pretrained(FIXTURES / "tiny_qwen2").config
    assert (q.architecture, q.attention_bias, q.tie_word_embeddings, q.num_kv_heads, q.rope_scaling) == (
        "qwen2",
        True,
        False,
        2,
        None,
    )
    assert q.rope_theta == 10000.0 and q.eos_token_ids == (2,)
    ll = from_pretrained(FIXTURES / "tiny_llama").config
    assert (ll.architecture, ll.attention_bias, ll.tie_word_embeddings, ll.head_dim, ll.num_kv_heads) == (
        "llama",
        False,
        True,
        32,
        1,
    )
    assert ll.rope_scaling is not None and ll.rope_scaling.factor == 4.0
    assert ll.rope_scaling.original_max_position_embeddings == 32 and ll.eos_token_ids == (1, 2)


@pytest.fixture(scope="module")
def smollm2():
    return from_pretrained(DEFAULT_MODEL)


def greedy_with_cache(model, prompt_ids, n, eos):
    """Prefill, then one token at a time through the KV cache; each jitted function compiles once."""
    graphdef, state = nnx.split(model)
    t = len(prompt_ids)

    @jax.jit
    def prefill(state, ids, cache):
        out = nnx.merge(graphdef, state)(ids, cache=cache)
        return jnp.argmax(out.logits[:, -1], -1), cache.append(out.k_new, out.v_new)

    @jax.jit
    def step(state, tok, cache):
        out = nnx.merge(graphdef, state)(tok[:, None], cache=cache)
        return jnp.argmax(out.logits[:, -1], -1), cache.append(out.k_new, out.v_new)

    cache = KVCache.zeros(model.config, 1, t + n)
    tok, cache = prefill(state, jnp.asarray([prompt_ids], jnp.int32), cache)
    out = [int(tok[0])]
    while len(out) < n and out[-1] not in eos:
        tok, cache = step(state, tok, cache)
        out.append(int(tok[0]))
    assert int(cache.lengths[0]) == t + len(out) - 1
    return out


def test_smollm2_gguf_greedy_matches_transformers(smollm2):
    cfg = smollm2.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    want = SMOL["output_ids"]
    got = greedy_with_cache(smollm2, SMOL["prompt_ids"], len(want), set(cfg.eos_token_ids))
    assert got == want


def test_generate_cli_loop_greedy_matches_transformers(smollm2):
    want = SMOL["output_ids"]
    res = gen.generate(smollm2, SMOL["prompt_ids"], max_new_tokens=len(want), num_samples=2)
    assert res.tokens == [want, want]
    assert res.prompt_tokens == len(SMOL["prompt_ids"]) and res.decode_steps == len(want) - 1


def test_sample_logits_filters():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))
    keys = jax.random.split(jax.random.key(0), 1)[0]
    top_k = np.asarray(gen.sample_logits(logits, keys, 1.0, 2, 1.0))
    assert set(np.unique(top_k)) == {0, 1} and 0.55 < (top_k == 0).mean() < 0.70  # 0.5 / 0.8 = 0.625
    top_p = np.asarray(gen.sample_logits(logits, keys, 1.0, 0, 0.85))  # keeps 0.5, 0.3, 0.15 (0.8 < 0.85)
    assert set(np.unique(top_p)) == {0, 1, 2}
    assert np.asarray(gen.sample_logits(logits, keys, 0.0, 0, 1.0)).tolist() == [0] * 4000
