"""Spot drafter training on idle mesh slices: one compiled train step per slice, local replicas, averaged per RL step.

Within an RL step every slice that trains starts a replica from its copy of the current drafter state (params +
AdamW state, kept on the slice's devices) and steps it on its own sub-mesh, with no collective across slices; which
slices train, and for how many steps, changes nothing compiled. At the step boundary the replicas that trained are
averaged on the devices, every process's at once (``replicas.ReplicaMerger``: float leaves a mean, integer counters
the max), and every slice's copy becomes that average: the state never goes through the host between steps.
``step_metrics`` waits for the average and reads the step's figures. Keys and batches depend only on (RL step,
slice, local step), so the same dispatch decisions give the same weights.

The held-out top-1 (``evaluate``) of the drafter a rollout drafts with runs on a slice that is idle anyway, and its
value travels to every process with the step's average. The drafter/train.py names used here (DrafterLossConfig,
DrafterOptimConfig, DrafterTrainState, make_drafter_train_step) are all imported in one block.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tlt_jax.adaptive.quiet import Activity, busy
from tlt_jax.distributed import LogicalRules
from tlt_jax.drafter.eagle import EagleDrafter
from tlt_jax.drafter.export import export_eagle
from tlt_jax.drafter.replicas import ReplicaMerger
from tlt_jax.drafter.train import (
    DrafterBatch,
    DrafterLossConfig,
    DrafterOptimConfig,
    DrafterTrainState,
    batch_sharding,
    drafter_loss,
    init_drafter_train_state,
    make_drafter_optimizer,
    make_drafter_train_step,
    pack_sequences,
)

log = logging.getLogger("tlt_jax")


@jax.jit
def _checksum(params) -> jax.Array:
    """A float32 fingerprint of a parameter tree: each leaf's elements weighted by their position (mod 7) + 1."""
    leaves = [x.astype(jnp.float32).ravel() for x in jax.tree.leaves(params)]
    return sum(jnp.sum(x * (1 + jnp.arange(x.size) % 7)) for x in leaves)


LOGGED = ("drafter/loss", "drafter/top1")  # drafter-step metrics averaged over the RL step's drafter steps
HELDOUT = "drafter/heldout_top1"  # the current drafter's top-1 on this step's responses (``evaluate``)


