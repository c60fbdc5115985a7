"""Decoder-only causal LM (Llama / Qwen2 / SmolLM2 families) in Flax NNX, with layers stacked and scanned."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.distributed.sharding import constrain
from tlt_jax.kernels import ATTENTION_IMPLS
from tlt_jax.models.config import ModelConfig, rope_inv_freq
from tlt_jax.models.grad_accumulation import scan_accumulating
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.layers import LOGICAL_AXES, DecoderLayer, RMSNorm, param, rope_cos_sin


class ModelOutput(NamedTuple):
    logits: jax.Array | None  # [B, T, V] (or [B, K, V] at logits_indices)
    hidden: jax.Array  # [B, T, H], final-normed: the tensor that feeds the LM head (EAGLE's feature)
    k_new: jax.Array | None  # [L, B, T, KV, D]: the new tokens' keys, for the caller to commit (None: layer_grads_into)
    v_new: jax.Array | None


def causal_mask(t: int) -> jax.Array:
    return jnp.tril(jnp.ones((t, t), bool))


def build_new_token_mask(batch, t, attention_mask=None, segment_ids=None, tree_mask=None):
    """[B, T, T] visibility among the new tokens: causal, restricted by padding or packed segments, or a tree mask."""
    if tree_mask is not None:
        return tree_mask.astype(bool)
    mask = jnp.broadcast_to(causal_mask(t)[None], (batch, t, t))
    if attention_mask is not None:
        mask = mask & attention_mask.astype(bool)[:, None, :]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask


def stacked_layers(cfg: ModelConfig, n: int, *, rngs: nnx.Rngs, **layer_kwargs) -> DecoderLayer:
    """n decoder layers whose parameters are stacked on a leading 'layers' axis (compile time independent of n)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=n)
    def make(r):
        return DecoderLayer(cfg, rngs=r, **layer_kwargs)

    layers = make(rngs)
    for _, var in nnx.iter_graph(layers):
        if isinstance(var, nnx.Variable) and var.has_metadata(LOGICAL_AXES):
            var.set_metadata(**{LOGICAL_AXES: ("layers", *var.get_metadata()[LOGICAL_AXES])})
    return layers


# Hidden states [B, T, E] between layers: split by batch (under a sharded train step; see distributed.constrain).
ACTIVATION = ("batch", None, None)

# Most new tokens per row the Pallas kernel takes (decode and verify trees); longer (prefill-sized) calls use XLA.
PALLAS_MAX_NEW_TOKENS = 128


def unstack_layers(layers: DecoderLayer, n: int) -> nnx.List:
    """The n stacked layers as a list of n separate layers, each parameter its own array.

    Decoding then runs the layers unrolled, every matmul reading its weights where they lie: scanning stacked
    weights makes XLA on GPU copy each layer's weight slices out of the stack at every step (profiled on an H200:
    6.4 of a 7B decode step's 12.5 ms)."""
    graphdef, state = nnx.split(layers)
    out = []
    for i in range(n):
        layer = nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], state))
        for _, var in nnx.iter_graph(layer):
            if isinstance(var, nnx.Variable) and var.has_metadata(LOGICAL_AXES):
                axes = var.get_metadata()[LOGICAL_AXES]
                if axes and axes[0] == "layers":
                    var.set_metadata(**{LOGICAL_AXES: tuple(axes[1:])})
        out.append(layer)
    return nnx.List(out)


