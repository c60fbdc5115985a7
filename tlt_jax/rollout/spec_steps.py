"""Speculative arms of the rollout engine: ``SpecConfig``, the verify steps registered in the compiled-step pool, and
the host-side n-gram proposer.

Once a wave's live rows are at most ``SpecConfig.threshold`` the engine runs verify steps instead of plain K-step
chunks. Both arms read the same DecodeState, so the switch costs no policy work: the policy cache, counters and keys
carry over, and (EAGLE) the drafter cache in ``DecodeState.aux`` is caught up over the pairs the prefill, plain and
n-gram steps recorded since it last ran (``tlt_jax.rollout.drafter_sync``). A verify step:

    [EAGLE: drafter caught up] → tree (EAGLE-2 draft on device from the drafter cache | n-gram trie built on the host)
    → one policy forward over the tree (tlt_jax.speculative.verify_tree: Rule S, each token keyed by its position,
      stop tokens / budget truncated exactly as plain decoding) → accepted path written into the tokens, log-probs,
      hidden capture and KV cache → drafter extended over the emitted tokens (EAGLE; their pairs recorded too, for
      a rebuild after a hot swap) or their pairs recorded (n-gram).

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

from tlt_jax.adaptive.arms import Arm, parse_arms
from tlt_jax.adaptive.bandit import BanditConfig
from tlt_jax.distributed import with_activations
from tlt_jax.rollout.drafter_sync import LazyDraft, catch_up, record_pairs
from tlt_jax.rollout.pool import StepKey, StepPool
from tlt_jax.rollout.state import DecodeState
from tlt_jax.rollout.steps import StepContext, step_info
from tlt_jax.speculative.ngram import NgramDrafter
from tlt_jax.speculative.tree import (
    DraftSampling,
    DraftState,
    Tree,
    TreeDrafter,
    draft_head,
    drafter_extend,
    eagle_draft,
    make_tree,
)
from tlt_jax.speculative.verify import VerifyOutput, depth_keys, verify_tree


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Tree speculative decoding in the rollout tail (TLT defaults).

    depth: draft depth D (most accepted draft tokens per verify). topk: children expanded per frontier node (EAGLE-2).
    verify_tokens: tree size N incl. the root (tokens the policy verifies per row and step), at most the EAGLE-2
    candidate pool + 1 = 1 + topk + (depth - 1) * topk**2. threshold: speculative steps once the live rows of a wave
    are at most this many (0 = never). steps_per_call: EAGLE verify steps per host round trip (n-gram: always 1).
    patience: chunks the live rows must stay at or under the threshold before speculation turns on (hysteresis).

    Adaptive (issue 17): ``arms`` (e.g. ("off", "ngram:4x2x8", "eagle:5x1x6")) lets a per-batch-bucket BEG-MAB bandit
    (``tlt_jax.adaptive.Bandit``: arms nothing (or too little) is known of first, then epsilon-greedy on the
    sliding-window median tokens/s of the wave's lagging row over ``window`` round trips, exploration seeded by
    ``seed``) choose the arm of every chunk the gate lets speculate; depth / topk / verify_tokens are then unused.
    ``margin``: exploration only among arms estimated within this fraction of the best; ``transfer``: a bucket
    borrows relative speeds from the nearest bucket for arms it has not measured; ``time_share``: epsilon bounds the
    share of time spent exploring; ``min_count``: measurements of an arm in a bucket before its median decides
    (``tlt_jax.adaptive.BanditConfig``); ``max_loss``: None, or the most time exploration and background compiles
    may cost against plain decoding, as a fraction of its time (a conservative bandit: beyond it the bandit explores
    nothing and no step compiles). Without arms the engine runs the one tree shape above.

    coupled: sampled rows draft EAGLE children coupled to the verifier's noise (``speculative.tree.coupled_scores``);
    False drafts the deterministic top-k for every row (the ablation ``benchmarks/speculative.py`` compares against).
    Either way the output is plain decoding's.
    """

    depth: int = 8
    topk: int = 4
    verify_tokens: int = 48
    threshold: int = 32
    steps_per_call: int = 4
    patience: int = 0
    arms: tuple = ()
    epsilon: float = 0.1
    window: int = 300
    seed: int = 0
    margin: float = 0.1
    transfer: bool = True
    time_share: bool = True
    min_count: int = 3
    max_loss: float | None = None
    coupled: bool = True

    def __post_init__(self):
        if not isinstance(self.coupled, bool):
            raise ValueError(f"SpecConfig.coupled must be True or False, got {self.coupled!r}")
        if int(self.patience) != self.patience or self.patience < 0:
            raise ValueError(f"SpecConfig.patience must be an integer >= 0 (chunks to wait), got {self.patience}")
        if self.arms:
            object.__setattr__(self, "arms", parse_arms(self.arms))
            try:  # epsilon / window / seed / margin / ..., with the bandit's messages naming this config's keys
                self.bandit_config()
            except ValueError as e:
                raise ValueError(str(e).replace("BanditConfig.", "SpecConfig.")) from None
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

    @property
    def adaptive(self) -> bool:
        return bool(self.arms)

    def bandit_config(self) -> BanditConfig:
        """The bandit over ``arms`` (adaptive configs only)."""
        return BanditConfig(
            self.arms,
            epsilon=self.epsilon,
            window=self.window,
            seed=self.seed,
            margin=self.margin,
            transfer=self.transfer,
            time_share=self.time_share,
            min_count=self.min_count,
            max_loss=self.max_loss,
        )

    def engine_arms(self, kind: str | None) -> tuple[Arm, ...]:
        """The arms an engine with this drafter kind runs: ``arms``, or "off" + the one tree shape of ``kind``."""
        if self.arms:
            return self.arms
        return (Arm("off"), Arm.from_spec(kind, self))

    def for_arm(self, arm: Arm) -> SpecConfig:
        """This config with the tree shape of a speculative arm (the verify steps compile it in)."""
        if not arm.speculative:
            raise ValueError("arm 'off' has no tree shape: it is plain decoding")
        return dataclasses.replace(self, depth=arm.depth, topk=arm.topk, verify_tokens=arm.verify_tokens, arms=())


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


