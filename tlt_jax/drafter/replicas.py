"""Average the slices' drafter replicas where they lie: one compiled program over every slice's devices.

Each slice holds its replica (params + optimizer state) on its own sub-mesh. ``ReplicaMerger`` views the replicas
of all slices as one array per leaf over the slices' meshes side by side (each device's buffer is one of its shards
as it is; nothing goes through the host), and one jitted program averages the slices that trained (float leaves:
weighted mean; integer counters: max) and gives every slice the average, on its devices. Inside it every device
flattens its own blocks into one buffer and sums it over the slices axis: one all-reduce, no resharding, whatever
the placement within a slice. Across processes the program spans them all, so the averaging is their collective.
The slices' step counts and drafter-metric sums travel in the same program, so every process learns every slice's.

With two slices the mean equals ``spot.average_states`` bit for bit (x + y rounds once either way); with more it may
differ in the last bit (the reduction order is the compiler's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

SLICES = "slices"  # the stacked mesh's leading axis


def stack_meshes(meshes: Sequence[Mesh]) -> Mesh:
    """The slices' (equally shaped) meshes side by side, under a leading ``SLICES`` axis."""
    names = meshes[0].axis_names
    if any(m.axis_names != names or m.devices.shape != meshes[0].devices.shape for m in meshes):
        raise ValueError("the slices' meshes differ in shape or axis names; they cannot be stacked")
    return Mesh(np.stack([m.devices for m in meshes]), (SLICES, *names))


class ReplicaMerger:
    """meshes: every slice's mesh, by slice index (all processes' slices). specs: a pytree of PartitionSpecs, one per
    leaf of a replica (its placement within a slice's mesh). logged: how many metric sums each slice reports.

    A leaf [d0, ...] of every slice becomes one array [slices * d0, ...] whose first axis is split over the slices
    first: each device's buffer is one of its shards as it is (scalars take a reshape to [1])."""

    def __init__(self, meshes: Sequence[Mesh], specs: Any, logged: int):
        self.meshes = list(meshes)
        self.mesh = stack_meshes(self.meshes)
        self.specs, self.logged = specs, int(logged)
        self._leaf_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        self._treedef = jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        rows = NamedSharding(self.mesh, PartitionSpec(SLICES))
        self._rows = rows
        self._stacked = [NamedSharding(self.mesh, _stacked_spec(p)) for p in self._leaf_specs]
        every = NamedSharding(self.mesh, PartitionSpec())
        stacked_specs = [sh.spec for sh in self._stacked]
        merge = jax.shard_map(_merge, mesh=self.mesh, in_specs=(stacked_specs, PartitionSpec(SLICES)),
                              out_specs=(stacked_specs, PartitionSpec()), check_vma=False)
        # no donation: the inputs are the slices' own buffers (a copy of the current state may still be read, e.g.
        # by the held-out evaluation)
        self._merge = jax.jit(merge, in_shardings=(self._stacked, rows), out_shardings=(self._stacked, every))

    def __call__(self, states: Mapping[int, Any], trained: Mapping[int, bool], steps: Mapping[int, int],
                 sums: Mapping[int, Sequence[float]]) -> tuple[dict[int, Any], dict[int, int], dict[int, list[float]]]:
        """states: this process's slices' replicas (on their meshes; a slice that did not train gives its copy of
        the current state). Returns (the average on each of those slices, every slice's step count where it ran
        steps, and its metric sums where it ran steps or reported a nonzero sum). Every process calls it at once (a
        collective when the slices span processes)."""
        local = sorted(states)
        zero = [0.0] * self.logged
        leaves = [jax.tree.leaves(states[s]) for s in local]
        shapes = tuple(tuple(x.shape) for x in leaves[0])
        stacked = [self._stack([lv[i] for lv in leaves], self._stacked[i]) for i in range(len(shapes))]
        meta = self._stack_rows(local, [np.array([bool(trained.get(s)), steps.get(s, 0), *sums.get(s, zero)],
                                                 np.float32) for s in local])
        out, meta = self._merge(stacked, meta)
        meta = jax.device_get(meta)  # the only host read: a few numbers per slice
        avg = {s: jax.tree.unflatten(self._treedef, [self._row(x, s, spec, shape) for x, spec, shape in
                                                     zip(out, self._leaf_specs, shapes, strict=True)])
               for s in local}
        all_steps = {s: int(row[1]) for s, row in enumerate(meta) if row[1]}
        all_sums = {s: [float(v) for v in row[2:]] for s, row in enumerate(meta) if row[1] or row[2:].any()}
        return avg, all_steps, all_sums

    def _stack(self, xs: Sequence[jax.Array], sharding: NamedSharding) -> jax.Array:
        """The local slices' arrays (each on its slice's mesh) as one global array [slices * d0, ...]."""
        shards = [sh.data.reshape(1) if x.ndim == 0 else sh.data for x in xs for sh in x.addressable_shards]
        shape = (len(self.meshes) * (xs[0].shape[0] if xs[0].ndim else 1), *xs[0].shape[1:])
        return jax.make_array_from_single_device_arrays(shape, sharding, shards)

    def _stack_rows(self, local: Sequence[int], values: Sequence[np.ndarray]) -> jax.Array:
        """One host row per local slice as the rows [slices, ...] of a global array (on the slices' devices)."""
        shards = []
        for s, v in zip(local, values, strict=True):
            row = np.asarray(v)[None]
            shards += [jax.device_put(row, d) for d in self.meshes[s].devices.flat if d.process_index ==
                       jax.process_index()]
        shape = (len(self.meshes), *np.shape(values[0]))
        return jax.make_array_from_single_device_arrays(shape, self._rows, shards)

    def _row(self, x: jax.Array, s: int, spec: PartitionSpec, shape: tuple) -> jax.Array:
        """Slice ``s``'s part of a stacked array, placed by ``spec`` on slice s's mesh."""
        mine = {d.id for d in self.meshes[s].devices.flat}
        shards = [sh.data if shape else sh.data.reshape(()) for sh in x.addressable_shards if sh.device.id in mine]
        return jax.make_array_from_single_device_arrays(shape, NamedSharding(self.meshes[s], spec), shards)


