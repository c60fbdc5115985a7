"""Sliced rollout: the device mesh split into R disjoint engines (whole tensor-parallel groups), all decoding at once.

Each slice holds its own copy of the policy (on the slice's sub-mesh, from one reshard program) and decodes a contiguous
block of the step's prompts; a prompt's whole GRPO group stays on one slice. Every slice has one worker thread (JAX
releases the GIL while a computation runs, so slices really overlap); the controller also runs drafter steps for a
slice on that slice's thread, so a slice never does two things at once. Request ids default to the prompts' global
indices, so the counter-based sampling keys, hence the tokens, do not depend on R. Across processes each process
runs its own slices (``SlicedRollout``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tlt_jax.adaptive.quiet import Activity
from tlt_jax.distributed import LogicalRules, engine_meshes
from tlt_jax.distributed.multihost import allgather_objects
from tlt_jax.rollout import RolloutEngine, RolloutResult, SamplingParams
from tlt_jax.rollout.reshard import Resharder

# Stats summed over slices when results are merged (the rest stay per slice in stats["slices"]).
_SUMMED = ("total_tokens", "hidden_bytes", "hidden_dropped", "tail_seconds", "sd_on_seconds", "sd_off_seconds",
           "verify_steps", "decode_seconds", "prefill_seconds", "compile_seconds_this_call",
           "background_compile_seconds_this_call", "steps")

_SLICE_SEED_STRIDE = 1_000_003  # bandit seed offset between slices (a prime: slices of nearby train.seeds differ)


def assign_prompts(num_prompts: int, num_slices: int) -> list[list[int]]:
    """Deterministic split of prompt indices into ``num_slices`` contiguous blocks whose sizes differ by at most one
    (earlier slices get the extra prompt). A slice may get no prompt when there are fewer prompts than slices."""
    if num_slices < 1:
        raise ValueError(f"num_slices must be >= 1, got {num_slices}")
    q, r = divmod(int(num_prompts), num_slices)
    out, start = [], 0
    for s in range(num_slices):
        size = q + (s < r)
        out.append(list(range(start, start + size)))
        start += size
    return out


def slice_spec(spec, s: int):
    """Slice ``s``'s SpecConfig: an adaptive spec's bandit seed offset by the slice index (slice 0 keeps ``spec.seed``,
    so one slice is the single engine), so slices' bandits explore with different draws; a function of the config
    alone (not of the process), so every process builds the same bandits. Other specs (or None) are unchanged."""
    if spec is None or not spec.adaptive or s == 0:
        return spec
    return dataclasses.replace(spec, seed=spec.seed + _SLICE_SEED_STRIDE * s)


@dataclasses.dataclass
class SliceJob:
    """One slice's share of a generate call: the prompts' global indices and the arguments its engine gets."""

    slice: int
    indices: list[int]
    prompts: list[list[int]]
    params: SamplingParams
    request_ids: list[int]


class SlicedRollout:
    """R rollout engines on disjoint groups of ``mesh``'s devices (``engine_meshes``: whole tensor-parallel groups
    each; R = -1 gives one engine per group, a pod's layout).

    ``engine_kwargs`` go to every RolloutEngine (max_batch, max_len, capture, drafter, spec, ...); a HiddenCapture's
    max_bytes applies per slice. An adaptive spec's bandit seed is made per slice (``slice_spec``). The policy reaches
    the engines through one compiled program per RL step (``Resharder``): its output is laid out so that every
    device holds its own engine's shard, from which each engine's arrays are assembled without a copy.

    Across processes (R > 1 in a multi-process job) every slice must lie on one process's devices: each process
    builds and runs only its own slices' engines (``engines``: slice -> engine), and the finished slices' results are
    exchanged (``exchange``), so every process returns the same merged result. With R = 1 the one engine spans every
    process, as a single engine does.
    """

    def __init__(self, model, mesh: Mesh, num_slices: int, **engine_kwargs: Any):
        self.meshes = engine_meshes(mesh, num_slices) if num_slices != 1 else [mesh]
        num_slices = len(self.meshes)
        self.owners = [mesh_process(m) for m in self.meshes]
        self.across_processes = num_slices > 1 and jax.process_count() > 1
        if self.across_processes and None in self.owners:
            s = self.owners.index(None)
            raise ValueError(
                f"slice {s} of {num_slices} spans devices of several processes; with {jax.process_count()} processes "
                "each engine must lie on one process's devices (a tensor-parallel group inside a node), or use 1"
            )
        layout = {k: engine_kwargs[k] for k in ("dtype", "attention_impl", "layers") if engine_kwargs.get(k)}
        self.resharder = Resharder(self.meshes, layout, engine_kwargs.get("rules", LogicalRules()))
        self.local_slices = self.resharder.local
        copies = self.resharder(model)
        spec = engine_kwargs.pop("spec", None)
        self.engines = {s: RolloutEngine(copies.pop(s), self.meshes[s], spec=slice_spec(spec, s), **engine_kwargs)
                        for s in self.local_slices}
        self.workers = {s: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"slice{s}")
                        for s in self.local_slices}
        # Bandit hygiene: each slice's compiles (and the drafter steps, ``SpotTrainer(activity=...)``) are registered
        # here, so a chunk timed while another slice of this process compiled or trained stays out of the medians.
        self.activity = Activity()
        for e in self.engines.values():
            e.pool.activity = self.activity

    @property
    def num_slices(self) -> int:
        return len(self.meshes)

    def policy(self, s: int):
        """The policy as a module on slice ``s``'s mesh (shares the engine's arrays: no copy); a slice of this
        process."""
        e = self.engines[s]
        return nnx.merge(e.graphdef, e.params)

    def set_params(self, model) -> None:
        """Publish new policy weights to every slice of this process (one compiled program over every slice's
        devices: a collective across processes); the previous copies are dropped first."""
        for e in self.engines.values():
            e.params = None
        copies = self.resharder(model)
        for s, e in self.engines.items():
            e.set_rollout_copy(copies[s])

    def set_drafter(self, drafter) -> None:
        """Publish new EAGLE drafter weights (host arrays) to every slice of this process (between generate calls)."""
        for e in self.engines.values():
            e.set_drafter(drafter)

    def jobs(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
             request_ids: Sequence[int] | None = None) -> list[SliceJob]:
        """Split a call into per-slice jobs (slices with no prompt are left out), every process's included."""
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        n = len(prompts)
        if request_ids is None:
            request_ids = list(range(n))
        elif len(request_ids) != n:
            raise ValueError(f"request_ids has {len(request_ids)} ids for {n} prompts")
        max_new = params.max_new_for(n)
        per_prompt = not isinstance(params.max_new_tokens, int | np.integer)
        out = []
        for s, idx in enumerate(assign_prompts(n, self.num_slices)):
            if not idx:
                continue
            p = dataclasses.replace(params, max_new_tokens=[max_new[i] for i in idx]) if per_prompt else params
            out.append(SliceJob(s, idx, [list(prompts[i]) for i in idx], p, [int(request_ids[i]) for i in idx]))
        return out

    def run_job(self, job: SliceJob, on_chunk=None) -> RolloutResult:
        """Run one job on its slice's engine (called on the slice's worker thread)."""
        return self.engines[job.slice].generate(job.prompts, job.params, request_ids=job.request_ids,
                                                on_chunk=on_chunk)

    def submit(self, job: SliceJob, on_chunk=None) -> concurrent.futures.Future:
        return self.workers[job.slice].submit(self.run_job, job, on_chunk)

    def hold_compiles(self) -> list:
        """Hold back the deferred compiles (``compile_between_calls``) of this process's slices until ``release``:
        a slice that finishes early must not compile while the others still decode (and time their chunks)."""
        pools = [e.pool for e in self.engines.values() if e.compile_between_calls and not e.pool.held]
        for pool in pools:
            pool.hold()
        return pools

    @staticmethod
    def release(pools: list) -> None:
        for pool in pools:
            pool.release()

    def exchange(self, results: dict[int, RolloutResult], extra: Any = None) -> tuple[dict[int, RolloutResult], list]:
        """This process's slices' results joined with every other process's (a collective across processes; the
        others' come without hidden states, which stay with the process that captured them), and every process's
        JSON-able ``extra`` in process order (``[extra]`` in one process)."""
        if not self.across_processes:
            return dict(results), [extra]
        sent = {str(s): dict(tokens=r.tokens, logprobs=r.logprobs, finish_reason=r.finish_reason, stats=r.stats)
                for s, r in results.items()}
        out = dict(results)
        parts = allgather_objects(dict(results=sent, extra=extra))
        for part in parts:
            for s, r in part["results"].items():
                if int(s) not in out:
                    out[int(s)] = RolloutResult(r["tokens"], r["logprobs"], r["finish_reason"], _int_keys(r["stats"]))
        return out, [p["extra"] for p in parts]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 request_ids: Sequence[int] | None = None,
                 on_chunk: Callable[[int, int], None] | None = None) -> RolloutResult:
        """Decode every slice's share at the same time; the result is in the original prompt order. on_chunk:
        as RolloutEngine.generate, with (finished, active) samples summed over this process's slices."""
        jobs = self.jobs(prompts, params, request_ids)
        mine = [j for j in jobs if j.slice in self.engines]
        hooks = progress_hooks(mine, on_chunk)
        held = self.hold_compiles()
        try:
            futures = {j.slice: self.submit(j, h) for j, h in zip(mine, hooks, strict=True)}
            concurrent.futures.wait(futures.values())
        finally:
            self.release(held)
        results, _ = self.exchange({s: f.result() for s, f in futures.items()})
        return merge_results(len(prompts), jobs, [results[j.slice] for j in jobs])

    def close(self) -> None:
        for w in self.workers.values():
            w.shutdown(wait=True)
        for e in self.engines.values():
            e.close()


