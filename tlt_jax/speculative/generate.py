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
from tlt_jax.speculative.tree import DraftState, Tree, drafter_extend, eagle_draft, init_draft_state, make_tree
from tlt_jax.speculative.verify import VerifyOutput, depth_keys, truncate, verify_tree


@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]  # per row, stop token included when hit
    logprobs: list[list[float]]  # raw policy log-probs of those tokens
    steps: int = 0  # decode (plain) or verify (speculative) calls
    accept_lens: list[int] = dataclasses.field(default_factory=list)  # per active row and verify step

    @property
    def mean_accept(self) -> float:
        """Mean tokens emitted per verify and row (accepted drafts + 1)."""
        return float(np.mean(self.accept_lens)) + 1.0 if self.accept_lens else 0.0


def _rows(x, b, dtype):
    return jnp.broadcast_to(jnp.asarray(x, dtype), (b,))


@jax.jit
def prefill_step(policy, cache: KVCache, ids, lengths, keys, temperature, top_k, top_p):
    """Right-padded prompts [B, P] -> (cache with the prompts, first sampled token, its raw log-prob, hidden)."""
    valid = jnp.arange(ids.shape[1])[None, :] < lengths[:, None]
    out = policy(ids, attention_mask=valid, cache=cache, logits_indices=(lengths - 1)[:, None])
    cache = cache.append(out.k_new, out.v_new, lengths)
    logits = out.logits[:, 0]
    tok = sample_from_logprobs(keys, processed_logprobs(logits, temperature, top_k, top_p))
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), -1), tok[:, None], axis=1)[:, 0]
    return cache, tok, lp, out.hidden


@jax.jit
def plain_step(policy, cache: KVCache, root, keys, temperature, top_k, top_p, stop_tokens, remaining, active):
    """Feed the root (commit its KV), sample the next token. Returns (token, raw log-prob, finished, cache)."""
    out = policy(root[:, None], cache=cache)
    logits = out.logits[:, 0]
    tok = sample_from_logprobs(keys, processed_logprobs(logits, temperature, top_k, top_p))
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), -1), tok[:, None], axis=1)[:, 0]
    count, finished = truncate(tok[:, None], jnp.ones_like(tok), stop_tokens, remaining, active)
    return tok, lp, finished, cache.append(out.k_new, out.v_new, count)


@partial(jax.jit, static_argnames=("max_depth",))
def verify_step(policy, cache, tree, keys, temperature, top_k, top_p, stop_tokens, remaining, active, *, max_depth):
    """``verify_tree`` under jit (for host-side drafters: n-gram, oracles)."""
    return verify_tree(policy, cache, tree, keys, temperature, top_k, top_p, stop_tokens, remaining, active,
                       max_depth=max_depth)


@partial(jax.jit, static_argnames=("depth", "topk", "num_nodes"))
def eagle_step(policy, drafter, cache, dstate: DraftState, root, keys, temperature, top_k, top_p, stop_tokens,
               remaining, active, *, depth: int, topk: int, num_nodes: int) -> tuple[VerifyOutput, DraftState, Tree]:
    """One speculative step: EAGLE-2 draft -> verify -> commit -> drafter extend over the emitted tokens."""
    tree, dcache = eagle_draft(policy, drafter, dstate, root, depth=depth, topk=topk, num_nodes=num_nodes)
    out = verify_tree(policy, cache, tree, keys, temperature, top_k, top_p, stop_tokens, remaining, active,
                      max_depth=depth)
    dstate = drafter_extend(policy, drafter, DraftState(dcache, dstate.feature), out.hidden,
                            jnp.maximum(out.tokens, 0), out.num_emitted)
    return out, dstate, tree


@jax.jit
def drafter_prefill(policy, drafter, dstate: DraftState, ids, lengths, first_tokens, hidden) -> DraftState:
    """Drafter extend over the prompt: pairs (h_t, x_{t+1}) for t < length, x_length = the first sampled token."""
    nxt = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)
    nxt = jnp.where(jnp.arange(ids.shape[1])[None, :] == (lengths - 1)[:, None], first_tokens[:, None], nxt)
    return drafter_extend(policy, drafter, dstate, hidden, nxt, lengths)


_make_tree = jax.jit(make_tree, static_argnums=3)


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
        keys = token_keys(seed, self.req, self.smp, self.lens)
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
                   request_ids=None, sample_ids=None, stop_tokens=None) -> GenerateResult:
    """Plain autoregressive decoding (the losslessness reference)."""
    st = _Loop(policy, prompts, max_new_tokens, temperature, top_k, top_p, seed, request_ids, sample_ids,
               stop_tokens, 1)
    steps = 0
    while not st.done.all():
        keys = token_keys(seed, st.req, st.smp, st.cache.lengths + 1)
        tok, lp, fin, st.cache = plain_step(policy, st.cache, st.root, keys, st.temperature, st.top_k, st.top_p,
                                            st.stop, st.remaining(), st.active())
        st.add(tok[:, None], lp[:, None], np.where(st.done, 0, 1), fin)
        st.root = tok
        steps += 1
    return GenerateResult(st.out, st.lps, steps)


Proposer = Callable[[list[list[int]], np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def speculative_generate(policy, prompts, *, drafter, depth: int, topk: int = 1, num_nodes: int,
                         max_new_tokens: int, temperature=0.0, top_k=0, top_p=1.0, seed=0, request_ids=None,
                         sample_ids=None, stop_tokens=None) -> GenerateResult:
    """Speculative decoding. ``drafter``: an EagleDrafter (device-side EAGLE-2 tree with depth/topk/num_nodes), or
    a host proposer ``(contexts, active) -> (tokens, parent, valid)`` numpy [B, num_nodes] with node 0 = root, where
    contexts[b] = prompt + generated tokens (the last one is the root); e.g. ``NgramDrafter.propose``."""
    from tlt_jax.drafter.eagle import EagleDrafter

    is_eagle = isinstance(drafter, EagleDrafter)
    st = _Loop(policy, prompts, max_new_tokens, temperature, top_k, top_p, seed, request_ids, sample_ids,
               stop_tokens, depth + 1)
    res = GenerateResult(st.out, st.lps)
    if is_eagle:
        dstate = init_draft_state(policy.config, st.b, st.max_len + (depth - 1) * topk)
        dstate = drafter_prefill(policy, drafter, dstate, jnp.asarray(st.ids), jnp.asarray(st.lens), st.first,
                                 st.hidden)
    while not st.done.all():
        keys = depth_keys(seed, st.req, st.smp, st.cache.lengths + 1, depth)
        args = (keys, st.temperature, st.top_k, st.top_p, st.stop, st.remaining(), st.active())
        if is_eagle:
            out, dstate, _ = eagle_step(policy, drafter, st.cache, dstate, st.root, *args, depth=depth, topk=topk,
                                        num_nodes=num_nodes)
        else:
            contexts = [p + o for p, o in zip(st.prompts, st.out, strict=True)]
            tokens, parent, valid = drafter(contexts, ~st.done)
            tokens = np.array(tokens, np.int32)
            tokens[:, 0] = np.asarray(st.root)  # the root is what gets fed, whatever the proposer says
            tree = _make_tree(jnp.asarray(tokens), jnp.asarray(parent), jnp.asarray(valid), depth)
            out = verify_step(policy, st.cache, tree, *args, max_depth=depth)
        res.accept_lens.extend(int(a) for a, d in zip(np.asarray(out.accept_len), st.done, strict=True) if not d)
        st.add(out.tokens, out.logprobs, out.num_emitted, out.finished)
        st.cache, st.root = out.cache, out.root
        res.steps += 1
    return res
