"""Meshes, mesh slices, logical-axis sharding rules, and multi-process start-up (``runtime``) and host collectives
(``multihost``)."""

from tlt_jax.distributed.mesh import AXES, MeshConfig, engine_count, engine_meshes, make_mesh, single_device_mesh
from tlt_jax.distributed.runtime import LaunchSpec, initialize, resolve_launch
from tlt_jax.distributed.sharding import (
    DEFAULT_RULES,
    LogicalRules,
    activation_sharding,
    constrain,
    decode_rules,
    init_sharded,
    logical_sharding,
    max_device_bytes,
    shard_module,
    state_shardings,
    with_activations,
)

__all__ = [
    "AXES",
    "DEFAULT_RULES",
    "LaunchSpec",
    "LogicalRules",
    "MeshConfig",
    "activation_sharding",
    "constrain",
    "decode_rules",
    "engine_count",
    "engine_meshes",
    "init_sharded",
    "initialize",
    "logical_sharding",
    "make_mesh",
    "max_device_bytes",
    "resolve_launch",
    "shard_module",
    "single_device_mesh",
    "state_shardings",
    "with_activations",
]
