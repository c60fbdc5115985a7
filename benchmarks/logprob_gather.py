"""All-gather bytes and memory of one log-prob pass (old policy / reference) as the real compiler builds it.

    python benchmarks/logprob_gather.py --target=h100:1x8 --config=configs/qwen2p5_7b_gsm8k.py \
        --out=benchmarks/results/logprob_gather_qwen7b_h100x8.json [--mesh=1,8,1] [--chunk_rows=8]

Compiles ``make_logprob_fn`` (``tlt_jax.rl.logprobs``) for the recipe's step (``data.prompts_per_step x
rollout.samples_per_prompt`` rows of the longest sequence) from abstract weights (``tlt_jax.plan.abstract``) on
compile-only devices (``tlt_jax.plan.targets``: XLA:GPU or libtpu, no accelerator needed), for the reference pass
(bfloat16 weights) and the old-policy pass (float32 weights). Per pass and device: the collective bytes of one call
(``tlt_jax.plan.hlo.collective_stats``, loop trip counts applied), all-gather bytes against the model's bfloat16
bytes, and ``memory_analysis()``. ``--chunk_rows``: rows per chunk (default: ``logprob_chunk_rows(cfg, mesh, ...)``,
what the learner runs); ``--mesh``: data,fsdp,tensor instead of the config's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time


def _impl(path: str):
    """``make_logprob_fn`` of this checkout, or of a copy of ``tlt_jax/rl/logprobs.py`` at ``path`` (e.g. an older
    revision's, ``git show REV:tlt_jax/rl/logprobs.py > FILE``: the figures before a change)."""
    if not path:
        from tlt_jax.rl.logprobs import make_logprob_fn

        return make_logprob_fn
    import importlib.util

    spec = importlib.util.spec_from_file_location("logprobs_impl", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_logprob_fn


def measure(cfg, mesh, chunk_rows: int, shape: str, impl: str = "") -> dict:
    """Compile both passes; their figures (bytes per device)."""
    import jax
    import jax.numpy as jnp

    from tlt_jax.distributed import LogicalRules
    from tlt_jax.plan import abstract as ab
    from tlt_jax.plan.hlo import collective_stats
    make_logprob_fn = _impl(impl)
    rules = LogicalRules()
    policy = ab.abstract_policy(cfg, ab.model_config(cfg, shape), mesh, rules)
    total = cfg.data.prompts_per_step * cfg.rollout.samples_per_prompt
    t = ab.sequence_length(cfg)
    ids = ab.batch_sds((total, t), jnp.int32, mesh, rules)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(policy.params))
    model_bf16 = 2 * n_params
    fn = make_logprob_fn(policy.graphdef, chunk_size=chunk_rows, temperature=cfg.rollout.temperature, mesh=mesh,
                         rules=rules)
    out = {"rows": total, "seq_len": t, "chunk_rows": chunk_rows, "chunks": total // chunk_rows,
           "params": n_params, "model_bf16_bytes": model_bf16, "passes": {}}
    for name, params in (("reference", ab.reference_params(cfg, policy.params)), ("old_policy", policy.params)):
        t0 = time.perf_counter()
        compiled = fn.lower(params, policy.rest, ids, ids).compile()
        secs = time.perf_counter() - t0
        stats = collective_stats(compiled.as_text())
        mem = compiled.memory_analysis()
        gathered = stats.by_kind.get("all-gather", 0)
        out["passes"][name] = {
            "compile_s": round(secs, 1),
            "all_gather_bytes": gathered,
            "all_gather_over_model_bf16": round(gathered / model_bf16, 2),
            "collective_bytes": stats.bytes,
            "by_kind": stats.by_kind,
            "unknown_trip_loops": stats.unknown_trip_loops,
            "argument_bytes": int(mem.argument_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes),
        }
        print(name, json.dumps(out["passes"][name]), flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="h100:1x8")
    p.add_argument("--config", default="configs/qwen2p5_7b_gsm8k.py")
    p.add_argument("--shape", default="qwen2.5-7b", help="model shape (tlt_jax.plan.abstract.SHAPES)")
    p.add_argument("--mesh", default="", help="data,fsdp,tensor (default: the config's)")
    p.add_argument("--chunk_rows", type=int, default=0, help="rows per chunk (0: logprob_chunk_rows, the learner's)")
    p.add_argument("--impl", default="", help="a logprobs.py file to take make_logprob_fn from (default: this one)")
    p.add_argument("--label", default="")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)

    from tlt_jax.plan.targets import compile_only_devices, quiet_platforms

    quiet_platforms()
    import dataclasses
    import subprocess

    from tlt_jax.config import config_file, from_config_dict
    from tlt_jax.distributed import MeshConfig, make_mesh
    from tlt_jax.plan import abstract as ab

    c = config_file(args.config, os.path.basename(args.config)).get_config()
    c.model.path = "/placeholder/Qwen2.5-7B"  # only the shape is read (--shape)
    c.data.train_path = "/placeholder/train.parquet"  # nothing is read
    c.rollout.drafter_path = ""
    cfg = from_config_dict(c)
    if args.mesh:
        cfg = dataclasses.replace(cfg, mesh=MeshConfig(*[int(v) for v in args.mesh.split(",")]))
    mesh = make_mesh(cfg.mesh, compile_only_devices(args.target))
    rows = args.chunk_rows
    if not rows:
        from tlt_jax.rl.logprobs import logprob_chunk_rows

        total = cfg.data.prompts_per_step * cfg.rollout.samples_per_prompt
        rows = logprob_chunk_rows(cfg, mesh, ab.model_config(cfg, args.shape), total, ab.sequence_length(cfg))
    res = measure(cfg, mesh, rows, args.shape, args.impl)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"label": args.label, "target": args.target, "config": args.config, "shape": args.shape,
           "mesh": dict(mesh.shape), "commit": commit, "command": "python benchmarks/logprob_gather.py "
           + " ".join(a for a in (argv or __import__("sys").argv[1:])), **res}
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
