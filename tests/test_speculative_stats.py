"""Lossless sampling, statistically: the joint law of the first two tokens emitted by tree verification equals the
exact joint of plain sampling (chi-square goodness of fit, 64 cells, 20k samples run as one batch), at temperature 1,
with top-p and with temperature + top-k; trees drafted from the verifier's own keys (coupled drafting) pass it too;
and two deliberately wrong variants fail the same test (power)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.stats import chisquare

from tlt_jax.models import CausalLM, KVCache, tiny_config
from tlt_jax.sampling import processed_logprobs
from tlt_jax.speculative import make_tree, verify_tree
from tlt_jax.speculative.tree import DraftSampling, coupled_scores
from tlt_jax.speculative.verify import depth_keys

V = 8
CFG = tiny_config(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  eos_token_ids=())
PREFIX = [1, 2, 3]  # committed; the root (4) is sampled but not yet fed
ROOT = 4
B = 20_000
PARENT = np.array([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3], np.int32)  # 3 children, 2 grandchildren each
_make_tree = jax.jit(make_tree, static_argnums=3)
verify_step = jax.jit(verify_tree, static_argnames=("max_depth", "attend_len"))


def make_policy(seed):
    policy = CausalLM(CFG, rngs=nnx.Rngs(seed))
    policy.lm_head[...] = policy.lm_head[...] * 12.0  # spread the distributions (random init is near uniform)
    return policy


def draft_table(seed, policy):
    """tokens [V, 10]: a fixed tree for every possible root (distinct siblings), a function of the prefix only.
    The tree at ROOT mixes the policy's likely tokens with random ones so that paths of every length occur."""
    rng = np.random.default_rng(seed + 100)
    table = np.zeros((V, 10), np.int32)
    for r in range(V):
        table[r, 0] = r
        table[r, 1:4] = rng.permutation(V)[:3]
        for j in range(3):
            table[r, 4 + 2 * j: 6 + 2 * j] = rng.permutation(V)[:2]
    first = np.argsort(-np.asarray(policy(jnp.asarray([PREFIX + [ROOT]])).logits[0, -1]))
    table[ROOT, 1:4] = [first[0], first[2], first[5]]
    for j, c in enumerate(table[ROOT, 1:4]):
        nxt = np.argsort(-np.asarray(policy(jnp.asarray([PREFIX + [ROOT, c]])).logits[0, -1]))
        table[ROOT, 4 + 2 * j: 6 + 2 * j] = [nxt[0], nxt[3]]
    return table


def exact_joint(policy, temperature, top_k, top_p):
    seqs = jnp.asarray([PREFIX + [ROOT, x] for x in range(V)])
    out = policy(seqs).logits
    p1 = np.exp(np.asarray(processed_logprobs(out[0, 3], temperature, top_k, top_p), np.float64))
    p2 = np.exp(np.asarray(processed_logprobs(out[:, 4], temperature, top_k, top_p), np.float64))
    return p1[:, None] * p2


def coupled_tree(drafter_policy, temperature, deterministic=False):
    """A tree builder for the first verify step: 3 children of the root and 2 per child, each the top scores of
    ``coupled_scores`` over the drafter's logits, so every row's tree depends on the verifier's keys (as the EAGLE
    drafter's trees do for sampled rows). ``deterministic``: the drafter's plain top-k instead (the same drafter
    without the coupling)."""
    seqs = jnp.asarray([PREFIX + [ROOT, 0]] + [PREFIX + [ROOT, x] for x in range(V)])
    logits = drafter_policy(seqs).logits.astype(jnp.float32)
    root_logits, child_logits = logits[0, 3], logits[1:, 4]  # [V], [V (child token), V]

    def build(root, keys):
        sampling = DraftSampling(keys, jnp.full(B, temperature))
        score = lambda lg, d: lg if deterministic else coupled_scores(lg, sampling, d, V)  # noqa: E731
        kids = jax.lax.top_k(score(jnp.broadcast_to(root_logits, (B, V)), 0), 3)[1]  # [B, 3]
        grand = jax.lax.top_k(score(child_logits[kids], 1), 2)[1]  # [B, 3, 2]
        return jnp.concatenate([root[:, None], kids, grand.reshape(B, 6)], axis=1).astype(jnp.int32)

    return build


def spec_two_tokens(policy, table, seed, temperature, top_k, top_p, stale_keys=False, first_tree=None):
    """First two tokens emitted after the root, for B samples (sample ids 0..B-1) via verify_step (1-2 steps).
    ``first_tree(root, keys)``: the first step's tree tokens [B, 10] (default: the table's tree for the root)."""
    cache = KVCache.zeros(CFG, 1, 8)
    out = policy(jnp.asarray([PREFIX]), cache=cache)
    cache = cache.append(out.k_new, out.v_new).gather(jnp.zeros(B, jnp.int32))
    temp, tk, tp = jnp.full(B, temperature), jnp.full(B, top_k, jnp.int32), jnp.full(B, top_p)
    stop, active, samples = jnp.array([-1]), jnp.ones(B, bool), np.arange(B)
    tab = jnp.asarray(table)
    emitted = []
    root = jnp.full(B, ROOT, jnp.int32)
    for _ in range(2):
        keys = depth_keys(seed, np.zeros(B), samples, cache.lengths + 1, 2)
        if stale_keys:  # wrong: one coin for every depth (not fresh per position)
            keys = jnp.repeat(keys[:, :1], 3, axis=1)
        tokens = first_tree(root, keys) if first_tree is not None and not emitted else tab[root]
        tree = _make_tree(tokens, jnp.broadcast_to(PARENT, (B, 10)), jnp.ones((B, 10), bool), 2)
        remaining = jnp.full(B, 2 - (len(emitted) and 1), jnp.int32)
        res = verify_step(policy, cache, tree, keys, temp, tk, tp, stop, remaining, active, max_depth=2)
        toks, n = np.asarray(res.tokens), np.asarray(res.num_emitted)
        if not emitted:
            emitted = [toks[:, 0], np.where(n >= 2, toks[:, 1], -1)]
            accepted = np.asarray(res.accept_len)
        else:
            emitted[1] = np.where(emitted[1] < 0, toks[:, 0], emitted[1])
        cache, root = res.cache, res.root
    assert (emitted[1] >= 0).all()
    return emitted[0], emitted[1], accepted


