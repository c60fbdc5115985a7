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
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

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
)


class SpotTrainer:
    """Drafter replicas on mesh slices.

    drafter: the starting EagleDrafter (its draft vocabulary, if any, is kept and re-attached on export; the token
    loss is then taken over that vocabulary, as in the warm-up).
    meshes: one sub-mesh per slice. policy_for(s): the policy on slice s's mesh (read at every step, so policy
    updates published to the slices are picked up; the policy only supplies the frozen embedding and LM head).
    """

    def __init__(self, drafter: EagleDrafter, meshes: Sequence[Mesh], policy_for: Callable[[int], Any], *,
                 optim: DrafterOptimConfig = DrafterOptimConfig(), loss: DrafterLossConfig = DrafterLossConfig(),
                 seed: int = 0, rules: LogicalRules = LogicalRules()):
        if not meshes:
            raise ValueError("SpotTrainer needs at least one mesh slice")
        self.meshes, self.policy_for, self.seed = list(meshes), policy_for, int(seed)
        self._vocab = drafter.vocab_ids()
        if loss.vocab is None and self._vocab is not None:  # the warm-up's objective: the token loss over the
            loss = dataclasses.replace(loss, vocab=tuple(int(t) for t in np.asarray(self._vocab)))  # draft vocab
        self.loss_cfg = loss
        self.optimizer = make_drafter_optimizer(optim)
        self.graphdef, host = init_drafter_train_state(drafter, self.optimizer)
        self.current: DrafterTrainState = jax.device_get(host)
        self._shardings, self._steps, self._batch_sh = [], [], []
        self.batch_multiple = [int(np.prod([m.shape[a] for a in rules.lookup("batch")])) for m in self.meshes]
        for m in self.meshes:
            _, placed = init_drafter_train_state(drafter, self.optimizer, m, rules)
            self._shardings.append(jax.tree.map(lambda x: x.sharding, placed))
            self._steps.append(make_drafter_train_step(self.graphdef, self.optimizer, loss, m, rules))
            self._batch_sh.append(batch_sharding(m, rules))
        self._lock = threading.Lock()
        self.rl_step = 0
        self.replicas: dict[int, DrafterTrainState] = {}
        self.local_steps: dict[int, int] = {}

    @property
    def num_slices(self) -> int:
        return len(self.meshes)

    def begin_step(self, rl_step: int) -> None:
        """Start RL step ``rl_step``: no replica yet (slices that train this step start from ``current``)."""
        if self.replicas:
            raise RuntimeError("SpotTrainer.begin_step: the previous step's replicas were not merged (end_step)")
        self.rl_step = int(rl_step)
        self.local_steps = {}

    def train_step(self, s: int, batch: DrafterBatch) -> dict[str, float]:
        """One drafter gradient step on slice ``s`` (thread-safe across slices; one call per slice at a time)."""
        if not 0 <= s < self.num_slices:
            raise ValueError(f"slice {s} out of range [0, {self.num_slices})")
        with self._lock:
            state = self.replicas.get(s)
            k = self.local_steps.get(s, 0)
        if state is None:
            state = jax.device_put(self.current, self._shardings[s])
        rows = batch.next_tokens.shape[0]
        if rows % self.batch_multiple[s]:
            raise ValueError(f"drafter batch of {rows} rows does not split over slice {s}'s {self.batch_multiple[s]} "
                             "batch-parallel devices; use a multiple of that many rows (ControllerConfig.rows)")
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), self.rl_step), s * 1_000_003 + k)
        batch = jax.device_put(batch, self._batch_sh[s])
        state, m = self._steps[s](state, self.policy_for(s), batch, key)
        out = {f"drafter/{name}": float(v) for name, v in m._asdict().items()}
        with self._lock:
            self.replicas[s] = state
            self.local_steps[s] = k + 1
        return out

    def end_step(self) -> dict[str, float]:
        """Average the replicas that trained into the current state (kept on the host); returns step metrics."""
        with self._lock:
            reps = [jax.device_get(self.replicas[s]) for s in sorted(self.replicas)]
            steps = dict(self.local_steps)
            self.replicas = {}
        if reps:
            self.current = average_states(reps)
        return {"drafter/steps": float(sum(steps.values())), "drafter/replicas": float(len(reps)),
                "drafter/total_steps": float(self.current.step)}

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
