"""Speculative vs plain decoding side by side: tokens per verify and tokens/s by active batch, drafter and tree shape.

    python benchmarks/speculative.py [--model=PATH|tiny] [--drafter=DIR] [--batches=1,2,4,8,16,32]
        [--temperatures=0,0.9] [--out=benchmarks/results/speculative_smollm2_cpu.json]

Prompts: the held-out GSM-style split (``gsm_symbolic_splits`` eval; the warm-up trains on the disjoint training
split), chat-templated; batch b = the first b prompts, generation stops at EOS as in a rollout (a row that ends early
leaves the batch, so b is the starting active batch; ignoring EOS would measure the drafter on post-EOS junk), at most
--tokens new tokens per row (shrinking with the batch to bound the runtime). For every (batch, temperature): plain
decoding, then each drafter (n-gram; the EAGLE drafter in --drafter, a ``tlt_jax.drafter.warmup`` output, if given)
and tree config ``depth x topk x N`` of that batch (--configs_b1, --configs_small for batch 2-4, --configs_large above).
Every speculative run is checked token for token against the plain run of the same seed (lossless). Compilation is
excluded: each run is preceded by a 2-step call with the same shapes (the cache is read whole, sized to the run: one
compile per shape).
Reports, per (batch, temperature), the best speedup and the smallest batch where no configuration beats plain.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import time

import jax
import numpy as np
from absl import app, flags

from tlt_jax.drafter.export import load_drafter
from tlt_jax.drafter.warmup import load_policy_and_prompts
from tlt_jax.speculative import NgramDrafter, plain_generate, speculative_generate

_F = flags.FLAGS
flags.DEFINE_string("model", None, "policy (default: embedded SmolLM2; 'tiny' = random tiny model)")
flags.DEFINE_string("drafter", None, "trained drafter directory (save_drafter format)")
flags.DEFINE_list("batches", ["1", "2", "4", "8", "16", "32"], "active batch sizes")
flags.DEFINE_list("tokens", ["128", "96", "64", "48", "32", "24"], "new tokens per row, per batch entry")
flags.DEFINE_list("temperatures", ["0", "0.9"], "sampling temperatures")
flags.DEFINE_list("configs_b1", ["3x2x6", "4x2x8", "5x4x16", "8x4x48"], "trees (depth x topk x N) at batch 1")
flags.DEFINE_list("configs_small", ["3x2x6", "4x2x8", "5x4x16"], "trees at batch 2-4")
flags.DEFINE_list("configs_large", ["3x1x4", "3x2x6"], "trees at batch > 4")
flags.DEFINE_integer("b1_prompts", 1, "at batch 1, run this many prompts one after the other (summed)")
flags.DEFINE_string("out", "benchmarks/results/speculative_smollm2_cpu.json", "JSON output")


def _run(fn, groups):
    """Run ``fn(prompts)`` over each prompt group (compile warm-up excluded); returns (tokens, accept_lens, steps,
    seconds) summed over the groups."""
    tokens, accepts, steps, seconds = [], [], 0, 0.0
    for g in groups:
        fn(g, max_steps=2)  # compile every shape of the run
        t = time.perf_counter()
        res = fn(g)
        seconds += time.perf_counter() - t
        tokens += res.tokens
        accepts += res.accept_lens
        steps += res.steps
    return tokens, accepts, steps, seconds


def main(argv):
    del argv
    split = None if _F.model == "tiny" else "eval"
    batches = [int(b) for b in _F.batches]
    tokens = [int(t) for t in _F.tokens]
    policy, prompts, stops = load_policy_and_prompts(_F.model, max(batches), 1000, split)
    eagle = load_drafter(_F.drafter) if _F.drafter else None
    rows = []
    t_start = time.perf_counter()
    for b, n_new in zip(batches, tokens, strict=False):
        groups = [prompts[i: i + 1] for i in range(_F.b1_prompts)] if b == 1 else [prompts[:b]]
        for temp in (float(t) for t in _F.temperatures):
            kw = dict(max_new_tokens=n_new, temperature=temp, seed=0, stop_tokens=stops, attend_buckets=False)
            plain_tok, _, plain_steps, t_plain = _run(lambda g, kw=kw, **k: plain_generate(policy, g, **kw, **k),
                                                      groups)
            n_tok = sum(len(t) for t in plain_tok)
            base = dict(batch=b, prompts=len(groups) * len(groups[0]), temperature=temp, tokens=n_tok,
                        plain_seconds=t_plain, plain_tokens_per_s=n_tok / t_plain)
            rows.append(dict(base, drafter="none", config="plain", seconds=t_plain, tokens_per_s=n_tok / t_plain,
                             steps=plain_steps, mean_accept=1.0, speedup=1.0, lossless=True))
            print(f"b={b:2d} T={temp}: plain {n_tok / t_plain:7.1f} tok/s ({plain_steps} steps)", flush=True)
            for c in _F.configs_b1 if b == 1 else _F.configs_small if b <= 4 else _F.configs_large:
                depth, topk, n = (int(x) for x in c.split("x"))
                runs = {"ngram": NgramDrafter(num_nodes=n, max_depth=depth)}
                if eagle is not None:
                    runs["eagle"] = eagle
                for name, d in runs.items():
                    tok, acc, steps, t = _run(lambda g, d=d, depth=depth, topk=topk, n=n, kw=kw, **k:
                                              speculative_generate(policy, g, drafter=d, depth=depth, topk=topk,
                                                                   num_nodes=n, **kw, **k), groups)
                    lossless = tok == plain_tok
                    mean_accept = float(np.mean(acc)) + 1.0
                    rows.append(dict(base, drafter=name, config=c, seconds=t, tokens_per_s=n_tok / t,
                                     steps=steps, mean_accept=mean_accept, speedup=t_plain / t, lossless=lossless))
                    print(f"b={b:2d} T={temp}: {name:>5} {c:>7}: accept {mean_accept:.2f} tok/verify, "
                          f"{n_tok / t:7.1f} tok/s, {t_plain / t:.2f}x plain, lossless={lossless}", flush=True)
    summary = []
    for temp in (float(t) for t in _F.temperatures):
        for name in ["ngram"] + (["eagle"] if eagle is not None else []):
            best = {}
            for r in rows:
                if r["temperature"] == temp and r["drafter"] == name:
                    if r["batch"] not in best or r["speedup"] > best[r["batch"]]["speedup"]:
                        best[r["batch"]] = r
            stop_at = next((b for b in sorted(best) if best[b]["speedup"] < 1.0), None)
            summary.append(dict(temperature=temp, drafter=name, stops_paying_off_at_batch=stop_at,
                                best={b: dict(config=r["config"], speedup=r["speedup"], mean_accept=r["mean_accept"],
                                              tokens_per_s=r["tokens_per_s"]) for b, r in sorted(best.items())}))
            print(f"T={temp} {name}: best speedup by batch "
                  + ", ".join(f"{b}: {r['speedup']:.2f}x ({r['config']}, accept {r['mean_accept']:.2f})"
                              for b, r in sorted(best.items()))
                  + f"; no configuration beats plain from batch {stop_at}")
    out = pathlib.Path(_F.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": _F.model or "SmolLM2-135M-Instruct (embedded)", "drafter": _F.drafter, "prompts": split or "tiny",
            "device": str(jax.devices()[0]), "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
            "jax": jax.__version__, "dtype": "float32", "total_seconds": time.perf_counter() - t_start,
            "load_average_end": os.getloadavg()}
    if eagle is not None and _F.drafter and (pathlib.Path(_F.drafter) / "warmup.json").exists():
        meta["warmup"] = json.loads((pathlib.Path(_F.drafter) / "warmup.json").read_text())
    out.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1, default=_np))
    print(f"wrote {out} in {meta['total_seconds']:.0f}s")


def _np(x):
    return x.item() if isinstance(x, np.generic) else str(x)


if __name__ == "__main__":
    app.run(main)
