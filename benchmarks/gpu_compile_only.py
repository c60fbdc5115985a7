"""The rollout engine's decode programs as XLA:GPU builds them for an H100, compiled on the CPU (no GPU needed).

    python benchmarks/gpu_suite.py --compile_only=h100 --out=benchmarks/results/gpu_compile_only_h100.json

Needs ``jax-cuda12-plugin`` / ``jax-cuda12-pjrt`` of this jax's version (``pip install -e '.[plan-gpu]'``). Random
abstract weights (ShapeDtypeStructs, nothing allocated), bf16, the GPU engine's layout (``layers="unstacked"``) and
the RL engines' sampling (``sampling_filters=False``: no top-k / top-p sort compiled). For
each program, from the compiled HLO (``tlt_jax.plan.traffic``): ``must_bytes`` = the weights it reads once (the
input embedding table only when tied: decode gathers its rows) + the committed KV of its length bucket once + what it
must write (the new tokens' KV, the outputs not written in place); ``moved_bytes`` = the bytes its kernels read and
write (the decode chunk's ``while`` body once: one token step, plus the call's work outside the loop); the weight
copies, cache copies, cache concatenates and transposes it makes.

Programs: ``decode_b1`` / ``decode_b64``: the engine's plain decode chunk (Qwen2.5-7B shape, cache 4,096, length
bucket 2,048); ``verify64_b1``: its n-gram verify step of a 64-token tree at batch 1 (same cache); ``chunk05_b1``:
the Qwen2.5-0.5B engine's plain chunk at batch 1 (cache and bucket 512: ``gpu_suite.py``'s ``engine_bs1``);
``decode_b1_stacked``: ``decode_b1`` with the stacked (scanned) layers the H200 profile ran, for comparison.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp

from tlt_jax.models import ModelConfig

# The Qwen2.5-7B / 0.5B shapes (the GPU suite's), the length bucket and the verify tree of each program.
GOALS = {"decode_b1": 1.15, "decode_b64": 1.3, "verify64_over_decode_b1": 1.2}


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program: model shape, phase ("decode" | "verify"), batch, cache capacity and length bucket."""

    model: str
    phase: str
    batch: int
    max_len: int
    length: int
    verify_tokens: int = 0
    layers: str = "unstacked"  # the rollout copy's layer layout ("stacked": scanned, as trained)


def programs(smoke: bool) -> dict[str, Program]:
    """The programs of the report; ``smoke``: the same on the suite's tiny shape (seconds to compile)."""
    if smoke:
        return {"decode_b1": Program("smoke", "decode", 1, 256, 128),
                "decode_b64": Program("smoke", "decode", 64, 256, 128),
                "verify64_b1": Program("smoke", "verify", 1, 256, 128, 64),
                "chunk05_b1": Program("smoke", "decode", 1, 128, 128),
                "decode_b1_stacked": Program("smoke", "decode", 1, 256, 128, layers="stacked")}
    return {"decode_b1": Program("qwen2.5-7b", "decode", 1, 4096, 2048),
            "decode_b64": Program("qwen2.5-7b", "decode", 64, 4096, 2048),
            "verify64_b1": Program("qwen2.5-7b", "verify", 1, 4096, 2048, 64),
            "chunk05_b1": Program("qwen2.5-0.5b", "decode", 1, 512, 512),
            "decode_b1_stacked": Program("qwen2.5-7b", "decode", 1, 4096, 2048, layers="stacked")}


def _spec(verify_tokens: int):
    """An n-gram tree shape of ``verify_tokens`` nodes (depth 8, 3 children per node)."""
    from tlt_jax.rollout import SpecConfig

    return SpecConfig(depth=8, topk=3, verify_tokens=verify_tokens, threshold=64)


def abstract_engine(cfg: ModelConfig, mesh, p: Program, dtype=jnp.bfloat16, options: dict | None = None) -> Any:
    """A RolloutEngine over abstract ``dtype`` weights on ``mesh`` (traced construction, as ``tlt_jax.plan``);
    ``options``: XLA compiler options of its compiles (the engine's ``compiler_options``)."""
    from flax import nnx

    from tlt_jax.distributed import state_shardings
    from tlt_jax.models.weights import abstract_model
    from tlt_jax.plan.abstract import on_mesh
    from tlt_jax.rollout import RolloutEngine

    graphdef, state = nnx.split(abstract_model(cfg, dtype, dtype))
    kw = dict(spec=_spec(p.verify_tokens), drafter="ngram") if p.verify_tokens else {}
    built = []

    def construct(state):
        engine = RolloutEngine(nnx.merge(graphdef, state), mesh, max_batch=max(p.batch, 1), max_len=p.max_len,
                               batch_buckets=(p.batch,), layers=p.layers, compiler_options=options,
                               sampling_filters=False, **kw)
        built.append(engine)
        return engine.params

    params = jax.eval_shape(construct, state)
    engine = built[-1]
    engine.params = on_mesh(params, state_shardings(params, engine.mesh, engine.param_rules))
    return engine


