"""The plain arm's compiled steps, as pure functions of explicit pytrees (params state, DecodeState, row inputs).

- prefill: right-padded prompts [Bp, P] → one forward (logits only at each prompt's last token) → prompt KV
  gathered into the rows of its samples ("prompt once, fork n") → first token sampled → DecodeState [B].
- decode: up to K decode steps in one ``lax.while_loop`` (stops early when every row is done); attention reads
  only the first Lb cache positions (``attend_len``); done rows are frozen.
- compact: gather surviving rows into a smaller batch bucket (padding rows marked done).

With an EAGLE drafter (``StepContext.drafter_graphdef``) the steps take params = (policy state, drafter state) and
carry the drafter's state (``DecodeState.aux``, a ``LazyDraft``): prefill and plain decode chunks do not run the
drafter, they only record its input pairs (the policy's hidden state at each committed position and the next token),
over which the next EAGLE verify catches it up (``tlt_jax.rollout.drafter_sync``). So speculative steps can start at
any chunk boundary without re-running the policy, and a wave that never speculates costs what it costs without a
drafter. With ``report_tokens`` (host-side n-gram drafting) info also carries the tokens the call emitted.

Every step returns (state, info): a packed ``StepInfo`` (done, num_generated[, R emitted tokens]), the one host read per
round trip.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tlt_jax.distributed import LogicalRules, with_activations
from tlt_jax.models import KVCache, ModelConfig
from tlt_jax.rollout.drafter_sync import LazyDraft, record_pairs
from tlt_jax.rollout.pool import StepKey, StepPool
from tlt_jax.rollout.state import DecodeState, RowInit, StepInfo, empty_state, gather_rows, tree_shardings
from tlt_jax.sampling import sample_tokens, token_keys
from tlt_jax.speculative.tree import init_draft_state


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Static configuration shared by every step of one engine (hashable)."""

    graphdef: Any
    config: ModelConfig
    max_len: int
    chunk_size: int
    num_stop: int
    capture_window: int
    capture_side: str
    cache_dtype: Any
    mesh: Mesh
    rules: LogicalRules
    drafter_graphdef: Any = None  # EAGLE drafter (its state in DecodeState.aux); params = (policy, drafter)
    drafter_len: int = 0  # drafter cache slots (max_len + tree scratch); 0 = no drafter state
    report_tokens: bool = False  # info carries the emitted tokens (host-side drafters need the contexts)
    capture_prompt: int = 0  # prefill also returns each prompt's last hidden states before its final position
    per_layer_cache: bool = False  # KVCache layout: per layer (an unstacked policy, layers unrolled) or stacked
    sampling_filters: bool = True  # top-k / top-p compiled in (False: no row may set them; no sort compiled)

    def merge(self, params) -> tuple[Any, Any]:
        """(policy, drafter or None) modules from the step's params pytree."""
        if self.drafter_graphdef is None:
            return nnx.merge(self.graphdef, params), None
        return nnx.merge(self.graphdef, params[0]), nnx.merge(self.drafter_graphdef, params[1])

    def empty_state(self, batch: int) -> DecodeState:
        state = empty_state(
            self.config,
            batch,
            self.max_len,
            num_stop=self.num_stop,
            capture_window=self.capture_window,
            dtype=self.cache_dtype,
            per_layer_cache=self.per_layer_cache,
        )
        if self.drafter_len:
            hidden = jnp.zeros((batch, self.max_len, self.config.hidden_size), self.cache_dtype)
            state = state.replace(aux=self.lazy_draft(hidden, jnp.zeros((batch, self.max_len), jnp.int32)))
        return state

    def lazy_draft(self, hidden: jax.Array, next_token: jax.Array) -> LazyDraft:
        """An empty drafter (cache length 0) with the recorded pairs hidden [B, S, H], next_token [B, S]."""
        draft = init_draft_state(self.config, next_token.shape[0], self.drafter_len, self.cache_dtype)
        return LazyDraft(draft, hidden, next_token)

    def abstract_state(self, batch: int) -> DecodeState:
        shapes = jax.eval_shape(lambda: self.empty_state(batch))
        shardings = self.state_shardings(shapes)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)

    def state_shardings(self, tree) -> Any:
        return tree_shardings(tree, self.mesh, self.rules)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def batch_sharding(self, shape) -> NamedSharding:
        spec = self.rules.spec(("batch",) + (None,) * (len(shape) - 1), self.mesh, shape)
        return NamedSharding(self.mesh, spec)


