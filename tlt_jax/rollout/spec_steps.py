"""Speculative arms of the rollout engine: ``SpecConfig``, the verify steps registered in the compiled-step pool, and
the host-side n-gram proposer.

Once a wave's live rows are at most ``SpecConfig.threshold`` the engine runs verify steps instead of plain K-step
chunks. Both arms read the same DecodeState, so the switch costs nothing: the policy cache, counters and keys carry
over, and (EAGLE) the drafter cache in ``DecodeState.aux`` was kept current by every plain step. A verify step:

    tree (EAGLE-2 draft on device from the drafter cache | n-gram trie built on the host)
    → one policy forward over the tree (tlt_jax.speculative.verify_tree: Rule S, each token keyed by its position,
      stop tokens / budget truncated exactly as plain decoding) → accepted path written into the tokens, log-probs,
      hidden capture and KV cache → (EAGLE) drafter extended over the emitted tokens.

EAGLE runs up to ``steps_per_call`` verify steps per host round trip (``lax.while_loop``, early exit when every row is
done); the n-gram arm runs one, since the host builds each tree from the tokens of the previous one.
Info read back per call: a packed ``StepInfo`` with verifies and accepted set, and (n-gram) the R = depth + 1 tokens
emitted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.rollout.pool import StepKey, StepPool
from tlt_jax.rollout.state import DecodeState
from tlt_jax.rollout.steps import StepContext, step_info
from tlt_jax.speculative.ngram import NgramDrafter
from tlt_jax.speculative.tree import DraftState, Tree, TreeDrafter, draft_head, drafter_extend, eagle_draft, make_tree
from tlt_jax.speculative.verify import VerifyOutput, depth_keys, verify_tree


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Tree speculative decoding in the rollout tail (TLT defaults).

    depth: draft depth D (most accepted draft tokens per verify). topk: children expanded per frontier node (EAGLE-2).
    verify_tokens: tree size N incl. the root (tokens the policy verifies per row and step), at most the EAGLE-2
    candidate pool + 1 = 1 + topk + (depth - 1) * topk**2. threshold: speculative steps once the live rows of a wave
    are at most this many (0 = never). steps_per_call: EAGLE verify steps per host round trip (n-gram: always 1).
    """

    depth: int = 8
    topk: int = 4
    verify_tokens: int = 48
    threshold: int = 32
    steps_per_call: int = 4

    def __post_init__(self):
        for name in ("depth", "topk", "steps_per_call"):
            v = getattr(self, name)
            if int(v) != v or v < 1:
                raise ValueError(f"SpecConfig.{name} must be an integer >= 1, got {v}")
        if int(self.threshold) != self.threshold or self.threshold < 0:
            raise ValueError(f"SpecConfig.threshold must be an integer >= 0, got {self.threshold}")
        n, top = self.verify_tokens, self.max_verify_tokens
        if int(n) != n or not 2 <= n <= top:
            raise ValueError(
                f"SpecConfig.verify_tokens must be in [2, {top}] (1 + topk + (depth-1)*topk^2 for depth={self.depth}, "
                f"topk={self.topk}), got {n}"
            )

    @property
    def max_verify_tokens(self) -> int:
        return 1 + self.topk + (self.depth - 1) * self.topk**2

    def arm(self, kind: str) -> str:
        """Pool arm name of this tree shape for a drafter kind ("eagle" | "ngram")."""
        return f"tree/{kind}/d{self.depth}k{self.topk}n{self.verify_tokens}"

    def drafter_len(self, max_len: int) -> int:
        """EAGLE drafter cache slots: the committed context plus the draft tree's scratch."""
        return max_len + (self.depth - 1) * self.topk


