"""Speculative decoding vs plain decoding: acceptance length, verify steps and tokens/s per drafter and tree shape.

    python benchmarks/speculative.py [--model=PATH|tiny] [--drafter=DIR] [--num_prompts=4] [--max_new_tokens=64]
        [--temperature=0] [--configs=3x2x6,5x4x16] [--out=benchmarks/results/speculative.json]

Drafters: ngram (always), the EAGLE drafter in --drafter (a ``tlt_jax.drafter.warmup`` output) if given, and a
random EAGLE drafter (the no-skill baseline). Every speculative run is checked token for token against plain
decoding (lossless). Timings exclude compilation (each configuration runs once to warm up, then is timed).
"""

from __future__ import annotations

import json
import pathlib
import platform
import time

import jax
from absl import app, flags
from flax import nnx

from tlt_jax.drafter import EagleDrafter
from tlt_jax.drafter.export import load_drafter
from tlt_jax.drafter.warmup import load_policy_and_prompts
from tlt_jax.speculative import NgramDrafter, plain_generate, speculative_generate

_F = flags.FLAGS
flags.DEFINE_string("model", None, "policy (default: embedded SmolLM2; 'tiny' = random tiny model)")
flags.DEFINE_string("drafter", None, "trained drafter directory (save_drafter format)")
flags.DEFINE_integer("num_prompts", 4, "prompts (one batch)")
flags.DEFINE_integer("max_new_tokens", 64, "tokens per response")
flags.DEFINE_float("temperature", 0.0, "sampling temperature")
flags.DEFINE_list("configs", ["3x2x6", "5x4x16"], "EAGLE trees as depth x topk x num_nodes")
flags.DEFINE_string("out", "benchmarks/results/speculative.json", "JSON output")
flags.DEFINE_integer("seed", 1000, "prompt seed (held out from the warm-up default seed 0)")


def _timed(fn):
    fn()  # compile
    t = time.perf_counter()
    res = fn()
    return res, time.perf_counter() - t


def main(argv):
    del argv
    policy, prompts, stops = load_policy_and_prompts(_F.model, _F.num_prompts, _F.seed)
    kw = dict(max_new_tokens=_F.max_new_tokens, temperature=_F.temperature, seed=0, stop_tokens=stops)
    plain, t_plain = _timed(lambda: plain_generate(policy, prompts, **kw))
    n_tok = sum(len(t) for t in plain.tokens)
    rows = [{"drafter": "none", "config": "plain", "seconds": t_plain, "tokens": n_tok, "steps": plain.steps,
             "tokens_per_s": n_tok / t_plain, "mean_accept": 1.0, "lossless": True}]
    drafters = {"random_eagle": EagleDrafter(policy.config, rngs=nnx.Rngs(0))}
    if _F.drafter:
        drafters["eagle"] = load_drafter(_F.drafter)
    for c in _F.configs:
        depth, topk, n = (int(x) for x in c.split("x"))
        runs = dict(drafters)
        runs["ngram"] = NgramDrafter(num_nodes=n, max_depth=depth, stop_tokens=tuple(stops or ()))
        for name, d in runs.items():
            res, t = _timed(lambda d=d, depth=depth, topk=topk, n=n: speculative_generate(
                policy, prompts, drafter=d, depth=depth, topk=topk, num_nodes=n, **kw))
            rows.append({"drafter": name, "config": c, "seconds": t, "tokens": n_tok, "steps": res.steps,
                         "tokens_per_s": n_tok / t, "mean_accept": res.mean_accept,
                         "lossless": res.tokens == plain.tokens})
            print(f"{name:>13} {c:>8}: {res.steps:4d} verifies, accept {res.mean_accept:.2f} tok/verify, "
                  f"{n_tok / t:8.1f} tok/s (plain {n_tok / t_plain:.1f}), lossless={rows[-1]['lossless']}")
    out = pathlib.Path(_F.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": _F.model or "default", "batch": len(prompts), "max_new_tokens": _F.max_new_tokens,
            "temperature": _F.temperature, "device": str(jax.devices()[0]), "machine": platform.machine()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
