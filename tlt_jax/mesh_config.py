"""The mesh's shape as the config gives it: no JAX here, so reading a config (entry points' flag errors, launch
scripts) does not start JAX. Meshes themselves: ``tlt_jax.distributed.mesh``."""

from __future__ import annotations

import dataclasses
import math

AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape over (data, fsdp, tensor); -1 in one place takes the remaining devices. Across nodes ``tensor``
    must divide a node's devices, and ``fsdp`` x ``tensor`` divide them (HSDP) or span whole nodes (``make_mesh``)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        dims = [self.data, self.fsdp, self.tensor]
        if dims.count(-1) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got {dims}")
        if any(d == 0 or d < -1 for d in dims):
            raise ValueError(f"mesh axis sizes must be positive or -1, got {dims}")
        known = math.prod(d for d in dims if d != -1)
        if -1 in dims:
            if num_devices % known:
                raise ValueError(f"{num_devices} devices cannot be split into mesh {dims}")
            dims[dims.index(-1)] = num_devices // known
        if math.prod(dims) != num_devices:
            raise ValueError(
                f"mesh {dict(zip(AXES, dims, strict=True))} needs {math.prod(dims)} devices, have {num_devices}"
            )
        return tuple(dims)
