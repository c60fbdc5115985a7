"""Spot drafter training on idle mesh slices: one compiled train step per slice, local replicas, averaged per RL step.

Within an RL step every slice that trains starts a replica from the current drafter state (params + AdamW state)
and steps it on its own sub-mesh, with no collective across slices; which slices train, and for how many steps,
changes nothing compiled. At the step boundary the replicas that trained are averaged (float leaves: mean in slice
order; integer counters: max) into the next current state, kept on the host. Keys and batches depend only on
(RL step, slice, local step), so the same dispatch decisions give the same weights.

The drafter/train.py names used here (DrafterLossConfig, DrafterOptimConfig, DrafterTrainState,
make_drafter_train_step) are all imported in one block.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tlt_jax.adaptive.quiet import Activity, busy
from tlt_jax.distributed import LogicalRules
from tlt_jax.drafter.eagle import EagleDrafter
from tlt_jax.drafter.export import export_eagle
from tlt_jax.drafter.train import (
    DrafterBatch,
    DrafterLossConfig,
    DrafterOptimConfig,
    DrafterTrainState,
    batch_sharding,
    init_drafter_train_state,
    make_drafter_optimizer,
    make_drafter_train_step,
    pack_sequences,
)

LOGGED = ("drafter/loss", "drafter/top1")  # drafter-step metrics averaged over the RL step's drafter steps


class SpotTrainer:
    """Drafter replicas on mesh slices.

    drafter: the starting EagleDrafter (its draft vocabulary, if any, is kept and re-attached on export; the token
    loss is then taken over that vocabulary, as in the warm-up).
    meshes: one sub-mesh per slice (a list, or {slice index: mesh} for the slices of this process). policy_for(s):
    the policy on slice s's mesh (read at every step, so policy updates published to the slices are picked up; the
    policy only supplies the frozen embedding and LM head). across_processes: the other slices train on other
    processes; ``end_step`` averages every process's replicas with one collective (``exchange_replicas``).
    activity: the sliced rollout's ``Activity``, where drafter steps are registered while they run.
    """

    def __init__(self, drafter: EagleDrafter, meshes: Sequence[Mesh] | Mapping[int, Mesh],
                 policy_for: Callable[[int], Any], *, optim: DrafterOptimConfig = DrafterOptimConfig(),
                 loss: DrafterLossConfig = DrafterLossConfig(), seed: int = 0, rules: LogicalRules = LogicalRules(),
                 across_processes: bool = False, activity: Activity | None = None):
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
        self.graphdef, host = init_drafter_train_state(drafter, self.optimizer)
        self.current: DrafterTrainState = jax.device_get(host)
        self._shardings, self._steps, self._batch_sh, self._multiple = {}, {}, {}, {}
        for s, m in self.meshes.items():
            self._multiple[s] = int(np.prod([m.shape[a] for a in rules.lookup("batch")]))
            _, placed = init_drafter_train_state(drafter, self.optimizer, m, rules)
            self._shardings[s] = jax.tree.map(lambda x: x.sharding, placed)
            self._steps[s] = make_drafter_train_step(self.graphdef, self.optimizer, loss, m, rules)
            self._batch_sh[s] = batch_sharding(m, rules)
        self.batch_multiple = [self._multiple[s] for s in self.slices]  # batch-parallel devices per slice
        self._lock = threading.Lock()
        self.rl_step = 0
        self.replicas: dict[int, DrafterTrainState] = {}
        self.local_steps: dict[int, int] = {}
        self.logs: dict[int, list] = {}  # this RL step's drafter-step metrics per slice, on device until end_step

    @property
    def num_slices(self) -> int:
        return len(self.meshes)

    def begin_step(self, rl_step: int) -> None:
        """Start RL step ``rl_step``: no replica yet (slices that train this step start from ``current``)."""
        if self.replicas:
            raise RuntimeError("SpotTrainer.begin_step: the previous step's replicas were not merged (end_step)")
        self.rl_step = int(rl_step)
        self.local_steps, self.logs = {}, {}

    def compile(self, rows: int, row_len: int) -> None:
        """Compile every slice's drafter step ahead of time for [rows, row_len] batches, so that the first step a
        slice runs (perhaps the one in flight when the rollout ends) does not compile on the RL step's path."""
        for s in self.slices:
            policy = self.policy_for(s)
            batch = dummy_batch(rows, row_len, policy.config.hidden_size)
            state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sh),
                                 self.current, self._shardings[s])
            batch = jax.device_put(batch, self._batch_sh[s])
            self._steps[s] = self._steps[s].lower(state, policy, batch, jax.random.key(0)).compile()

    def train_step(self, s: int, batch: DrafterBatch) -> dict[str, jax.Array]:
        """One drafter gradient step on slice ``s`` (thread-safe across slices; one call per slice at a time). It
        returns when the step has run, with its metrics still on device: ``end_step`` reads them all at once."""
        if s not in self.meshes:
            raise ValueError(f"slice {s} is not one of this trainer's slices {self.slices}")
        with self._lock:
            state = self.replicas.get(s)
            k = self.local_steps.get(s, 0)
        if state is None:
            state = jax.device_put(self.current, self._shardings[s])
        rows = batch.next_tokens.shape[0]
        if rows % self._multiple[s]:
            raise ValueError(f"drafter batch of {rows} rows does not split over slice {s}'s {self._multiple[s]} "
                             "batch-parallel devices; use a multiple of that many rows (ControllerConfig.rows)")
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), self.rl_step), s * 1_000_003 + k)
        with busy(self.activity, ("drafter", s)):  # other slices' bandit timings taken meanwhile are disturbed
            batch = jax.device_put(batch, self._batch_sh[s])
            state, m = self._steps[s](state, self.policy_for(s), batch, key)
            jax.block_until_ready(state)  # no host read: the controller (preemption) and activity see the step's end
        out = {f"drafter/{name}": v for name, v in m._asdict().items()}
        with self._lock:
            self.replicas[s] = state
            self.local_steps[s] = k + 1
            self.logs.setdefault(s, []).append(out)
        return out

    def end_step(self) -> dict[str, float]:
        """Average the replicas that trained (every process's, across processes: a collective) into the current
        state, kept on the host; returns step metrics over all slices."""
        with self._lock:
            reps = {s: jax.device_get(self.replicas[s]) for s in sorted(self.replicas)}
            steps, logs = dict(self.local_steps), jax.device_get(self.logs)  # one read of every step's metrics
            self.replicas, self.logs = {}, {}
        sums = {s: [sum(float(m[k]) for m in ms) for k in LOGGED] for s, ms in logs.items()}
        if self.across_processes:
            reps, steps, sums = exchange_replicas(self.current, self.slices, reps, steps, sums)
        if reps:
            self.current = average_states([reps[s] for s in sorted(reps)])
        n = sum(steps.values())
        out = {"drafter/steps": float(n), "drafter/replicas": float(len(reps)),
               "drafter/total_steps": float(self.current.step)}
        if n:  # means over every drafter step of the RL step, on every slice
            out.update({k: sum(v[i] for v in sums.values()) / n for i, k in enumerate(LOGGED)})
        return out

    def train_steps(self, s: int, batches: Callable[[int], DrafterBatch], n: int) -> list[dict[str, float]]:
        """``n`` steps on slice ``s`` with ``batches(k)`` as the k-th batch (single slice, no idle time: run after
        the rollout). Call between begin_step and end_step."""
        return [self.train_step(s, batches(k)) for k in range(n)]

    # ---- the drafter, checkpoints, export --------------------------------------------------------------------

    def drafter(self) -> EagleDrafter:
        """The current drafter as a module (host arrays), draft vocabulary re-attached."""
        d = nnx.merge(self.graphdef, self.current.params)
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
        self.current = jax.tree_util.tree_unflatten(treedef, leaves)

    def export(self, path) -> None:
        """Write the current drafter in the EAGLE/SGLang layout (see ``export_eagle``)."""
        export_eagle(self.drafter(), path)


