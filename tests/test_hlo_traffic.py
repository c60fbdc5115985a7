"""tlt_jax.plan.traffic on a hand-made program whose bytes are known, and on a real XLA:CPU compile."""

import jax
import jax.numpy as jnp

from tlt_jax.plan.traffic import hlo_traffic

# Entry arguments: a weight f32[8,16] (512 B), a cache f32[64,4] (1,024 B), an update f32[1,4] (16 B), x f32[1,8].
PROGRAM = """HloModule hand_made

%fused_slice (param_0: f32[8,16]) -> f32[2,16] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  ROOT %slice.1 = f32[2,16]{1,0} slice(%param_0), slice={[0:2], [0:16]}
}

%fused_dus (param_0: f32[64,4], param_1: f32[1,4], param_2: s32[]) -> f32[64,4] {
  %param_0 = f32[64,4]{1,0} parameter(0)
  %param_1 = f32[1,4]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus.1 = f32[64,4]{1,0} dynamic-update-slice(%param_0, %param_1, %param_2, %zero)
}

%fused_concat (param_0: f32[64,4], param_1: f32[1,4]) -> f32[65,4] {
  %param_0 = f32[64,4]{1,0} parameter(0)
  %param_1 = f32[1,4]{1,0} parameter(1)
  ROOT %cat = f32[65,4]{1,0} concatenate(%param_0, %param_1), dimensions={0}
}

%body (p: (s32[], f32[8,16], f32[64,4], f32[1,4])) -> (s32[], f32[8,16], f32[64,4], f32[1,4]) {
  %p = (s32[], f32[8,16]{1,0}, f32[64,4]{1,0}, f32[1,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %kv = f32[64,4]{1,0} get-tuple-element(%p), index=2
  %u = f32[1,4]{1,0} get-tuple-element(%p), index=3
  %ws = f32[2,16]{1,0} fusion(%w), kind=kLoop, calls=%fused_slice
  %kv2 = f32[64,4]{1,0} fusion(%kv, %u, %i), kind=kLoop, calls=%fused_dus
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,16]{1,0}, f32[64,4]{1,0}, f32[1,4]{1,0}) tuple(%i2, %w, %kv2, %u)
}

%cond (p: (s32[], f32[8,16], f32[64,4], f32[1,4])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}, f32[64,4]{1,0}, f32[1,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %three), direction=LT
}

ENTRY %main (params_w: f32[8,16], state_cache_k: f32[64,4], upd: f32[1,4], x: f32[1,8]) -> (f32[65,4], f32[4,64]) {
  %params_w = f32[8,16]{1,0} parameter(0)
  %state_cache_k = f32[64,4]{1,0} parameter(1)
  %upd = f32[1,4]{1,0} parameter(2)
  %x = f32[1,8]{1,0} parameter(3)
  %wt = f32[8,16]{0,1} copy(%params_w)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}, f32[64,4]{1,0}, f32[1,4]{1,0}) tuple(%zero, %params_w, %state_cache_k, %upd)
  %loop = (s32[], f32[8,16], f32[64,4], f32[1,4]) while(%init), condition=%cond, body=%body, TRIP
  %kv = f32[64,4]{1,0} get-tuple-element(%loop), index=2
  %cat = f32[65,4]{1,0} fusion(%kv, %upd), kind=kInput, calls=%fused_concat
  %tr = f32[4,64]{1,0} transpose(%kv), dimensions={1,0}
  %mm = (f32[1,16]{1,0}, s8[256]{0}) custom-call(%x, %wt), custom_call_target="__cublas$gemm"
  ROOT %out = (f32[65,4]{1,0}, f32[4,64]{1,0}) tuple(%cat, %tr)
}
"""
KNOWN_TRIP = 'backend_config={"known_trip_count":{"n":"3"}}'



def test_hand_made_program_bytes_and_copies():
    t = hlo_traffic(PROGRAM.replace("TRIP", KNOWN_TRIP))
    copy = 512 + 512  # the weight's layout copy: read and written whole
    per_iter = (
        (128 + 128)  # the slice fusion reads only the 2 x 16 rows it slices, writes them
        + (0 + 16 + 4 + 16)  # the in-place update: the cache it updates counts nothing, the update is written
        + (4 + 4 + 4)  # i + 1
        + (4 + 4 + 1)  # the loop condition
    )
    concat = (1024 + 16) + 1040
    transpose = 1024 + 1024
    gemm = (32 + 512) + 64  # the custom call's s8 scratch counts nothing
    assert t.moved_bytes == copy + 3 * per_iter + concat + transpose + gemm
    assert t.loop_bytes == 3 * per_iter and t.unknown_trip_loops == 0 and t.matmul_bytes == gemm
    assert (t.weight_slice_copies, t.weight_layout_copies) == (3, 1)  # the slice once per iteration; the copy once
    assert t.weight_copy_bytes == 3 * 128 + 512
    assert (t.cache_concats, t.cache_transposes, t.cache_copies) == (1, 1, 2)
    assert t.top_ops[0][1] == "cat" and t.top_ops[0][0] == concat


def test_unknown_trip_count_counts_the_body_once():
    t = hlo_traffic(PROGRAM.replace(", TRIP", ""))
    assert t.unknown_trip_loops == 1
    assert t.loop_bytes == (128 + 128) + 36 + 12 + 9


KERNEL = """HloModule kernel

ENTRY %main (state_cache_k: f32[64,4], q: f32[2,4], lens: s32[1]) -> f32[2,4] {
  %state_cache_k = f32[64,4]{1,0} parameter(0)
  %q = f32[2,4]{1,0} parameter(1)
  %lens = s32[1]{0} parameter(2)
  %kc = f32[64,4]{1,0} bitcast(%state_cache_k)
  ROOT %attn = f32[2,4]{1,0} custom-call(%lens, %q, %kc), custom_call_target="TARGET"
}
"""


def test_a_kernel_reads_the_committed_share_of_a_cache_operand():
    """A Pallas kernel (Triton or Mosaic custom call) taking the cache whole counts kernel_cache_fraction of it (the
    tree-attention kernels load no block past a row's length); its other operands, and any other custom call, whole."""
    small = 4 + 32 + 32  # lens, q, the result
    for target in ("__gpu$xla.gpu.triton", "tpu_custom_call"):
        text = KERNEL.replace("TARGET", target)
        assert hlo_traffic(text).moved_bytes == 1024 + small
        assert hlo_traffic(text, kernel_cache_fraction=0.5).moved_bytes == 512 + small
    other = KERNEL.replace("TARGET", "__cublas$gemm")
    assert hlo_traffic(other, kernel_cache_fraction=0.5).moved_bytes == 1024 + small


def test_real_compile_finds_the_stacked_weight_slices():
    """A scan over 4 stacked weights, compiled by XLA:CPU: its body copies each layer's slice out of the stack (what
    XLA:GPU did to the stacked decode layout), once per iteration."""
    w = jnp.ones((4, 32, 32), jnp.float32)

    def f(params, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, params)[0]

    text = jax.jit(f).lower(w, jnp.ones((2, 32))).compile().as_text()
    t = hlo_traffic(text)
    assert t.unknown_trip_loops == 0 and t.loop_bytes >= 2 * w.nbytes  # each slice copied out and read again
    assert t.weight_slice_copies == 4 and t.weight_copy_bytes == w.nbytes and t.weight_layout_copies == 0