def commit_verify(state: DecodeState, out: VerifyOutput, side: str) -> DecodeState:
    """Write a verification's emitted tokens (log-probs, captured hidden states) and its KV commit into the state."""
    b, m = state.tokens.shape
    w = out.tokens.shape[1]
    j = jnp.arange(w, dtype=jnp.int32)[None, :]
    count = out.num_emitted[:, None]
    keep = j < count
    rows = jnp.arange(b)[:, None]
    idx = jnp.where(keep, state.num_generated[:, None] + j, m)
    tokens = state.tokens.at[rows, idx].set(out.tokens, mode="drop")
    logprobs = state.logprobs.at[rows, idx].set(out.logprobs, mode="drop")
    hid = state.hidden
    if hid is not None:
        win = hid.shape[1]
        pos = state.num_generated[:, None] + j
        if side == "last":  # a ring: only the last `win` of this call's tokens, so no slot is written twice
            slot = jnp.where(keep & (j >= count - win), pos % win, win)
        else:
            slot = jnp.where(keep & (pos < win), pos, win)
        hid = hid.at[rows, slot].set(out.hidden.astype(hid.dtype), mode="drop")
    return state.replace(
        cache=out.cache,
        last_token=jnp.where(out.num_emitted > 0, out.root, state.last_token),
        num_generated=state.num_generated + out.num_emitted,
        done=state.done | out.finished,
        tokens=tokens,
        logprobs=logprobs,
        hidden=hid,
    )


def verify_rows(model, state: DecodeState, tree: Tree, spec: SpecConfig, length: int) -> VerifyOutput:
    """Verify ``tree`` for every row with plain decoding's keys and the rows' own sampling params, stop tokens and
    budgets; the policy reads the first ``length`` cache positions."""
    keys = depth_keys(state.seed[:, None], state.request_id, state.sample_id, state.cache.lengths + 1, spec.depth)
    return verify_tree(
        model,
        state.cache,
        tree,
        keys,
        state.temperature,
        state.top_k,
        state.top_p,
        state.stop_ids,
        state.max_new - state.num_generated,
        ~state.done,
        max_depth=spec.depth,
        attend_len=length,
    )


def build_verify_eagle(ctx: StepContext, spec: SpecConfig, key: StepKey):
    """Key: ("verify", B, Lb, arm). Args: (policy, drafter) params, DecodeState [B] (donated). Up to steps_per_call
    EAGLE-2 draft → verify → commit → drafter extend rounds."""
    length = key.length
    dlen = min(length + (spec.depth - 1) * spec.topk, ctx.drafter_len)  # committed context + draft scratch

    def one(model, drafter, head, state: DecodeState):
        ds: DraftState = state.aux
        view = DraftState(ds.cache.view(dlen), ds.feature)
        tree, _ = eagle_draft(
            model, drafter, view, state.last_token, depth=spec.depth, topk=spec.topk, num_nodes=spec.verify_tokens,
            head=head,
        )
        out = verify_rows(model, state, tree, spec, length)
        ds = drafter_extend(
            model, drafter, ds, out.hidden, jnp.maximum(out.tokens, 0), out.num_emitted, attend_len=dlen
        )
        return commit_verify(state, out, ctx.capture_side).replace(aux=ds), out.accept_len

    def step(params, state: DecodeState):
        model, drafter = ctx.merge(params)
        head = draft_head(model, drafter)  # draft-vocabulary rows of the LM head: gathered once per call
        zero = jnp.zeros_like(state.num_generated)

        def cond(c):
            return (c[0] < spec.steps_per_call) & jnp.any(~c[1].done)

        def body(c):
            i, s, nv, acc = c
            active = ~s.done
            s, alen = one(model, drafter, head, s)
            return i + 1, s, nv + active, acc + jnp.where(active, alen, 0)

        _, state, nv, acc = jax.lax.while_loop(cond, body, (jnp.int32(0), state, zero, zero))
        return state, step_info(state, verifies=nv, accepted=acc)

    out_sh = (ctx.state_shardings(ctx.abstract_state(key.batch)), ctx.replicated())
    return jax.jit(step, donate_argnums=(1,), out_shardings=out_sh)


