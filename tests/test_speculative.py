"""Tree speculative decoding: format helpers and kernels against the numpy oracles, tree-forward parity, KV commit,
and the lossless end-to-end property through the rollout engine (speculative == plain decoding, token for token,
greedy and sampled, for several EAGLE tree shapes, the n-gram drafter and an oracle drafter)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter import EagleDrafter
from tlt_jax.models import CausalLM, KVCache, tiny_config
from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig
from tlt_jax.speculative import (
    NgramDrafter,
    accept_tree,
    ancestor_matrix,
    check_tree,
    drafter_prefill,
    eagle_draft,
    from_first_child_next_sibling,
    init_draft_state,
    make_tree,
    sample_tree,
    select_tree,
    tree_forward,
    truncate,
    verify_tree,
)
from tlt_jax.speculative.reference import (
    ref_accept,
    ref_ancestors,
    ref_depths,
    ref_eagle_draft,
    ref_select,
    ref_truncate,
)
from tlt_jax.speculative.verify import depth_keys

CFG = tiny_config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=())
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def policy():
    return CausalLM(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def drafter():
    return EagleDrafter(CFG, rngs=nnx.Rngs(1))


def random_tree(rng, n, vocab, p_invalid=0.15):
    """Topologically ordered random tree with distinct sibling tokens (numpy)."""
    parent = np.full(n, -1, np.int32)
    tokens = np.zeros(n, np.int32)
    valid = np.ones(n, bool)
    used = {}
    tokens[0] = rng.integers(vocab)
    for i in range(1, n):
        p = int(rng.integers(i))
        parent[i] = p
        choices = [t for t in range(vocab) if t not in used.setdefault(p, set())]
        tokens[i] = rng.choice(choices)
        used[p].add(int(tokens[i]))
        valid[i] = rng.random() > p_invalid
    return tokens, parent, valid


def closure(parent, valid):
    v = valid.copy()
    for i in range(1, len(parent)):
        v[i] = v[i] and v[parent[i]]
    return v


# ------------------------------------------------------------------------------------------------ format + kernels


def test_make_tree_and_ancestors_match_reference():
    rng = np.random.default_rng(0)
    n = 12
    rows = [random_tree(rng, n, 20) for _ in range(6)]
    tok, par, val = (np.stack(x) for x in zip(*rows, strict=True))
    tree = make_tree(tok, par, val, max_depth=n - 1)
    anc = np.asarray(ancestor_matrix(tree, n - 1))
    for b in range(len(rows)):
        v = closure(par[b], val[b])
        np.testing.assert_array_equal(np.asarray(tree.valid[b]), v)
        ref = ref_ancestors(par[b])
        np.testing.assert_array_equal(anc[b][v][:, v], ref[v][:, v])
        np.testing.assert_array_equal(np.asarray(tree.depth[b])[v], ref_depths(par[b])[v])
        np.testing.assert_array_equal(np.asarray(tree.tokens[b])[~v], 0)
    check_tree(tree)
    # Depth beyond max_depth is invalidated (the accepted path has a static width).
    chain = make_tree(np.arange(6)[None], np.arange(-1, 5)[None], np.ones((1, 6), bool), max_depth=3)
    np.testing.assert_array_equal(np.asarray(chain.valid[0]), [1, 1, 1, 1, 0, 0])


def test_accept_matches_reference_walk():
    rng = np.random.default_rng(1)
    n, vocab = 10, 12
    rows = [random_tree(rng, n, vocab) for _ in range(64)]
    tok, par, val = (np.stack(x) for x in zip(*rows, strict=True))
    samples = rng.integers(vocab, size=(64, n)).astype(np.int32)
    for b in range(64):  # make acceptance frequent: a node's sample usually equals one of its children
        for u in range(n):
            kids = [c for c in range(n) if par[b, c] == u]
            if kids and rng.random() < 0.8:
                samples[b, u] = tok[b, rng.choice(kids)]
    tree = make_tree(tok, par, val, max_depth=n - 1)
    acc = accept_tree(tree, jnp.asarray(samples), max_depth=n - 1)
    lens = []
    for b in range(64):
        path, alen = ref_accept(tok[b], par[b], closure(par[b], val[b]), samples[b])
        assert int(acc.accept_len[b]) == alen
        np.testing.assert_array_equal(np.asarray(acc.path[b, : alen + 1]), path)
        lens.append(alen)
    assert max(lens) >= 3 and min(lens) == 0


def test_sglang_greedy_verification_case():
    """The example of sgl-kernel's test_verify_tree_greedy, converted to parent pointers."""
    t0, p0 = from_first_child_next_sibling([0, 1, 2, 3, 4, 5], [1, 2, -1, 4, 5, -1], [-1, 3, -1, -1, -1, -1])
    t1, p1 = from_first_child_next_sibling([7, 8, 9, 10, 11, 12], [4, 2, 3, -1, 5, -1], [-1, -1, -1, -1, 1, -1])
    np.testing.assert_array_equal(p0, [-1, 0, 1, 0, 3, 4])
    np.testing.assert_array_equal(p1, [-1, 0, 1, 2, 0, 4])
    argmax = np.full((2, 6), 18, np.int32)
    argmax[0, [0, 3, 4]] = [3, 4, 5]
    argmax[1, [0, 4]] = [11, 12]
    tree = make_tree(np.stack([t0, t1]), np.stack([p0, p1]), np.ones((2, 6), bool), max_depth=3)
    # Greedy = temperature 0 through the one sampling path (the keys must not matter).
    logits = jax.nn.one_hot(argmax, 24) * 5.0 + 0.01 * jax.random.normal(jax.random.key(0), (2, 6, 24))
    keys = depth_keys(0, np.arange(2), np.zeros(2), np.array([6, 6]), 3)
    samples = sample_tree(logits, tree, keys, jnp.zeros(2), jnp.zeros(2, jnp.int32), jnp.ones(2))
    np.testing.assert_array_equal(np.asarray(samples), argmax)
    acc = accept_tree(tree, samples, max_depth=3)
    np.testing.assert_array_equal(np.asarray(acc.accept_len), [3, 2])
    np.testing.assert_array_equal(np.asarray(acc.path), [[0, 3, 4, 5], [0, 4, 5, 0]])
    emitted = np.take_along_axis(argmax, np.asarray(acc.path), axis=1)
    np.testing.assert_array_equal(emitted[0], [3, 4, 5, 18])  # SGLang predicts at nodes 0,3,4,5
    np.testing.assert_array_equal(emitted[1, :3], [11, 12, 18])  # flat accept_index [6, 10, 11]
    for b, (t, p) in enumerate([(t0, p0), (t1, p1)]):
        path, alen = ref_accept(t, p, np.ones(6, bool), argmax[b])
        assert path == np.asarray(acc.path[b, : alen + 1]).tolist()