def compile_program(engine, p: Program):
    """The engine's own compiled step for the program (its pool's builder, abstract arguments)."""
    from tlt_jax.adaptive import Arm
    from tlt_jax.rollout.plan import step_key

    arm = Arm("off") if p.phase == "decode" else next(iter(engine.arm_specs))
    return engine.pool.compile(step_key(arm, p.batch, p.length), *engine.abstract_args(arm, p.batch, p.length))


def must_bytes(cfg: ModelConfig, p: Program, itemsize: int, extra_output_bytes: int) -> int:
    """Weights once (an untied input table's rows are gathered, not read whole), the length bucket's KV once, the
    KV of the tokens it commits (1 per row, a verify's accepted path up to depth + 1) and its other outputs."""
    untied_table = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    weights = (cfg.num_params() - untied_table) * itemsize
    commit = (_spec(p.verify_tokens).depth + 1) if p.verify_tokens else 1
    kv = p.batch * (p.length + commit) * cfg.kv_bytes_per_token(itemsize)
    return weights + kv + extra_output_bytes


def analyse(cfg: ModelConfig, p: Program, exe, itemsize: int = 2) -> dict:
    """The report row of one compiled program."""
    from tlt_jax.plan.traffic import hlo_traffic

    t = hlo_traffic(exe.as_text())
    mem = exe.memory_analysis()
    unaliased = mem.output_size_in_bytes - mem.alias_size_in_bytes
    must = must_bytes(cfg, p, itemsize, unaliased)
    return {
        "program": dataclasses.asdict(p), "must_bytes": must, "moved_bytes": t.moved_bytes,
        "moved_over_must": t.moved_bytes / must, "loop_bytes": t.loop_bytes, "matmul_bytes": t.matmul_bytes,
        "weight_slice_copies": t.weight_slice_copies, "weight_layout_copies": t.weight_layout_copies,
        "weight_copy_bytes": t.weight_copy_bytes,
        "cache_copies": t.cache_copies, "cache_copy_bytes": t.cache_copy_bytes,
        "cache_concats": t.cache_concats, "cache_transposes": t.cache_transposes,
        "unknown_trip_loops": t.unknown_trip_loops, "ops": t.ops, "temp_bytes": mem.temp_size_in_bytes,
        "unaliased_output_bytes": unaliased,
        "top_ops": t.to_json()["top_ops"][:8],
    }


def goals(rows: dict) -> dict:
    """Each compile-only goal of issue 59 against this run's figures (None where a program is missing)."""
    def ok(name, cond):
        return None if name not in rows else bool(cond(rows[name]))

    verify = (rows["verify64_b1"]["moved_bytes"] / rows["decode_b1"]["moved_bytes"]
              if {"verify64_b1", "decode_b1"} <= rows.keys() else None)
    return {
        "decode_b1": ok("decode_b1", lambda r: r["moved_over_must"] <= GOALS["decode_b1"]
                        and r["weight_slice_copies"] == 0),
        "decode_b64": ok("decode_b64", lambda r: r["moved_over_must"] <= GOALS["decode_b64"]
                         and r["cache_concats"] == 0 and r["cache_transposes"] == 0),
        "verify64_over_decode_b1": verify,
        "verify64_b1": None if verify is None else verify <= GOALS["verify64_over_decode_b1"],
    }


def run(target: str, shapes: dict[str, ModelConfig], smoke: bool = False, only: tuple[str, ...] = (),
        options: dict | None = None) -> dict:
    """Compile every program for ``target`` (e.g. "h100") and return the report; ``shapes``: the model shape of each
    program's ``model`` name (``gpu_suite.py``'s); ``options``: XLA compiler options (e.g.
    ``{"xla_gpu_enable_dot_strength_reduction": False}``)."""
    from tlt_jax.distributed import MeshConfig, make_mesh
    from tlt_jax.plan.targets import compile_only_devices

    devices = compile_only_devices(f"{target}:1x1")
    mesh = make_mesh(MeshConfig(1, 1, 1), devices)
    out = {"device_kind": devices[0].device_kind, "target": target, "jax": jax.__version__, "smoke": smoke,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "compiler_options": options or {}, "programs": {}}
    for name, p in programs(smoke).items():
        if only and name not in only:
            continue
        cfg = shapes[p.model]
        t0 = time.perf_counter()
        engine = abstract_engine(cfg, mesh, p, options=options)
        exe = compile_program(engine, p)
        row = analyse(cfg, p, exe)
        row["compile_seconds"] = time.perf_counter() - t0
        out["programs"][name] = row
        print(f"  {name:12} must {row['must_bytes'] / 1e9:7.3f} GB  moved {row['moved_bytes'] / 1e9:7.3f} GB "
              f"({row['moved_over_must']:.3f}x)  weight slice / layout copies {row['weight_slice_copies']} / "
              f"{row['weight_layout_copies']}  cache copies "
              f"{row['cache_copies']} concats {row['cache_concats']} transposes {row['cache_transposes']}  "
              f"[{row['compile_seconds']:.0f} s]", flush=True)
        del engine, exe
    out["goals"] = goals(out["programs"])
    return out
