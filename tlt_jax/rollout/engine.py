"""Rollout engine for RL: prompt once / fork n, K decode steps per host round trip, finished rows leave and the
survivors are compacted into the smallest batch bucket that holds them, attention reads only up to a cache-length
bucket covering the longest live row. Runs on one (sub-)mesh; every compiled step comes from a keyed pool.

Host loop (``tlt_jax.rollout.run.GenerateRun``; one device→host read of a ``StepInfo`` per round trip):

    prefill+fork (B rows) → [decode chunk (≤K steps) → read info → drop finished rows / compact]* → harvest

With a drafter and a ``SpecConfig`` a chunk is a speculative round trip once the wave's live rows are at most
``spec.threshold`` (tree draft → lossless verify → commit; see ``tlt_jax.rollout.spec_steps``); the switch re-runs
nothing, the state carries over. Requests larger than ``max_batch`` rows run in consecutive waves of at most
``max_batch`` rows (no refill of freed slots inside a wave). Decode-state layout: see ``tlt_jax.rollout.state``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tlt_jax.adaptive import Arm, Bandit, BanditConfig
from tlt_jax.distributed import LogicalRules, decode_rules, shard_module, single_device_mesh
from tlt_jax.models import CausalLM, rollout_copy
from tlt_jax.rollout import buckets as bk
from tlt_jax.rollout.params import HiddenCapture, RolloutResult, SamplingParams
from tlt_jax.rollout.plan import reachable_plan
from tlt_jax.rollout.pool import StepKey, StepPool
from tlt_jax.rollout.reshard import Resharder
from tlt_jax.rollout.run import OFF, GenerateRun
from tlt_jax.rollout.spec_steps import SpecConfig, register_spec, resolve_drafter
from tlt_jax.rollout.steps import StepContext, register_plain
from tlt_jax.speculative import NgramDrafter
from tlt_jax.speculative.history import NgramHistory


class RolloutEngine:
    """Generates GRPO groups with a causal LM on one mesh slice.

    model: a CausalLM (its parameters are placed on ``mesh`` with ``shard_module`` by ``decode_rules(rules)``: split
    over 'tensor' only, replicated over the data axes, so no decode step gathers a weight; the decode batch is sharded
    on 'data'/'fsdp' where the bucket divides). max_batch: rows decoded together (a
    wave). max_len: KV-cache capacity per row (prompt + generated). chunk_size: decode steps per host round trip.
    batch_buckets / length_buckets: the shapes compiled steps are specialised to. precompile: compile every decode
    and compaction step ahead of time (prefill compiles on first use, its shape depends on the call).
    background_compile: a speculative step met for the first time compiles on the pool's worker thread while plain
    decoding (the same tokens) goes on, instead of stopping the rollout; which arm runs then depends on when the
    compile finishes (the tokens do not). compile_between_calls: those compiles start only once ``generate`` has
    returned (the pool is held during a call), so none runs beside decoding: a compile's tracing and lowering hold
    the GIL, which the decode loop's dispatch waits for, and on XLA:CPU its code generation takes the decoding cores
    (docs/architecture.md §4.5). The arm becomes usable from the next call. pool_budget:
    most compiled steps kept (LRU); pool_max_bytes: most bytes of compiled code kept (None = no byte bound).
    compaction: drop finished rows into smaller buckets (False keeps them frozen in
    place; may be changed between calls). tail_threshold: chunks with at most this many live rows count as tail.
    capture: keep hidden states of a window of every finished sample (see HiddenCapture; its max_bytes may be
    changed between calls, window and side are compiled in). compiler_options: passed to every XLA compile.
    drafter: None, an EagleDrafter (prefill and plain steps only record its input pairs, over which the drafter is
    caught up before it drafts EAGLE-2 trees on device), or "ngram" (trees from the row's prompt + output and its
    GRPO siblings, built on the host).
    spec: the tree shape (or adaptive ``arms``: "ngram" arms need no drafter object, "eagle" arms an EagleDrafter)
    and the switch threshold / patience (default SpecConfig() when a drafter is given); ``spec.threshold`` and
    ``spec.patience`` may be changed between calls (``engine.spec = dataclasses.replace(engine.spec, threshold=...)``:
    host-side decisions), tree shapes are compiled in. The adaptive bandit lives on the engine (across generate
    calls); ``state_dict`` / ``load_state_dict`` carry it through checkpoints.
    dtype: rollout layout, e.g. jnp.bfloat16: decode with a cast copy of the params (and a KV cache) in that dtype;
    ``model`` and later ``set_params`` models stay fp32 masters. attention_impl: "xla" (default) or "pallas" (the
    tree-attention kernel for decode and verify; interpreted on CPU). layers: "stacked" (scanned, as trained) or
    "unstacked" (one array per layer, run unrolled: no per-step copies of stacked weight slices on GPU).
    ngram_history_bytes: with n-gram arms, keep each call's responses per prompt (``ngram_history``, a
    ``NgramHistory`` of at most this many token bytes; 0 = none) as draft sources of later calls.
    sampling_filters: False compiles the steps without top-k / top-p (no full-vocabulary sort, and with a vocabulary
    split over tensor-parallel devices no collective but two small all-reduces per sampled token; RL rollouts, which
    reject both); ``generate`` then refuses SamplingParams that set them.
    """

    def __init__(
        self,
        model: CausalLM,
        mesh: Mesh | None = None,
        *,
        drafter: Any = None,
        spec: SpecConfig | None = None,
        max_batch: int = 64,
        max_len: int | None = None,
        chunk_size: int = 8,
        batch_buckets: Sequence[int] = bk.DEFAULT_BATCH_BUCKETS,
        length_buckets: Sequence[int] | None = None,
        precompile: bool = False,
        background_compile: bool = False,
        compile_between_calls: bool = False,
        pool_budget: int = 128,
        pool_max_bytes: int | None = None,
        compaction: bool = True,
        tail_threshold: int = 32,
        capture: HiddenCapture | None = None,
        rules: LogicalRules = LogicalRules(),
        max_stop_tokens: int = 8,
        compiler_options: dict[str, Any] | None = None,
        dtype: Any = None,
        attention_impl: str | None = None,
        layers: str | None = None,
        ngram_history_bytes: int = 0,
        sampling_filters: bool = True,
    ):
        self.rollout_layout = dict(dtype=dtype, attention_impl=attention_impl, layers=layers)  # rollout layout
        model = rollout_copy(model, **self.rollout_layout)  # rollout layout (issue 19)
        cfg = model.config
        if max_len is None:
            max_len = min(cfg.max_position_embeddings, 1024)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if max_stop_tokens < 1:
            raise ValueError(f"max_stop_tokens must be >= 1, got {max_stop_tokens}")
        self.config = cfg
        self.mesh = single_device_mesh() if mesh is None else mesh
        # An engine over several processes' devices agrees its host decisions with them (``tlt_jax.adaptive.sync``);
        # one on this process's devices alone (a rollout slice across processes) decides alone.
        self.spans_processes = len({d.process_index for d in self.mesh.devices.flat}) > 1
        self.rules = rules
        self.max_batch = int(max_batch)
        self.max_len = int(max_len)
        self.chunk_size = int(chunk_size)
        self.batch_buckets = bk.batch_buckets(self.max_batch, batch_buckets)
        self.length_buckets = bk.length_buckets(self.max_len, length_buckets)
        self.compaction = compaction
        self.background_compile = bool(background_compile)
        self.compile_between_calls = bool(compile_between_calls)
        self.tail_threshold = int(tail_threshold)
        self.capture = capture
        self.max_stop_tokens = int(max_stop_tokens)
        self.drafter_kind, self.spec, drafter = resolve_drafter(drafter, spec, cfg)
        self.param_rules = decode_rules(rules)  # weights split over "tensor" only: decode steps gather none
        self.graphdef, self.params = nnx.split(shard_module(model, self.mesh, self.param_rules))
        self._resharder: Resharder | None = None  # made on the first set_params
        ngram_arms = self._init_arms(drafter, ngram_history_bytes)
        self.ctx = self._step_context(model, capture, ngram_arms, sampling_filters)
        self._init_pool(pool_budget, compiler_options, pool_max_bytes)
        self._tree_shape = self._shape_of(self.spec)
        if precompile:
            self.precompile()

    def _init_arms(self, drafter: Any, ngram_history_bytes: int) -> bool:
        """The arms, their tree shapes, the bandit, the n-gram drafter and history, the EAGLE drafter's params;
        returns whether any arm drafts n-grams."""
        # Arms: "off" + the speculative arms (adaptive: the bandit's list); the tree shape of each verify step.
        self.arms = self.spec.engine_arms(self.drafter_kind) if self.spec else (Arm("off"),)
        self.arm_specs = {a: self.spec.for_arm(a) for a in self.arms if a.speculative}
        self.bandit = Bandit(self.spec.bandit_config()) if self.spec and self.spec.adaptive else None
        ngram_arms = any(a.kind == "ngram" for a in self.arms)
        self.ngram = NgramDrafter(2, 1) if ngram_arms and self.drafter_kind == "eagle" else None  # template only
        self.ngram = drafter if self.drafter_kind == "ngram" else self.ngram
        # n-gram arms also draft from the prompt's responses in earlier calls (a store of this many token bytes)
        use_history = ngram_history_bytes > 0 and self.ngram is not None
        self.ngram_history = NgramHistory(ngram_history_bytes) if use_history else None
        self.drafter_graphdef, self.drafter_params = None, None
        if self.drafter_kind == "eagle":
            self.drafter_graphdef, self.drafter_params = nnx.split(shard_module(drafter, self.mesh, self.param_rules))
        return ngram_arms

    def _step_context(self, model: CausalLM, capture: HiddenCapture | None, ngram_arms: bool,
                      sampling_filters: bool) -> StepContext:
        """What every compiled step of this engine is specialised to (shapes, layouts, capture, mesh)."""
        cfg, rules = self.config, self.rules
        return StepContext(
            graphdef=self.graphdef,
            config=cfg,
            max_len=self.max_len,
            chunk_size=self.chunk_size,
            num_stop=self.max_stop_tokens,
            capture_window=capture.window if capture else 0,
            capture_side=capture.side if capture else "last",
            capture_prompt=capture.prompt if capture else 0,
            cache_dtype=model.dtype,
            per_layer_cache=isinstance(model.layers, nnx.List),
            mesh=self.mesh,
            rules=rules,
            drafter_graphdef=self.drafter_graphdef,
            drafter_len=max(
                (s.drafter_len(self.max_len) for a, s in self.arm_specs.items() if a.kind == "eagle"), default=0
            ),
            report_tokens=ngram_arms,  # the host builds n-gram trees from every emitted token, whatever the arm
            sampling_filters=sampling_filters,
        )

    def _init_pool(self, pool_budget: int, compiler_options: dict[str, Any] | None, pool_max_bytes: int | None) -> None:
        """The pool of compiled steps, with the plain steps and each speculative arm's registered."""
        self.pool = StepPool(pool_budget, compiler_options, max_bytes=pool_max_bytes)
        register_plain(self.pool, self.ctx)
        for a, s in self.arm_specs.items():
            register_spec(self.pool, self.ctx, s, a.kind)
        spec_arms = [a.pool_name for a in self.arm_specs]
        self.spec_arm = spec_arms[0] if len(spec_arms) == 1 else None  # the fixed arm's pool name (not adaptive)

    # ---- weights and compiled steps -------------------------------------------------------------------------

    def set_params(self, model: CausalLM) -> None:
        """Publish new policy weights (same shapes): compiled steps stay valid. The trained model (any sharding over
        this engine's devices) is cast and laid out by one compiled program (``Resharder``); the previous copy is
        dropped first, so two copies are never alive together."""
        if self._resharder is None:
            self._resharder = Resharder([self.mesh], self.rollout_layout, self.rules)
        self.params = None
        self.set_rollout_copy(self._resharder(model)[0])

    def set_rollout_copy(self, copy: CausalLM) -> None:
        """Publish a model already in this engine's rollout layout on its mesh (``Resharder``'s output)."""
        graphdef, params = nnx.split(copy)
        if graphdef != self.graphdef:
            raise ValueError("set_params: the new model's structure differs from the engine's model")
        self.params = params

    def set_drafter(self, drafter) -> None:
        """Publish new EAGLE drafter weights (same structure): compiled steps stay valid. A generate call running on
        another thread (a hot swap) drafts with them from its next chunk, which first rebuilds each row's drafter cache
        with them over the sequence so far (``drafter_sync.forget``; the chunk's stats say ``drafter_swapped``)."""
        if self.drafter_kind != "eagle":
            raise ValueError("set_drafter: this engine has no EAGLE drafter")
        graphdef, params = nnx.split(shard_module(drafter, self.mesh, self.param_rules))
        if graphdef != self.drafter_graphdef:
            raise ValueError("set_drafter: the new drafter's structure differs from the engine's drafter")
        self.drafter_params = params

    def set_drafter_params(self, params: nnx.State) -> None:
        """``set_drafter`` for new values of some of the drafter's variables (e.g. ``nnx.state(drafter, nnx.Param)``
        of a drafter of the same structure), the others kept: the cheap form for a publish every RL step. Leaves
        placed otherwise than the engine's are moved to its placement (no copy where that is equivalent)."""
        if self.drafter_kind != "eagle":
            raise ValueError("set_drafter_params: this engine has no EAGLE drafter")
        new = nnx.State.merge(self.drafter_params, params)
        if jax.tree.structure(new) != jax.tree.structure(self.drafter_params):
            raise ValueError("set_drafter_params: the new variables do not fit the engine's drafter")
        self.drafter_params = jax.tree.map(
            lambda x, old: x if x.sharding == old.sharding else jax.device_put(x, old.sharding), new,
            self.drafter_params)

    @staticmethod
    def _shape_of(spec: SpecConfig | None):
        return None if spec is None else dataclasses.replace(spec, threshold=0, patience=0)

    def step_params(self) -> Any:
        """The params pytree every compiled step takes: the policy state, or (policy, drafter) with EAGLE."""
        return self.params if self.drafter_graphdef is None else (self.params, self.drafter_params)

    def choose_arm(self, speculate: bool, batch: int) -> Arm:
        """The arm of the next chunk: "off" unless the gate lets it speculate; then the fixed arm, or the bandit's
        choice for this batch bucket (adaptive)."""
        if not speculate:
            return OFF
        if self.bandit is None:
            return next(iter(self.arm_specs))
        return self.bandit.choose(batch)

    def state_dict(self) -> dict[str, Any]:
        """Host state that outlives generate calls, as JSON values: the bandit's (empty when not adaptive)."""
        return {"bandit": self.bandit.state_dict()} if self.bandit is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (e.g. from a checkpoint)."""
        if self.bandit is None:
            if state.get("bandit") is not None:
                raise ValueError("the saved engine state has a bandit but this engine is not adaptive (no spec.arms)")
            return
        if state.get("bandit") is None:
            raise ValueError("the saved engine state has no bandit; it was saved by an engine without spec.arms")
        self.bandit.load_state_dict(state["bandit"])

    def history_state(self) -> dict[str, Any] | None:
        """The n-gram history's state (``ngram_history_bytes``) as JSON values, None without one: a run checkpoints
        it beside the bandit (``builders.restore_engine_state``), so a resumed run drafts from the same store."""
        return None if self.ngram_history is None else self.ngram_history.state_dict()

    def load_history_state(self, state: dict[str, Any] | None) -> None:
        """Restore ``history_state()`` output; None (a checkpoint without a store) leaves the store as it is."""
        if self.ngram_history is not None and state is not None:
            self.ngram_history.load_state_dict(state)

    def precompile(self) -> None:
        """Compile every reachable (decode or verify, arm, batch bucket, length bucket) and compaction step ahead
        of time (verify only for buckets the threshold can reach; ``BanditConfig.reachable``)."""
        rep = self.ctx.replicated()
        threshold = self.spec.threshold if self.spec else 0
        table = BanditConfig(self.arms)
        self.pool.precompile(
            reachable_plan(
                table, self.batch_buckets, self.length_buckets, threshold, self.abstract_args, self.compaction
            )
        )
        if not self.compaction:
            return
        for b in self.batch_buckets:
            state = self.ctx.abstract_state(b)
            for dst in self.batch_buckets:
                if dst < b:
                    idx = jax.ShapeDtypeStruct((dst,), jnp.int32, sharding=rep)
                    ok = jax.ShapeDtypeStruct((dst,), jnp.bool_, sharding=rep)
                    self.pool.compile(StepKey("compact", dst, 0, "plain", (b,)), state, idx, ok)

    def close(self) -> None:
        """Stop the pool's background compiles (the compiled steps stay usable)."""
        self.pool.close()

    def abstract_args(self, arm: Arm, b: int, length: int) -> tuple:
        """Abstract arguments of the (arm, batch bucket, cache length) step, for compiling it ahead of its use."""
        state = self.ctx.abstract_state(b)
        if arm.kind == "eagle":
            return self.step_params(), state, jax.ShapeDtypeStruct((), jnp.int32, sharding=self.ctx.replicated())
        if arm.kind != "ngram":
            return self.step_params(), state
        shape = (b, arm.verify_tokens)
        sh = self.ctx.batch_sharding(shape)
        tree = [jax.ShapeDtypeStruct(shape, dt, sharding=sh) for dt in (jnp.int32, jnp.int32, jnp.bool_)]
        return (self.step_params(), state, *tree)

    # ---- validation -------------------------------------------------------------------------------------------

    def _validate(self, prompts, params: SamplingParams, request_ids) -> tuple[list[list[int]], list[int], list[int]]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        v = self.config.vocab_size
        out = []
        for i, p in enumerate(prompts):
            p = [int(t) for t in np.asarray(p).reshape(-1)] if not isinstance(p, list) else [int(t) for t in p]
            if not p:
                raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
            if len(p) > self.max_len:
                raise ValueError(f"prompts[{i}] has {len(p)} tokens, longer than the KV cache (max_len={self.max_len})")
            bad = [t for t in p if not 0 <= t < v]
            if bad:
                raise ValueError(f"prompts[{i}] has token id {bad[0]} outside the vocabulary [0, {v})")
            out.append(p)
        max_new = params.max_new_for(len(out))
        for i, (p, m) in enumerate(zip(out, max_new, strict=True)):
            if len(p) + m > self.max_len:
                raise ValueError(
                    f"prompts[{i}]: {len(p)} prompt tokens + max_new_tokens={m} exceeds max_len={self.max_len}"
                )
        if not self.ctx.sampling_filters and (params.top_k or params.top_p < 1.0):
            raise ValueError(f"this engine was built with sampling_filters=False: top_k={params.top_k} / "
                             f"top_p={params.top_p} need an engine with sampling_filters=True")
        stops = self._stop_ids(params)
        if len(stops) > self.max_stop_tokens:
            raise ValueError(
                f"stop_token_ids has {len(stops)} ids; the engine holds at most max_stop_tokens={self.max_stop_tokens}"
            )
        bad = [t for t in stops if not 0 <= t < v]
        if bad:
            raise ValueError(f"stop_token_ids has id {bad[0]} outside the vocabulary [0, {v})")
        if request_ids is None:
            request_ids = list(range(len(out)))
        else:
            request_ids = [int(r) for r in request_ids]
            if len(request_ids) != len(out):
                raise ValueError(f"request_ids has {len(request_ids)} ids for {len(out)} prompts")
            if any(not 0 <= r < 2**31 for r in request_ids):
                raise ValueError("request_ids must be in [0, 2**31)")
        return out, max_new, request_ids

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        if params.ignore_eos:
            return ()
        return tuple(self.config.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids)

    # ---- generation -------------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        request_ids: Sequence[int] | None = None,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> RolloutResult:
        """Sample ``params.n`` completions per prompt. ``request_ids`` (default 0..N-1) name the prompts for the
        counter-based keys: the same (seed, request id, sample index) gives the same tokens in any batch, with or
        without speculative decoding.

        stats: steps (decode steps + verify steps), tokens_per_s (generated tokens / (prefill + decode seconds),
        compilation excluded), arms (chunks per arm), sd_on_seconds / sd_off_seconds (speculative / plain chunks,
        n-gram tree building included), verify_steps, mean_accept_length (tokens emitted per verify step and live
        row), spec (arm, drafter, threshold, switches: live rows / batch / seconds into the wave when tree decoding
        switched on, accepted drafts), chunks (per round trip), prefills, compactions, by_batch, pool counters,
        compile_seconds_this_call (compiles the rollout waited for) and background_compile_seconds_this_call.
        on_chunk(finished_samples, active_samples) is called once per host round trip (progress bars)."""
        prompts, max_new, request_ids = self._validate(prompts, params, request_ids)
        cap = self.capture
        compiled = (self.ctx.capture_window, self.ctx.capture_side, self.ctx.capture_prompt)
        if ((cap.window, cap.side, cap.prompt) if cap else (0, "last", 0)) != compiled:
            raise ValueError(
                "capture: only max_bytes may change after construction (window, side and prompt are compiled in)"
            )
        if self._shape_of(self.spec) != self._tree_shape:
            raise ValueError(
                "spec: only threshold and patience may change after construction (tree shapes and arms are fixed)"
            )
        t_start = time.perf_counter()
        pool0 = self.pool.counters()
        n = int(params.n)
        stops = self._stop_ids(params)
        run = GenerateRun(self, prompts, max_new, request_ids, params, stops)
        rows = [(i, j) for i in range(len(prompts)) for j in range(n)]
        hold = self.compile_between_calls and not self.pool.held  # (a caller may hold it across several calls)
        if hold:
            self.pool.hold()
        try:
            for w0 in range(0, len(rows), self.max_batch):
                wave = rows[w0 : w0 + self.max_batch]
                if on_chunk is not None:
                    run.on_chunk = lambda live, end=w0 + len(wave): on_chunk(end - live, live)
                run.wave(wave)
        finally:
            if hold:
                self.pool.release()
        result = run.assemble(n)
        pool1 = self.pool.counters()
        st = result.stats
        st["wall_seconds"] = time.perf_counter() - t_start
        st["pool"] = pool1
        st["pool_this_call"] = {k: pool1[k] - pool0[k] for k in ("compiles", "hits", "misses", "evictions")}
        st["compile_seconds_this_call"] = pool1["compile_seconds"] - pool0["compile_seconds"]
        st["background_compile_seconds_this_call"] = pool1["background_seconds"] - pool0["background_seconds"]
        return result
