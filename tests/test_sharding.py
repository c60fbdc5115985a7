"""Logical-axis rules on 8 simulated devices: a dimension the mesh does not divide is an error naming the tensor,
unless replication is asked for explicitly (LogicalRules.replicate_indivisible)."""

import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from tlt_jax.distributed import LogicalRules, MeshConfig, make_mesh, state_shardings
from tlt_jax.models import CausalLM, tiny_config


def _abstract_params(**cfg):
    return nnx.state(nnx.eval_shape(lambda: CausalLM(tiny_config(**cfg), rngs=nnx.Rngs(0))), nnx.Param)


def test_indivisible_parameter_is_an_error_naming_tensor_shape_axis_and_mesh_size():
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=8))
    params = _abstract_params(num_heads=4, num_kv_heads=2)  # 4 query / 2 KV heads over 8 tensor devices
    with pytest.raises(ValueError) as e:
        state_shardings(params, mesh, LogicalRules())
    msg = str(e.value)
    assert "tensor 'layers.self_attn." in msg and "_proj" in msg, msg
    assert "logical axis 'kv_heads', size 2" in msg or "logical axis 'q_heads', size 4" in msg, msg
    assert "mesh axis tensor of size 8" in msg and "replicate_indivisible" in msg, msg


def test_explicit_replication_and_batch_default():
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=8))
    params = _abstract_params(num_heads=4, num_kv_heads=2)
    rules = LogicalRules(replicate_indivisible=("batch", "q_heads", "kv_heads"))
    shardings = state_shardings(params, mesh, rules)
    k = shardings["layers"]["self_attn"]["k_proj"].get_value()
    assert k.spec == PartitionSpec(None, "fsdp", None, None)  # [layers, embed, kv_heads, head_dim]: heads replicated
    assert shardings["embed_tokens"].get_value().spec == PartitionSpec("tensor", "fsdp")  # vocab 256 / 8: sharded
    # "batch" is replicable by default (shrinking rollout waves); strict when the rules say so.
    data_mesh = make_mesh(MeshConfig(data=8, fsdp=1, tensor=1))
    assert LogicalRules().spec(("batch", None), data_mesh, (3, 16)) == PartitionSpec(None, None)
    assert LogicalRules().spec(("batch", None), data_mesh, (16, 16)) == PartitionSpec(("data", "fsdp"), None)
    strict = LogicalRules(replicate_indivisible=())
    with pytest.raises(
        ValueError, match=r"tensor 'rows' of shape \(3, 16\): dimension 0 \(logical axis 'batch', size 3"
    ):
        strict.spec(("batch", None), data_mesh, (3, 16), tensor="rows")
