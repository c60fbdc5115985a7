"""Average the slices' drafter replicas where they lie: one compiled program over every slice's devices.

Each slice holds its replica (params + optimizer state) on its own sub-mesh. Per slice, one small program
(``_pack``, under ``shard_map`` on the slice's mesh) flattens every device's blocks of every leaf into one float
buffer, and the slice's integer counters, step count and drafter-metric sums into one row. ``ReplicaMerger`` views
those buffers of all slices as one array over the slices' meshes side by side (each device's buffer as it is;
nothing goes through the host), and one jitted program averages the slices that trained (float leaves: weighted
mean; integer counters: max): every device sums its buffer over the slices axis, one all-reduce, no resharding,
whatever the placement within a slice. The integer counters, step counts and metric sums ride in the same
all-reduce (each slice's row of a table that is zero elsewhere), so every process learns every slice's and the
program holds one collective. Per slice again, ``_unpack`` turns the average back into the replica's leaves, placed
as they were. Across processes the averaging program spans them all, so it is their collective. A handful of
dispatches per slice, whatever the number of leaves: the call only dispatches them, the average is used where it
lies, and ``read`` waits for the table.

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

    Every device's buffer [n] becomes one block of a global array [slices * devices per slice * n] split over the
    stacked mesh's axes, slices first."""

    def __init__(self, meshes: Sequence[Mesh], specs: Any, logged: int):
        self.meshes = list(meshes)
        self.mesh = stack_meshes(self.meshes)
        self.specs, self.logged = specs, int(logged)
        self._leaf_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        self._treedef = jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        axes = tuple(self.meshes[0].axis_names)
        self._per_device = PartitionSpec(axes)  # one block per device of a slice
        self._flat = [NamedSharding(m, self._per_device) for m in self.meshes]
        self._stacked = NamedSharding(self.mesh, PartitionSpec((SLICES, *axes)))
        self._devices = len(self.meshes[0].devices.flat)
        self._mine = [{d.id for d in m.devices.flat} for m in self.meshes]  # each slice's device ids
        self._pack, self._unpack = {}, {}  # per slice, compiled at its first call (when the leaves are known)
        self._merge = None
        self.layout: tuple | None = None  # per leaf: (its block's shape on one device, dtype), set at the first call

    def __call__(self, states: Mapping[int, Any], trained: Mapping[int, bool], steps: Mapping[int, int],
                 sums: Mapping[int, Sequence[float]]) -> tuple[dict[int, Any], jax.Array]:
        """states: this process's slices' replicas (on their meshes; a slice that did not train gives its copy of
        the current state). Returns the average on each of those slices and the table of every slice's step count
        and metric sums (on the devices; ``read`` it), both dispatched, not waited for. Every process calls it at
        once (a collective when the slices span processes)."""
        local = sorted(states)
        zero = [0.0] * self.logged
        packed = {}
        for s in local:
            leaves = jax.tree.leaves(states[s])
            if s not in self._pack:
                self._compile_slice(s, leaves)
            meta = np.array([bool(trained.get(s)), steps.get(s, 0), *sums.get(s, zero)], np.float32)
            packed[s] = self._pack[s](leaves, meta)
        flat, rows = (self._stack([packed[s][i] for s in local]) for i in (0, 1))
        if self._merge is None:
            self._merge = self._compile_merge(flat.shape[0] // (len(self.meshes) * self._devices),
                                              rows.shape[1])
        mean, ints, table = self._merge(flat, rows)
        avg = {s: jax.tree.unflatten(self._treedef, self._unpack[s](self._part(mean, s), self._part(ints, s)))
               for s in local}
        return avg, table

    def compile(self, states: Mapping[int, Any]) -> None:
        """Compile the programs ahead of time for replicas like ``states`` (abstract values with shardings will do),
        so that the first average adds no compile to an RL step."""
        for s in sorted(states):
            if s not in self._pack:
                self._compile_slice(s, jax.tree.leaves(states[s]))
        if self._merge is None:
            floats, ints = self._sizes()
            self._merge = self._compile_merge(floats, 2 + self.logged + 2 * ints)

    def _sizes(self) -> tuple[int, int]:
        """Elements per device of the float leaves and of the integer leaves."""
        n = [math.prod(shape) for shape, _ in self.layout]
        is_int = [jnp.issubdtype(dtype, jnp.integer) for _, dtype in self.layout]
        return (sum(k for k, i in zip(n, is_int, strict=True) if not i),
                sum(k for k, i in zip(n, is_int, strict=True) if i))

    def _compile_slice(self, s: int, leaves: Sequence[Any]) -> None:
        """Slice ``s``'s pack and unpack programs for replicas with these leaves (arrays or abstract values)."""
        mesh = self.meshes[s]
        placed = [NamedSharding(mesh, p) for p in self._leaf_specs]
        layout = tuple((tuple(sh.shard_shape(x.shape)), jnp.dtype(x.dtype)) for x, sh in
                       zip(leaves, placed, strict=True))
        if self.layout is not None and layout != self.layout:
            raise ValueError("ReplicaMerger: the slices' replicas differ in shapes or dtypes")
        self.layout = layout
        floats, ints = self._sizes()
        meta = NamedSharding(mesh, PartitionSpec())
        pack = jax.shard_map(_pack, mesh=mesh, in_specs=(self._leaf_specs, PartitionSpec()),
                             out_specs=(self._per_device, self._per_device), check_vma=False)
        self._pack[s] = jax.jit(pack, in_shardings=(placed, meta), out_shardings=(self._flat[s], self._flat[s])).lower(
            [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
            jax.ShapeDtypeStruct((2 + self.logged,), np.float32)).compile()
        unpack = jax.shard_map(lambda f, i: _unpack(f, i, layout), mesh=mesh,
                               in_specs=(self._per_device, self._per_device), out_specs=self._leaf_specs,
                               check_vma=False)
        self._unpack[s] = jax.jit(unpack, in_shardings=(self._flat[s], self._flat[s]), out_shardings=placed).lower(
            jax.ShapeDtypeStruct((self._devices * floats,), np.float32),
            jax.ShapeDtypeStruct((self._devices * ints,), np.int32)).compile()

    def _compile_merge(self, floats: int, width: int):
        """The averaging program (``_merge`` under shard_map) for ``floats`` elements and a meta row of ``width`` per
        device."""
        every = NamedSharding(self.mesh, PartitionSpec())
        spec = self._stacked.spec
        merge = jax.shard_map(lambda f, r: _merge(f, r, 2 + self.logged), mesh=self.mesh, in_specs=(spec, spec),
                              out_specs=(spec, spec, PartitionSpec()), check_vma=False)
        total = len(self.meshes) * self._devices
        return jax.jit(merge, in_shardings=(self._stacked, self._stacked),
                       out_shardings=(self._stacked, self._stacked, every)).lower(
            jax.ShapeDtypeStruct((total * floats,), np.float32),
            jax.ShapeDtypeStruct((total, width), np.float32)).compile()

    @staticmethod
    def read(meta: jax.Array) -> tuple[dict[int, int], dict[int, list[float]]]:
        """The host read of a call's table (it waits for the program): every slice's step count where it ran steps,
        and its metric sums where it ran steps or reported a nonzero sum."""
        meta = jax.device_get(meta)
        all_steps = {s: int(row[1]) for s, row in enumerate(meta) if row[1]}
        all_sums = {s: [float(v) for v in row[2:]] for s, row in enumerate(meta) if row[1] or row[2:].any()}
        return all_steps, all_sums

    def _stack(self, xs: Sequence[jax.Array]) -> jax.Array:
        """The local slices' per-device buffers (each on its slice's mesh, [devices * n, ...]) as one global array
        [slices * devices * n, ...]."""
        shards = [sh.data for x in xs for sh in x.addressable_shards]
        return jax.make_array_from_single_device_arrays((len(self.meshes) * xs[0].shape[0], *xs[0].shape[1:]),
                                                        self._stacked, shards)

    def _part(self, x: jax.Array, s: int) -> jax.Array:
        """Slice ``s``'s blocks of a stacked per-device array, as an array on slice s's mesh."""
        shards = [sh.data for sh in x.addressable_shards if sh.device.id in self._mine[s]]
        return jax.make_array_from_single_device_arrays((x.shape[0] // len(self.meshes), *x.shape[1:]), self._flat[s],
                                                        shards)


def _pack(blocks, meta):
    """Per device of a slice (under ``shard_map``): its blocks of every leaf as one float32 buffer, and a row of the
    slice's meta values (trained flag, steps, metric sums) followed by its integer blocks as 12-bit halves (exact in
    float32 for any int32)."""
    floats = [b.reshape(-1).astype(jnp.float32) for b in blocks if not jnp.issubdtype(b.dtype, jnp.integer)]
    ints = [b.reshape(-1).astype(jnp.int32) for b in blocks if jnp.issubdtype(b.dtype, jnp.integer)]
    flat = jnp.concatenate(floats or [jnp.zeros(0)])
    ints = jnp.concatenate(ints or [jnp.zeros(0, jnp.int32)])
    row = jnp.concatenate([meta, (ints >> 12).astype(jnp.float32), (ints & 0xFFF).astype(jnp.float32)])
    return flat, row[None]


def _merge(flat, row, width):
    """Per device (under ``shard_map`` on the stacked mesh): its slice's buffer and row. The mean over the slices
    that trained replaces the buffer (when none did, all slices hold the same state and keep it); the integer blocks
    become their max over the slices; every slice's meta row (the first ``width`` entries) goes to every device. One
    all-reduce carries it all: the buffers of the slices that trained (zeros elsewhere), then a [slices, ...] table
    holding this slice's row in its own row (zero elsewhere)."""
    count_slices = jax.lax.psum(1, SLICES)  # a constant (the axis size): no collective
    mine = (jnp.arange(count_slices) == jax.lax.axis_index(SLICES))[:, None]
    table = jnp.where(mine, row, 0.0)  # (a select, not a product: a NaN sum stays in its own row)
    summed = jax.lax.psum(jnp.concatenate([jnp.where(row[0, 0] > 0, flat, 0.0), table.reshape(-1)]), SLICES)
    table = summed[flat.size:].reshape(count_slices, row.shape[1])
    count = jnp.sum(table[:, 0])
    mean = jnp.where(count > 0, summed[:flat.size] / jnp.maximum(count, 1.0), flat)
    n_ints = (row.shape[1] - width) // 2
    halves = table[:, width:].astype(jnp.int32)
    ints = jnp.max(halves[:, :n_ints] * 4096 + halves[:, n_ints:], axis=0)
    return mean, ints, table[:, :width]


def _unpack(flat, ints, layout):
    """Per device of a slice (under ``shard_map``): its blocks of every leaf back from the averaged buffers."""
    out, at_f, at_i = [], 0, 0
    for shape, dtype in layout:
        size = math.prod(shape)
        if jnp.issubdtype(dtype, jnp.integer):
            out.append(ints[at_i:at_i + size].reshape(shape).astype(dtype))
            at_i += size
        else:
            out.append(flat[at_f:at_f + size].reshape(shape).astype(dtype))
            at_f += size
    return out