def row_sampling(state: DecodeState, spec: SpecConfig) -> DraftSampling:
    """The rows' verify keys (plain decoding's, by position) and temperatures, for the drafter and the verifier."""
    keys = depth_keys(state.seed[:, None], state.request_id, state.sample_id, state.cache.lengths + 1, spec.depth)
    return DraftSampling(keys, state.temperature)


def verify_rows(model, state: DecodeState, tree: Tree, spec: SpecConfig, length: int,
                sampling: DraftSampling | None = None, filters: bool = True) -> VerifyOutput:
    """Verify ``tree`` for every row with plain decoding's keys and the rows' own sampling params, stop tokens and
    budgets; the policy reads the first ``length`` cache positions. ``sampling``: ``row_sampling(state, spec)``
    when the caller already made it; ``filters``: top-k / top-p compiled in (``StepContext.sampling_filters``)."""
    keys = (sampling or row_sampling(state, spec)).keys
    return verify_tree(
        model,
        state.cache,
        tree,
        keys,
        state.temperature,
        state.top_k if filters else None,
        state.top_p if filters else None,
        state.stop_ids,
        state.max_new - state.num_generated,
        ~state.done,
        max_depth=spec.depth,
        attend_len=length,
    )


def build_verify_eagle(ctx: StepContext, spec: SpecConfig, key: StepKey):
    """Key: ("verify", B, Lb, arm). Args: (policy, drafter) params, DecodeState [B] (donated), rounds (int32 scalar,
    at most steps_per_call). Catches the drafter up, then up to ``rounds`` EAGLE-2 draft → verify → commit → drafter
    extend rounds; rounds = 0 only catches up (the adaptive engine times that apart from the bandit's reward)."""
    length = key.length
    dlen = min(length + (spec.depth - 1) * spec.topk, ctx.drafter_len)  # committed context + draft scratch

    def one(model, drafter, head, state: DecodeState):
        sync: LazyDraft = state.aux
        ds = sync.draft
        view = DraftState(ds.cache.view(dlen), ds.feature)
        sampling = row_sampling(state, spec)
        tree, _ = eagle_draft(
            model, drafter, view, state.last_token, depth=spec.depth, topk=spec.topk, num_nodes=spec.verify_tokens,
            head=head, sampling=sampling if spec.coupled else None,
        )
        out = verify_rows(model, state, tree, spec, length, sampling, ctx.sampling_filters)
        emitted = jnp.maximum(out.tokens, 0)
        ds = drafter_extend(model, drafter, ds, out.hidden, emitted, out.num_emitted, attend_len=dlen)
        sync = record_pairs(sync, state.cache.lengths, out.hidden, emitted, out.num_emitted)  # for a rebuild (forget)
        return commit_verify(state, out, ctx.capture_side).replace(aux=sync.replace(draft=ds)), out.accept_len

    def step(params, state: DecodeState, rounds):
        model, drafter = ctx.merge(params)
        aux = catch_up(model, drafter, state.aux, state.cache.lengths, state.done, piece=ctx.chunk_size,
                       attend_len=dlen)
        state = state.replace(aux=aux)
        head = draft_head(model, drafter)  # draft-vocabulary rows of the LM head: gathered once per call
        zero = jnp.zeros_like(state.num_generated)
        ngen = state.num_generated

        def cond(c):
            return (c[0] < jnp.minimum(rounds, spec.steps_per_call)) & jnp.any(~c[1].done)

        def body(c):
            i, s, nv, acc = c
            active = ~s.done
            s, alen = one(model, drafter, head, s)
            return i + 1, s, nv + active, acc + jnp.where(active, alen, 0)

        _, state, nv, acc = jax.lax.while_loop(cond, body, (jnp.int32(0), state, zero, zero))
        width = spec.steps_per_call * (spec.depth + 1) if ctx.report_tokens else 0  # n-gram arms beside EAGLE
        return state, step_info(state, ngen, width, verifies=nv, accepted=acc)

    out_sh = (ctx.state_shardings(ctx.abstract_state(key.batch)), ctx.replicated())
    return jax.jit(with_activations(step, ctx.mesh, ctx.rules), donate_argnums=(1,), out_shardings=out_sh)