def build_verify_ngram(ctx: StepContext, spec: SpecConfig, key: StepKey):
    """Key: ("verify", B, Lb, arm). Args: params, DecodeState [B] (donated), host tree tokens / parent / valid
    [B, N]. One verify step; the root is the row's last token whatever the host sent."""
    length = key.length

    def step(params, state: DecodeState, tokens, parent, valid):
        model, _ = ctx.merge(params)
        ngen, active = state.num_generated, ~state.done
        tokens = tokens.at[:, 0].set(state.last_token)
        tree = make_tree(tokens, parent, valid, spec.depth)
        out = verify_rows(model, state, tree, spec, length)
        state = commit_verify(state, out, ctx.capture_side)
        acc = jnp.where(active, out.accept_len, 0)
        return state, step_info(state, ngen, spec.depth + 1, verifies=active.astype(jnp.int32), accepted=acc)

    out_sh = (ctx.state_shardings(ctx.abstract_state(key.batch)), ctx.replicated())
    return jax.jit(step, donate_argnums=(1,), out_shardings=out_sh)


def register_spec(pool: StepPool, ctx: StepContext, spec: SpecConfig, kind: str) -> str:
    """Register the verify builder of one speculative arm; returns the arm name."""
    arm = spec.arm(kind)
    build = build_verify_eagle if kind == "eagle" else build_verify_ngram
    pool.register("verify", arm, lambda key: build(ctx, spec, key))
    return arm


# ------------------------------------------------------------------------------------------------ host n-gram trees


def propose_ngram(
    template: NgramDrafter,
    spec: SpecConfig,
    contexts: list[np.ndarray],
    groups: list[int],
    live: np.ndarray,
    stops: tuple[int, ...],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Trees [B, N] for the first ``len(live)`` contexts (the batch rows; rows not live get a root-only tree). Every
    context with the same group id (the row's GRPO group: other rows in the batch and finished samples appended after
    the batch rows) is a lookup source besides the row's own prompt + output."""
    b, n = len(live), spec.verify_tokens
    ng = dataclasses.replace(template, num_nodes=n, max_depth=spec.depth, stop_tokens=tuple(stops), group_ids=groups)
    tokens = np.zeros((b, n), np.int32)
    parent = np.zeros((b, n), np.int32)
    valid = np.zeros((b, n), bool)
    parent[:, 0], valid[:, 0] = -1, True
    for r in np.nonzero(live)[0]:
        tokens[r], parent[r], valid[r] = ng.propose_one(int(r), contexts)
    return tokens, parent, valid


def resolve_drafter(drafter: Any, spec: SpecConfig | None, cfg) -> tuple[str | None, SpecConfig | None, Any]:
    """(kind, spec, drafter) from the engine arguments: kind "eagle" | "ngram" | None; spec defaults to SpecConfig()
    when a drafter is given; an NgramDrafter instance serves as the template of the n-gram options; an EAGLE drafter
    is anything that implements ``TreeDrafter`` (``tlt_jax.drafter.EagleDrafter``)."""
    if drafter is None:
        if spec is not None:
            raise ValueError("spec was given without a drafter: pass drafter=EagleDrafter(...) or drafter='ngram'")
        return None, None, None
    if spec is None:
        spec = SpecConfig()
    if not isinstance(spec, SpecConfig):
        raise ValueError(f"spec must be a SpecConfig, got {type(spec).__name__}")
    if isinstance(drafter, str):
        if drafter != "ngram":
            raise ValueError(f"drafter must be None, an EagleDrafter, or 'ngram'; got {drafter!r}")
        return "ngram", spec, NgramDrafter(num_nodes=spec.verify_tokens, max_depth=spec.depth)
    if isinstance(drafter, NgramDrafter):
        return "ngram", spec, drafter
    if isinstance(drafter, TreeDrafter):
        d = drafter.config
        for f in ("hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(d, f) != getattr(cfg, f):
                raise ValueError(f"drafter {f}={getattr(d, f)} does not match the policy's {getattr(cfg, f)}")
        if spec.topk > cfg.vocab_size:
            raise ValueError(f"SpecConfig.topk={spec.topk} exceeds the vocabulary ({cfg.vocab_size})")
        return "eagle", spec, drafter
    raise ValueError(f"drafter must be None, an EagleDrafter, or 'ngram'; got {type(drafter).__name__}")