def scan_layers(layers: DecoderLayer | nnx.List, x, cos, sin, new_mask, cache: KVCache | None, remat: bool = False,
                attention_impl: str = "xla", attend_len: int | None = None, grads_into: nnx.State | None = None):
    """Run the layers: stacked layers with lax.scan, an ``unstack_layers`` list unrolled (layer i reads cache layer
    i); returns the final activations and the new keys/values of every layer [L, B, T, KV, D].
    grads_into (a training forward, no cache): the layers' parameter gradients are added into it in place in the
    backward pass, each layer recomputed there (``grad_accumulation``); no keys/values are returned (None).
    attention_impl "pallas" with a cache and at most PALLAS_MAX_NEW_TOKENS new tokens: the tree-attention kernel.
    attend_len (static): attention reads only the first attend_len cache positions, sliced inside each layer's step
    (fused with that layer's read) rather than copying the whole cache prefix up front. The kernel takes the whole
    cache (it loads no block at or past a row's length; a slice would be copied for its call: 7.5 GB a token step
    of the 7B shape at batch 64, compiled for an H100)."""
    use_kernel = attention_impl == "pallas" and cache is not None and x.shape[1] <= PALLAS_MAX_NEW_TOKENS
    n = None if cache is None else min(cache.max_len, attend_len or cache.max_len)
    cache_mask = None if cache is None or use_kernel else cache.attention_mask(x.shape[1], n)
    cache_len = cache.lengths if use_kernel else None

    def run(layer, h, kc, vc):
        if kc is not None and n < kc.shape[1] and not use_kernel:
            kc, vc = kc[:, :n], vc[:, :n]
        h, kv = layer(constrain(h, ACTIVATION), cos, sin, new_mask, kc, vc, cache_mask, cache_len)
        return constrain(h, ACTIVATION), kv

    if grads_into is not None:
        if cache is not None or isinstance(layers, nnx.List):
            raise ValueError("grads_into goes with a training forward: stacked layers and no KV cache")

        def run_layer(layer, h, consts):  # the RoPE tables and mask as arguments: the custom VJP closes over none
            h, _ = layer(constrain(h, ACTIVATION), *consts, None, None, None, None)
            return constrain(h, ACTIVATION)

        return scan_accumulating(layers, x, (cos, sin, new_mask), grads_into, run_layer), None, None

    if isinstance(layers, nnx.List):
        ks, vs = [], []
        for i, layer in enumerate(layers):
            kc, vc = (None, None) if cache is None else cache.layer(i)
            gd, st = nnx.split(layer)
            fn = lambda st, h, kc, vc, gd=gd: run(nnx.merge(gd, st), h, kc, vc)  # noqa: E731
            x, (k, v) = (jax.checkpoint(fn) if remat else fn)(st, x, kc, vc)
            ks.append(k)
            vs.append(v)
        return x, jnp.stack(ks), jnp.stack(vs)

    if cache is not None and cache.per_layer:
        raise ValueError("a per-layer KVCache goes with unstacked layers (rollout_copy(..., layers='unstacked'))")
    graphdef, state = nnx.split(layers)

    def body(h, xs):
        layer_state, kc, vc = xs
        return run(nnx.merge(graphdef, layer_state), h, kc, vc)

    if remat:
        body = jax.checkpoint(body)
    ks = (None, None) if cache is None else (cache.k, cache.v)
    x, (k_new, v_new) = jax.lax.scan(body, x, (state, *ks))
    return x, k_new, v_new


