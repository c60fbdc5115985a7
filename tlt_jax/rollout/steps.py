"""The plain arm's compiled steps, as pure functions of explicit pytrees (params state, DecodeState, row inputs).

- prefill: right-padded prompts [Bp, P] → one forward (logits only at each prompt's last token) → prompt KV
  gathered into the rows of its samples ("prompt once, fork n") → first token sampled → DecodeState [B].
- decode: up to K decode steps in one ``lax.while_loop`` (stops early when every row is done); attention reads
  only the first Lb cache positions (``cache.view``); done rows are frozen.
- compact: gather surviving rows into a smaller batch bucket (padding rows marked done).

Every step returns (state, info [2, B] int32 = done, num_generated): the one host read per round trip.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tlt_jax.distributed import LogicalRules
from tlt_jax.models import KVCache, ModelConfig
from tlt_jax.rollout.pool import StepKey, StepPool
from tlt_jax.rollout.sampling import processed_logprobs, sample_from_logprobs, token_keys
from tlt_jax.rollout.state import DecodeState, RowInit, empty_state, gather_rows, tree_shardings


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

    def abstract_state(self, batch: int) -> DecodeState:
        shapes = jax.eval_shape(
            lambda: empty_state(
                self.config,
                batch,
                self.max_len,
                num_stop=self.num_stop,
                capture_window=self.capture_window,
                dtype=self.cache_dtype,
            )
        )
        shardings = self.state_shardings(shapes)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)

    def state_shardings(self, tree) -> Any:
        return tree_shardings(tree, self.mesh, self.rules)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def batch_sharding(self, shape) -> NamedSharding:
        spec = self.rules.spec(("batch",) + (None,) * (len(shape) - 1), self.mesh, shape)
        return NamedSharding(self.mesh, spec)


def choose_tokens(logits: jax.Array, state: DecodeState, positions: jax.Array) -> jax.Array:
    """Sample each row's next token from its processed distribution (counter-based keys); a greedy-only batch
    takes the argmax directly (the same token the processed one-hot gives), skipping sort and Gumbel noise."""

    def greedy(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(_):
        keys = token_keys(state.seed, state.request_id, state.sample_id, positions)
        logp = processed_logprobs(logits, state.temperature, state.top_k, state.top_p)
        return sample_from_logprobs(keys, logp)

    return jax.lax.cond(jnp.all(state.temperature <= 0.0), greedy, sample, None)


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


def decode_one(model, state: DecodeState, length: int, side: str) -> DecodeState:
    """One plain decode step over every row; attention reads only cache positions < ``length``."""
    active = ~state.done
    out = model(state.last_token[:, None], cache=state.cache.view(length))
    logits = out.logits[:, 0].astype(jnp.float32)
    tok = choose_tokens(logits, state, state.cache.lengths + 1)
    cache = state.cache.append(out.k_new, out.v_new, active.astype(jnp.int32))
    return record(state.replace(cache=cache), tok, logits, out.hidden[:, 0], side)


def build_prefill(ctx: StepContext, key: StepKey):
    """Key: ("prefill", B, P, arm, (Bp,)). Args: params, ids [Bp, P], lens [Bp], RowInit [B]."""
    cfg, s_max = ctx.config, ctx.max_len

    def step(params, ids, lens, init: RowInit):
        model = nnx.merge(ctx.graphdef, params)
        bp, p = ids.shape
        mask = jnp.arange(p)[None, :] < lens[:, None]
        out = model(ids, attention_mask=mask, logits_indices=(lens - 1)[:, None])
        prompt_cache = KVCache.zeros(cfg, bp, p, ctx.cache_dtype).append(out.k_new, out.v_new, lens)
        forked = prompt_cache.gather(init.src)
        pad = ((0, 0), (0, 0), (0, s_max - p), (0, 0), (0, 0))
        cache = KVCache(jnp.pad(forked.k, pad), jnp.pad(forked.v, pad), forked.lengths)
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
        tok = choose_tokens(logits, state, cache.lengths)
        state = record(state, tok, logits, hidden, ctx.capture_side)
        return state, state.info()

    out_sh = (ctx.state_shardings(ctx.abstract_state(key.batch)), ctx.replicated())
    return jax.jit(step, out_shardings=out_sh)


def build_decode(ctx: StepContext, key: StepKey):
    """Key: ("decode", B, Lb). Args: params, DecodeState [B] (donated). Up to K steps, early exit when all done."""
    k, length = ctx.chunk_size, key.length

    def step(params, state: DecodeState):
        model = nnx.merge(ctx.graphdef, params)

        def cond(c):
            i, s = c
            return (i < k) & jnp.any(~s.done)

        def body(c):
            i, s = c
            return i + 1, decode_one(model, s, length, ctx.capture_side)

        _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
        return state, state.info()

    out_sh = (ctx.state_shardings(ctx.abstract_state(key.batch)), ctx.replicated())
    return jax.jit(step, donate_argnums=(1,), out_shardings=out_sh)


def build_compact(ctx: StepContext, key: StepKey):
    """Key: ("compact", B_dst, 0, arm, (B_src,)). Args: DecodeState [B_src], rows [B_dst], valid [B_dst]."""

    def step(state: DecodeState, rows, valid):
        s = gather_rows(state, rows)
        s = s.replace(done=s.done | ~valid)
        return s, s.info()

    out_sh = (ctx.state_shardings(ctx.abstract_state(key.batch)), ctx.replicated())
    return jax.jit(step, out_shardings=out_sh)


def register_plain(pool: StepPool, ctx: StepContext) -> None:
    """Register the plain arm's builders (prefill, decode, compact) with a pool."""
    pool.register("prefill", "plain", lambda key: build_prefill(ctx, key))
    pool.register("decode", "plain", lambda key: build_decode(ctx, key))
    pool.register("compact", "plain", lambda key: build_compact(ctx, key))