def test_truncate_matches_reference():
    rng = np.random.default_rng(2)
    tokens = rng.integers(6, size=(200, 5)).astype(np.int32)
    n = rng.integers(1, 6, size=200).astype(np.int32)
    remaining = rng.integers(1, 7, size=200).astype(np.int32)
    active = rng.random(200) > 0.1
    stops = np.array([2, 4], np.int32)
    count, finished = truncate(jnp.asarray(tokens), jnp.asarray(n), stops, jnp.asarray(remaining),
                               jnp.asarray(active))
    for b in range(200):
        ref = ref_truncate(tokens[b, : n[b]].tolist(), {2, 4}, int(remaining[b])) if active[b] else []
        assert int(count[b]) == len(ref)
        fin = active[b] and (len(ref) == remaining[b] or (ref and ref[-1] in (2, 4)))
        assert bool(finished[b]) == bool(fin)


def test_select_tree_matches_reference():
    rng = np.random.default_rng(3)
    k, depth = 3, 3
    b = 8
    # Candidates in EAGLE layer order: k roots' children, then k*k per step with parents among the previous frontier.
    scores, tokens, parents = [], [], []
    for _ in range(b):
        s = list(-rng.random(k))
        t = list(rng.permutation(30)[:k])
        p = [-1] * k
        front = list(range(k))
        for _ in range(1, depth):
            base = len(s)
            for f in front:
                s += list(s[f] - rng.random(k))
                t += list(rng.permutation(30)[:k])
                p += [f] * k
            front = [base + int(i) for i in np.argsort(-np.array(s[base:]), kind="stable")[:k]]
        scores.append(s)
        tokens.append(t)
        parents.append(p)
    scores, tokens, parents = np.array(scores), np.array(tokens, np.int32), np.array(parents, np.int32)
    scores[0, 5] = np.nan
    for n in (4, 9, 40):  # 40 > candidate count (21): invalid padding
        tree = select_tree(jnp.asarray(scores), jnp.asarray(tokens), jnp.asarray(parents), jnp.arange(b), n, depth)
        check_tree(tree)
        for r in range(b):
            rt, rp, rv = ref_select(scores[r], tokens[r], parents[r], r, n)
            np.testing.assert_array_equal(np.asarray(tree.valid[r]), rv)
            np.testing.assert_array_equal(np.asarray(tree.tokens[r])[rv], rt[rv])
            np.testing.assert_array_equal(np.asarray(tree.parent[r])[rv], rp[rv])


