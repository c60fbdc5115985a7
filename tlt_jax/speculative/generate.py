"""Jitted per-step functions (prefill, plain decode step, EAGLE step, verify step) and small host generation loops.

The loops are the reference the tests compare against and a template for the engine: they keep every row in the
batch (finished rows go inactive), derive keys from (seed, request id, sample id, position) with the convention
"a token's key is its own absolute position", and return the generated tokens (stop token included) and raw
log-probs. Plain and speculative generation with the same seed give the same tokens up to floating point.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models.kv_cache import KVCache
from tlt_jax.rollout.sampling import processed_logprobs, sample_from_logprobs, token_keys
from tlt_jax.speculative.tree import DraftState, drafter_extend, eagle_draft, init_draft_state, make_tree
from tlt_jax.speculative.verify import depth_keys, truncate, verify_tree


@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]  # per row, stop token included when hit
    logprobs: list[list[float]]  # raw policy log-probs of those tokens
    steps: int = 0  # decode (plain) or verify (speculative) calls
    accept_lens: list[int] = dataclasses.field(default_factory=list)  # per active row and verify step
    hidden: list[np.ndarray] | None = None  # plain_generate(return_hidden=True): per row [len(prompt)+len(tokens)-1, H]

    @property
    def mean_accept(self) -> float:
        """Mean tokens emitted per verify and row (accepted drafts + 1)."""
        return float(np.mean(self.accept_lens)) + 1.0 if self.accept_lens else 0.0


def _rows(x, b, dtype):
    return jnp.broadcast_to(jnp.asarray(x, dtype), (b,))


def _choose(logits, keys, temperature, top_k, top_p):
    """Plain decoding's token choice; an all-greedy batch takes the argmax directly (the token the processed one-hot
    gives) and skips the full-vocabulary sort and the Gumbel noise."""
    greedy = lambda _: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sample = lambda _: sample_from_logprobs(keys, processed_logprobs(logits, temperature, top_k, top_p))
    return jax.lax.cond(jnp.all(jnp.asarray(temperature) <= 0.0), greedy, sample, None)


def _raw_logprob(logits, tok):
    logits = logits.astype(jnp.float32)
    return jnp.take_along_axis(logits, tok[:, None], axis=1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)


def _view(cache: KVCache, attend_len: int | None) -> KVCache:
    return cache if attend_len is None or attend_len >= cache.max_len else cache.view(attend_len)


@jax.jit
def prefill_step(policy, cache: KVCache, ids, lengths, keys, temperature, top_k, top_p):
    """Right-padded prompts [B, P] -> (cache with the prompts, first sampled token, its raw log-prob, hidden)."""
    valid = jnp.arange(ids.shape[1])[None, :] < lengths[:, None]
    out = policy(ids, attention_mask=valid, cache=cache, logits_indices=(lengths - 1)[:, None])
    cache = cache.append(out.k_new, out.v_new, lengths)
    logits = out.logits[:, 0].astype(jnp.float32)
    tok = _choose(logits, keys, temperature, top_k, top_p)
    return cache, tok, _raw_logprob(logits, tok), out.hidden


def _plain_step(policy, cache: KVCache, root, keys, temperature, top_k, top_p, stop_tokens, remaining, active,
                attend_len=None):
    """Feed the root (commit its KV), sample the next token. Returns (token, raw log-prob, finished, cache).
    attend_len (static, optional): attention reads only the first attend_len cache slots (>= committed length + 1)."""
    out = policy(root[:, None], cache=_view(cache, attend_len))
    logits = out.logits[:, 0].astype(jnp.float32)
    tok = _choose(logits, keys, temperature, top_k, top_p)
    count, finished = truncate(tok[:, None], jnp.ones_like(tok), stop_tokens, remaining, active)
    return tok, _raw_logprob(logits, tok), finished, cache.append(out.k_new, out.v_new, count), out.hidden[:, 0]


_plain_static = ("attend_len",)
plain_step = jax.jit(lambda *a, **k: _plain_step(*a, **k)[:4], static_argnames=_plain_static)
plain_step.__doc__ = _plain_step.__doc__
_plain_step_donated = jax.jit(_plain_step, static_argnames=_plain_static, donate_argnames=("cache",))


def _verify_step(policy, cache, tree, keys, temperature, top_k, top_p, stop_tokens, remaining, active, *, max_depth,
                 attend_len=None):
    """``verify_tree`` under jit (for host-side drafters: n-gram, oracles)."""
    return verify_tree(policy, cache, tree, keys, temperature, top_k, top_p, stop_tokens, remaining, active,
                       max_depth=max_depth, attend_len=attend_len)


verify_step = jax.jit(_verify_step, static_argnames=("max_depth", "attend_len"))


@partial(jax.jit, static_argnames=("max_depth", "attend_len"), donate_argnames=("cache",))
def _host_tree_step(policy, cache, tokens, parent, valid, root, keys, temperature, top_k, top_p, stop_tokens,
                    remaining, active, *, max_depth, attend_len=None):
    """make_tree + verify in one call for host proposers; the root is what gets fed, whatever the proposer says."""
    tree = make_tree(tokens.at[:, 0].set(root), parent, valid, max_depth)
    return verify_tree(policy, cache, tree, keys, temperature, top_k, top_p, stop_tokens, remaining, active,
                       max_depth=max_depth, attend_len=attend_len)


def _eagle_step(policy, drafter, cache, dstate: DraftState, root, keys, temperature, top_k, top_p, stop_tokens,
                remaining, active, *, depth: int, topk: int, num_nodes: int, attend_len: int | None = None):
    """One speculative step: EAGLE-2 draft -> verify -> commit -> drafter extend over the emitted tokens, one compiled
    call per (batch, depth, topk, num_nodes, attend_len). attend_len (static, optional): the policy reads only the first
    attend_len cache slots (>= every committed length + depth + 1), the drafter attend_len + (depth - 1) * topk.
    Returns (VerifyOutput, new DraftState, the drafted Tree)."""
    if attend_len is None:
        dlen = None
    else:
        dlen = min(attend_len + (depth - 1) * topk, dstate.cache.max_len)  # committed context + draft scratch
    dview = DraftState(_view(dstate.cache, dlen), dstate.feature)
    tree, _ = eagle_draft(policy, drafter, dview, root, depth=depth, topk=topk, num_nodes=num_nodes)
    out = verify_tree(policy, cache, tree, keys, temperature, top_k, top_p, stop_tokens, remaining, active,
                      max_depth=depth, attend_len=attend_len)
    dstate = drafter_extend(policy, drafter, dstate, out.hidden, jnp.maximum(out.tokens, 0), out.num_emitted,
                            attend_len=dlen if dlen is None or dlen < dstate.cache.max_len else None)
    return out, dstate, tree


_eagle_static = ("depth", "topk", "num_nodes", "attend_len")
eagle_step = jax.jit(_eagle_step, static_argnames=_eagle_static)
_eagle_step_donated = jax.jit(_eagle_step, static_argnames=_eagle_static, donate_argnames=("cache", "dstate"))


@jax.jit
def drafter_prefill(policy, drafter, dstate: DraftState, ids, lengths, first_tokens, hidden) -> DraftState:
    """Drafter extend over the prompt: pairs (h_t, x_{t+1}) for t < length, x_length = the first sampled token."""
    nxt = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)
    nxt = jnp.where(jnp.arange(ids.shape[1])[None, :] == (lengths - 1)[:, None], first_tokens[:, None], nxt)
    return drafter_extend(policy, drafter, dstate, hidden, nxt, lengths)


_make_tree = jax.jit(make_tree, static_argnums=3)
_token_keys = jax.jit(token_keys)
_depth_keys = jax.jit(depth_keys, static_argnums=4)


def attend_bucket(need: int, max_len: int) -> int:
    """The cache-length bucket for a step that needs ``need`` slots: a power of two >= 64 (fewer compiles), capped at
    max_len (the same buckets for plain and speculative loops, so they read the same cache extents)."""
    b = 64
    while b < need:
        b *= 2
    return min(b, max_len)


def pad_prompts(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    lens = np.array([len(p) for p in prompts], np.int32)
    if lens.min() < 1:
        raise ValueError("every prompt needs at least one token")
    ids = np.zeros((len(prompts), int(lens.max())), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return ids, lens


class _Loop:
    """Shared host bookkeeping of the two generation loops."""

    def __init__(self, policy, prompts, max_new_tokens, temperature, top_k, top_p, seed, request_ids, sample_ids,
                 stop_tokens, extra_slots):
        self.b = b = len(prompts)
        self.ids, self.lens = pad_prompts(prompts)
        self.prompts = [list(p) for p in prompts]
        self.max_new = max_new_tokens
        self.temperature, self.top_k, self.top_p = (_rows(temperature, b, jnp.float32), _rows(top_k, b, jnp.int32),
                                                    _rows(top_p, b, jnp.float32))
        self.seed = seed
        self.req = np.arange(b) if request_ids is None else np.asarray(request_ids)
        self.smp = np.zeros(b, np.int64) if sample_ids is None else np.asarray(sample_ids)
        stops = tuple(policy.config.eos_token_ids) if stop_tokens is None else tuple(stop_tokens)
        self.stop = jnp.asarray(stops or (-1,), jnp.int32)
        self.max_len = self.ids.shape[1] + max_new_tokens + extra_slots
        cache = KVCache.zeros(policy.config, b, self.max_len)
        self.req_j, self.smp_j = jnp.asarray(self.req, jnp.uint32), jnp.asarray(self.smp, jnp.uint32)
        keys = _token_keys(seed, self.req_j, self.smp_j, jnp.asarray(self.lens))
        self.cache, tok, lp, self.hidden = prefill_step(policy, cache, jnp.asarray(self.ids), jnp.asarray(self.lens),
                                                        keys, self.temperature, self.top_k, self.top_p)
        self.first = tok
        self.out = [[int(t)] for t in np.asarray(tok)]
        self.lps = [[float(x)] for x in np.asarray(lp)]
        self.done = np.array([self._stopped(i) for i in range(b)])
        self.root = tok

    def _stopped(self, i):
        return len(self.out[i]) >= self.max_new or self.out[i][-1] in set(np.asarray(self.stop).tolist())

    def remaining(self):
        return jnp.asarray([self.max_new - len(o) for o in self.out], jnp.int32)

    def bucket(self, extra: int) -> int:
        """Cache-length bucket for a step that writes up to ``extra`` slots past the longest committed row."""
        return attend_bucket(int(self.lens.max()) + max(len(o) for o in self.out) - 1 + extra, self.max_len)

    def active(self):
        return jnp.asarray(~self.done)

    def add(self, tokens, logprobs, counts, finished):
        tokens, logprobs, counts, finished = (np.asarray(x) for x in (tokens, logprobs, counts, finished))
        for i in range(self.b):
            if self.done[i]:
                continue
            self.out[i].extend(int(t) for t in tokens[i, : counts[i]])
            self.lps[i].extend(float(x) for x in logprobs[i, : counts[i]])
            self.done[i] = bool(finished[i])


def plain_generate(policy, prompts, *, max_new_tokens: int, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                   request_ids=None, sample_ids=None, stop_tokens=None, return_hidden: bool = False,
                   attend_buckets: bool = True, max_steps: int | None = None) -> GenerateResult:
    """Plain autoregressive decoding (the losslessness reference). ``return_hidden``: also return the policy's
    final-normed features of every fed position (prompt + all generated tokens but the last), e.g. drafter data.
    ``attend_buckets``: attention reads a power-of-two cache bucket covering the longest row (one compile per
    bucket); False reads the whole cache (sized to the run: one compile). ``max_steps``: stop after that many decode
    steps (compile warm-up)."""
    st = _Loop(policy, prompts, max_new_tokens, temperature, top_k, top_p, seed, request_ids, sample_ids,
               stop_tokens, 1)
    steps = 0
    feats = [] if return_hidden else None
    while not st.done.all() and (max_steps is None or steps < max_steps):
        keys = _token_keys(seed, st.req_j, st.smp_j, st.cache.lengths + 1)
        tok, lp, fin, st.cache, h = _plain_step_donated(policy, st.cache, st.root, keys, st.temperature, st.top_k,
                                                        st.top_p, st.stop, st.remaining(), st.active(),
                                                        attend_len=st.bucket(1) if attend_buckets else None)
        if feats is not None:
            feats.append((np.asarray(h), ~st.done))
        st.add(tok[:, None], lp[:, None], np.where(st.done, 0, 1), fin)
        st.root = tok
        steps += 1
    hidden = None
    if feats is not None:
        prompt_h = np.asarray(st.hidden)
        hidden = []
        for i in range(st.b):
            rows = [prompt_h[i, : st.lens[i]]] + [h[i][None] for h, alive in feats if alive[i]]
            hidden.append(np.concatenate(rows, 0)[: st.lens[i] + len(st.out[i]) - 1])
    return GenerateResult(st.out, st.lps, steps, hidden=hidden)


Proposer = Callable[[list[list[int]], np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def speculative_generate(policy, prompts, *, drafter, depth: int, topk: int = 1, num_nodes: int,
                         max_new_tokens: int, temperature=0.0, top_k=0, top_p=1.0, seed=0, request_ids=None,
                         sample_ids=None, stop_tokens=None, attend_buckets: bool = True,
                         max_steps: int | None = None) -> GenerateResult:
    """Speculative decoding (``attend_buckets`` / ``max_steps`` as in ``plain_generate``). ``drafter``: an
    EagleDrafter (device-side EAGLE-2 tree with depth/topk/num_nodes, one fused compiled step), or a host proposer
    ``(contexts, active) -> (tokens, parent, valid)`` numpy [B, num_nodes] with node 0 = root, where contexts[b] =
    prompt + generated tokens (the last one is the root); e.g. ``NgramDrafter.propose``."""
    from tlt_jax.drafter.eagle import EagleDrafter

    is_eagle = isinstance(drafter, EagleDrafter)
    st = _Loop(policy, prompts, max_new_tokens, temperature, top_k, top_p, seed, request_ids, sample_ids,
               stop_tokens, depth + 1)
    res = GenerateResult(st.out, st.lps)
    if is_eagle:
        dstate = init_draft_state(policy.config, st.b, st.max_len + (depth - 1) * topk)
        dstate = drafter_prefill(policy, drafter, dstate, jnp.asarray(st.ids), jnp.asarray(st.lens), st.first,
                                 st.hidden)
    while not st.done.all() and (max_steps is None or res.steps < max_steps):
        keys = _depth_keys(seed, st.req_j, st.smp_j, st.cache.lengths + 1, depth)
        args = (keys, st.temperature, st.top_k, st.top_p, st.stop, st.remaining(), st.active())
        attend = st.bucket(depth + 1) if attend_buckets else None
        if is_eagle:
            out, dstate, _ = _eagle_step_donated(policy, drafter, st.cache, dstate, st.root, *args, depth=depth,
                                                 topk=topk, num_nodes=num_nodes, attend_len=attend)
        else:
            contexts = [p + o for p, o in zip(st.prompts, st.out, strict=True)]
            tokens, parent, valid = drafter(contexts, ~st.done)
            out = _host_tree_step(policy, st.cache, jnp.asarray(tokens, jnp.int32), jnp.asarray(parent, jnp.int32),
                                  jnp.asarray(valid, bool), st.root, *args, max_depth=depth, attend_len=attend)
        res.accept_lens.extend(int(a) for a, d in zip(np.asarray(out.accept_len), st.done, strict=True) if not d)
        st.add(out.tokens, out.logprobs, out.num_emitted, out.finished)
        st.cache, st.root = out.cache, out.root
        res.steps += 1
    return res
