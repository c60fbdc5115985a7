"""Meshes, mesh slices, logical-axis sharding rules, and multi-process start-up (``runtime``) and host collectives
(``multihost``)."""

from tlt_jax.distributed.mesh import AXES, MeshConfig, make_mesh, single_device_mesh, split_mesh
from tlt_jax.distributed.runtime import LaunchSpec, initialize, resolve_launch
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
    "LaunchSpec",
    "LogicalRules",
    "MeshConfig",
    "init_sharded",
    "initialize",
    "logical_sharding",
    "make_mesh",
    "resolve_launch",
    "shard_module",
    "single_device_mesh",
    "split_mesh",
    "state_shardings",
]
