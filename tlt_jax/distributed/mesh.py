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


def split_mesh(mesh: Mesh, num_slices: int, axis: str = "data") -> list[Mesh]:
    """Disjoint sub-meshes along ``axis`` (each keeps the same axis names): one rollout engine per slice."""
    size = mesh.shape[axis]
    if size % num_slices:
        raise ValueError(f"mesh axis {axis!r} of size {size} cannot be split into {num_slices} slices")
    i = mesh.axis_names.index(axis)
    return [Mesh(d, mesh.axis_names) for d in np.split(mesh.devices, num_slices, axis=i)]
