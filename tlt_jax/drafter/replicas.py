"""Average the slices' drafter replicas where they lie: one compiled program over every slice's devices.

Each slice holds its replica (params + optimizer state) on its own sub-mesh. ``ReplicaMerger`` views the replicas
of all slices as one array per leaf over the slices' meshes side by side (each device's buffer is one of its shards
as it is; nothing goes through the host), and one jitted program averages the slices that trained (float leaves:
weighted mean; integer counters: max) and gives every slice the average, on its devices. Inside it every device
flattens its own blocks into one buffer and sums it over the slices axis: one all-reduce, no resharding, whatever
the placement within a slice. Across processes the program spans them all, so the averaging is their collective.
The slices' integer counters, step counts and drafter-metric sums ride in the same all-reduce (each slice's row of a
table that is zero elsewhere), so every process learns every slice's and the program holds one collective.
The call only dispatches the program: the average is used where it lies, and ``read`` waits for the table.

With two slices the mean equals ``spot.average_states`` bit for bit (x + y rounds once either way); with more it may
differ in the last bit (the reduction order is the compiler's).
"""

from __future__ import annotations

import functools
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
    first: each device's buffer is one of its shards as it is (scalars take a reshape to [1]; their average comes back
    replicated)."""

    def __init__(self, meshes: Sequence[Mesh], specs: Any, logged: int):
        self.meshes = list(meshes)
        self.mesh = stack_meshes(self.meshes)
        self.specs, self.logged = specs, int(logged)
        self._leaf_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        self._treedef = jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        self._rows = NamedSharding(self.mesh, PartitionSpec(SLICES))
        self._stacked = [NamedSharding(self.mesh, _stacked_spec(p)) for p in self._leaf_specs]
        self._mine = [{d.id for d in m.devices.flat} for m in self.meshes]
        self._placement = {}  # (slice, leaf) -> its NamedSharding on the slice's mesh (built once: cheaper to reuse)
        self._merge = None  # compiled at the first call (which leaves are scalars is known then)

    def __call__(self, states: Mapping[int, Any], trained: Mapping[int, bool], steps: Mapping[int, int],
                 sums: Mapping[int, Sequence[float]]) -> tuple[dict[int, Any], jax.Array]:
        """states: this process's slices' replicas (on their meshes; a slice that did not train gives its copy of
        the current state). Returns the average on each of those slices and the table of every slice's step count
        and metric sums (on the devices; ``read`` it), both dispatched, not waited for. Every process calls it at
        once (a collective when the slices span processes)."""
        local = sorted(states)
        zero = [0.0] * self.logged
        leaves = [jax.tree.leaves(states[s]) for s in local]
        shapes = tuple(tuple(x.shape) for x in leaves[0])
        if self._merge is None:
            self._merge = self._compile_merge(tuple(not shape for shape in shapes))
        stacked = [self._stack([lv[i] for lv in leaves], self._stacked[i]) for i in range(len(shapes))]
        meta = self._stack_rows(local, [np.array([bool(trained.get(s)), steps.get(s, 0), *sums.get(s, zero)],
                                                 np.float32) for s in local])
        out, meta = self._merge(stacked, meta)
        avg = {s: jax.tree.unflatten(self._treedef, [self._row(x, s, i, shape) for i, (x, shape) in
                                                     enumerate(zip(out, shapes, strict=True))])
               for s in local}
        return avg, meta

    def _compile_merge(self, scalar: tuple[bool, ...]):
        """The averaging program (``_merge`` under shard_map); ``scalar``: which leaves are scalars (they come back
        replicated over every slice, so no slice needs a reshape)."""
        every = NamedSharding(self.mesh, PartitionSpec())
        specs = [sh.spec for sh in self._stacked]
        out_specs = [PartitionSpec() if sc else p for sc, p in zip(scalar, specs, strict=True)]
        out_shardings = [every if sc else sh for sc, sh in zip(scalar, self._stacked, strict=True)]
        merge = jax.shard_map(functools.partial(_merge, scalar=scalar), mesh=self.mesh,
                              in_specs=(specs, PartitionSpec(SLICES)), out_specs=(out_specs, PartitionSpec()),
                              check_vma=False)
        # no donation: the inputs are the slices' own buffers (a copy of the current state may still be read, e.g.
        # by the held-out evaluation)
        return jax.jit(merge, in_shardings=(self._stacked, self._rows), out_shardings=(out_shardings, every))

    @staticmethod
    def read(meta: jax.Array) -> tuple[dict[int, int], dict[int, list[float]]]:
        """The host read of a call's table (it waits for the program): every slice's step count where it ran steps,
        and its metric sums where it ran steps or reported a nonzero sum."""
        meta = jax.device_get(meta)
        all_steps = {s: int(row[1]) for s, row in enumerate(meta) if row[1]}
        all_sums = {s: [float(v) for v in row[2:]] for s, row in enumerate(meta) if row[1] or row[2:].any()}
        return all_steps, all_sums

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

    def _row(self, x: jax.Array, s: int, i: int, shape: tuple) -> jax.Array:
        """Slice ``s``'s part of leaf ``i`` of the average (stacked, or a replicated scalar), placed as that leaf is
        on slice s's mesh."""
        key = (s, i)
        if key not in self._placement:
            self._placement[key] = NamedSharding(self.meshes[s], self._leaf_specs[i])
        shards = [sh.data for sh in x.addressable_shards if sh.device.id in self._mine[s]]
        return jax.make_array_from_single_device_arrays(shape, self._placement[key], shards)


