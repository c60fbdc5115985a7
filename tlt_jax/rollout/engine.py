"""Rollout engine for RL: prompt once / fork n, K decode steps per host round trip, finished rows leave and the
survivors are compacted into the smallest batch bucket that holds them, attention reads only up to a cache-length
bucket covering the longest live row. Runs on one (sub-)mesh; every compiled step comes from a keyed pool.

Host loop (one device→host read per round trip: done flags + generated counts):

    prefill+fork (B rows) → [decode chunk (≤K steps) → read info → drop finished rows / compact]* → harvest

With a drafter and a ``SpecConfig`` a chunk is a speculative round trip once the wave's live rows are at most
``spec.threshold`` (tree draft → lossless verify → commit; see ``tlt_jax.rollout.speculative``); the switch re-runs
nothing, the state carries over. Requests larger than ``max_batch`` rows run in consecutive waves of at most
``max_batch`` rows (no refill of freed slots inside a wave). Decode-state layout: see ``tlt_jax.rollout.state``.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tlt_jax.distributed import LogicalRules, shard_module, single_device_mesh
from tlt_jax.distributed.multihost import to_host
from tlt_jax.models import CausalLM, rollout_copy
from tlt_jax.rollout import buckets as bk
from tlt_jax.rollout.params import HiddenCapture, RolloutResult, SamplingParams
from tlt_jax.rollout.pool import StepKey, StepPool
from tlt_jax.rollout.speculative import SpecConfig, propose_ngram, register_spec, resolve_drafter
from tlt_jax.rollout.state import RowInit
from tlt_jax.rollout.steps import StepContext, register_plain


class RolloutEngine:
    """Generates GRPO groups with a causal LM on one mesh slice.

    model: a CausalLM (its parameters are placed on ``mesh`` with ``shard_module``: tensor-parallel inside the slice;
    the decode batch is sharded on 'data'/'fsdp' where the bucket divides). max_batch: rows decoded together (a
    wave). max_len: KV-cache capacity per row (prompt + generated). chunk_size: decode steps per host round trip.
    batch_buckets / length_buckets: the shapes compiled steps are specialised to. precompile: compile every decode
    and compaction step ahead of time (prefill compiles on first use, its shape depends on the call). pool_budget:
    most compiled steps kept (LRU). compaction: drop finished rows into smaller buckets (False keeps them frozen in
    place; may be changed between calls). tail_threshold: chunks with at most this many live rows count as tail.
    capture: keep hidden states of a window of every finished sample (see HiddenCapture; its max_bytes may be
    changed between calls, window and side are compiled in). compiler_options: passed to every XLA compile.
    drafter: None, an EagleDrafter (its KV cache is kept current during plain decoding, then it drafts EAGLE-2
    trees on device), or "ngram" (trees from the row's prompt + output and its GRPO siblings, built on the host).
    spec: the tree shape and the switch threshold (default SpecConfig() when a drafter is given); ``spec.threshold``
    may be changed between calls (``engine.spec = dataclasses.replace(engine.spec, threshold=...)``: a host-side
    decision), the tree shape is compiled in.
    dtype: rollout layout, e.g. jnp.bfloat16: decode with a cast copy of the params (and a KV cache) in that dtype;
    ``model`` and later ``set_params`` models stay fp32 masters. attention_impl: "xla" (default) or "pallas" (the
    tree-attention kernel for decode and verify; interpreted on CPU).
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
        pool_budget: int = 128,
        compaction: bool = True,
        tail_threshold: int = 32,
        capture: HiddenCapture | None = None,
        rules: LogicalRules = LogicalRules(),
        max_stop_tokens: int = 8,
        compiler_options: dict[str, Any] | None = None,
        dtype: Any = None,
        attention_impl: str | None = None,
    ):
        self.rollout_layout = dict(dtype=dtype, attention_impl=attention_impl)  # rollout layout (issue 19)
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
        self.rules = rules
        self.max_batch = int(max_batch)
        self.max_len = int(max_len)
        self.chunk_size = int(chunk_size)
        self.batch_buckets = bk.batch_buckets(self.max_batch, batch_buckets)
        self.length_buckets = bk.length_buckets(self.max_len, length_buckets)
        self.compaction = compaction
        self.tail_threshold = int(tail_threshold)
        self.capture = capture
        self.max_stop_tokens = int(max_stop_tokens)
        self.drafter_kind, self.spec, drafter = resolve_drafter(drafter, spec, cfg)
        self.graphdef, self.params = nnx.split(shard_module(model, self.mesh, rules))
        self.ngram = drafter if self.drafter_kind == "ngram" else None
        self.drafter_graphdef, self.drafter_params = None, None
        if self.drafter_kind == "eagle":
            self.drafter_graphdef, self.drafter_params = nnx.split(shard_module(drafter, self.mesh, rules))
        self.ctx = StepContext(
            graphdef=self.graphdef,
            config=cfg,
            max_len=self.max_len,
            chunk_size=self.chunk_size,
            num_stop=self.max_stop_tokens,
            capture_window=capture.window if capture else 0,
            capture_side=capture.side if capture else "last",
            cache_dtype=model.dtype,
            mesh=self.mesh,
            rules=rules,
            drafter_graphdef=self.drafter_graphdef,
            drafter_len=self.spec.drafter_len(self.max_len) if self.drafter_kind == "eagle" else 0,
            report_tokens=self.drafter_kind == "ngram",
        )
        self.pool = StepPool(pool_budget, compiler_options)
        register_plain(self.pool, self.ctx)
        self.spec_arm = register_spec(self.pool, self.ctx, self.spec, self.drafter_kind) if self.spec else None
        self._tree_shape = self._shape_of(self.spec)
        if precompile:
            self.precompile()

    # ---- weights and compiled steps -------------------------------------------------------------------------

    def set_params(self, model: CausalLM) -> None:
        """Publish new policy weights (same shapes): compiled steps stay valid."""
        model = rollout_copy(model, **self.rollout_layout)  # rollout layout (issue 19)
        graphdef, params = nnx.split(shard_module(model, self.mesh, self.rules))
        if graphdef != self.graphdef:
            raise ValueError("set_params: the new model's structure differs from the engine's model")
        self.params = params

    def set_drafter(self, drafter) -> None:
        """Publish new EAGLE drafter weights (same structure): compiled steps stay valid."""
        if self.drafter_kind != "eagle":
            raise ValueError("set_drafter: this engine has no EAGLE drafter")
        graphdef, params = nnx.split(shard_module(drafter, self.mesh, self.rules))
        if graphdef != self.drafter_graphdef:
            raise ValueError("set_drafter: the new drafter's structure differs from the engine's drafter")
        self.drafter_params = params

    @staticmethod
    def _shape_of(spec: SpecConfig | None):
        return None if spec is None else dataclasses.replace(spec, threshold=0)

    def step_params(self) -> Any:
        """The params pytree every compiled step takes: the policy state, or (policy, drafter) with EAGLE."""
        return self.params if self.drafter_graphdef is None else (self.params, self.drafter_params)

    def arm_for(self, active: int, batch: int) -> str:
        """Decode arm for the next chunk: the speculative arm once at most ``spec.threshold`` rows are live."""
        if self.spec is not None and active <= self.spec.threshold:
            return self.spec_arm
        return "plain"

    def precompile(self, arms: Sequence[str] | None = None) -> None:
        """Compile every (decode or verify, batch bucket, length bucket, arm) and compaction step ahead of time
        (default arms: plain and the speculative arm; verify only for buckets the threshold can reach)."""
        rep = self.ctx.replicated()
        if arms is None:
            arms = ("plain",) + ((self.spec_arm,) if self.spec else ())
        tail = self.max_batch
        if self.spec is not None and self.compaction:  # speculative steps only run in buckets the threshold reaches
            tail = bk.pick(self.batch_buckets, max(1, min(self.spec.threshold, self.max_batch)))
        for arm in arms:
            for b in self.batch_buckets:
                state = self.ctx.abstract_state(b)
                if arm != "plain" and b > tail:
                    continue
                for length in self.length_buckets:
                    if arm == "plain":
                        self.pool.compile(StepKey("decode", b, length, arm), self.step_params(), state)
                    else:
                        self.pool.compile(StepKey("verify", b, length, arm), *self._verify_abstract(b, state))
                if not self.compaction or arm != "plain":
                    continue
                for dst in self.batch_buckets:
                    if dst < b:
                        idx = jax.ShapeDtypeStruct((dst,), jnp.int32, sharding=rep)
                        ok = jax.ShapeDtypeStruct((dst,), jnp.bool_, sharding=rep)
                        self.pool.compile(StepKey("compact", dst, 0, "plain", (b,)), state, idx, ok)

    def _verify_abstract(self, b: int, state) -> tuple:
        if self.drafter_kind != "ngram":
            return self.step_params(), state
        shape = (b, self.spec.verify_tokens)
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
        switched on, accepted drafts), chunks (per round trip), prefills, compactions, by_batch, pool counters.
        on_chunk(finished_samples, active_samples) is called once per host round trip (progress bars)."""
        prompts, max_new, request_ids = self._validate(prompts, params, request_ids)
        cap = self.capture
        if (cap.window if cap else 0) != self.ctx.capture_window or (cap and cap.side != self.ctx.capture_side):
            raise ValueError("capture: only max_bytes may change after construction (window and side are compiled in)")
        if self._shape_of(self.spec) != self._tree_shape:
            raise ValueError("spec: only threshold may change after construction (the tree shape is compiled in)")
        t_start = time.perf_counter()
        pool0 = self.pool.counters()
        n = int(params.n)
        stops = self._stop_ids(params)
        run = _Run(self, prompts, max_new, request_ids, params, stops)
        rows = [(i, j) for i in range(len(prompts)) for j in range(n)]
        for w0 in range(0, len(rows), self.max_batch):
            wave = rows[w0 : w0 + self.max_batch]
            if on_chunk is not None:
                run.on_chunk = lambda live, end=w0 + len(wave): on_chunk(end - live, live)
            run.wave(wave)
        result = run.assemble(n)
        pool1 = self.pool.counters()
        st = result.stats
        st["wall_seconds"] = time.perf_counter() - t_start
        st["pool"] = pool1
        st["pool_this_call"] = {k: pool1[k] - pool0[k] for k in ("compiles", "hits", "misses", "evictions")}
        st["compile_seconds_this_call"] = pool1["compile_seconds"] - pool0["compile_seconds"]
        return result


class _Run:
    """Host-side bookkeeping of one generate call (slots, harvests, stats)."""

    def __init__(self, engine: RolloutEngine, prompts, max_new, request_ids, params: SamplingParams, stops):
        self.e = engine
        self.prompts, self.max_new, self.request_ids, self.params = prompts, max_new, request_ids, params
        stop_row = np.full((engine.max_stop_tokens,), -1, np.int32)
        stop_row[: len(stops)] = stops
        self.stop_row, self.stops = stop_row, set(stops)
        n_total = len(prompts) * params.n
        self.final_n = np.zeros((n_total,), np.int64)
        self.harvests: list[tuple[Any, Any, Any, np.ndarray, np.ndarray]] = []
        self.chunks: list[dict] = []
        self.prefills: list[dict] = []
        self.compactions: list[dict] = []
        self.switches: list[dict] = []
        self.steps = 0
        self.on_chunk: Callable[[int], None] | None = None
        # n-gram drafting: every sample's generated tokens so far, kept from the info of each call (no extra read).
        self.gen: list[list[int]] | None = [[] for _ in range(n_total)] if engine.ngram is not None else None

    def _put(self, x: np.ndarray, replicated: bool = False):
        sh = self.e.ctx.replicated() if replicated else self.e.ctx.batch_sharding(x.shape)
        return jax.device_put(x, sh)

    def wave(self, rows: list[tuple[int, int]]) -> None:
        e, n = self.e, self.params.n
        order = list(dict.fromkeys(i for i, _ in rows))
        where = {i: k for k, i in enumerate(order)}
        bp = bk.pick(e.batch_buckets, len(order))
        plen = max(len(self.prompts[i]) for i in order)
        p_bucket = bk.pick(e.length_buckets, plen)
        ids = np.zeros((bp, p_bucket), np.int32)
        lens = np.ones((bp,), np.int32)
        for k, i in enumerate(order):
            ids[k, : len(self.prompts[i])] = self.prompts[i]
            lens[k] = len(self.prompts[i])
        b = bk.pick(e.batch_buckets, len(rows))
        r = len(rows)
        slots = np.full((b,), -1, np.int64)
        slots[:r] = [i * n + j for i, j in rows]
        prompt_of = np.zeros((b,), np.int64)
        prompt_of[:r] = [i for i, _ in rows]
        sp = self.params

        def col(values, dtype, fill):
            a = np.full((b,), fill, dtype)
            a[:r] = values
            return a

        init = RowInit(
            src=col([where[i] for i, _ in rows], np.int32, 0),
            valid=col([True] * r, bool, False),
            max_new=col([self.max_new[i] for i, _ in rows], np.int32, 1),
            temperature=np.full((b,), sp.temperature, np.float32),
            top_k=np.full((b,), sp.top_k, np.int32),
            top_p=np.full((b,), sp.top_p, np.float32),
            seed=np.full((b,), sp.seed, np.uint32),
            request_id=col([self.request_ids[i] for i, _ in rows], np.int32, 0),
            sample_id=col([j for _, j in rows], np.int32, 0),
            stop_ids=np.broadcast_to(self.stop_row, (b, e.max_stop_tokens)).copy(),
        )
        args = (e.step_params(), self._put(ids), self._put(lens), jax.tree.map(self._put, init))
        exe = e.pool.get(StepKey("prefill", b, p_bucket, "plain", (bp,)), *args)
        t0 = time.perf_counter()
        state, info = exe(*args)
        info = np.asarray(jax.device_get(info))
        self.prefills.append(
            dict(batch=b, prompts=bp, length=p_bucket, seconds=time.perf_counter() - t0, tokens=int(info[1].sum()))
        )
        self._keep_tokens(info, 2, np.zeros((b,), np.int64), slots)
        plen_row = np.array([len(self.prompts[i]) for i in prompt_of], np.int64)
        maxnew_row = np.array(init.max_new, np.int64)
        k = e.chunk_size
        wave_t0, spec_on = time.perf_counter(), False
        while True:
            done, ngen = info[0].astype(bool), info[1].astype(np.int64)
            real = slots >= 0
            live = ~done & real
            n_live = int(live.sum())
            if self.on_chunk is not None:
                self.on_chunk(n_live)
            if n_live == 0:
                break
            if e.compaction and bk.pick(e.batch_buckets, n_live) < b:
                nb = bk.pick(e.batch_buckets, n_live)
                keep = np.nonzero(live)[0]
                self._harvest(state, done & real, slots, ngen)
                idx = np.full((nb,), keep[0], np.int32)
                idx[:n_live] = keep
                ok = np.arange(nb) < n_live
                cargs = (state, self._put(idx, True), self._put(ok, True))
                cexe = e.pool.get(StepKey("compact", nb, 0, "plain", (b,)), *cargs)
                t0 = time.perf_counter()
                state, _ = cexe(*cargs)
                self.compactions.append(dict(src=b, dst=nb, seconds=time.perf_counter() - t0))
                slots = np.where(ok, slots[idx], -1)
                plen_row, maxnew_row, ngen = plen_row[idx], maxnew_row[idx], ngen[idx]
                done = np.where(ok, done[idx], True)
                b = nb
                live = ~done
            committed = plen_row + ngen - 1
            arm = e.arm_for(n_live, b)
            if arm != "plain" and not spec_on:
                spec_on = True
                self.switches.append(dict(active=n_live, batch=b, after_seconds=time.perf_counter() - wave_t0))
            # Cache positions a call reads: the committed length at its last (decode or verify) step.
            ahead = k - 1 if arm == "plain" else (self._spec_steps() - 1) * (e.spec.depth + 1)
            need = int(np.max(np.minimum(committed + ahead, plen_row + maxnew_row - 1)[live]))
            length = bk.pick(e.length_buckets, max(need, 1))
            t0 = time.perf_counter()
            if arm == "plain":
                key, args = StepKey("decode", b, length, arm), (e.step_params(), state)
            elif e.ngram is not None:
                tree = self._ngram_trees(live, slots)
                key, args = StepKey("verify", b, length, arm), (e.step_params(), state, *map(self._put, tree))
            else:
                key, args = StepKey("verify", b, length, arm), (e.step_params(), state)
            host_s = time.perf_counter() - t0
            exe = e.pool.get(key, *args)
            t0 = time.perf_counter()
            state, info = exe(*args)
            info = np.asarray(jax.device_get(info))
            dt = time.perf_counter() - t0 + host_s
            emitted = info[1].astype(np.int64) - ngen
            chunk = dict(batch=b, active=n_live, length=length, arm=arm, seconds=dt, tokens=int(emitted.sum()))
            if arm == "plain":
                self.steps += int(emitted.max(initial=0))
                self._keep_tokens(info, 2, ngen, slots)
            else:
                self.steps += int(info[2].max(initial=0))
                chunk.update(
                    verify_steps=int(info[2].max(initial=0)),
                    row_verifies=int(info[2].sum()),
                    accepted=int(info[3].sum()),
                    host_seconds=host_s,
                )
                self._keep_tokens(info, 4, ngen, slots)
            self.chunks.append(chunk)
        done, ngen = info[0].astype(bool), info[1].astype(np.int64)
        self._harvest(state, slots >= 0, slots, ngen)

    def _spec_steps(self) -> int:
        return 1 if self.e.ngram is not None else self.e.spec.steps_per_call

    def _keep_tokens(self, info: np.ndarray, row0: int, ngen_before: np.ndarray, slots: np.ndarray) -> None:
        """n-gram drafting: append each row's newly emitted tokens (info rows row0..) to its sample's history."""
        if self.gen is None:
            return
        new = info[1].astype(np.int64) - ngen_before
        for r in np.nonzero((new > 0) & (slots >= 0))[0]:
            self.gen[slots[r]].extend(info[row0 : row0 + new[r], r].tolist())

    def _ngram_trees(self, live: np.ndarray, slots: np.ndarray):
        """Host n-gram trees for the batch: sources are each row's prompt + output and its GRPO group's other
        samples (rows in the batch, and samples already finished or compacted away)."""
        n = self.params.n
        contexts, groups = [], []
        for r, slot in enumerate(slots):
            if slot < 0:
                contexts.append(np.zeros((1,), np.int64))
                groups.append(-1 - r)
            else:
                contexts.append(np.asarray(self.prompts[slot // n] + self.gen[slot], np.int64))
                groups.append(int(slot // n))
        in_batch = set(slots[slots >= 0].tolist())
        for i in sorted({int(slots[r] // n) for r in np.nonzero(live)[0]}):
            for slot in range(i * n, (i + 1) * n):
                if slot not in in_batch and self.gen[slot]:
                    contexts.append(np.asarray(self.prompts[i] + self.gen[slot], np.int64))
                    groups.append(i)
        return propose_ngram(self.e.ngram, self.e.spec, contexts, groups, live, tuple(sorted(self.stops)))

    def _harvest(self, state, finished: np.ndarray, slots: np.ndarray, ngen: np.ndarray) -> None:
        """Keep (on device, copying to host in the background) the outputs of rows that finished."""
        rows = np.nonzero(finished)[0]
        if rows.size == 0:
            return
        bufs = (state.tokens, state.logprobs, state.hidden)
        for x in bufs:
            if x is not None:
                x.copy_to_host_async()
        self.harvests.append((*bufs, rows, slots[rows]))
        self.final_n[slots[rows]] = ngen[rows]

    def assemble(self, n: int) -> RolloutResult:
        e = self.e
        num = len(self.prompts)
        tokens: list[list[list[int]]] = [[[] for _ in range(n)] for _ in range(num)]
        logprobs: list[list[list[float]]] = [[[] for _ in range(n)] for _ in range(num)]
        reasons: list[list[str]] = [["length"] * n for _ in range(num)]
        cap = e.capture
        hidden = [[None] * n for _ in range(num)] if cap else None
        hidden_start = [[0] * n for _ in range(num)] if cap else None
        kept_bytes, dropped = 0, 0
        for tok_ref, lp_ref, hid_ref, rows, slots in self.harvests:
            tok, lp = to_host(tok_ref), to_host(lp_ref)  # gathered when the batch spans processes
            hid = None if hid_ref is None else to_host(hid_ref)
            for row, slot in zip(rows, slots, strict=True):
                i, j = divmod(int(slot), n)
                m = int(self.final_n[slot])
                t = tok[row, :m].tolist()
                tokens[i][j] = t
                logprobs[i][j] = lp[row, :m].tolist()
                reasons[i][j] = "stop" if t and t[-1] in self.stops else "length"
                if hid is not None:
                    w = min(cap.window, m)
                    nbytes = w * hid.shape[-1] * 4
                    if kept_bytes + nbytes > cap.max_bytes:
                        dropped += 1
                        continue
                    kept_bytes += nbytes
                    start = m - w if cap.side == "last" else 0
                    sl = np.arange(start, start + w) % cap.window
                    hidden[i][j] = np.array(hid[row, sl], np.float32)
                    hidden_start[i][j] = start
        stats = self._stats()
        stats["total_tokens"] = int(self.final_n.sum())
        if cap:
            stats["hidden_bytes"] = kept_bytes
            stats["hidden_dropped"] = dropped
        return RolloutResult(tokens, logprobs, reasons, stats, hidden, hidden_start)

    def _stats(self) -> dict[str, Any]:
        e = self.e
        decode_s = sum(c["seconds"] for c in self.chunks)
        tail_s = sum(c["seconds"] for c in self.chunks if c["active"] <= e.tail_threshold)
        by_batch: dict[int, dict[str, float]] = {}
        for c in self.chunks:
            d = by_batch.setdefault(c["batch"], dict(seconds=0.0, tokens=0, chunks=0))
            d["seconds"] += c["seconds"]
            d["tokens"] += c["tokens"]
            d["chunks"] += 1
        for d in by_batch.values():
            d["tokens_per_s"] = d["tokens"] / d["seconds"] if d["seconds"] > 0 else 0.0
        spec = [c for c in self.chunks if c["arm"] != "plain"]
        on_s = sum(c["seconds"] for c in spec)
        row_verifies = sum(c["row_verifies"] for c in spec)
        spec_tokens = sum(c["tokens"] for c in spec)
        prefill_s = sum(p["seconds"] for p in self.prefills)
        total = int(self.final_n.sum())
        return dict(
            steps=self.steps,
            tokens_per_s=total / (prefill_s + decode_s) if prefill_s + decode_s > 0 else 0.0,
            arms=dict(collections.Counter(c["arm"] for c in self.chunks)),
            sd_on_seconds=on_s,
            sd_off_seconds=decode_s - on_s,
            verify_steps=sum(c["verify_steps"] for c in spec),
            mean_accept_length=spec_tokens / row_verifies if row_verifies else 0.0,
            spec=dict(
                arm=e.spec_arm,
                drafter=e.drafter_kind,
                threshold=e.spec.threshold if e.spec else None,
                switches=self.switches,
                row_verifies=row_verifies,
                accepted_drafts=sum(c["accepted"] for c in spec),
                mean_accepted_drafts=sum(c["accepted"] for c in spec) / row_verifies if row_verifies else 0.0,
                tokens=spec_tokens,
                host_seconds=sum(c["host_seconds"] for c in spec),
            ),
            chunk_size=e.chunk_size,
            chunks=self.chunks,
            prefills=self.prefills,
            compactions=self.compactions,
            prefill_seconds=prefill_s,
            decode_seconds=decode_s,
            decode_tokens=sum(c["tokens"] for c in self.chunks),
            by_batch=dict(sorted(by_batch.items(), reverse=True)),
            tail_threshold=e.tail_threshold,
            tail_seconds=tail_s,
            tail_share=tail_s / decode_s if decode_s > 0 else 0.0,
        )