class SpotTrainer:
    """Drafter replicas on mesh slices.

    drafter: the starting EagleDrafter (its draft vocabulary, if any, is kept and re-attached on export; the token
    loss is then taken over that vocabulary, as in the warm-up).
    meshes: one sub-mesh per slice (a list, or {slice index: mesh} for the slices of this process). policy_for(s):
    the policy on slice s's mesh (read at every step, so policy updates published to the slices are picked up; the
    policy only supplies the frozen embedding and LM head). all_meshes: every slice's mesh by slice index, other
    processes' slices included (default: ``meshes``, which must then be every slice). across_processes: the other
    slices train on other processes; ``average`` averages every process's replicas in one program spanning them.
    activity: the sliced rollout's ``Activity``, where drafter steps are registered while they run.
    """

    def __init__(self, drafter: EagleDrafter, meshes: Sequence[Mesh] | Mapping[int, Mesh],
                 policy_for: Callable[[int], Any], *, optim: DrafterOptimConfig = DrafterOptimConfig(),
                 loss: DrafterLossConfig = DrafterLossConfig(), seed: int = 0, rules: LogicalRules = LogicalRules(),
                 across_processes: bool = False, activity: Activity | None = None,
                 all_meshes: Sequence[Mesh] | None = None):
        if not meshes:
            raise ValueError("SpotTrainer needs at least one mesh slice")
        self.meshes = dict(meshes) if isinstance(meshes, Mapping) else dict(enumerate(meshes))
        self.slices = sorted(self.meshes)
        self.policy_for, self.seed, self.across_processes = policy_for, int(seed), bool(across_processes)
        self.activity = activity  # the sliced rollout's: drafter steps disturb the slices' bandit timings
        self._vocab = drafter.vocab_ids()
        if loss.vocab is None and self._vocab is not None:  # the warm-up's objective: the token loss over the
            loss = dataclasses.replace(loss, vocab=tuple(int(t) for t in np.asarray(self._vocab)))  # draft vocab
        self.loss_cfg = loss
        self.optimizer = make_drafter_optimizer(optim)
        self.graphdef, _ = init_drafter_train_state(drafter, self.optimizer)
        self._shardings, self._steps, self._batch_sh, self._multiple, self._evals = {}, {}, {}, {}, {}
        self._copies = {}  # per slice: one program copying the current state (a step's starting point)
        self._placed: dict[int, DrafterTrainState] = {}  # each slice's copy of the current state, on its devices
        for s, m in self.meshes.items():
            self._multiple[s] = int(np.prod([m.shape[a] for a in rules.lookup("batch")]))
            _, self._placed[s] = init_drafter_train_state(drafter, self.optimizer, m, rules)
            self._shardings[s] = jax.tree.map(lambda x: x.sharding, self._placed[s])
            step = make_drafter_train_step(self.graphdef, self.optimizer, loss, m, rules)
            self._steps[s] = keyed_step(step, self.seed)
            self._batch_sh[s] = batch_sharding(m, rules)
            self._evals[s] = jax.jit(lambda p, policy, b: drafter_loss(nnx.merge(self.graphdef, p), policy, b,
                                                                       self.loss_cfg)[1].top1)
            self._copies[s] = jax.jit(lambda state: jax.tree.map(jnp.copy, state))
        if all_meshes is None:
            if self.slices != list(range(len(self.slices))) or across_processes:
                raise ValueError("SpotTrainer: give all_meshes (every slice's mesh) when meshes are some slices only")
            all_meshes = [self.meshes[s] for s in self.slices]
        specs = jax.tree.map(lambda sh: sh.spec, self._shardings[self.slices[0]])
        # the LOGGED sums, the drafter steps' seconds, the held-out top-1 sum and count
        self._merger = ReplicaMerger(all_meshes, specs, len(LOGGED) + 3)
        self.batch_multiple = [self._multiple[s] for s in self.slices]  # batch-parallel devices per slice
        self._lock = threading.Lock()
        self.rl_step = 0
        self.replicas: dict[int, DrafterTrainState] = {}
        self.local_steps: dict[int, int] = {}
        self.logs: dict[int, jax.Array] = {}  # per slice, this RL step's sums of the LOGGED metrics (on device)
        self.step_seconds: dict[int, float] = {}  # per slice, this RL step's drafter steps' wall seconds
        self.heldout: dict[int, jax.Array] = {}  # this RL step's held-out top-1 per slice that evaluated (on device)
        self._pending: dict[str, Any] | None = None  # the last average's table, total step count and metrics

    @property
    def num_slices(self) -> int:
        return len(self.meshes)

    def begin_step(self, rl_step: int) -> None:
        """Start RL step ``rl_step``: no replica yet (slices that train this step start from ``current``)."""
        if self.replicas:
            raise RuntimeError("SpotTrainer.begin_step: the previous step's replicas were not merged (end_step)")
        self.rl_step = int(rl_step)
        self.local_steps, self.logs, self.heldout, self.step_seconds = {}, {}, {}, {}

    def compile(self, rows: int, row_len: int) -> None:
        """Compile every slice's drafter step, held-out evaluation and the replicas' average ahead of time for [rows,
        row_len] batches, so that none compiles on an RL step's path (the first step a slice runs may be the one in
        flight when the rollout ends)."""
        abstract = {}
        for s in self.slices:
            policy = self.policy_for(s)
            batch = dummy_batch(rows, row_len, policy.config.hidden_size)
            state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                 self._placed[s])
            batch = jax.device_put(batch, self._batch_sh[s])
            self._steps[s] = self._steps[s].lower(state, policy, batch, step_ids(0, s, 0)).compile()
            self._evals[s] = self._evals[s].lower(state.params, policy, batch).compile()
            self._copies[s] = self._copies[s].lower(state).compile()
            abstract[s] = state
        self._merger.compile(abstract)

    def evaluate(self, s: int, batch: DrafterBatch) -> None:
        """Top-1 agreement with the policy of slice ``s``'s copy of the current drafter (the one this RL step's
        rollout drafted with, which never trained on that rollout's responses) on ``batch`` of them: held-out data.
        The value stays on the device until ``average``; ``step_metrics`` reports the mean over the slices (of every
        process) that evaluated as ``HELDOUT``. Run on a slice whose share has finished while others decode (the
        controller drops it if it has not started when the rollout ends)."""
        with busy(self.activity, ("drafter", s)):
            batch = jax.device_put(batch, self._batch_sh[s])
            value = self._evals[s](self._placed[s].params, self.policy_for(s), batch)
            jax.block_until_ready(value)
        with self._lock:
            self.heldout[s] = value

    def train_step(self, s: int, batch: DrafterBatch) -> dict[str, jax.Array]:
        """One drafter gradient step on slice ``s`` (thread-safe across slices; one call per slice at a time). It
        returns when the step has run, with its metrics still on device: ``average`` reads them all at once."""
        if s not in self.meshes:
            raise ValueError(f"slice {s} is not one of this trainer's slices {self.slices}")
        with self._lock:
            state = self.replicas.get(s)
            k = self.local_steps.get(s, 0)
        if state is None:  # a copy: the step donates its state, and the slice's copy stays the step's starting point
            state = self._copies[s](self._placed[s])
        rows = batch.next_tokens.shape[0]
        if rows % self._multiple[s]:
            raise ValueError(f"drafter batch of {rows} rows does not split over slice {s}'s {self._multiple[s]} "
                             "batch-parallel devices; use a multiple of that many rows (ControllerConfig.rows)")
        t0 = time.perf_counter()
        with busy(self.activity, ("drafter", s)):  # other slices' bandit timings taken meanwhile are disturbed
            batch = jax.device_put(batch, self._batch_sh[s])
            state, m, logged = self._steps[s](state, self.policy_for(s), batch, step_ids(self.rl_step, s, k))
            jax.block_until_ready(state)  # no host read: the controller (preemption) and activity see the step's end
        out = {f"drafter/{name}": v for name, v in m._asdict().items()}
        with self._lock:
            self.replicas[s] = state
            self.local_steps[s] = k + 1
            self.logs[s] = logged if s not in self.logs else self.logs[s] + logged
            self.step_seconds[s] = self.step_seconds.get(s, 0.0) + time.perf_counter() - t0
        return out

    def end_step(self) -> dict[str, float]:
        """``average``, then its ``step_metrics`` (waiting for it)."""
        self.average()
        return self.step_metrics()

    def average(self) -> None:
        """Average the replicas that trained (every process's: all call it at once) into every slice's copy of the
        current state, on the devices. Only dispatched: drafter steps, publishing and checkpoints use the copies where
        they lie, and ``step_metrics`` waits for it and reads the step's figures."""
        with self._lock:
            reps, steps = dict(self.replicas), dict(self.local_steps)
            logs, heldout = jax.device_get((self.logs, self.heldout))  # one read: every slice's metric sums
            seconds = self.step_seconds
            self.replicas, self.logs, self.heldout, self.step_seconds = {}, {}, {}, {}
        sums = {s: [float(v) for v in logs.get(s, [0.0] * len(LOGGED))] + [seconds.get(s, 0.0)]
                + ([float(heldout[s]), 1.0] if s in heldout else [0.0, 0.0]) for s in set(logs) | set(heldout)}
        states = {s: reps.get(s, self._placed[s]) for s in self.slices}
        self._placed, meta = self._merger(states, {s: s in reps for s in self.slices}, steps, sums)
        self._pending = dict(meta=meta, total=self._placed[self.slices[0]].step, metrics=None)

    def step_metrics(self) -> dict[str, float]:
        """The last ``average``'s RL-step metrics over all slices (``HELDOUT``: NaN when no slice evaluated); the
        first call waits for the average (every local slice's copy)."""
        pending = self._pending
        if pending is None:
            raise RuntimeError("SpotTrainer.step_metrics: no average yet (call average or end_step first)")
        if pending["metrics"] is None:
            steps, sums = self._merger.read(pending["meta"])
            total = float(jax.device_get(pending["total"]))
            jax.block_until_ready(self._placed)
            n, evaluated = sum(steps.values()), sum(v[-1] for v in sums.values())
            out = {"drafter/steps": float(n), "drafter/replicas": float(len(steps)), "drafter/total_steps": total,
                   HELDOUT: sum(v[-2] for v in sums.values()) / evaluated if evaluated else float("nan")}
            if n:  # means over every drafter step of the RL step, on every slice
                out.update({k: sum(v[i] for v in sums.values()) / n for i, k in enumerate(LOGGED)})
                out["drafter/step_s"] = sum(v[len(LOGGED)] for v in sums.values()) / n  # wall, on its slice's thread
            pending["metrics"] = out
            if self.across_processes:
                self._log_checksums(total)
        return dict(pending["metrics"])

    def _log_checksums(self, total: float) -> None:
        """One log line per local slice: a checksum of its copy of the averaged drafter, the same on every process
        when the average reached them all (tests/test_multihost.py compares the processes' lines). Slices that span
        processes are left out (their checksum would be a collective)."""
        me = jax.process_index()
        for s in self.slices:
            if any(d.process_index != me for d in self.meshes[s].devices.flat):
                continue
            value = float(jax.device_get(_checksum(self._placed[s].params)))
            log.info("drafter average after %d steps: process %d slice %d checksum %r", int(total), me, s, value)

    def train_steps(self, s: int, batches: Callable[[int], DrafterBatch], n: int) -> list[dict[str, float]]:
        """``n`` steps on slice ``s`` with ``batches(k)`` as the k-th batch (single slice, no idle time: run after
        the rollout). Call between begin_step and end_step."""
        return [self.train_step(s, batches(k)) for k in range(n)]

    # ---- the drafter, checkpoints, export --------------------------------------------------------------------

    @property
    def current(self) -> DrafterTrainState:
        """The current state as host arrays (a read from the first local slice's devices)."""
        return jax.device_get(self._placed[self.slices[0]])

    def params_on(self, s: int) -> Any:
        """The current drafter params on slice ``s``'s devices (no copy; the next average leaves them as they are)."""
        return self._placed[s].params

    def drafter(self, s: int | None = None) -> EagleDrafter:
        """The current drafter as a module, draft vocabulary re-attached: host arrays, or with ``s`` the arrays on
        slice s's devices (to publish to that slice's engine without a trip through the host)."""
        d = nnx.merge(self.graphdef, self.current.params if s is None else self._placed[s].params)
        if self._vocab is not None:
            d.set_draft_vocab(np.asarray(self._vocab))
        return d

    def replica_drafter(self, s: int) -> EagleDrafter:
        """Slice ``s``'s replica of this RL step as a module (arrays on slice s's mesh), for a hot swap into the
        engines still decoding; the step's averaged drafter replaces it at the step boundary."""
        with self._lock:
            state = self.replicas[s]
        d = nnx.merge(self.graphdef, state.params)
        if self._vocab is not None:
            d.set_draft_vocab(np.asarray(self._vocab))
        return d

    def state_tree(self) -> dict[str, np.ndarray]:
        """Trainable drafter params + optimizer state + step count as a flat dict of arrays (an orbax pytree)."""
        if self.replicas:
            raise RuntimeError("SpotTrainer.state_tree: replicas in flight; call end_step first")
        return {f"{i:05d}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(self.current))}

    def load_state_tree(self, tree: dict[str, Any]) -> None:
        """Inverse of ``state_tree`` (e.g. after a checkpoint restore); shapes and dtypes are checked."""
        paths, treedef = jax.tree_util.tree_flatten_with_path(self.current)
        if len(tree) != len(paths):
            raise ValueError(f"drafter checkpoint has {len(tree)} arrays, this drafter/optimizer needs {len(paths)}: "
                             "was it saved with another drafter shape or optimizer config?")
        leaves = []
        for i, (path, want) in enumerate(paths):
            x = np.asarray(tree[f"{i:05d}"])
            if x.shape != np.shape(want) or x.dtype != np.asarray(want).dtype:
                raise ValueError(f"drafter checkpoint entry {jax.tree_util.keystr(path)}: {x.dtype}{list(x.shape)}, "
                                 f"expected {np.asarray(want).dtype}{list(np.shape(want))}")
            leaves.append(x)
        host = jax.tree_util.tree_unflatten(treedef, leaves)
        self._placed = {s: jax.device_put(host, self._shardings[s]) for s in self.slices}

    def export(self, path) -> None:
        """Write the current drafter in the EAGLE/SGLang layout (see ``export_eagle``)."""
        export_eagle(self.drafter(), path)


def keyed_step(step, seed: int):
    """``step(state, policy, batch, key)`` as ``(state, policy, batch, ids) -> (state, metrics, logged)``: the key is
    made inside the program from ``ids`` (``step_ids``) and the ``LOGGED`` metrics come stacked (summed on the device
    across a slice's steps), so a drafter step is one dispatch."""

    def run(state, policy, batch, ids):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), ids[0]), ids[1])
        state, m = step(state, policy, batch, key)
        return state, m, jnp.stack([getattr(m, name.split("/", 1)[1]) for name in LOGGED])

    return jax.jit(run, donate_argnums=(0,))


def step_ids(rl_step: int, s: int, k: int) -> np.ndarray:
    """What a drafter step's key depends on: the RL step and (slice, local step); ``keyed_step`` folds them in."""
    return np.array([rl_step, s * 1_000_003 + k], np.uint32)


def dummy_batch(rows: int, row_len: int, hidden: int) -> DrafterBatch:
    """A [rows, row_len] batch of zeros with a real batch's dtypes and layout (for compiling ahead of time)."""
    return pack_sequences([(np.zeros(2, np.int32), np.zeros((2, hidden), np.float32), 1)], row_len, rows)


def average_states(states: Sequence[Any]) -> Any:
    """Mean of float leaves (accumulated in the given order), max of integer leaves (step counters): the plain host
    reference of ``ReplicaMerger``'s average."""
    def one(*xs):
        xs = [np.asarray(x) for x in xs]
        if np.issubdtype(xs[0].dtype, np.integer):
            return np.max(np.stack(xs), axis=0)
        acc = np.zeros(xs[0].shape, np.float64)
        for x in xs:
            acc += x
        return (acc / len(xs)).astype(xs[0].dtype)

    return jax.tree.map(one, *states)
