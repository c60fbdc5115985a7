"""The GPU suite: decode, verify and prefill against the device's roofline, and the rollout engine's small batches.

    python benchmarks/gpu_suite.py                  # one H100/H200, <= 8 minutes: benchmarks/results/gpu/suite.json
    python benchmarks/gpu_suite.py --smoke --out /tmp/suite.json   # the same code on CPU, tiny shapes
    python benchmarks/gpu_suite.py --compile_only=h100 --out=FILE  # no GPU: the decode programs' HLO traffic

Random weights of real shapes, bf16 (fp32 in --smoke). Sections in priority order (skipped and listed past
--time_budget_s; the JSON rewritten after each): ``matmul`` (the bf16 peak); ``decode`` (Qwen2.5-7B shape, cache
4,096 half committed: ``decode_bs1``, ``decode_bs64``, a 64-token chain ``verify64_bs1``, per layer layout and
attention; ``hbm_fraction``: weights + committed KV per step time over the datasheet bandwidth); ``prefill`` (1 x
2,048 tokens: ``prefill_mfu``); ``engine_bs1`` (the RolloutEngine, Qwen2.5-0.5B shape, one request, over its weights'
HBM floor); ``tail`` (``rollout_tail.py``: ``tail_speedup``); ``plan`` (``tlt_jax.plan``'s CPU estimate of bf16
decode / verify temporaries against this GPU's compile: ``plan_gpu_over_estimate``).

``--compile_only=h100`` (``pip install -e '.[plan-gpu]'``): the engine's decode programs compiled for a compile-only
H100 on the CPU (abstract bf16 weights, ``layers="unstacked"``, no top-k / top-p), their HLO's ``must_bytes`` (the
weights, the length bucket's KV, the outputs) against ``moved_bytes`` (``tlt_jax.plan.traffic``) and their weight and
cache copies: ``decode_b1`` / ``decode_b64`` (7B, cache 4,096, bucket 2,048), ``verify64_b1`` (a 64-token tree),
``chunk05_b1`` (the 0.5B engine's chunk, cache 512), ``decode_b1_stacked``. ``--attention_impl=pallas``: with the
Triton tree-attention kernel (it loads each row's prefix: its cache operands count the bucket's share).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tlt_jax.models import CausalLM, KVCache, ModelConfig, rollout_copy, tiny_config  # noqa: E402

RESULT = Path(__file__).parent / "results" / "gpu" / "suite.json"
PEAK_GBPS = {"H200": 4800, "H100": 3350, "A100": 2039}  # datasheet HBM bandwidth by device kind
QWEN_7B = ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                      num_kv_heads=4, rope_theta=1e6, attention_bias=True, architecture="qwen2")
QWEN_05B = ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                       num_kv_heads=2, rope_theta=1e6, attention_bias=True, tie_word_embeddings=True,
                       architecture="qwen2", max_position_embeddings=4096)
SMOKE_LM = tiny_config(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                       num_kv_heads=2, max_position_embeddings=1024)
COMPILE_ONLY_SHAPES = {"qwen2.5-7b": QWEN_7B, "qwen2.5-0.5b": QWEN_05B, "smoke": SMOKE_LM}
COMPILE_ONLY_GOALS = {"decode_b1": 1.15, "decode_b64": 1.3, "verify64_over_decode_b1": 1.2}


def shapes(smoke: bool) -> SimpleNamespace:
    if smoke:
        return SimpleNamespace(big=SMOKE_LM, small=SMOKE_LM, dtype=jnp.float32, matmul=256, cache=128, batch=4,
                               verify=8, prefill=64, steps=3, requests=8, max_new=24, bs1_tokens=16)
    return SimpleNamespace(big=QWEN_7B, small=QWEN_05B, dtype=jnp.bfloat16, matmul=8192, cache=4096, batch=64,
                           verify=64, prefill=2048, steps=20, requests=64, max_new=256, bs1_tokens=256)


def timed(fn, *args, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return out


def weight_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """Weight bytes one decode step reads: every parameter but an untied input embedding table (rows gathered)."""
    untied_table = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return (cfg.num_params() - untied_table) * itemsize


def matmul_peak(s) -> dict:
    n = s.matmul
    a = jax.random.normal(jax.random.key(0), (n, n), s.dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), s.dtype)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    best = min(timed(f, a, b, reps=10))
    return {"n": n, "dtype": jnp.dtype(s.dtype).name, "ms": 1e3 * best, "tflops": 2 * n**3 / best / 1e12}


def decode_step(graphdef, cfg, batch: int, tree: int, attend_len: int):
    chain = jnp.broadcast_to(jnp.tril(jnp.ones((tree, tree), bool)), (batch, tree, tree))

    def step(params, tok, cache):
        ids = (tok[:, None] + jnp.arange(tree, dtype=jnp.int32)[None, :]) % cfg.vocab_size
        out = nnx.merge(graphdef, params)(ids, cache=cache, tree_mask=chain, attend_len=attend_len,
                                          logits_indices=jnp.full((batch, 1), tree - 1, jnp.int32))
        cache = cache.append(out.k_new[:, :, :1], out.v_new[:, :, :1])  # commit one token, as a decode step does
        return jnp.argmax(out.logits[:, -1], -1).astype(jnp.int32), cache

    return jax.jit(step, donate_argnums=(2,))


def bench_decode(model: CausalLM, s, batch: int, tree: int, peak_gbps: float | None) -> dict:
    cfg, dtype = model.config, model.dtype
    committed = s.cache // 2
    attend = min(s.cache, -(-(committed + s.steps + 2 + tree) // 128) * 128)  # the committed prefix's bucket
    graphdef, params = nnx.split(model)
    fn = decode_step(graphdef, cfg, batch, tree, attend)
    cache = KVCache.zeros(cfg, batch, s.cache, dtype)
    cache = KVCache(cache.k, cache.v, jnp.full((batch,), committed, jnp.int32))
    tok = jnp.zeros((batch,), jnp.int32)
    t0 = time.perf_counter()
    tok, cache = fn(params, tok, cache)
    jax.block_until_ready(tok)
    compile_s = time.perf_counter() - t0
    tok, cache = fn(params, tok, cache)
    jax.block_until_ready(tok)
    t0 = time.perf_counter()
    for _ in range(s.steps):
        tok, cache = fn(params, tok, cache)
    jax.block_until_ready((tok, cache))
    ms = 1e3 * (time.perf_counter() - t0) / s.steps
    itemsize = jnp.dtype(dtype).itemsize
    moved = weight_bytes(cfg, itemsize) + batch * committed * cfg.kv_bytes_per_token(itemsize)
    gbps = moved / ms / 1e6
    del cache
    return {"batch": batch, "tree_tokens": tree, "attend_len": attend, "ms": ms, "first_call_s": compile_s,
            "bytes": moved, "gbps": gbps, "hbm_fraction": None if peak_gbps is None else gbps / peak_gbps}


DECODE_VARIANTS = ("unstacked/xla", "unstacked/pallas", "stacked/xla", "stacked/pallas")


def decode_section(s, peak_gbps, out: dict, budget, variants=DECODE_VARIANTS) -> None:
    """Every (layout, attention) variant; the old stacked (scanned) layout as the baseline of the same run, at batch 1
    only for its kernel path (its cost there is the weight copies)."""
    stacked = CausalLM(s.big, dtype=s.dtype, param_dtype=s.dtype, rngs=nnx.Rngs(0))
    models = {"stacked": stacked, "unstacked": rollout_copy(stacked, layers="unstacked")}
    rows = out.setdefault("decode", {})
    for key in variants:
        if not budget(f"decode {key}"):
            continue
        layers, impl = key.split("/")
        model = rollout_copy(models[layers], attention_impl=impl)
        rows[key] = {}
        cells = [("decode_bs1", 1, 1), ("decode_bs64", s.batch, 1), ("verify64_bs1", 1, s.verify)]
        for name, batch, tree in cells[:1] if key == "stacked/pallas" else cells:
            rows[key][name] = r = bench_decode(model, s, batch, tree, peak_gbps)
            print(f"  {key:18} {name:13} {r['ms']:8.2f} ms {r['gbps']:7.0f} GB/s, first call {r['first_call_s']:.1f} s",
                  flush=True)
        del model


def prefill_section(s, out: dict, layers: str) -> None:
    cfg = s.big
    model = rollout_copy(CausalLM(cfg, dtype=s.dtype, param_dtype=s.dtype, rngs=nnx.Rngs(0)), layers=layers)
    graphdef, params = nnx.split(model)
    t = s.prefill

    def prefill(params, ids):
        cache = KVCache.zeros(cfg, 1, t, s.dtype)
        o = nnx.merge(graphdef, params)(ids, cache=cache, logits_indices=jnp.full((1, 1), t - 1, jnp.int32))
        return o.logits, cache.append(o.k_new, o.v_new)

    fn = jax.jit(prefill)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, t)), jnp.int32)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(params, ids))
    compile_s = time.perf_counter() - t0
    best = min(timed(fn, params, ids, reps=5))
    matmul_params = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    flops = 2 * matmul_params * t + 2 * cfg.hidden_size * cfg.vocab_size  # + the LM head at the last position
    flops += 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * t * t  # causal QK^T and PV: half of 4 T^2 H D
    out["prefill"] = {"batch": 1, "tokens": t, "layers": layers, "ms": 1e3 * best, "first_call_s": compile_s,
                      "flops": flops, "tflops": flops / best / 1e12}


def engine_bs1_section(s, peak_gbps, out: dict, budget, layouts=("unstacked", "stacked")) -> None:
    from tlt_jax.rollout import RolloutEngine, SamplingParams

    base = CausalLM(s.small, dtype=s.dtype, param_dtype=s.dtype, rngs=nnx.Rngs(0))
    floor_s = weight_bytes(s.small, jnp.dtype(s.dtype).itemsize) / (peak_gbps * 1e9) if peak_gbps else None
    rows = out.setdefault("engine_bs1", {"floor_ms": None if floor_s is None else 1e3 * floor_s})
    prompt = [list(range(3, 19))]
    params = SamplingParams(temperature=0.0, max_new_tokens=s.bs1_tokens, ignore_eos=True)
    for layers in layouts:
        if not budget(f"engine_bs1 {layers}"):
            continue
        engine = RolloutEngine(base, max_batch=1, max_len=256 + s.bs1_tokens, batch_buckets=(1,), layers=layers)
        t0 = time.perf_counter()
        engine.generate(prompt, params)  # compiles
        warm = time.perf_counter() - t0
        st = engine.generate(prompt, params).stats
        ms = 1e3 * st["decode_seconds"] / st["decode_tokens"]
        rows[layers] = {"ms_per_token": ms, "tokens": st["decode_tokens"], "warmup_s": warm,
                        "over_floor": None if floor_s is None else ms / (1e3 * floor_s)}
        print(f"  engine bs1 {layers:10} {ms:7.3f} ms/token", flush=True)
        del engine


def tail_section(s, out: dict, smoke: bool) -> None:
    import rollout_tail

    model = rollout_copy(CausalLM(s.small, dtype=s.dtype, param_dtype=s.dtype, rngs=nnx.Rngs(0)),
                         layers="stacked" if smoke else "unstacked")
    args = SimpleNamespace(requests=s.requests, max_new=s.max_new, equal_len=s.max_new, prompt_min=8, prompt_max=24,
                           chunk=8, repeats=2, seed=0)
    r = rollout_tail.run_model("qwen2.5-0.5b-shape", model, args, "tail")
    keep = ("speedup", "speedup_median_of_rounds", "engine_seconds", "whole_batch_seconds", "tokens_equal",
            "mismatched_requests", "max_logprob_diff", "engine_tail_share_of_wall", "pool", "warmup_seconds",
            "engine_ms_per_step", "workload")
    out["tail"] = {k: r[k] for k in keep}


def plan_section(out: dict, smoke: bool) -> None:
    from e2e_step import load_config  # (benchmarks/ is on the path: this script's folder)

    from tlt_jax.distributed import MeshConfig, make_mesh
    from tlt_jax.plan import plan_run

    over = {"rollout.dtype": "bfloat16", "drafter.online": False}  # (online training reads hidden states in fp32)
    if smoke:  # tiny_tlt's EAGLE drafter is the one trained online: n-gram verify steps instead; one slice
        over.update({"rollout.speculative": "ngram", "rollout.num_slices": 1})
    cfg, shape = (load_config("tiny_tlt", over), None) if smoke else (load_config("gsm8k", over), "smollm2-135m")
    res = {}
    for name, devices, mode in (("device", jax.devices()[:1], "compiled"), ("cpu_estimate", jax.devices("cpu")[:1],
                                "estimate"), ("cpu_compiled", jax.devices("cpu")[:1], "compiled")):
        plan = plan_run(cfg, make_mesh(MeshConfig(), devices), shape=shape, backend="gpu", bf16_temps=mode)
        res[name] = {k: plan.steps[k].temp_bytes for k in ("decode", "verify") if plan.steps.get(k) is not None}
    res["gpu_over_estimate"] = {k: res["device"][k] / max(1, res["cpu_estimate"][k]) for k in res["device"]}
    out["plan"] = res


def headline(out: dict) -> dict:
    """The issue's figures from the sections that ran (the best variant of each; None where a section was skipped)."""
    dec = out.get("decode", {})

    def best(cell, field="hbm_fraction", low=False):
        vals = [(v[cell][field], k) for k, v in dec.items() if cell in v and v[cell][field] is not None]
        return (min if low else max)(vals) if vals else (None, None)

    verify = [(v["verify64_bs1"]["ms"] / v["decode_bs1"]["ms"], k) for k, v in dec.items() if "verify64_bs1" in v]
    peak = out.get("matmul", {}).get("tflops")
    pre = out.get("prefill")
    eng = out.get("engine_bs1", {})
    over = [(v["over_floor"], k) for k, v in eng.items() if isinstance(v, dict) and v.get("over_floor")]
    return {
        "decode_hbm_fraction": {"1": best("decode_bs1")[0], "64": best("decode_bs64")[0]},
        "decode_best_variant": {"1": best("decode_bs1")[1], "64": best("decode_bs64")[1]},
        "verify64_over_decode_bs1": min(verify)[0] if verify else None,
        "prefill_mfu": pre["tflops"] / peak if pre and peak else None,
        "engine_bs1_step_over_floor": min(over)[0] if over else None,
        "tail_speedup": out.get("tail", {}).get("speedup"),
        "plan_gpu_over_estimate": out.get("plan", {}).get("gpu_over_estimate"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, fp32): the same code, in minutes")
    ap.add_argument("--out", default=str(RESULT))
    ap.add_argument("--time_budget_s", type=float, default=420.0, help="start no section after this many seconds")
    ap.add_argument("--sections", default="matmul,decode,prefill,engine_bs1,tail,engine_bs1_stacked,plan",
                    help="in order; engine_bs1 times the unstacked engine, engine_bs1_stacked the stacked one")
    ap.add_argument("--compile_only", default="", choices=("", "h100", "h200"), help="no GPU: the programs' traffic")
    ap.add_argument("--programs", default="", help="with --compile_only: a comma-separated subset")
    ap.add_argument("--attention_impl", default="xla", choices=("xla", "pallas"), help="with --compile_only")
    args = ap.parse_args(argv)
    if args.compile_only:
        return compile_only_main(args, argv)
    s = shapes(args.smoke)
    start = time.perf_counter()
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_GBPS.items() if k in kind), None)
    out = {"command": "python benchmarks/gpu_suite.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "device_kind": kind, "backend": jax.default_backend(), "jax": jax.__version__, "smoke": args.smoke,
           "peak_hbm_gbps": peak, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "skipped": [], "errors": {}}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def budget(name: str) -> bool:
        if time.perf_counter() - start < args.time_budget_s:
            return True
        out["skipped"].append(name)
        return False

    def write():
        out["seconds"] = time.perf_counter() - start
        out.update(headline(out))
        path.write_text(json.dumps(out, indent=1) + "\n")

    sections = {
        "matmul": lambda: out.update(matmul=matmul_peak(s)),
        "decode": lambda: decode_section(s, peak, out, budget),
        "prefill": lambda: prefill_section(s, out, "unstacked"),
        "engine_bs1": lambda: engine_bs1_section(s, peak, out, budget, ("unstacked",)),
        "engine_bs1_stacked": lambda: engine_bs1_section(s, peak, out, budget, ("stacked",)),
        "tail": lambda: tail_section(s, out, args.smoke),
        "plan": lambda: plan_section(out, args.smoke),
    }
    for name in args.sections.split(","):
        if not budget(name):
            continue
        print(f"[{time.perf_counter() - start:6.1f}s] {name}", flush=True)
        try:
            sections[name]()
        except Exception as e:  # one failed section must not lose the others' figures
            traceback.print_exc()
            out["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
        write()
    write()
    print(json.dumps({k: out[k] for k in (*headline(out), "skipped", "errors", "seconds")}, indent=1))
    print(f"wrote {path}")
    return 0


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
    """The --compile_only programs; ``smoke``: the same on the suite's tiny shape (seconds to compile)."""
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


def abstract_engine(cfg: ModelConfig, mesh, p: Program, dtype=jnp.bfloat16, attention_impl: str = "xla") -> Any:
    """A RolloutEngine over abstract ``dtype`` weights on ``mesh`` (traced construction, as ``tlt_jax.plan``)."""
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
                               batch_buckets=(p.batch,), layers=p.layers, sampling_filters=False,
                               attention_impl=attention_impl, **kw)
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
    """The weights once, the length bucket's KV once, the KV of the tokens it commits (1 per row, a verify's
    accepted path up to depth + 1) and its other outputs."""
    commit = (_spec(p.verify_tokens).depth + 1) if p.verify_tokens else 1
    kv = p.batch * (p.length + commit) * cfg.kv_bytes_per_token(itemsize)
    return weight_bytes(cfg, itemsize) + kv + extra_output_bytes


