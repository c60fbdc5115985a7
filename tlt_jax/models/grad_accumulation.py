"""The stacked layers' scan with gradient accumulation in place: each layer's parameter gradient is added into a given
accumulator in the backward pass, so micro-batch accumulation holds one gradient-sized buffer, not two.

Under plain autodiff a micro-batch's layer gradients are written into a fresh [L, ...] buffer (the transposed scan's
outputs) and only then added to the accumulator: both exist at once. Here a ``custom_vjp`` runs the backward pass as
its own reverse scan that carries the accumulator and adds layer l's gradient into slice l (an in-place
dynamic-update-slice), and returns the accumulator as the layers' cotangent. The forward saves each layer's input
only and recomputes the layer in the backward pass (as ``jax.checkpoint`` on the scan body does), and every sum is
``acc[l] + g[l]`` as before, so the result is the plain path's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx


def _layer(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _add_into(acc, g, i):
    return jax.lax.dynamic_update_index_in_dim(acc, jax.lax.dynamic_index_in_dim(acc, i, keepdims=False) + g, i, 0)


def scan_accumulating(
    layers: nnx.Module,
    x: jax.Array,
    consts: tuple,
    grads_into: nnx.State,
    run: Callable[[nnx.Module, jax.Array, tuple], jax.Array],
) -> jax.Array:
    """``run(layer, h, consts)`` over the stacked ``layers`` from ``x``; returns the last layer's output.

    Differentiated with respect to the layers' parameters, the cotangent is ``grads_into`` plus this call's
    gradient, summed in place (``grads_into``: a state structured like ``nnx.state(layers, nnx.Param)``; it gets no
    cotangent of its own). ``consts`` (arrays every layer reads, e.g. RoPE tables and the attention mask) get none
    either: they must not depend on what is differentiated."""
    graphdef, params, other = nnx.split(layers, nnx.Param, ...)
    if jax.tree.structure(grads_into) != jax.tree.structure(params):
        raise ValueError("scan_accumulating: grads_into is not structured like the layers' parameters")
    n = jax.tree.leaves(params)[0].shape[0]

    def apply(p, h, consts):  # consts: (the caller's, the layers' non-parameter state)
        return run(nnx.merge(graphdef, p, consts[1]), h, consts[0])

    @jax.custom_vjp
    def stack(params, acc, x, consts):
        return jax.lax.scan(lambda h, p: (apply(p, h, consts), None), x, params)[0]

    def fwd(params, acc, x, consts):
        h, inputs = jax.lax.scan(lambda h, p: (apply(p, h, consts), h), x, params)
        return h, (params, acc, inputs, consts)

    def bwd(res, ct):
        params, acc, inputs, consts = res

        def body(carry, i):
            ct_h, acc = carry
            _, vjp = jax.vjp(lambda p, h: apply(p, h, consts), _layer(params, i), _layer(inputs, i))
            g, ct_h = vjp(ct_h)
            return (ct_h, jax.tree.map(lambda a, b: _add_into(a, b, i), acc, g)), None

        (ct_x, acc), _ = jax.lax.scan(body, (ct, acc), jnp.arange(n), reverse=True)
        return acc, None, ct_x, jax.tree.map(lambda _: None, consts)

    stack.defvjp(fwd, bwd)
    return stack(params, grads_into, x, (consts, other))
