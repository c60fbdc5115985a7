"""The trained policy into every rollout engine's layout in one compiled program, once per RL step.

The trainer holds float32 masters sharded for training (FSDP over ``data`` x ``fsdp``, heads / MLP over ``tensor``);
each engine decodes a copy in its rollout layout (``rollout_copy``: dtype, attention, stacked or unstacked layers)
split over its own ``tensor`` devices only (``decode_rules``). ``Resharder`` compiles one program over every engine's
devices (the global mesh's, all processes') whose outputs are laid out on an ``engine`` x data x fsdp x ``tensor``
mesh: replicated over the engines, split over ``tensor`` as each engine's own layout is. Every device's shard of the
result is then exactly the shard its engine needs, and each engine's arrays are assembled from its devices' shards
(``jax.make_array_from_single_device_arrays``: no copy, no host). No parameter is ever gathered whole onto one device
(each device receives only its tensor-parallel share; the cast runs on the trainer's shards before they move), and
across processes each process assembles only its own engines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from tlt_jax.distributed import LogicalRules, decode_rules, max_device_bytes, state_shardings
from tlt_jax.models import rollout_copy

__all__ = ["Resharder", "engines_mesh"]

ENGINE_AXIS = "engine"


def engines_mesh(meshes: Sequence[Mesh]) -> Mesh:
    """The engines' meshes stacked along a leading ``engine`` axis (they must have equal shapes and axis names)."""
    shapes = {m.devices.shape for m in meshes}
    names = {m.axis_names for m in meshes}
    if len(shapes) != 1 or len(names) != 1:
        raise ValueError(f"engine meshes differ in shape or axes: {sorted(shapes)}, {sorted(names)}")
    return Mesh(np.stack([m.devices for m in meshes]), (ENGINE_AXIS, *meshes[0].axis_names))


@dataclasses.dataclass
class _Layout:
    graphdef: Any  # the rollout copy's graphdef
    global_shardings: nnx.State  # per variable, a NamedSharding over engines_mesh
    engine_shardings: list  # per engine, the copy's shardings on that engine's mesh


class Resharder:
    """``Resharder(meshes, layout, rules)(model)`` -> this process's engines' rollout copies of ``model``.

    meshes: every engine's mesh (all processes', in engine order; see ``engine_meshes``); layout: ``rollout_copy``'s
    keywords (dtype, attention_impl, layers). The program is compiled on the first call for the model's structure and
    shardings and reused while they stay the same (every RL step). ``last_bytes`` is the largest per-device size of
    the copy it made (``rollout/reshard_bytes``)."""

    def __init__(self, meshes: Sequence[Mesh], layout: dict, rules: LogicalRules = LogicalRules()):
        self.meshes = list(meshes)
        self.layout = dict(layout)
        self.param_rules = decode_rules(rules)
        self.mesh = engines_mesh(self.meshes)
        me = jax.process_index()
        self.local = [e for e, m in enumerate(self.meshes) if any(d.process_index == me for d in m.devices.flat)]
        self._key = None
        self._program = None
        self._out: _Layout | None = None
        self.last_bytes = 0

    def _compile(self, graphdef, state) -> None:
        """The rollout copy's structure and shardings (from an abstract trace), and the program that makes it."""
        copy = nnx.eval_shape(lambda s: rollout_copy(nnx.merge(graphdef, s), **self.layout), state)
        copy_def, abstract = nnx.split(copy)
        per_engine = [state_shardings(abstract, m, self.param_rules) for m in self.meshes]
        global_sh = jax.tree.map(lambda sh: NamedSharding(self.mesh, sh.spec), per_engine[0])
        self._out = _Layout(copy_def, global_sh, per_engine)

        def program(s):
            return nnx.state(rollout_copy(nnx.merge(graphdef, s), **self.layout))

        self._program = jax.jit(program, out_shardings=global_sh)

    def _own_layout(self, model):
        """(graphdef, state, engine shardings) when one engine's layout is ``model``'s own; else None."""
        if len(self.meshes) != 1 or _changes_layout(model, **self.layout):
            return None
        graphdef, state = nnx.split(model)
        want = state_shardings(state, self.meshes[0], self.param_rules)
        same = all(isinstance(x, jax.Array) and x.sharding.is_equivalent_to(w, x.ndim)
                   for x, w in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True))
        return (graphdef, state, want) if same else None

    def program_for(self, model):
        """The jitted program and its argument for ``model`` (compiled lazily; for plans and tests)."""
        graphdef, state = nnx.split(model)
        key = (graphdef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves(state)))
        if key != self._key:
            self._compile(graphdef, state)
            self._key = key
        return self._program, state

    def __call__(self, model) -> dict[int, Any]:
        """This process's engines' copies of ``model`` as modules (engine index -> module on that engine's mesh). A
        collective: every process calls it with the same model. Callers drop their previous copies first, so that
        at most one rollout copy is alive. One engine whose layout is the model's own (same dtype, layers and
        shardings: e.g. data-parallel float32 on one device) takes the model's arrays as they are (no copy)."""
        own = self._own_layout(model)
        if own is not None:
            graphdef, state, want = own
            self.last_bytes = max_device_bytes(state)
            return {0: nnx.merge(graphdef, jax.tree.map(_assemble, state, want))}
        program, state = self.program_for(model)
        out = program(state)
        self.last_bytes = max_device_bytes(out)
        lay = self._out
        return {e: nnx.merge(lay.graphdef, jax.tree.map(_assemble, out, lay.engine_shardings[e])) for e in self.local}


def _changes_layout(model, dtype=None, attention_impl=None, layers=None) -> bool:
    """Whether ``rollout_copy(model, ...)`` makes a new module (else it returns ``model`` itself)."""
    unstack = layers == "unstacked" and not isinstance(model.layers, nnx.List)
    return (dtype is not None and jnp.dtype(dtype) != model.dtype) or attention_impl not in (
        None, model.attention_impl) or unstack


def _assemble(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """The engine's array from the shards ``x`` holds on that engine's devices (the same buffers: no copy)."""
    if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == sharding.mesh and x.sharding.spec == sharding.spec:
        return x
    mine = set(sharding.mesh.devices.flat)
    shards = [s.data for s in x.addressable_shards if s.device in mine]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)