def analyse(cfg: ModelConfig, p: Program, exe, itemsize: int = 2) -> dict:
    """The report row of one compiled program."""
    from tlt_jax.plan.traffic import hlo_traffic

    t = hlo_traffic(exe.as_text(), kernel_cache_fraction=p.length / p.max_len)  # the kernel reads the bucket
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
        "decode_b1": ok("decode_b1", lambda r: r["moved_over_must"] <= COMPILE_ONLY_GOALS["decode_b1"]
                        and r["weight_slice_copies"] == 0),
        "decode_b64": ok("decode_b64", lambda r: r["moved_over_must"] <= COMPILE_ONLY_GOALS["decode_b64"]
                         and r["cache_concats"] == 0 and r["cache_transposes"] == 0),
        "verify64_over_decode_b1": verify,
        "verify64_b1": None if verify is None else verify <= COMPILE_ONLY_GOALS["verify64_over_decode_b1"],
    }


def compile_only_main(args, argv) -> int:
    """``--compile_only``: every program (or the --programs subset) compiled for a compile-only ``--compile_only``
    device, its traffic report written to ``--out``."""
    from tlt_jax.distributed import MeshConfig, make_mesh
    from tlt_jax.plan.targets import compile_only_devices

    only = tuple(p for p in args.programs.split(",") if p)
    devices = compile_only_devices(f"{args.compile_only}:1x1")
    mesh = make_mesh(MeshConfig(1, 1, 1), devices)
    out = {"device_kind": devices[0].device_kind, "target": args.compile_only, "attention_impl": args.attention_impl,
           "jax": jax.__version__, "smoke": args.smoke, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "programs": {}}
    for name, p in programs(args.smoke).items():
        if only and name not in only:
            continue
        cfg = COMPILE_ONLY_SHAPES[p.model]
        t0 = time.perf_counter()
        engine = abstract_engine(cfg, mesh, p, attention_impl=args.attention_impl)
        row = out["programs"][name] = analyse(cfg, p, exe := compile_program(engine, p))
        row["compile_seconds"] = time.perf_counter() - t0
        print(f"  {name:12} must {row['must_bytes'] / 1e9:7.3f} GB  moved {row['moved_bytes'] / 1e9:7.3f} GB "
              f"({row['moved_over_must']:.3f}x)  weight slice / layout copies {row['weight_slice_copies']} / "
              f"{row['weight_layout_copies']}  cache copies {row['cache_copies']} concats {row['cache_concats']} "
              f"transposes {row['cache_transposes']}  [{row['compile_seconds']:.0f} s]", flush=True)
        del engine, exe
    out["goals"] = goals(out["programs"])
    out["command"] = "python benchmarks/gpu_suite.py " + " ".join(sys.argv[1:] if argv is None else argv)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["goals"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