def _stacked_spec(spec: PartitionSpec) -> PartitionSpec:
    """A leaf's spec within a slice, its first axis split over the slices first."""
    first = spec[0] if len(spec) else None
    lead = SLICES if first is None else (SLICES, first) if isinstance(first, str) else (SLICES, *first)
    return PartitionSpec(lead, *spec[1:])


def _merge(blocks, meta, scalar):
    """Per device (under ``shard_map``): its blocks of every leaf and its slice's meta row (trained flag, steps,
    metric sums). The mean over the slices that trained replaces every float block (when none did, all slices hold
    the same state and keep it); integer blocks become their max over the slices; every slice's meta row goes to
    every device; ``scalar`` leaves come back as scalars. One all-reduce carries it all: the float blocks of the
    slices that trained (zeros elsewhere), then a [slices, ...] table holding this slice's meta row and integer
    blocks in its own row (zero elsewhere). Integers travel as 12-bit halves (exact in float32 for any int32)."""
    count_slices = jax.lax.psum(1, SLICES)  # a constant (the axis size): no collective
    floats = [i for i, b in enumerate(blocks) if not jnp.issubdtype(b.dtype, jnp.integer)]
    ints = [i for i, b in enumerate(blocks) if i not in floats]
    flat = jnp.concatenate([blocks[i].reshape(-1).astype(jnp.float32) for i in floats] or [jnp.zeros(0)])
    ints_flat = jnp.concatenate([blocks[i].reshape(-1).astype(jnp.int32) for i in ints] or [jnp.zeros(0, jnp.int32)])
    row = jnp.concatenate([meta[0], (ints_flat >> 12).astype(jnp.float32), (ints_flat & 0xFFF).astype(jnp.float32)])
    mine = (jnp.arange(count_slices) == jax.lax.axis_index(SLICES))[:, None]
    table = jnp.where(mine, row[None], 0.0)  # (a select, not a product: a NaN sum stays in its own row)
    summed = jax.lax.psum(jnp.concatenate([jnp.where(meta[0, 0] > 0, flat, 0.0), table.reshape(-1)]), SLICES)
    table = summed[flat.size:].reshape(count_slices, row.size)
    count = jnp.sum(table[:, 0])
    mean = jnp.where(count > 0, summed[:flat.size] / jnp.maximum(count, 1.0), flat)
    width, n_ints = meta.shape[1], ints_flat.size
    halves = table[:, width:].astype(jnp.int32)
    ints_max = jnp.max(halves[:, :n_ints] * 4096 + halves[:, n_ints:], axis=0)
    out, at_f, at_i = [], 0, 0
    for i, b in enumerate(blocks):
        size = math.prod(b.shape)
        if i in floats:
            out.append(mean[at_f:at_f + size].reshape(() if scalar[i] else b.shape).astype(b.dtype))
            at_f += size
        else:
            out.append(ints_max[at_i:at_i + size].reshape(() if scalar[i] else b.shape).astype(b.dtype))
            at_i += size
    return out, table[:, :width]