def choose_tokens(logits: jax.Array, state: DecodeState, positions: jax.Array, filters: bool = True) -> jax.Array:
    """Sample each row's next token from its processed distribution (counter-based keys at ``positions``, derived
    only when some row samples: an all-greedy batch takes the argmax); ``filters``: top-k / top-p compiled in."""

    def keys():
        return token_keys(state.seed, state.request_id, state.sample_id, positions)

    top_k, top_p = (state.top_k, state.top_p) if filters else (None, None)
    return sample_tokens(logits, keys, state.temperature, top_k, top_p)


def record(state: DecodeState, tok: jax.Array, logits: jax.Array, hidden: jax.Array, side: str) -> DecodeState:
    """Emit ``tok`` on every active row: write token, raw log-prob and hidden state, update counters and done."""
    active = ~state.done
    b, m = state.tokens.shape
    rows = jnp.arange(b)
    idx = jnp.where(active, state.num_generated, m)
    lse = jax.nn.logsumexp(logits, axis=-1)
    lp = jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0] - lse
    tokens = state.tokens.at[rows, idx].set(tok, mode="drop")
    logprobs = state.logprobs.at[rows, idx].set(lp, mode="drop")
    hid = state.hidden
    if hid is not None:
        w = hid.shape[1]
        slot = state.num_generated % w if side == "last" else state.num_generated
        slot = jnp.where(active, slot, w)
        hid = hid.at[rows, slot].set(hidden.astype(hid.dtype), mode="drop")
    n = state.num_generated + active.astype(jnp.int32)
    stop = jnp.any(tok[:, None] == state.stop_ids, axis=-1)
    done = state.done | (active & (stop | (n >= state.max_new)))
    return state.replace(
        last_token=jnp.where(active, tok, state.last_token),
        num_generated=n,
        done=done,
        tokens=tokens,
        logprobs=logprobs,
        hidden=hid,
    )


def decode_one(model, state: DecodeState, length: int, side: str,
               filters: bool = True) -> tuple[DecodeState, jax.Array, jax.Array]:
    """One plain decode step over every row; attention reads only cache positions < ``length``. Returns the new state
    and the drafter's pair of the step: the policy's hidden state of the fed token [B, H] and the sampled token [B]."""
    active = ~state.done
    out = model(state.last_token[:, None], cache=state.cache, attend_len=length)
    logits = out.logits[:, 0].astype(jnp.float32)
    tok = choose_tokens(logits, state, state.cache.lengths + 1, filters)
    cache = state.cache.append(out.k_new, out.v_new, active.astype(jnp.int32))
    return record(state.replace(cache=cache), tok, logits, out.hidden[:, 0], side), out.hidden[:, 0], tok


def step_info(state: DecodeState, ngen_before: jax.Array | None = None, width: int = 0, *, verifies=None,
              accepted=None) -> jax.Array:
    """The packed ``StepInfo`` the host reads back after a call: done, num_generated, (speculative steps) verifies and
    accepted drafts, and (with width) the ``width`` tokens emitted since ``ngen_before``, -1 padded."""
    tokens = None
    if width:
        idx = ngen_before[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        tok = jnp.take_along_axis(state.tokens, jnp.clip(idx, 0, state.tokens.shape[1] - 1), axis=1)
        tokens = jnp.where(idx < state.num_generated[:, None], tok, -1).T
    return StepInfo(state.done, state.num_generated, verifies, accepted, tokens).pack()


def _prompt_pairs(ctx: StepContext, out, ids, lens, init: RowInit, tok) -> LazyDraft:
    """The drafter's pairs over each row's prompt: (h_t, ids_{t+1}) for t < P-1 and (h_{P-1}, first sampled token),
    recorded for the first EAGLE verify's catch-up (the drafter itself does not run here)."""
    p, s_max = ids.shape[1], ctx.max_len
    hidden = jnp.pad(out.hidden[init.src].astype(ctx.cache_dtype), ((0, 0), (0, s_max - p), (0, 0)))
    nxt = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)[init.src]
    nxt = jnp.pad(nxt, ((0, 0), (0, s_max - p)))
    nxt = nxt.at[jnp.arange(nxt.shape[0]), lens[init.src] - 1].set(tok)
    return ctx.lazy_draft(hidden, nxt)


