"""Meshes, mesh slices and logical-axis sharding rules."""

from tlt_jax.distributed.mesh import AXES, MeshConfig, make_mesh, single_device_mesh, split_mesh
from tlt_jax.distributed.sharding import (
    DEFAULT_RULES,
    LogicalRules,
    init_sharded,
    logical_sharding,
    shard_module,
    state_shardings,
)

__all__ = [
    "AXES",
    "DEFAULT_RULES",
    "LogicalRules",
    "MeshConfig",
    "init_sharded",
    "logical_sharding",
    "make_mesh",
    "shard_module",
    "single_device_mesh",
    "split_mesh",
    "state_shardings",
]