# ---------------------------------------------------------------------------------------- model-level invariants


def pad_prompts(prompts):
    lens = np.array([len(p) for p in prompts], np.int32)
    ids = np.zeros((len(prompts), int(lens.max())), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return ids, lens


def _prefill(policy, prompts, extra=16):
    """Prompts into a fresh cache: (ids, lens, cache, greedy first token, the prompts' hidden states)."""
    ids, lens = pad_prompts(prompts)
    cache = KVCache.zeros(policy.config, len(prompts), ids.shape[1] + extra)
    valid = jnp.arange(ids.shape[1])[None, :] < lens[:, None]
    out = policy(jnp.asarray(ids), attention_mask=valid, cache=cache, logits_indices=jnp.asarray(lens - 1)[:, None])
    first = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
    return ids, lens, cache.append(out.k_new, out.v_new, jnp.asarray(lens)), first, out.hidden


def _drafter_state(policy, drafter, ids, lens, first, hidden, slots):
    """The drafter state after the prompt and the first token: pairs (h_t, x_{t+1}) for t < len, x_len = first."""
    b = len(lens)
    seq = np.concatenate([ids, np.zeros((b, 1), np.int32)], axis=1)
    seq[np.arange(b), lens] = np.asarray(first)
    hid = jnp.concatenate([hidden, jnp.zeros_like(hidden[:, :1])], axis=1)
    state = init_draft_state(CFG, b, slots)
    return jax.jit(drafter_prefill)(policy, drafter, state, hid, jnp.asarray(seq), jnp.asarray(lens))


@jax.jit
def _logits(policy, ids):
    return policy(ids).logits.astype(jnp.float32)


def _greedy(policy, prompts, steps):
    """Greedy continuations and their raw log-probs by re-forwarding every whole sequence (no cache; right padding
    to one shape, which a causal model never sees from earlier positions): the kernel tests' reference."""
    seqs = [list(p) for p in prompts]
    lps = [[] for _ in prompts]
    for _ in range(steps):
        ids, lens = pad_prompts(seqs)
        ids = np.pad(ids, ((0, 0), (0, 32 - ids.shape[1])))
        logp = jax.nn.log_softmax(_logits(policy, jnp.asarray(ids)), axis=-1)
        logp = np.asarray(logp[jnp.arange(len(seqs)), jnp.asarray(lens) - 1])
        for i, row in enumerate(logp):
            seqs[i].append(int(np.argmax(row)))
            lps[i].append(float(row[seqs[i][-1]]))
    return [s[len(p):] for s, p in zip(seqs, prompts, strict=True)], lps


def test_tree_forward_logits_equal_sequential_decode(policy):
    rng = np.random.default_rng(4)
    n, d = 10, 4
    _, lens, cache, first, _ = _prefill(policy, PROMPTS)
    rows = [random_tree(rng, n, CFG.vocab_size, p_invalid=0.1) for _ in PROMPTS]
    tok, par, val = (np.stack(x) for x in zip(*rows, strict=True))
    tok[:, 0] = np.asarray(first)
    tree = make_tree(tok, par, val, max_depth=d)
    out = tree_forward(policy, cache, tree, d)
    tok, par, val = (np.asarray(x) for x in (tree.tokens, tree.parent, tree.valid))
    seqs, where = [], []
    for b, prompt in enumerate(PROMPTS):
        for u in range(n):
            if not val[b, u]:
                continue
            path, j = [], u
            while j >= 0:
                path.append(int(tok[b, j]))
                j = int(par[b, j])
            seqs.append(prompt + path[::-1])
            where.append((b, u))
    ids, lens = pad_prompts(seqs)  # one plain causal forward per path (right-padded batch)
    ref = policy(jnp.asarray(ids), logits_indices=jnp.asarray(lens - 1)[:, None]).logits[:, 0]
    got = jnp.stack([out.logits[b, u] for b, u in where])
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    checked = len(seqs)
    assert checked > 15


def test_kv_commit_equals_plain_decoding_kv(policy):
    _, lens, cache, first, _ = _prefill(policy, PROMPTS)
    greedy, greedy_lp = _greedy(policy, PROMPTS, 6)
    g = [np.array(t) for t in greedy]
    np.testing.assert_array_equal([t[0] for t in g], np.asarray(first))
    # Chain root -> g[1] -> g[2] -> g[3] plus wrong siblings: greedy verification accepts exactly the chain.
    tok = np.array([[t[0], t[1], (t[1] + 1) % 64, t[2], t[3], (t[3] + 7) % 64] for t in g], np.int32)
    par = np.array([[-1, 0, 0, 1, 3, 3]] * 3, np.int32)
    tree = make_tree(tok, par, np.ones((3, 6), bool), max_depth=3)
    keys = depth_keys(0, np.arange(3), np.zeros(3), cache.lengths + 1, 3)
    zeros = jnp.zeros(3)
    remaining = jnp.array([10, 2, 10])  # row 1: budget cut inside the accepted path
    out = verify_tree(policy, cache, tree, keys, zeros, zeros.astype(jnp.int32), jnp.ones(3), jnp.array([-1]),
                      remaining, jnp.array([True, True, False]), max_depth=3)
    np.testing.assert_array_equal(np.asarray(out.accept_len), [3, 3, 3])
    np.testing.assert_array_equal(np.asarray(out.num_emitted), [4, 2, 0])
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), g[0][1:5])
    np.testing.assert_array_equal(np.asarray(out.tokens[1]), [g[1][1], g[1][2], -1, -1])
    np.testing.assert_array_equal(np.asarray(out.finished), [False, True, False])
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), lens + np.array([4, 2, 0]))
    for b in range(2):
        committed = PROMPTS[b] + g[b][: int(out.num_emitted[b])].tolist()
        ref = policy(jnp.asarray([committed]))
        n = len(committed)
        np.testing.assert_allclose(out.cache.k[:, b, :n], ref.k_new[:, 0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(out.cache.v[:, b, :n], ref.v_new[:, 0], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(out.cache.k[:, 2]), np.asarray(cache.k[:, 2]))  # inactive: untouched
    # Log-probs are the raw policy log-probs at the parent node.
    np.testing.assert_allclose(out.logprobs[0], greedy_lp[0][1:5], atol=1e-5)


def test_sampled_walk_equals_all_node_sampling(policy):
    """verify_tree samples only along the realised path (a while-loop walk); it must pick exactly what sampling every
    node (sample_tree) + the vectorised acceptance (accept_tree) picks, for mixed greedy / sampled rows."""
    rng = np.random.default_rng(11)
    n, d = 9, 4
    _, lens, cache, first, _ = _prefill(policy, PROMPTS)
    greedy, _ = _greedy(policy, PROMPTS, 2)
    for trial in range(6):
        rows = [random_tree(rng, n, CFG.vocab_size, p_invalid=0.1) for _ in PROMPTS]
        tok, par, val = (np.stack(x) for x in zip(*rows, strict=True))
        tok[:, 0] = np.asarray(first)
        tok[:, 1] = [g[1] for g in greedy]  # a likely first hit, so the walk goes deeper than the root
        par[:, 1], val[:, 1] = 0, True
        tree = make_tree(tok, par, val, max_depth=d)
        keys = depth_keys(trial, np.arange(3), np.zeros(3), cache.lengths + 1, d)
        temp, top_k, top_p = jnp.array([0.0, 1.0, 0.8]), jnp.array([0, 0, 5]), jnp.array([1.0, 0.9, 1.0])
        out = verify_tree(policy, cache, tree, keys, temp, top_k, top_p, jnp.array([-1]), jnp.full(3, 20),
                          jnp.ones(3, bool), max_depth=d)
        logits = tree_forward(policy, cache, tree, d).logits
        acc = accept_tree(tree, sample_tree(logits, tree, keys, temp, top_k, top_p), d)
        np.testing.assert_array_equal(np.asarray(out.accept_len), np.asarray(acc.accept_len))
        for b in range(3):
            a = int(acc.accept_len[b]) + 1
            np.testing.assert_array_equal(np.asarray(out.path[b, :a]), np.asarray(acc.path[b, :a]))
        ref_tok = np.asarray(_gather_np(sample_tree(logits, tree, keys, temp, top_k, top_p), acc.path))
        got = np.asarray(out.tokens)
        for b in range(3):
            a = int(acc.accept_len[b]) + 1
            np.testing.assert_array_equal(got[b, :a], ref_tok[b, :a])


def _gather_np(x, idx):
    return np.take_along_axis(np.asarray(x), np.asarray(idx), axis=1)


def test_eagle_draft_matches_sequential_reference(policy, drafter):
    depth, topk, n = 3, 3, 12
    prompts = PROMPTS[:2]
    ids, lens, cache, first, hidden = _prefill(policy, prompts)
    dstate = _drafter_state(policy, drafter, ids, lens, first, hidden, ids.shape[1] + 16)
    tree, _ = jax.jit(eagle_draft, static_argnames=("depth", "topk", "num_nodes"))(
        policy, drafter, dstate, first, depth=depth, topk=topk, num_nodes=n)
    check_tree(tree)
    for b, prompt in enumerate(prompts):
        seq = prompt + [int(first[b])]
        h = policy(jnp.asarray([prompt])).hidden[0]  # h_t for t < len(prompt)

        def feature_fn(path_tokens, path_feats, seq=seq, h=h):
            toks = jnp.asarray([seq[1:] + list(path_tokens)])
            feats = jnp.concatenate([h] + [jnp.asarray(f)[None] for f in path_feats], 0)[None]
            return np.asarray(drafter(policy, toks, feats)[0, -1])

        root_feature = feature_fn([], [])
        np.testing.assert_allclose(dstate.feature[b], root_feature, atol=1e-5)
        (rt, rp, rv), _ = ref_eagle_draft(feature_fn, lambda f: np.asarray(policy.logits_from_hidden(jnp.asarray(f))),
                                          root_feature, depth, topk, n, int(first[b]))
        np.testing.assert_array_equal(np.asarray(tree.valid[b]), rv)
        np.testing.assert_array_equal(np.asarray(tree.tokens[b]), rt)
        np.testing.assert_array_equal(np.asarray(tree.parent[b])[rv], rp[rv])
        assert int(np.asarray(tree.depth[b]).max()) >= 2


# ------------------------------------------------------------------------------------------------- lossless loops


def test_eagle_draft_any_static_config_is_well_formed(policy, drafter):
    ids, lens, cache, first, hidden = _prefill(policy, PROMPTS)
    draft = jax.jit(eagle_draft, static_argnames=("depth", "topk", "num_nodes"))
    dstate = _drafter_state(policy, drafter, ids, lens, first, hidden, ids.shape[1] + 24)
    for depth, topk, n in [(1, 1, 1), (1, 4, 3), (2, 2, 20), (5, 1, 4), (3, 4, 16)]:
        tree, _ = draft(policy, drafter, dstate, first, depth=depth, topk=topk, num_nodes=n)
        check_tree(tree)
        assert tree.tokens.shape == (3, n)
        pool = topk + (depth - 1) * topk * topk
        np.testing.assert_array_equal(np.asarray(tree.valid).sum(1), min(n, pool + 1))
        np.testing.assert_array_equal(np.asarray(tree.tokens[:, 0]), np.asarray(first))
        assert int(np.asarray(tree.depth).max()) <= depth


FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
ENGINE = dict(max_batch=4, max_len=64, length_buckets=(64,), batch_buckets=(4,), compiler_options=FAST)


@dataclasses.dataclass
class Oracle(NgramDrafter):
    """A host drafter that knows the answer: a chain along the reference continuation, a wrong sibling at each node."""

    reference: dict = dataclasses.field(default_factory=dict)  # prompt tuple -> continuation

    def propose_one(self, b, contexts):
        ctx = [int(t) for t in contexts[b]]
        prompt = next(p for p in self.reference if tuple(ctx[: len(p)]) == p)
        done = len(ctx) - len(prompt)
        chain = self.reference[prompt][done : done + self.max_depth]
        n = self.num_nodes
        tok, par, val = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, bool)
        tok[0], par[0], val[0] = ctx[-1], -1, True
        k, prev = 1, 0
        for t in chain:
            if k + 1 >= n:
                break
            tok[k], par[k], val[k] = t, prev, True
            tok[k + 1], par[k + 1], val[k + 1] = (t + 1) % CFG.vocab_size, prev, True
            prev, k = k, k + 2
        return tok, par, val


@pytest.fixture(scope="module")
def engines(policy, drafter):
    """RolloutEngine per (drafter kind, depth, topk, verify tokens), tree decoding from the first step; kind None is
    plain decoding (the reference)."""
    cache = {}

    def get(kind=None, depth=0, topk=0, n=0):
        key = (kind, depth, topk, n)
        if key not in cache:
            spec = SpecConfig(depth=depth, topk=topk, verify_tokens=n, threshold=4) if kind else None
            cache[key] = RolloutEngine(policy, drafter=drafter if kind == "eagle" else kind, spec=spec, **ENGINE)
        return cache[key]

    return get


def _flat(res):
    return np.concatenate([np.asarray(x) for row in res.logprobs for x in row])


def _oracle_engine(engines, reference):
    eng = engines("ngram", 4, 2, 9)
    eng.ngram = Oracle(num_nodes=9, max_depth=4, reference={tuple(p): r[0] for p, r in zip(PROMPTS, reference,
                                                                                           strict=True)})
    return eng


@pytest.mark.parametrize("depth,topk,n", [(3, 2, 6), (4, 3, 10), (2, 1, 3), (1, 1, 2)])
def test_greedy_eagle_equals_plain(policy, engines, depth, topk, n):
    params = SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True)
    want = engines().generate(PROMPTS, params)
    if depth == 3:  # plain decoding itself against re-forwarding the whole sequence for every token
        assert want.tokens == [[t] for t in _greedy(policy, PROMPTS, 14)[0]]
    res = engines("eagle", depth, topk, n).generate(PROMPTS, params)
    assert res.tokens == want.tokens and set(res.stats["arms"]) == {f"tree/eagle/d{depth}k{topk}n{n}"}
    np.testing.assert_allclose(_flat(res), _flat(want), atol=1e-5)


