"""Meshes with named axes (data, fsdp, tensor) and disjoint slices of one mesh for independent rollout engines."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape over (data, fsdp, tensor); -1 in one place takes the remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        dims = [self.data, self.fsdp, self.tensor]
        if dims.count(-1) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got {dims}")
        if any(d == 0 or d < -1 for d in dims):
            raise ValueError(f"mesh axis sizes must be positive or -1, got {dims}")
        known = int(np.prod([d for d in dims if d != -1]))
        if -1 in dims:
            if num_devices % known:
                raise ValueError(f"{num_devices} devices cannot be split into mesh {dims}")
            dims[dims.index(-1)] = num_devices // known
        if int(np.prod(dims)) != num_devices:
            raise ValueError(
                f"mesh {dict(zip(AXES, dims, strict=True))} needs {int(np.prod(dims))} devices, have {num_devices}"
            )
        return tuple(dims)


def make_mesh(cfg: MeshConfig = MeshConfig(), devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.resolve(len(devices))
    return Mesh(np.asarray(devices).reshape(shape), AXES)


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