def build_prefill(ctx: StepContext, key: StepKey):
    """Key: ("prefill", B, P, arm, (Bp,)). Args: params, ids [Bp, P], lens [Bp], RowInit [B]. Returns (state, packed
    info), plus with ``ctx.capture_prompt`` = C the final-normed hidden states [Bp, C, H] float32 at each prompt's
    positions len - 1 - C .. len - 2 (HiddenCapture.prompt; entries before a short prompt's start are filler)."""
    cfg, s_max = ctx.config, ctx.max_len

    def step(params, ids, lens, init: RowInit):
        model, drafter = ctx.merge(params)
        bp, p = ids.shape
        mask = jnp.arange(p)[None, :] < lens[:, None]
        out = model(ids, attention_mask=mask, logits_indices=(lens - 1)[:, None])
        prompt_cache = KVCache.zeros(cfg, bp, p, ctx.cache_dtype, ctx.per_layer_cache)
        cache = prompt_cache.append(out.k_new, out.v_new, lens).gather(init.src).pad_to(s_max)
        logits = out.logits[:, 0].astype(jnp.float32)[init.src]
        hidden = jnp.take_along_axis(out.hidden, (lens - 1)[:, None, None], axis=1)[:, 0][init.src]
        b = init.src.shape[0]
        state = DecodeState(
            cache=cache,
            last_token=jnp.zeros((b,), jnp.int32),
            num_generated=jnp.zeros((b,), jnp.int32),
            done=~init.valid,
            max_new=init.max_new,
            temperature=init.temperature,
            top_k=init.top_k,
            top_p=init.top_p,
            seed=init.seed,
            request_id=init.request_id,
            sample_id=init.sample_id,
            stop_ids=init.stop_ids,
            tokens=jnp.zeros((b, s_max), jnp.int32),
            logprobs=jnp.zeros((b, s_max), jnp.float32),
            hidden=jnp.zeros((b, ctx.capture_window, cfg.hidden_size), jnp.float32) if ctx.capture_window else None,
        )
        tok = choose_tokens(logits, state, cache.lengths, ctx.sampling_filters)
        if drafter is not None:
            state = state.replace(aux=_prompt_pairs(ctx, out, ids, lens, init, tok))
        state = record(state, tok, logits, hidden, ctx.capture_side)
        info = step_info(state, jnp.zeros_like(lens[init.src]), int(ctx.report_tokens))
        if not ctx.capture_prompt:
            return state, info
        pos = jnp.clip(lens[:, None] - 1 - ctx.capture_prompt + jnp.arange(ctx.capture_prompt)[None, :], 0, p - 1)
        return state, info, jnp.take_along_axis(out.hidden, pos[..., None], axis=1).astype(jnp.float32)

    out_sh = (ctx.state_shardings(ctx.abstract_state(key.batch)), ctx.replicated())
    if ctx.capture_prompt:  # sharded like the prompts (the host gathers it), not replicated on every device
        out_sh += (ctx.batch_sharding((key.extra[0], ctx.capture_prompt, cfg.hidden_size)),)
    return jax.jit(with_activations(step, ctx.mesh, ctx.rules), out_shardings=out_sh)


def build_decode(ctx: StepContext, key: StepKey):
    """Key: ("decode", B, Lb). Args: params, DecodeState [B] (donated). Up to K steps, early exit when all done.

    With an EAGLE drafter each step also records the drafter's pair of its position (the fed token's hidden state,
    the sampled token: one [B, H] write); the drafter itself does not run (the next EAGLE verify, if any, catches it
    up)."""
    k, length = ctx.chunk_size, key.length

    def step(params, state: DecodeState):
        model, _ = ctx.merge(params)
        ngen = state.num_generated

        def cond(c):
            i, s = c
            return (i < k) & jnp.any(~s.done)

        def body(c):
            i, s = c
            position, active = s.cache.lengths, ~s.done
            s, h, tok = decode_one(model, s, length, ctx.capture_side, ctx.sampling_filters)
            if ctx.drafter_graphdef is not None:
                s = s.replace(aux=record_pairs(s.aux, position, h[:, None], tok[:, None], active.astype(jnp.int32)))
            return i + 1, s

        _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
        return state, step_info(state, ngen, k if ctx.report_tokens else 0)

    out_sh = (ctx.state_shardings(ctx.abstract_state(key.batch)), ctx.replicated())
    return jax.jit(with_activations(step, ctx.mesh, ctx.rules), donate_argnums=(1,), out_shardings=out_sh)


def build_compact(ctx: StepContext, key: StepKey):
    """Key: ("compact", B_dst, 0, arm, (B_src,)). Args: DecodeState [B_src], rows [B_dst], valid [B_dst]."""

    def step(state: DecodeState, rows, valid):
        s = gather_rows(state, rows)
        s = s.replace(done=s.done | ~valid)
        return s, step_info(s)

    out_sh = (ctx.state_shardings(ctx.abstract_state(key.batch)), ctx.replicated())
    return jax.jit(step, out_shardings=out_sh)


def register_plain(pool: StepPool, ctx: StepContext) -> None:
    """Register the plain arm's builders (prefill, decode, compact) with a pool."""
    pool.register("prefill", "plain", lambda key: build_prefill(ctx, key))
    pool.register("decode", "plain", lambda key: build_decode(ctx, key))
    pool.register("compact", "plain", lambda key: build_compact(ctx, key))
