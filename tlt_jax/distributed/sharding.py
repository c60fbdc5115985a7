"""Logical-axis rules: one validated table maps parameter/activation logical axis names to mesh axes."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The nnx.Variable metadata key under which parameters carry their logical axis names.
LOGICAL_AXES = "logical_axes"


MeshAxes = str | tuple[str, ...] | None

DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", ("data", "fsdp")),
    ("layers", None),
    ("vocab", "tensor"),
    ("vocab_in", "tensor"),  # an untied input embedding's rows (only looked up); replicated by decode_rules
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
)


@dataclasses.dataclass(frozen=True)
class LogicalRules:
    """Logical axis name → mesh axis (or tuple of mesh axes, or None = replicated). Unknown names are errors.

    A tensor dimension whose size the mesh axes do not divide is an error naming the tensor, unless its logical
    axis is listed in ``replicate_indivisible`` (then that dimension is replicated). By default only "batch" is:
    rollout waves and evaluation batches shrink to sizes such as 1, and replicating their rows costs compute, never
    parameter memory; a parameter silently replicated over a tensor / fsdp axis would be a memory surprise.
    """

    rules: tuple[tuple[str, MeshAxes], ...] = DEFAULT_RULES
    replicate_indivisible: tuple[str, ...] = ("batch",)

    def __post_init__(self):
        names = [n for n, _ in self.rules]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"logical axis rules name {sorted(dup)} more than once; give each logical axis one rule")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, MeshAxes] | Sequence[tuple[str, MeshAxes]]) -> LogicalRules:
        items = mapping.items() if isinstance(mapping, Mapping) else mapping
        return cls(tuple((str(k), tuple(v) if isinstance(v, list) else v) for k, v in items))

    def lookup(self, name: str) -> tuple[str, ...]:
        for n, axes in self.rules:
            if n == name:
                if axes is None:
                    return ()
                return (axes,) if isinstance(axes, str) else tuple(axes)
        raise KeyError(f"logical axis {name!r} has no sharding rule; known: {[n for n, _ in self.rules]}")

    def validate(self, mesh: Mesh) -> None:
        for name, _ in self.rules:
            for ax in self.lookup(name):
                if ax not in mesh.axis_names:
                    raise ValueError(f"rule {name!r} -> {ax!r}: mesh has no axis {ax!r} (mesh axes: {mesh.axis_names})")

    def spec(
        self, logical: Sequence[str | None], mesh: Mesh, shape: Sequence[int] | None = None, *, tensor: str = ""
    ) -> PartitionSpec:
        """PartitionSpec for one tensor (``tensor``: its path, for errors). Two logical axes on one mesh axis is an
        error; so is a dimension the mesh axes do not divide, unless its logical axis is in
        ``replicate_indivisible`` (then it is replicated, with a log line)."""
        used: dict[str, str] = {}
        out = []
        for i, name in enumerate(logical):
            axes = () if name is None else self.lookup(name)
            for a in axes:
                if a not in mesh.axis_names:
                    raise ValueError(f"logical axis {name!r} maps to {a!r}, which mesh {mesh.axis_names} lacks")
                if a in used:
                    raise ValueError(
                        f"logical axes {used[a]!r} and {name!r} of one tensor {tuple(logical)} both map to mesh "
                        f"axis {a!r}; change the rules so each mesh axis is used once per tensor"
                    )
                used[a] = name
            if shape is not None and axes:
                size = 1
                for a in axes:
                    size *= mesh.shape[a]
                if shape[i] % size:
                    if name not in self.replicate_indivisible:
                        what = f"tensor {tensor!r}" if tensor else f"a tensor with logical axes {tuple(logical)}"
                        raise ValueError(
                            f"{what} of shape {tuple(shape)}: dimension {i} (logical axis {name!r}, size {shape[i]}) "
                            f"does not divide over mesh axis {'x'.join(axes)} of size {size}; pick a mesh whose "
                            f"{'x'.join(axes)} size divides {shape[i]}, or replicate that dimension explicitly with "
                            f"LogicalRules(replicate_indivisible=(..., {name!r}))"
                        )
                    logging.info(
                        "%s dim %d (%s, size %d) not divisible by %s: replicated", tensor, i, name, shape[i], axes
                    )
                    axes = ()
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*out)


# (mesh, rules) under which ``constrain`` pins activations; set while a sharded step is traced (``with_activations``).
_ACTIVATIONS: contextvars.ContextVar[tuple[Mesh, LogicalRules] | None] = contextvars.ContextVar(
    "tlt_jax_activation_sharding", default=None
)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: LogicalRules):
    """Within this block, ``constrain`` pins activations to ``mesh`` by ``rules`` (outside it, it does nothing)."""
    token = _ACTIVATIONS.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVATIONS.reset(token)


def with_activations(fn, mesh: Mesh | None, rules: LogicalRules):
    """``fn`` traced under ``activation_sharding(mesh, rules)`` (unchanged without a mesh): wrap before ``jax.jit``."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with activation_sharding(mesh, rules):
            return fn(*args, **kwargs)

    return traced


