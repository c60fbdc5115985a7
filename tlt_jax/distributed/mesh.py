"""Meshes with named axes (data, fsdp, tensor), ordered by node across processes (HSDP: tensor and FSDP inside a node,
data across nodes), and disjoint slices of one mesh for independent rollout engines."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from tlt_jax.mesh_config import AXES, MeshConfig

__all__ = ["AXES", "MeshConfig", "engine_count", "engine_meshes", "hybrid_devices", "make_mesh", "single_device_mesh"]


def make_mesh(cfg: MeshConfig = MeshConfig(), devices=None) -> Mesh:
    """The (data, fsdp, tensor) mesh over ``devices`` (default: all). Devices of one locality unit (a process: a GPU
    node; a TPU slice) in one process or slice keep their order. Across several, the mesh is hybrid
    (:func:`hybrid_devices`): ``tensor`` and then ``fsdp`` inside a unit, ``data`` (and the rest of ``fsdp``) across
    units, so tensor-parallel and FSDP collectives stay on NVLink / ICI."""
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.resolve(len(devices))
    units = _locality_units(devices)
    if len(units) > 1:
        return Mesh(hybrid_devices(shape, units), AXES)
    return Mesh(np.asarray(devices).reshape(shape), AXES)


def _locality_units(devices: list) -> list[list]:
    """``devices`` grouped by what shares a fast interconnect: a TPU slice (``slice_index``), else a process (a GPU
    node), in unit order; each unit's devices by id."""
    tpu = devices[0].platform == "tpu"
    key = (lambda d: getattr(d, "slice_index", 0)) if tpu else (lambda d: d.process_index)
    units: dict[int, list] = {}
    for d in devices:
        units.setdefault(key(d), []).append(d)
    return [sorted(units[k], key=lambda d: d.id) for k in sorted(units)]


def hybrid_devices(shape: tuple[int, int, int], units: list[list]) -> np.ndarray:
    """A [data, fsdp, tensor] device array over equal locality ``units`` (``mesh_utils.create_hybrid_device_mesh``'s
    layout, unit = granule): ``tensor`` inside a unit, then as much of ``fsdp`` as fits the unit, then ``data``; the
    remaining ``data`` (and, when an FSDP group is larger than a unit, ``fsdp``) across units. A ValueError when a
    tensor-parallel group would span units, or an FSDP group would hold part of a unit beside another unit."""
    data, fsdp, tensor = shape
    per = len(units[0])
    if any(len(u) != per for u in units):
        raise ValueError(f"devices per process differ ({sorted({len(u) for u in units})}): a mesh needs equal nodes")
    if per % tensor:
        raise ValueError(f"mesh.tensor={tensor} does not divide the {per} devices of a process (node): a "
                         f"tensor-parallel group would span nodes; use a divisor of {per}")
    room = per // tensor
    if room % fsdp == 0:  # FSDP groups inside a node (HSDP); the node's other groups are data-parallel
        inner_data, inner_fsdp = room // fsdp, fsdp
    elif fsdp % room == 0:  # FSDP groups of whole nodes (ZeRO-3 over the network), data across groups of nodes
        inner_data, inner_fsdp = 1, room
    else:
        raise ValueError(
            f"mesh fsdp x tensor = {fsdp} x {tensor} neither fits inside a {per}-device process (node) nor spans whole "
            f"ones: choose fsdp dividing {room} (FSDP inside a node, data across nodes) or a multiple of {room}"
        )
    if data % inner_data:
        raise ValueError(f"mesh.data={data} does not split into {inner_data} data groups per node")
    outer = (data // inner_data, fsdp // inner_fsdp)
    grid = np.empty((len(units), per), dtype=object)
    grid[:] = units
    grid = grid.reshape(*outer, inner_data, inner_fsdp, tensor)  # [nodes: data, fsdp; in a node: data, fsdp, tensor]
    return grid.transpose(0, 2, 1, 3, 4).reshape(shape)


def single_device_mesh(device=None) -> Mesh:
    return make_mesh(MeshConfig(1, 1, 1), [device or jax.devices()[0]])


def engine_count(mesh: Mesh, num_engines: int) -> int:
    """``num_engines`` resolved: -1 is one engine per tensor-parallel group (devices / ``tensor``)."""
    groups = mesh.size // mesh.shape["tensor"]
    n = groups if num_engines == -1 else int(num_engines)
    if n < 1 or groups % n:
        raise ValueError(
            f"{num_engines} rollout engines do not split the mesh's {groups} tensor-parallel groups (data x fsdp = "
            f"{mesh.shape['data']} x {mesh.shape['fsdp']}); use a divisor of {groups}, or -1 for one engine per group"
        )
    return n


def engine_meshes(mesh: Mesh, num_engines: int) -> list[Mesh]:
    """Disjoint sub-meshes for ``num_engines`` rollout engines (-1: one per tensor-parallel group), each a whole number
    of the mesh's tensor-parallel groups (a TP group is never split). The data x fsdp groups are taken in the mesh's
    order (data-major: with an HSDP mesh, whose fsdp axis runs inside a node, an engine's devices share a node), and
    each engine's groups are laid along its ``data`` axis: its mesh is (groups, 1, tensor) with the same axis names,
    so the logical rules apply unchanged (its batch over its data axis, heads over its tensor axis)."""
    n = engine_count(mesh, num_engines)
    t = mesh.shape["tensor"]
    order = [mesh.axis_names.index(a) for a in AXES]
    groups = np.transpose(mesh.devices, order).reshape(-1, t)  # [data * fsdp, tensor]
    per = groups.shape[0] // n
    return [Mesh(groups[e * per:(e + 1) * per].reshape(per, 1, t), AXES) for e in range(n)]
