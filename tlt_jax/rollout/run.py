"""Host side of one ``RolloutEngine.generate`` call: waves of rows, the chunk loop (one device-to-host read of a
``StepInfo`` per round trip), compaction, n-gram trees, harvests, and the assembled result with its stats.

Per wave: prefill+fork (B rows) → [decode or verify chunk → read info → drop finished rows / compact]* → harvest.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np

from tlt_jax.adaptive import Arm, Bandit, SpecGate, agreed_all, agreed_seconds
from tlt_jax.distributed.multihost import to_host
from tlt_jax.rollout import buckets as bk
from tlt_jax.rollout.drafter_sync import forget
from tlt_jax.rollout.params import RolloutResult, SamplingParams
from tlt_jax.rollout.plan import step_key
from tlt_jax.rollout.pool import StepKey, StepPool
from tlt_jax.rollout.spec_steps import SpecConfig, propose_ngram
from tlt_jax.rollout.state import RowInit, StepInfo
from tlt_jax.rollout.steps import StepContext
from tlt_jax.speculative import NgramDrafter
from tlt_jax.speculative.history import NgramHistory

OFF = Arm("off")


class _Wave:
    """One wave's loop state, carried from round trip to round trip (``GenerateRun.wave``): the decode state, the last
    step's info, each row's sample index (or -1), prompt length and budget, and the drafting flags."""

    def __init__(self, state, info: StepInfo, slots: np.ndarray, plen_row: np.ndarray, maxnew_row: np.ndarray,
                 t0: float, gate: SpecGate | None):
        self.state, self.info, self.slots, self.plen_row, self.maxnew_row = state, info, slots, plen_row, maxnew_row
        self.t0, self.gate, self.spec_on = t0, gate, False  # t0: the prefill's end; gate: per wave, hysteresis
        self.drafter_current = False  # an EAGLE verify ran last: no prefill/plain/n-gram pairs left to catch up over
        self.drafted_with = None  # the drafter weights that built the drafter cache (the last EAGLE verify's)


class EngineParts(Protocol):
    """What a run reads from its engine (``RolloutEngine`` provides it): the engine owns the compiled steps and the
    bandit across calls, a run only drives them for one call."""

    ctx: StepContext
    pool: StepPool
    bandit: Bandit | None
    arm_specs: dict[Arm, SpecConfig]
    ngram: NgramDrafter | None
    ngram_history: NgramHistory | None
    chunk_size: int
    length_buckets: tuple[int, ...]
    max_stop_tokens: int


class GenerateRun:
    """Host-side bookkeeping of one generate call (slots, harvests, stats)."""

    def __init__(self, engine: EngineParts, prompts, max_new, request_ids, params: SamplingParams, stops):
        self.e = engine
        self.prompts, self.max_new, self.request_ids, self.params = prompts, max_new, request_ids, params
        stop_row = np.full((engine.max_stop_tokens,), -1, np.int32)
        stop_row[: len(stops)] = stops
        self.stop_row, self.stops = stop_row, set(stops)
        n_total = len(prompts) * params.n
        self.final_n = np.zeros((n_total,), np.int64)
        self.harvests: list[tuple[Any, Any, Any, np.ndarray, np.ndarray]] = []
        self.prompt_hidden: dict[int, tuple[Any, int]] = {}  # HiddenCapture.prompt: prompt -> (prefill output, row)
        self.chunks: list[dict] = []
        self.prefills: list[dict] = []
        self.compactions: list[dict] = []
        self.switches: list[dict] = []
        self.steps = 0
        self._rounds_arg: dict[int, Any] = {}  # EAGLE verify rounds -> its device scalar
        self.on_chunk: Callable[[int], None] | None = None
        # n-gram drafting: every sample's generated tokens so far, kept from the info of each call (no extra read).
        self.gen: list[list[int]] | None = [[] for _ in range(n_total)] if engine.ngram is not None else None
        self.past: dict[int, list[np.ndarray]] = {}  # prompt -> its earlier calls' responses (``ngram_history``)

    def _put(self, x: np.ndarray, replicated: bool = False):
        sh = self.e.ctx.replicated() if replicated else self.e.ctx.batch_sharding(x.shape)
        return jax.device_put(x, sh)

    def prefill(self, rows: list[tuple[int, int]]):
        """Prompt once / fork n for the wave's (prompt, sample) rows: returns (DecodeState, StepInfo, slots [B] with
        each row's sample index or -1, prompt length [B] and budget [B] of each row)."""
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
        state, packed, *prompt_hidden = exe(*args)
        info = StepInfo.unpack(jax.device_get(packed), speculative=False)
        seconds, tokens = time.perf_counter() - t0, int(info.num_generated.sum())
        if prompt_hidden:  # [Bp, C, H]: copied in the background, read when the samples are assembled
            prompt_hidden[0].copy_to_host_async()
            self.prompt_hidden.update({i: (prompt_hidden[0], k) for k, i in enumerate(order)})
        self.prefills.append(dict(batch=b, prompts=bp, length=p_bucket, seconds=seconds, tokens=tokens))
        self._keep_tokens(info, np.zeros((b,), np.int64), slots)
        plen_row = np.array([len(self.prompts[i]) for i in prompt_of], np.int64)
        return state, info, slots, plen_row, np.array(init.max_new, np.int64)

    def wave(self, rows: list[tuple[int, int]]) -> None:
        """Decode the wave's rows (prefill, then one round trip per chunk until none is live) and harvest them."""
        e = self.e
        w = _Wave(*self.prefill(rows), t0=time.perf_counter(),
                  gate=SpecGate(e.spec.threshold, e.spec.patience) if e.spec else None)
        while True:
            done, ngen = w.info.done, w.info.num_generated
            live = ~done & (w.slots >= 0)
            n_live = int(live.sum())
            if self.on_chunk is not None:
                self.on_chunk(n_live)
            if n_live == 0:
                break
            if e.compaction and bk.pick(e.batch_buckets, n_live) < len(w.slots):
                ngen, live = self._compact(w, live, done, ngen, n_live)
            self._round_trip(w, live, ngen, n_live)
        self._harvest(w.state, w.slots >= 0, w.slots, w.info.num_generated)

    def _compact(self, w: _Wave, live: np.ndarray, done: np.ndarray, ngen: np.ndarray, n_live: int):
        """Harvest the finished rows and move the live ones into the smallest batch bucket that holds them; returns
        the new rows' (ngen, live)."""
        e, b, nb = self.e, len(w.slots), bk.pick(self.e.batch_buckets, n_live)
        keep = np.nonzero(live)[0]
        self._harvest(w.state, done & (w.slots >= 0), w.slots, ngen)
        idx = np.full((nb,), keep[0], np.int32)
        idx[:n_live] = keep
        ok = np.arange(nb) < n_live
        cargs = (w.state, self._put(idx, True), self._put(ok, True))
        cexe = e.pool.get(StepKey("compact", nb, 0, "plain", (b,)), *cargs)
        t0 = time.perf_counter()
        w.state, _ = cexe(*cargs)
        self.compactions.append(dict(src=b, dst=nb, seconds=time.perf_counter() - t0))
        w.slots = np.where(ok, w.slots[idx], -1)
        w.plen_row, w.maxnew_row = w.plen_row[idx], w.maxnew_row[idx]
        return ngen[idx], ~np.where(ok, done[idx], True)

    def _round_trip(self, w: _Wave, live: np.ndarray, ngen: np.ndarray, n_live: int) -> None:
        """One chunk: choose its arm, run its decode or verify step, read its info, record it, feed the bandit."""
        e, b = self.e, len(w.slots)
        cache_length = functools.partial(self._cache_length, w.plen_row + ngen - 1, w.plen_row + w.maxnew_row - 1, live)
        speculate = w.gate is not None and w.gate.update(n_live)
        arm = wanted = e.choose_arm(speculate, b)
        length, quiet = cache_length(arm), True
        if speculate and e.background_compile:
            ready, quiet = self._background_ready(arm, b, length)
            if not ready:
                arm, length = OFF, cache_length(OFF)
        if arm.speculative and not w.spec_on:
            w.spec_on = True
            self.switches.append(dict(active=n_live, batch=b, after_seconds=time.perf_counter() - w.t0))
        key, args, host_s, swapped = self._step_args(w, arm, b, length, live)
        compiled_s = e.pool.compile_seconds
        exe = e.pool.get(key, *args)
        compiled_s = e.pool.compile_seconds - compiled_s  # compiled (or waited for) in place
        catchup_s = 0.0
        if arm.kind == "eagle" and e.bandit is not None and not w.drafter_current:
            # The drafter's catch-up over the pairs other arms recorded is a cost of switching, not of the arm:
            # run it alone (0 rounds) and keep it out of the bandit's reward (it stays in the chunk's seconds).
            t0 = time.perf_counter()
            w.state = jax.block_until_ready(exe(args[0], w.state, self._rounds(0))[0])
            catchup_s = time.perf_counter() - t0
            args = (args[0], w.state, args[2])
        first = e.pool.first_run(key)
        act = e.pool.activity  # a sliced rollout's: the other slices' drafter steps and compiles in this process
        mark = None if act is None else act.mark(own=e.pool)
        t0 = time.perf_counter()
        w.state, packed = exe(*args)
        w.info = info = StepInfo.unpack(jax.device_get(packed), speculative=arm.speculative)
        dt = time.perf_counter() - t0 + host_s
        disturbed = act is not None and not e.spans_processes and not act.quiet_since(mark, own=e.pool)
        quiet = quiet and not disturbed
        w.drafter_current = arm.kind == "eagle"
        emitted = info.num_generated - ngen
        tokens = int(emitted.sum())
        chunk = dict(
            batch=b, active=n_live, length=length, arm=key.arm, choice=str(arm), seconds=dt + catchup_s,
            tokens=tokens, first_run=first, lag_tokens=_lag_tokens(emitted, live, info.done, w.maxnew_row - ngen),
        )
        if compiled_s > 0:
            chunk["compile_seconds"] = compiled_s  # not in its seconds
        if wanted != arm:
            chunk["waited_for"] = str(wanted)  # the bandit's choice, compiling in the background
        if not quiet:
            chunk["compile_overlap" if not disturbed else "disturbed"] = True  # not a measure of its arm
        if arm.kind == "eagle" and swapped:
            chunk["drafter_swapped"] = True  # it rebuilt the drafter cache with the new weights first
        if not arm.speculative:
            chunk["steps"] = int(emitted.max(initial=0))
        else:
            chunk["steps"] = int(info.verifies.max(initial=0))
            chunk.update(verify_steps=chunk["steps"], row_verifies=int(info.verifies.sum()),
                         accepted=int(info.accepted.sum()), host_seconds=host_s, catchup_seconds=catchup_s)
        self.steps += chunk["steps"]
        if e.bandit is not None and (speculate or (not first and quiet)):
            self._feed_bandit(arm, b, chunk, dt, compiled_s, speculate, first, quiet)
        self._keep_tokens(info, ngen, w.slots)
        self.chunks.append(chunk)

    def _background_ready(self, arm: Arm, b: int, length: int) -> tuple[bool, bool]:
        """(ready, quiet): a speculative step not compiled yet compiles on the pool's worker thread; plain decoding (the
        tokens are the same) runs meanwhile. Every process takes the same arm (``agreed_all``)."""
        e = self.e
        e.pool.collect()
        key = step_key(arm, b, length)
        if not arm.speculative:
            ready = True
        elif key in e.pool or (e.bandit is None or e.bandit.may_spend()) and not self._one_at_a_time():
            ready = e.pool.prepare(key, functools.partial(e.abstract_args, arm, b, length))
        else:  # the loss budget is spent (or a compile runs already): plain decoding, no compile
            ready = False
        return agreed_all(ready, not e.pool.compiling, across=e.spans_processes)

    def _step_args(self, w: _Wave, arm: Arm, b: int, length: int, live: np.ndarray):
        """(key, args, host seconds spent on them, whether the drafter was swapped) of the chunk's step."""
        t0 = time.perf_counter()
        key, args, swapped = step_key(arm, b, length), (self.e.step_params(), w.state), False
        if arm.kind == "ngram":
            args = (*args, *map(self._put, self._ngram_trees(arm, live, w.slots)))
        elif arm.kind == "eagle":
            swapped = w.drafted_with is not None and args[0][1] is not w.drafted_with
            if swapped:  # a hot swap (set_drafter during the call): the new weights rebuild the drafter cache
                w.state, w.drafter_current = w.state.replace(aux=forget(w.state.aux)), False
                args = (args[0], w.state)
            w.drafted_with = args[0][1]
            args = (*args, self._rounds(self._spec_steps(arm)))
        return key, args, time.perf_counter() - t0, swapped

    def _feed_bandit(self, arm: Arm, b: int, chunk: dict, dt: float, compiled_s: float, speculate: bool, first: bool,
                     quiet: bool) -> None:
        """A step's first run is not a measure of it (``first_run``), nor is a round trip that shared the machine
        with a background compile. Every process feeds the same numbers: tokens are replicated, seconds agreed.
        Every round trip the bandit decided goes into its loss ledger (``Bandit.charge``), observed or not,
        with a speculative step's compile in place (plain decoding compiles its own steps too)."""
        e, tokens = self.e, chunk["tokens"]
        rows = chunk.get("row_verifies", tokens) / max(chunk["steps"], 1)  # live rows per step (plain: 1 token)
        seen, all_s = agreed_seconds(dt, chunk["seconds"] + (compiled_s if arm.speculative else 0.0),
                                     across=e.spans_processes)
        if not first and quiet:
            e.bandit.observe(arm, b, tokens, seen, chunk["steps"], rows=rows, lag=chunk["lag_tokens"])
        if speculate:  # plain decoding without a compile beside it costs what it would cost anyway
            plain = not arm.speculative and quiet
            e.bandit.charge(arm, b, tokens, all_s, rows=rows, lag=chunk["lag_tokens"], as_plain=plain)

    def _one_at_a_time(self) -> bool:
        """With a loss budget (``max_loss``) one background compile at a time, a deferred one included, so compiles
        come one by one as the budget allows."""
        return self.e.bandit is not None and self.e.bandit.config.max_loss is not None and self.e.pool.outstanding

    def _cache_length(self, committed: np.ndarray, last: np.ndarray, live: np.ndarray, arm: Arm) -> int:
        """The cache-length bucket of ``arm``'s next call: the positions it reads, i.e. each live row's committed
        length at the call's last decode or verify step (at most the row's last position)."""
        ahead = (self._spec_steps(arm) - 1) * (arm.depth + 1) if arm.speculative else self.e.chunk_size - 1
        need = int(np.max(np.minimum(committed + ahead, last)[live]))
        return bk.pick(self.e.length_buckets, max(need, 1))

    def _rounds(self, n: int):
        """The EAGLE verify step's rounds argument (replicated int32 scalar), made once per value."""
        if n not in self._rounds_arg:
            self._rounds_arg[n] = self._put(np.int32(n), True)
        return self._rounds_arg[n]

    def _spec_steps(self, arm: Arm) -> int:
        return 1 if arm.kind == "ngram" else self.e.arm_specs[arm].steps_per_call

    def _keep_tokens(self, info: StepInfo, ngen_before: np.ndarray, slots: np.ndarray) -> None:
        """n-gram drafting: append each row's newly emitted tokens (``info.tokens``) to its sample's history."""
        if self.gen is None:
            return
        new = info.num_generated - ngen_before
        for r in np.nonzero((new > 0) & (slots >= 0))[0]:
            self.gen[slots[r]].extend(info.tokens[: new[r], r].tolist())

    def _ngram_trees(self, arm: Arm, live: np.ndarray, slots: np.ndarray):
        """Host n-gram trees for the batch: sources are each row's prompt + output, its GRPO group's other
        samples (rows in the batch, and samples already finished or compacted away) and, with an ``ngram_history``,
        the prompt's responses in earlier calls (after this call's, so ties go to the current policy's samples)."""
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
        live_prompts = sorted({int(slots[r] // n) for r in np.nonzero(live)[0]})
        for i in live_prompts:
            for slot in range(i * n, (i + 1) * n):
                if slot not in in_batch and self.gen[slot]:
                    contexts.append(np.asarray(self.prompts[i] + self.gen[slot], np.int64))
                    groups.append(i)
        for i in live_prompts if self.e.ngram_history is not None else ():
            if i not in self.past:  # the store changes only when the call ends
                prompt = np.asarray(self.prompts[i], np.int64)
                self.past[i] = [np.concatenate([prompt, r]) for r in self.e.ngram_history.get(self.prompts[i])]
            contexts.extend(self.past[i])
            groups.extend([i] * len(self.past[i]))
        return propose_ngram(self.e.ngram, self.e.arm_specs[arm], contexts, groups, live, tuple(sorted(self.stops)))

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
        prompt_host: dict[int, np.ndarray] = {}  # id of a prefill output -> its host copy
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
                    start = m - w if cap.side == "last" else 0
                    # The prompt context: positions p - 1 - c .. p - 2 (position p - 1 is the window's first entry).
                    p = len(self.prompts[i])
                    c = min(cap.prompt, p - 1) if start == 0 else 0
                    nbytes = (c + w) * hid.shape[-1] * 4
                    if kept_bytes + nbytes > cap.max_bytes:
                        dropped += 1
                        continue
                    kept_bytes += nbytes
                    sl = np.arange(start, start + w) % cap.window
                    hidden[i][j] = np.array(hid[row, sl], np.float32)
                    hidden_start[i][j] = start - c
                    if c:
                        ref, k = self.prompt_hidden[i]
                        if id(ref) not in prompt_host:
                            prompt_host[id(ref)] = to_host(ref)
                        ph = prompt_host[id(ref)]  # [Bp, cap.prompt, H], ending at position p - 2
                        hidden[i][j] = np.concatenate([ph[k, cap.prompt - c :], hidden[i][j]])
        if e.ngram_history is not None:  # drafts for later calls: this call's responses to each prompt
            for prompt, group in zip(self.prompts, tokens, strict=True):
                e.ngram_history.add(prompt, group)
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
        arm_steps: dict[int, dict[str, int]] = {}
        per_arm: dict[str, list[float]] = {}
        for c in self.chunks:
            per = arm_steps.setdefault(c["batch"], {})
            per[c["choice"]] = per.get(c["choice"], 0) + c["steps"]
            t = per_arm.setdefault(c["choice"], [0, 0.0])
            t[0] += c["tokens"]
            t[1] += c["seconds"]
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
            arm_steps=dict(sorted(arm_steps.items())),
            arm_tokens_per_s={a: t / s for a, (t, s) in sorted(per_arm.items()) if s > 0},
            bandit=e.bandit.stats() if e.bandit is not None else None,
            sd_on_seconds=on_s,
            sd_off_seconds=decode_s - on_s,
            verify_steps=sum(c["verify_steps"] for c in spec),
            mean_accept_length=spec_tokens / row_verifies if row_verifies else 0.0,
            spec=dict(
                arm=e.spec_arm,
                drafter=e.drafter_kind,
                arms=[str(a) for a in e.arms],
                threshold=e.spec.threshold if e.spec else None,
                patience=e.spec.patience if e.spec else None,
                switches=self.switches,
                row_verifies=row_verifies,
                accepted_drafts=sum(c["accepted"] for c in spec),
                mean_accepted_drafts=sum(c["accepted"] for c in spec) / row_verifies if row_verifies else 0.0,
                tokens=spec_tokens,
                host_seconds=sum(c["host_seconds"] for c in spec),
                catchup_seconds=sum(c["catchup_seconds"] for c in spec),
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


def _lag_tokens(emitted: np.ndarray, live: np.ndarray, done: np.ndarray, budget_left: np.ndarray) -> float:
    """Tokens a round trip emitted for the wave's lagging row: among the rows live before and after it, those with
    the most budget left when it began (ties: their mean). With one budget per wave that row finishes last if every
    row runs to the cap, so its progress, not the mean row's, decides when the wave ends. Speculation advances rows
    unevenly; plain decoding emits the same count for every row still live. No row live after it: the mean."""
    still = live & ~done
    if not still.any():
        return float(emitted[live].mean()) if live.any() else 0.0
    behind = still & (budget_left == budget_left[still].max())
    return float(emitted[behind].mean())


def arm_share_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """Per-step metrics of an adaptive rollout: ``rollout/arm_share/ARM`` = the share of decode + verify steps that
    ran ARM (over every batch bucket), ``rollout/arm_tokens_per_s/ARM``, and ``rollout/spec_loss``: the bandits'
    ledgers so far (``Bandit.charge``), the seconds the bandit's choices cost beyond plain decoding as a fraction of
    plain's (negative: a gain). Empty when the engine is not adaptive."""
    if stats.get("bandit") is None:
        return {}
    ledgers = [b["ledger"] for b in (stats["bandit"] if isinstance(stats["bandit"], list) else [stats["bandit"]])]
    steps: dict[str, int] = collections.Counter()
    for per in stats["arm_steps"].values():
        steps.update(per)
    total = sum(steps.values())
    out = {f"rollout/arm_share/{a}": s / total for a, s in sorted(steps.items()) if total}
    out.update({f"rollout/arm_tokens_per_s/{a}": float(v) for a, v in stats["arm_tokens_per_s"].items()})
    plain = sum(led["plain_s"] for led in ledgers)
    if plain > 0:
        out["rollout/spec_loss"] = sum(led["loss_s"] for led in ledgers) / plain
    return out