def activation_context() -> tuple[Mesh, LogicalRules] | None:
    """The (mesh, rules) of the enclosing ``activation_sharding`` block, or None."""
    return _ACTIVATIONS.get()


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout by logical axis names, e.g. ("batch", None, None) for [B, T, E] hidden states, so
    that XLA shards the layers' work by batch (FSDP: weights gathered per layer, activations never) instead of
    choosing layouts that all-gather activations. A no-op outside ``activation_sharding``."""
    ctx = _ACTIVATIONS.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.spec(logical, mesh, x.shape)))


def decode_rules(rules: LogicalRules) -> LogicalRules:
    """The rollout (decode) layout of ``rules``: parameters no longer split over the data-parallel mesh axes (those
    of "batch": "data", "fsdp"), only over the others ("tensor": heads, MLP columns, vocabulary). A decode or verify
    step then reads every weight where it lies instead of all-gathering it at every token step; the engine reshards
    the trained weights into this layout once per RL step (``RolloutEngine.set_params``).

    An untied model's input embedding ("vocab_in") is whole on every device of an engine: a token step only looks
    up rows of it, which split by vocabulary costs an all-reduce of the rows looked up (one more per step beside the
    layers' two); whole, it costs none, for vocab x hidden x (1 - 1 / tensor) more bytes per device."""
    data_axes = set(rules.lookup("batch"))

    def keep(name: str, axes: MeshAxes) -> MeshAxes:
        if name == "batch" or axes is None:
            return axes
        if name == "vocab_in":
            return None
        left = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a not in data_axes)
        return None if not left else left[0] if len(left) == 1 else left

    return dataclasses.replace(rules, rules=tuple((n, keep(n, a)) for n, a in rules.rules))


def max_device_bytes(tree) -> int:
    """The most bytes of ``tree``'s arrays that any one device holds (its addressable shards, summed per device)."""
    per_device: dict = {}
    for x in jax.tree.leaves(tree):
        for shard in getattr(x, "addressable_shards", ()):
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: nnx.State, mesh: Mesh, rules: LogicalRules) -> nnx.State:
    """NamedSharding for every variable of an (abstract) NNX state, from its ``logical_axes`` metadata."""
    rules.validate(mesh)

    def one(path, var):
        meta = var.get_metadata()
        logical = meta.get(LOGICAL_AXES)
        name = ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        spec = PartitionSpec() if logical is None else rules.spec(logical, mesh, var.shape, tensor=name)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_var)


def init_sharded(make_module, mesh: Mesh, rules: LogicalRules = LogicalRules()):
    """Build an NNX module with every parameter created directly in its sharding (never whole on one device)."""
    abstract = nnx.eval_shape(make_module)
    graphdef, abs_state = nnx.split(abstract)
    shardings = state_shardings(abs_state, mesh, rules)

    def init():
        return nnx.state(make_module())

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def shard_module(module: nnx.Module, mesh: Mesh, rules: LogicalRules = LogicalRules()) -> nnx.Module:
    """Place an existing module's state on ``mesh`` according to the rules (used after loading weights)."""
    graphdef, state = nnx.split(module)
    shardings = state_shardings(state, mesh, rules)
    return nnx.merge(graphdef, jax.device_put(state, shardings))


def logical_sharding(mesh: Mesh, rules: LogicalRules, *logical: str | None) -> NamedSharding:
    """Sharding of an activation/input from logical axis names, e.g. ('batch', None)."""
    return NamedSharding(mesh, rules.spec(logical, mesh))