def no_residual_two_tokens(policy, table, seed, temperature, top_k, top_p):
    """A classic bug: try each child x with probability p(x); if all fail, resample from p itself (no residual)."""
    rng = np.random.default_rng(seed)
    seqs = [PREFIX + [ROOT]] + [PREFIX + [ROOT, x] for x in range(V)]
    seqs = jnp.asarray([s + [0] * (5 - len(s)) for s in seqs])
    logits = policy(seqs).logits
    p_root = np.exp(np.asarray(processed_logprobs(logits[0, 3], temperature, top_k, top_p), np.float64))
    p_next = np.exp(np.asarray(processed_logprobs(logits[1:, 4], temperature, top_k, top_p), np.float64))

    def step(p, children):
        out = np.full(B, -1)
        for c in children:
            take = (out < 0) & (rng.random(B) < p[:, c] if p.ndim == 2 else rng.random(B) < p[c])
            out = np.where(take, c, out)
        cdf = np.cumsum(p, axis=-1)
        u = rng.random(B)
        fallback = (u[:, None] > (cdf if cdf.ndim == 2 else cdf[None])).sum(-1)
        return np.where(out >= 0, out, np.minimum(fallback, V - 1))

    first = step(p_root, table[ROOT, 1:4])
    second = np.zeros(B, np.int64)
    for x in range(V):  # second token: the same rule at the child, or plain sampling after a non-child
        rows = first == x
        kids = table[ROOT, 4 + 2 * list(table[ROOT, 1:4]).index(x):][:2] if x in table[ROOT, 1:4] else []
        second[rows] = step(np.broadcast_to(p_next[x], (B, V)), kids)[rows]
    return first, second


def chi2(first, second, joint):
    obs = np.bincount(first * V + second, minlength=V * V).astype(np.float64)
    exp = joint.reshape(-1) * len(first)
    assert obs[exp == 0].sum() == 0, "a token outside the top-k/top-p support was emitted"
    big = exp >= 5
    o = np.append(obs[big], obs[~big & (exp > 0)].sum())
    e = np.append(exp[big], exp[~big & (exp > 0)].sum())
    if e[-1] == 0:
        o, e = o[:-1], e[:-1]
    e = e * o.sum() / e.sum()
    tv = 0.5 * np.abs(obs / len(first) - joint.reshape(-1)).sum()
    return chisquare(o, e).pvalue, tv


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.0, 0, 0.8), (0.7, 3, 1.0)])
def test_tree_sampling_matches_exact_joint(seed, temperature, top_k, top_p):
    policy = make_policy(seed)
    table = draft_table(seed, policy)
    first, second, accepted = spec_two_tokens(policy, table, seed, temperature, top_k, top_p)
    p, tv = chi2(first, second, exact_joint(policy, temperature, top_k, top_p))
    assert (accepted >= 1).mean() > 0.1 and (accepted == 2).any()  # the tree actually carries tokens
    assert p > 1e-3, (p, tv)
    assert tv < 0.03


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 0.9)])
def test_trees_drafted_from_the_verifiers_keys_stay_exact(seed, temperature, top_k, top_p):
    """Trees built from the verifier's own noise (coupled drafting) keep the exact joint: every position's key is
    plain decoding's, so the emitted tokens are plain sampling's whatever the tree holds. Without top-k / top-p (the
    drafter guesses from the temperature-scaled distribution only) the policy as its own drafter has its coupled tree
    accepted whole on (almost) every row, and the same drafter's deterministic top-k tree is accepted less."""
    policy = make_policy(seed)
    table = draft_table(seed, policy)
    joint = exact_joint(policy, temperature, top_k, top_p)
    for drafter in (make_policy(seed + 10), policy):
        first, second, accepted = spec_two_tokens(policy, table, seed, temperature, top_k, top_p,
                                                  first_tree=coupled_tree(drafter, temperature))
        p, tv = chi2(first, second, joint)
        assert p > 1e-3 and tv < 0.03, (p, tv)
    if top_k == 0 and top_p == 1.0:
        assert (accepted == 2).mean() > 0.99
        _, _, plain_top_k = spec_two_tokens(policy, table, seed, temperature, top_k, top_p,
                                            first_tree=coupled_tree(policy, temperature, deterministic=True))
        assert plain_top_k.mean() < accepted.mean() - 0.01


@pytest.mark.parametrize("seed", [0, 1])
def test_wrong_variants_fail(seed):
    policy = make_policy(seed)
    table = draft_table(seed, policy)
    joint = exact_joint(policy, 1.0, 0, 1.0)
    first, second, _ = spec_two_tokens(policy, table, seed, 1.0, 0, 1.0, stale_keys=True)
    p_stale, _ = chi2(first, second, joint)
    first, second = no_residual_two_tokens(policy, table, seed, 1.0, 0, 1.0)
    p_nores, _ = chi2(first, second, joint)
    assert p_stale < 1e-6 and p_nores < 1e-6, (p_stale, p_nores)