def test_greedy_ngram_and_oracle_equal_plain_with_eos(engines):
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    want = engines().generate(PROMPTS, params)
    res = engines("ngram", 3, 2, 6).generate(PROMPTS, params)
    assert res.tokens == want.tokens
    assert res.stats["spec"]["accepted_drafts"] >= 1  # the random model repeats itself, so lookup drafts get accepted
    oracle = _oracle_engine(engines, want.tokens)
    res = oracle.generate(PROMPTS, params)
    assert res.tokens == want.tokens
    st = res.stats
    assert st["verify_steps"] <= 4 and st["mean_accept_length"] > 4.0  # (20 - 1) / 4 tokens per verify: all accepted
    # A stop token that occurs inside an accepted path: output truncated exactly as plain decoding truncates it.
    stop = want.tokens[2][0][6]
    eos = dataclasses.replace(params, ignore_eos=False, stop_token_ids=[stop])
    want_eos = engines().generate(PROMPTS, eos)
    assert len(want_eos.tokens[2][0]) <= 7 and want_eos.tokens[2][0][-1] == stop
    assert oracle.generate(PROMPTS, eos).tokens == want_eos.tokens


def test_sampled_speculative_reproduces_plain_sampling(engines):
    """Keys are per (request, sample, position), so Rule S with any drafter emits the very tokens plain sampling
    emits (up to floating point): a much stronger check than a distribution test, run for several drafters."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, seed=7, ignore_eos=True)
    rids = [4, 9, 2]
    want = engines().generate(PROMPTS, params, request_ids=rids)
    res = _oracle_engine(engines, want.tokens).generate(PROMPTS, params, request_ids=rids)
    assert res.tokens == want.tokens and res.stats["mean_accept_length"] > 3.0
    for kind in ("eagle", "ngram"):
        res = engines(kind, 3, 2, 6).generate(PROMPTS, params, request_ids=rids)
        assert res.tokens == want.tokens
        np.testing.assert_allclose(_flat(res), _flat(want), atol=1e-5)


def test_sampled_eagle_drafts_the_verifiers_sample(policy, drafter, engines):
    """Sampled rows draft each child as the drafter's own Gumbel-max sample under the noise the verifier adds at that
    depth. At a temperature so high that both distributions are uniform, the policy's sample is the noise's argmax
    alone, so even this random drafter's chains are accepted whole; a deterministic top-1 draft would be accepted
    with probability about 1 / 64 per depth."""
    params = SamplingParams(temperature=1e4, max_new_tokens=16, seed=3, ignore_eos=True)
    want = engines().generate(PROMPTS, params)
    res = engines("eagle", 2, 1, 3).generate(PROMPTS, params)
    assert res.tokens == want.tokens
    assert res.stats["mean_accept_length"] > 2.9  # 15 tokens after prefill's: 5 verifies of 3 (2 drafts + bonus)
    spec = SpecConfig(depth=2, topk=1, verify_tokens=3, threshold=4, coupled=False)  # the ablation
    res = RolloutEngine(policy, drafter=drafter, spec=spec, **ENGINE).generate(PROMPTS, params)
    assert res.tokens == want.tokens
    assert res.stats["mean_accept_length"] < 1.5
    with pytest.raises(ValueError, match="SpecConfig.coupled"):
        SpecConfig(coupled=1)


# ---------------------------------------------------------------------------------------------------------- n-gram


def test_ngram_trees_are_well_formed():
    ng = NgramDrafter(num_nodes=8, max_depth=3, max_ngram=3, stop_tokens=(99,), group_ids=[0, 0, 1])
    contexts = [
        [1, 2, 3, 4, 5, 1, 2, 3, 6, 7, 1, 2, 3],  # "1 2 3" continued by 4 5 1 and 6 7 1 -> two branches
        [8, 2, 3, 99, 11, 12, 2, 3],  # own match stops at the stop token; sibling row 0 adds 4.. and 6..
        [1, 2, 3],  # different group, nothing to match: root only
    ]
    tok, par, val = ng.propose(contexts)
    tree = make_tree(tok, par, val, max_depth=3)
    check_tree(tree)
    paths = []
    for b in range(3):
        t, p, v = tok[b], par[b], val[b]
        rows = []
        for u in range(1, 8):
            if v[u]:
                seq, j = [], u
                while j > 0:
                    seq.append(int(t[j]))
                    j = int(p[j])
                rows.append(seq[::-1])
        paths.append(rows)
    assert [4, 5, 1] in paths[0] and [6, 7, 1] in paths[0]
    assert [99] in paths[1] and not any(len(s) > 1 and s[0] == 99 for s in paths[1])  # nothing after the stop
    assert [4, 5, 1] in paths[1] or [4, 5] in paths[1]  # drawn from the other sample of the same group
    assert paths[2] == [] and val[2].sum() == 1
    tok_i, _, val_i = ng.propose(contexts, active=np.array([True, False, True]))
    assert val_i[1].sum() == 1 and tok_i[1, 0] == 3


def test_ngram_tree_takes_the_most_frequent_continuation_before_a_single_longer_match():
    """Nodes best-first by the summed match lengths through them: "3" went on to 4 four times (1-gram matches, 4)
    and to 9 once, after "2 3" (the 2-gram match, 2, plus its 1-gram, 1): 4 is the one node a 2-node tree holds."""
    ctx = [5, 3, 4, 6, 3, 4, 7, 3, 4, 8, 3, 4, 2, 3, 9, 1, 2, 3]
    tok, par, val = NgramDrafter(num_nodes=2, max_depth=2, max_ngram=2).propose([ctx])
    assert val[0].tolist() == [True, True] and tok[0].tolist() == [3, 4] and par[0].tolist() == [-1, 0]
    tok, par, val = NgramDrafter(num_nodes=4, max_depth=2, max_ngram=2).propose([ctx])
    assert tok[0].tolist() == [3, 4, 9, 1] and par[0].tolist() == [-1, 0, 0, 2]  # weight 3 (9), then 3 (9's 1)