def build_verify_ngram(ctx: StepContext, spec: SpecConfig, key: StepKey):
    """Key: ("verify", B, Lb, arm). Args: params, DecodeState [B] (donated), host tree tokens / parent / valid
    [B, N]. One verify step; the root is the row's last token whatever the host sent."""
    length = key.length

    def step(params, state: DecodeState, tokens, parent, valid):
        model, _ = ctx.merge(params)
        ngen, active, position = state.num_generated, ~state.done, state.cache.lengths
        tokens = tokens.at[:, 0].set(state.last_token)
        tree = make_tree(tokens, parent, valid, spec.depth)
        out = verify_rows(model, state, tree, spec, length, filters=ctx.sampling_filters)
        state = commit_verify(state, out, ctx.capture_side)
        if ctx.drafter_graphdef is not None:  # beside EAGLE arms: the drafter catches up over these tokens later
            state = state.replace(aux=record_pairs(state.aux, position, out.hidden, jnp.maximum(out.tokens, 0),
                                                   out.num_emitted))
        acc = jnp.where(active, out.accept_len, 0)
        return state, step_info(state, ngen, spec.depth + 1, verifies=active.astype(jnp.int32), accepted=acc)

    out_sh = (ctx.state_shardings(ctx.abstract_state(key.batch)), ctx.replicated())
    return jax.jit(with_activations(step, ctx.mesh, ctx.rules), donate_argnums=(1,), out_shardings=out_sh)


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
    is anything that implements ``TreeDrafter`` (``tlt_jax.drafter.EagleDrafter``). Adaptive specs: "ngram" arms run
    with any drafter (or none), "eagle" arms need an EAGLE drafter."""
    if spec is not None and not isinstance(spec, SpecConfig):
        raise ValueError(f"spec must be a SpecConfig, got {type(spec).__name__}")
    if drafter is None:
        if spec is None:
            return None, None, None
        if not spec.adaptive:
            raise ValueError("spec was given without a drafter: pass drafter=EagleDrafter(...) or drafter='ngram'")
        drafter = "ngram"
    if spec is None:
        spec = SpecConfig()
    eagle_arms = [str(a) for a in spec.arms if a.kind == "eagle"]
    if isinstance(drafter, str):
        if drafter != "ngram":
            raise ValueError(f"drafter must be None, an EagleDrafter, or 'ngram'; got {drafter!r}")
        drafter = NgramDrafter(num_nodes=spec.verify_tokens, max_depth=spec.depth)
    if isinstance(drafter, NgramDrafter):
        if eagle_arms:
            raise ValueError(f"spec.arms {eagle_arms} need an EAGLE drafter: pass drafter=EagleDrafter(...)")
        return "ngram", spec, drafter
    if isinstance(drafter, TreeDrafter):
        d = drafter.config
        for f in ("hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(d, f) != getattr(cfg, f):
                raise ValueError(f"drafter {f}={getattr(d, f)} does not match the policy's {getattr(cfg, f)}")
        if spec.adaptive and not eagle_arms:
            raise ValueError("an EAGLE drafter was given but spec.arms has no 'eagle:DxKxN' arm; add one or drop it")
        top = max([spec.topk] + [a.topk for a in spec.arms if a.kind == "eagle"])
        if top > cfg.vocab_size:
            raise ValueError(f"SpecConfig.topk={top} exceeds the vocabulary ({cfg.vocab_size})")
        return "eagle", spec, drafter
    raise ValueError(f"drafter must be None, an EagleDrafter, or 'ngram'; got {type(drafter).__name__}")