def _stacked_spec(spec: PartitionSpec) -> PartitionSpec:
    """A leaf's spec within a slice, its first axis split over the slices first."""
    first = spec[0] if len(spec) else None
    lead = SLICES if first is None else (SLICES, first) if isinstance(first, str) else (SLICES, *first)
    return PartitionSpec(lead, *spec[1:])


def _merge(blocks, meta):
    """Per device (under ``shard_map``): its blocks of every leaf and its slice's meta row (trained flag, steps,
    metric sums). The mean over the slices that trained (slice 0's copy when none did: all slices hold the same state
    then) replaces every block; every slice's meta row goes to every device."""
    trained = meta[0, 0]
    count = jax.lax.psum(trained, SLICES)
    w = jnp.where(count > 0, trained, (jax.lax.axis_index(SLICES) == 0).astype(jnp.float32))
    n = jnp.where(count > 0, count, 1.0)
    floats = [i for i, b in enumerate(blocks) if not jnp.issubdtype(b.dtype, jnp.integer)]
    out = {i: jax.lax.pmax(b, SLICES) for i, b in enumerate(blocks) if i not in floats}  # step counters
    if floats:
        flat = jnp.concatenate([blocks[i].reshape(-1).astype(jnp.float32) for i in floats])
        mean = jax.lax.psum(flat * w, SLICES) / n
        at = 0
        for i in floats:
            size = math.prod(blocks[i].shape)
            out[i] = mean[at:at + size].reshape(blocks[i].shape).astype(blocks[i].dtype)
            at += size
    return [out[i] for i in range(len(blocks))], jax.lax.all_gather(meta[0], SLICES)