def mesh_process(mesh: Mesh) -> int | None:
    """The process whose devices make up ``mesh``, or None when they belong to several."""
    procs = {d.process_index for d in mesh.devices.flat}
    return procs.pop() if len(procs) == 1 else None


def _int_keys(stats: dict) -> dict:
    """Rollout stats after a JSON round trip: the per-bucket arm steps keyed by batch size again."""
    if "arm_steps" in stats:
        stats = dict(stats, arm_steps={int(b): per for b, per in stats["arm_steps"].items()})
    return stats


def progress_hooks(jobs: Sequence[SliceJob], on_chunk: Callable[[int, int], None] | None) -> list:
    """Per-slice on_chunk callbacks that report (finished, active) summed over all slices, one call at a time
    (they run on the slices' threads)."""
    if on_chunk is None:
        return [None] * len(jobs)
    lock = threading.Lock()
    state = {j.slice: (0, len(j.indices) * j.params.n) for j in jobs}

    def hook(s, finished, active):
        with lock:
            state[s] = (finished, active)
            on_chunk(sum(f for f, _ in state.values()), sum(a for _, a in state.values()))

    return [lambda f, a, s=j.slice: hook(s, f, a) for j in jobs]


def merge_results(num_prompts: int, jobs: Sequence[SliceJob], results: Sequence[RolloutResult]) -> RolloutResult:
    """Per-slice results back into one RolloutResult in the original prompt order. stats: the sums in ``_SUMMED``,
    ``mean_accept_length`` over all verify rows, ``wall_seconds`` = the slowest slice, per-slice stats in "slices"."""
    tokens: list = [None] * num_prompts
    logprobs: list = [None] * num_prompts
    reasons: list = [None] * num_prompts
    with_hidden = all(r.hidden is not None for r in results)
    hidden: list | None = [None] * num_prompts if with_hidden else None
    hidden_start: list | None = [None] * num_prompts if with_hidden else None
    for job, res in zip(jobs, results, strict=True):
        for k, i in enumerate(job.indices):
            tokens[i], logprobs[i], reasons[i] = res.tokens[k], res.logprobs[k], res.finish_reason[k]
            if with_hidden:
                hidden[i], hidden_start[i] = res.hidden[k], res.hidden_start[k]
    if any(t is None for t in tokens):
        raise ValueError("merge_results: the jobs do not cover every prompt")
    stats: dict[str, Any] = {k: sum(r.stats.get(k, 0) for r in results) for k in _SUMMED}
    rows = sum(r.stats.get("spec", {}).get("row_verifies", 0) for r in results)
    spec_tokens = sum(r.stats.get("spec", {}).get("tokens", 0) for r in results)
    stats["mean_accept_length"] = spec_tokens / rows if rows else 0.0
    stats["wall_seconds"] = max(r.stats.get("wall_seconds", 0.0) for r in results)
    stats["tail_share"] = stats["tail_seconds"] / stats["decode_seconds"] if stats["decode_seconds"] > 0 else 0.0
    stats["slices"] = [dict(r.stats, slice=j.slice, prompts=len(j.indices)) for j, r in zip(jobs, results,
                                                                                           strict=True)]
    if any(r.stats.get("bandit") is not None for r in results):  # adaptive: arm steps and speeds over all slices
        stats["bandit"] = [r.stats["bandit"] for r in results]
        arm_steps: dict[int, dict[str, int]] = {}
        per_arm: dict[str, list[float]] = {}
        for r in results:
            for bucket, per in r.stats["arm_steps"].items():
                d = arm_steps.setdefault(bucket, {})
                for arm, n in per.items():
                    d[arm] = d.get(arm, 0) + n
            for c in r.stats["chunks"]:
                t = per_arm.setdefault(c["choice"], [0, 0.0])
                t[0] += c["tokens"]
                t[1] += c["seconds"]
        stats["arm_steps"] = dict(sorted(arm_steps.items()))
        stats["arm_tokens_per_s"] = {a: t / s for a, (t, s) in sorted(per_arm.items()) if s > 0}
    return RolloutResult(tokens, logprobs, reasons, stats, hidden, hidden_start)