class CausalLM(nnx.Module):
    """Causal LM. Positions and masks are explicit, so one forward serves padded or packed full sequences,
    KV-cached decode with per-row lengths, and tree verification (tree_mask + positions = length + depth)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.dtype = dtype
        self.remat = False
        self.attention_impl = "xla"  # or "pallas": tree-attention kernel for cached decode/verify (rollout_copy)
        # Tied, the embedding is the LM head too, split by vocabulary; untied, it is only looked up ("vocab_in", whole
        # on each device of a rollout engine: distributed.sharding.decode_rules).
        vocab = "vocab" if cfg.tie_word_embeddings else "vocab_in"
        self.embed_tokens = param(rngs, (cfg.vocab_size, cfg.hidden_size), (vocab, "embed"), param_dtype)
        self.layers = stacked_layers(cfg, cfg.num_layers, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), param_dtype)

    def embed(self, input_ids: jax.Array) -> jax.Array:
        return jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(self.dtype)

    def lm_head_weight(self) -> jax.Array:
        """The LM head's parameter as stored: ``lm_head`` [E, V], or the tied embedding [V, E]."""
        return self.embed_tokens[...] if self.lm_head is None else self.lm_head[...]

    def logits_from_hidden(self, hidden: jax.Array, weight: jax.Array | None = None) -> jax.Array:
        """LM head on final-normed hidden states (shared, frozen, with the EAGLE drafter). ``weight``: the
        ``lm_head_weight()`` array as the caller placed it (e.g. split by vocabulary), default the parameter itself."""
        w = (self.lm_head_weight() if weight is None else weight).astype(self.dtype)
        if self.lm_head is None:
            return jnp.einsum("...e,ve->...v", hidden, w)
        return hidden @ w

    def rope(self, positions: jax.Array):
        inv = jnp.asarray(rope_inv_freq(self.config).astype(np.float32))
        return rope_cos_sin(positions, inv)

    def __call__(
        self,
        input_ids: jax.Array,
        *,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        tree_mask: jax.Array | None = None,
        cache: KVCache | None = None,
        logits_indices: jax.Array | None = None,
        return_logits: bool = True,
        attend_len: int | None = None,
        layer_grads_into: nnx.State | None = None,
    ) -> ModelOutput:
        """Forward over T new tokens per row.

        input_ids [B, T]; positions [B, T] (default: cache length + arange(T), or arange(T)); attention_mask [B, T]
        marks valid (non-padding) tokens; segment_ids [B, T] separates packed samples; tree_mask [B, T, T] replaces
        the causal mask among new tokens; cache: keys/values the new tokens also attend to (up to each row's length);
        logits_indices [B, K]: compute logits only at these positions. attend_len (static int): attention reads only
        the first attend_len cache positions (>= every row's length; a cache-length bucket). layer_grads_into
        (training, no cache): a gradient accumulator for the stacked layers' parameters that their gradients are
        added into in the backward pass (``scan_layers``' grads_into; k_new / v_new are then None).
        """
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"CausalLM.attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        b, t = input_ids.shape
        if positions is None:
            base = jnp.zeros((b,), jnp.int32) if cache is None else cache.lengths
            positions = base[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        new_mask = build_new_token_mask(b, t, attention_mask, segment_ids, tree_mask)
        cos, sin = self.rope(positions)
        x = constrain(self.embed(input_ids), ACTIVATION)
        x, k_new, v_new = scan_layers(
            self.layers, x, cos, sin, new_mask, cache, remat=self.remat, attention_impl=self.attention_impl,
            attend_len=attend_len, grads_into=layer_grads_into,
        )
        hidden = constrain(self.norm(x), ACTIVATION)
        logits = None
        if return_logits:
            h = hidden if logits_indices is None else jnp.take_along_axis(hidden, logits_indices[..., None], axis=1)
            logits = self.logits_from_hidden(h)
        return ModelOutput(logits, hidden, k_new, v_new)


LAYER_LAYOUTS = ("stacked", "unstacked")


def rollout_copy(model: CausalLM, *, dtype=None, attention_impl: str | None = None,
                 layers: str | None = None) -> CausalLM:
    """The model as the rollout engine runs it: parameters and compute in ``dtype`` (e.g. bfloat16, while the trainer
    keeps float32 masters; the KV cache follows), ``attention_impl``, and ``layers``: "stacked" (scanned, as the
    trainer holds them) or "unstacked" (``unstack_layers``: one array per layer, run unrolled). Returns ``model``
    itself when nothing changes; otherwise a new module (the original is untouched)."""
    if attention_impl is not None and attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
    if layers is not None and layers not in LAYER_LAYOUTS:
        raise ValueError(f"layers must be one of {LAYER_LAYOUTS}, got {layers!r}")
    if dtype is not None:
        dtype = jnp.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"rollout dtype must be a floating dtype such as bfloat16 or float32, got {dtype}")
    unstacked = isinstance(model.layers, nnx.List)
    if layers == "stacked" and unstacked:
        raise ValueError("rollout_copy: the model's layers are already unstacked; pass the stacked (trainer) model")
    unstack = layers == "unstacked" and not unstacked
    if (dtype is None or dtype == model.dtype) and (attention_impl in (None, model.attention_impl)) and not unstack:
        return model
    graphdef, state = nnx.split(model)
    if dtype is not None:
        cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
        state = jax.tree.map(cast, state)
    copy = nnx.merge(graphdef, state)
    for _, module in nnx.iter_graph(copy):
        if dtype is not None and isinstance(module, nnx.Module) and hasattr(module, "dtype"):
            module.dtype = dtype
    if attention_impl is not None:
        copy.attention_impl = attention_impl
    if unstack:
        copy.layers = unstack_layers(copy.layers, copy.config.num_layers)
    return copy