def dummy_batch(rows: int, row_len: int, hidden: int) -> DrafterBatch:
    """A [rows, row_len] batch of zeros with a real batch's dtypes and layout (for compiling ahead of time)."""
    return pack_sequences([(np.zeros(2, np.int32), np.zeros((2, hidden), np.float32), 1)], row_len, rows)


def average_states(states: Sequence[Any]) -> Any:
    """Mean of float leaves (accumulated in the given order), max of integer leaves (step counters)."""
    def one(*xs):
        xs = [np.asarray(x) for x in xs]
        if np.issubdtype(xs[0].dtype, np.integer):
            return np.max(np.stack(xs), axis=0)
        acc = np.zeros(xs[0].shape, np.float64)
        for x in xs:
            acc += x
        return (acc / len(xs)).astype(xs[0].dtype)

    return jax.tree.map(one, *states)


def exchange_replicas(like: Any, slices: Sequence[int], replicas: dict[int, Any], steps: dict[int, int],
                      sums: dict[int, list[float]]) -> tuple[dict[int, Any], dict[int, int], dict[int, list[float]]]:
    """Every process's trained replicas, step counts and metric sums (``LOGGED``), by slice, from one all-gather of
    raw bytes: a row per local slice (slice index, trained flag, steps, the sums, then the state's leaves as in
    ``like``), the same row count on every process (every process runs as many slices)."""
    from jax.experimental import multihost_utils

    leaves, treedef = jax.tree.flatten(like)
    specs = [(np.shape(x), np.asarray(x).dtype) for x in leaves]
    sizes = [int(np.prod(shape)) * dt.itemsize for shape, dt in specs]
    head = 16 + 8 * len(LOGGED)
    rows = np.zeros((len(slices), head + sum(sizes)), np.uint8)
    for i, s in enumerate(slices):
        rows[i, :16] = np.array([s, s in replicas, steps.get(s, 0), 0], np.int32).view(np.uint8)
        rows[i, 16:head] = np.array(sums.get(s, [0.0] * len(LOGGED)), np.float64).view(np.uint8)
        if s in replicas:
            blob = [np.ascontiguousarray(np.asarray(x, dt)).view(np.uint8).reshape(-1)
                    for x, (_, dt) in zip(jax.tree.leaves(replicas[s]), specs, strict=True)]
            rows[i, head:] = np.concatenate(blob)
    gathered = np.asarray(multihost_utils.process_allgather(rows)).reshape(-1, rows.shape[1])
    reps, all_steps, all_sums = {}, {}, {}
    for row in gathered:
        s, trained, n, _ = (int(v) for v in row[:16].view(np.int32))
        if n:
            all_steps[s], all_sums[s] = n, row[16:head].copy().view(np.float64).tolist()
        if trained:
            out, at = [], head
            for (shape, dt), size in zip(specs, sizes, strict=True):
                out.append(row[at:at + size].view(dt).reshape(shape).copy())
                at += size
            reps[s] = jax.tree.unflatten(treedef, out)
    return reps, all_steps, all_sums
