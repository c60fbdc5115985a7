"""Long-tail rollout benchmark: RolloutEngine vs a whole-batch ``lax.while_loop`` decode of the same requests.

Workloads (``--workload``), N requests with forced lengths (ignore_eos), greedy, tokens checked equal: ``tail``
(log-normal lengths, median max / 8, the longest at the max) and ``equal`` (every request ``--equal-len`` tokens: the
engine must not lose). The baseline (``whole_batch_decoder``) prefills the batch, then loops over the whole batch
until every row is done, attention reading the full cache. Both run after a warm-up call, alternating for --repeats
rounds; medians compared; ms per step = wall seconds / the longest request's tokens. Output: per model and workload
the times, speedups, the engine's tail share and chunks by batch bucket (results/rollout_tail.json).

    python benchmarks/rollout_tail.py                        # tiny model, then SmolLM2-135M (embedded GGUF)
    python benchmarks/rollout_tail.py --models tiny --repeats 5 --workload both
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tlt_jax.models import CausalLM, KVCache, tiny_config  # noqa: E402
from tlt_jax.rollout import RolloutEngine, SamplingParams  # noqa: E402
from tlt_jax.rollout.buckets import pick  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "rollout_tail.json"


def tail_lengths(num: int, max_new: int, seed: int = 0, sigma: float = 1.0) -> list[int]:
    """Heavy-tailed forced lengths: log-normal with median max_new / 8, clipped to [1, max_new], longest = max."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(max_new / 8 * np.exp(rng.normal(0.0, sigma, num))), 1, max_new).astype(int)
    lengths[np.argmax(lengths)] = max_new
    return lengths.tolist()


def whole_batch_decoder(model: CausalLM, max_len: int):
    """Jitted whole-batch greedy decode: (params, ids [B,P], lens [B], max_new [B]) -> (tokens [B, S], n [B])."""
    graphdef, params = nnx.split(model)
    cfg = model.config

    def run(params, ids, lens, max_new):
        m = nnx.merge(graphdef, params)
        b, p = ids.shape
        rows = jnp.arange(b)
        mask = jnp.arange(p)[None, :] < lens[:, None]
        out = m(ids, attention_mask=mask, logits_indices=(lens - 1)[:, None])
        cache = KVCache.zeros(cfg, b, max_len, model.dtype).append(out.k_new, out.v_new, lens)

        def emit(logits, tokens, logprobs, n, active):
            logits = logits.astype(jnp.float32)
            tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            lp = jnp.take_along_axis(logits, tok[:, None], -1)[:, 0] - jax.nn.logsumexp(logits, -1)
            idx = jnp.where(active, n, max_len)
            return tok, tokens.at[rows, idx].set(tok, mode="drop"), logprobs.at[rows, idx].set(lp, mode="drop")

        tokens = jnp.zeros((b, max_len), jnp.int32)
        logprobs = jnp.zeros((b, max_len), jnp.float32)
        n = jnp.zeros((b,), jnp.int32)
        tok, tokens, logprobs = emit(out.logits[:, 0], tokens, logprobs, n, jnp.ones((b,), bool))
        n = n + 1

        def cond(c):
            return jnp.any(c[3] < max_new)

        def body(c):
            cache, last, tokens, n, logprobs = c
            active = n < max_new
            o = m(last[:, None], cache=cache)
            tok, tokens, logprobs = emit(o.logits[:, 0], tokens, logprobs, n, active)
            cache = cache.append(o.k_new, o.v_new, active.astype(jnp.int32))
            return cache, jnp.where(active, tok, last), tokens, n + active.astype(jnp.int32), logprobs

        _, _, tokens, n, logprobs = jax.lax.while_loop(cond, body, (cache, tok, tokens, n, logprobs))
        return tokens, n, logprobs

    fn = jax.jit(run)
    return lambda *a: fn(params, *a)


def run_model(name: str, model: CausalLM, args, workload: str = "tail") -> dict:
    cfg = model.config
    if workload == "equal":
        max_new = args.equal_len
        lengths = [max_new] * args.requests
    else:
        max_new = args.max_new if args.max_new else (256 if name != "tiny" else 512)
        lengths = tail_lengths(args.requests, max_new, seed=args.seed)
    load0 = os.getloadavg()[0]
    rng = np.random.default_rng(args.seed + 1)  # random prompts of --prompt-min to --prompt-max tokens
    prompts = [rng.integers(3, cfg.vocab_size, rng.integers(args.prompt_min, args.prompt_max + 1)).tolist()
               for _ in range(args.requests)]
    max_len = max(map(len, prompts)) + max_new
    engine = RolloutEngine(model, max_batch=args.requests, max_len=max_len, chunk_size=args.chunk)
    params = SamplingParams(temperature=0.0, max_new_tokens=lengths, ignore_eos=True)
    p_bucket = pick(engine.length_buckets, max(map(len, prompts)))
    ids = np.zeros((len(prompts), p_bucket), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    base_args = (jnp.asarray(ids), jnp.asarray([len(p) for p in prompts], jnp.int32), jnp.asarray(lengths, jnp.int32))
    baseline = whole_batch_decoder(model, max_len)

    def run_baseline():
        t0, c0 = time.perf_counter(), time.process_time()
        toks, n, lps = jax.device_get(baseline(*base_args))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return wall, cpu, [toks[i, : n[i]].tolist() for i in range(len(prompts))], lps

    print(f"[{name}/{workload}] {args.requests} requests, max_new {max_new}, median {int(np.median(lengths))}, "
          f"mean {np.mean(lengths):.1f}, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens", flush=True)
    t0 = time.perf_counter()
    warm = engine.generate(prompts, params)
    engine_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, _, base_tokens, base_lps = run_baseline()
    base_compile = time.perf_counter() - t0
    print(f"[{name}/{workload}] warm-up: engine {engine_compile:.1f}s ({warm.stats['pool']['compiles']} compiles), "
          f"baseline {base_compile:.1f}s", flush=True)
    eng_times, base_times, eng_cpu, base_cpu, last = [], [], [], [], warm
    for r in range(args.repeats or (3 if name == "tiny" else 1)):
        c0 = time.process_time()
        res = engine.generate(prompts, params)
        eng_cpu.append(time.process_time() - c0)
        eng_times.append(res.stats["wall_seconds"])
        bt, bc, base_tokens, base_lps = run_baseline()
        base_cpu.append(bc)
        base_times.append(bt)
        last = res
        print(f"[{name}/{workload}] round {r}: engine {eng_times[-1]:.2f}s  whole-batch {bt:.2f}s  ratio "
              f"{bt / eng_times[-1]:.2f}x  CPU {bc / eng_cpu[-1]:.2f}x  (compiles this call: "
              f"{res.stats['pool_this_call']['compiles']})", flush=True)
    got = [t[0] for t in last.tokens]
    mismatch = [i for i in range(len(prompts)) if got[i] != base_tokens[i]]
    lp_err = max(float(np.max(np.abs(np.array(last.logprobs[i][0]) - base_lps[i, : lengths[i]])))
                 for i in range(len(prompts)))
    st = last.stats
    total = sum(lengths)
    eng_s, base_s = statistics.median(eng_times), statistics.median(base_times)
    live_per_step = np.array([sum(1 for x in lengths if x > s) for s in range(1, max_new)])
    out = dict(
        model=name, kind=workload,
        config=dict(vocab=cfg.vocab_size, hidden=cfg.hidden_size, layers=cfg.num_layers, heads=cfg.num_heads,
                    kv_heads=cfg.num_kv_heads, params_m=round(cfg.num_params() / 1e6, 1)),
        workload=dict(requests=args.requests, max_new=max_new, median=float(np.median(lengths)),
                      mean=float(np.mean(lengths)), total_tokens=total, seed=args.seed,
                      prompt_tokens=[min(map(len, prompts)), max(map(len, prompts))], max_len=max_len),
        chunk_size=args.chunk, engine_seconds=eng_times, whole_batch_seconds=base_times, speedup=base_s / eng_s,
        speedup_median_of_rounds=statistics.median(b / e for b, e in zip(base_times, eng_times, strict=True)),
        engine_cpu_seconds=eng_cpu, whole_batch_cpu_seconds=base_cpu,
        speedup_cpu=statistics.median(base_cpu) / statistics.median(eng_cpu),
        engine_ms_per_step=1e3 * eng_s / max_new, whole_batch_ms_per_step=1e3 * base_s / max_new,
        engine_tokens_per_s=total / eng_s, whole_batch_tokens_per_s=total / base_s,
        tokens_equal=not mismatch, mismatched_requests=mismatch, max_logprob_diff=lp_err,
        engine_prefill_seconds=st["prefill_seconds"], engine_decode_seconds=st["decode_seconds"],
        engine_tail_seconds=st["tail_seconds"], engine_tail_share_of_wall=st["tail_seconds"] / st["wall_seconds"],
        tail_threshold=st["tail_threshold"],
        whole_batch_steps_with_tail_batch=float(np.mean(live_per_step <= st["tail_threshold"])),
        by_batch={str(b): dict(tokens=d["tokens"], seconds=round(d["seconds"], 4), chunks=d["chunks"],
                               tokens_per_s=round(d["tokens_per_s"], 1)) for b, d in st["by_batch"].items()},
        chunks=len(st["chunks"]), compactions=len(st["compactions"]), pool=st["pool"],
        warmup_seconds=dict(engine=engine_compile, whole_batch=base_compile),
        load_average=dict(start=load0, end=os.getloadavg()[0]),
    )
    print_table(out)
    return out


def print_table(r: dict) -> None:
    w = r["workload"]
    med = statistics.median
    print(f"\n== {r['model']} ({r['config']['params_m']}M params), {r['kind']}: {w['requests']} requests, "
          f"max_new {w['max_new']}, median {w['median']:.0f}, {w['total_tokens']} tokens")
    print(f"{'':24}{'engine':>12}{'whole-batch':>14}")
    print(f"{'wall s (median)':24}{med(r['engine_seconds']):12.2f}{med(r['whole_batch_seconds']):14.2f}")
    print(f"{'tokens/s':24}{r['engine_tokens_per_s']:12.1f}{r['whole_batch_tokens_per_s']:14.1f}")
    print(f"{'ms per step':24}{r['engine_ms_per_step']:12.2f}{r['whole_batch_ms_per_step']:14.2f}")
    print(f"{'process CPU s (median)':24}{med(r['engine_cpu_seconds']):12.2f}{med(r['whole_batch_cpu_seconds']):14.2f}")
    print(f"speedup {r['speedup']:.2f}x (rounds' median {r['speedup_median_of_rounds']:.2f}x, CPU "
          f"{r['speedup_cpu']:.2f}x)   tokens equal: {r['tokens_equal']}   max |logprob diff| "
          f"{r['max_logprob_diff']:.2e}")
    print(f"engine tail (≤{r['tail_threshold']} live rows): {r['engine_tail_seconds']:.2f}s = "
          f"{100 * r['engine_tail_share_of_wall']:.0f}% of wall; whole-batch steps in tail: "
          f"{100 * r['whole_batch_steps_with_tail_batch']:.0f}%")
    print(f"{'batch bucket':>14}{'tokens':>9}{'seconds':>10}{'tokens/s':>11}")
    for b, d in r["by_batch"].items():
        print(f"{b:>14}{d['tokens']:>9}{d['seconds']:>10.3f}{d['tokens_per_s']:>11.1f}")
    print(f"pool: {r['pool']}\n", flush=True)


def load(name: str) -> CausalLM:
    if name == "tiny":
        cfg = tiny_config(vocab_size=512, hidden_size=128, intermediate_size=512, num_layers=4, num_heads=4,
                          num_kv_heads=2, max_position_embeddings=2048)
        return CausalLM(cfg, rngs=nnx.Rngs(0))
    if name == "smollm2":
        from tlt_jax.models import from_pretrained
        from tlt_jax.models.presets import default_model_path

        return from_pretrained(default_model_path())
    raise ValueError(f"unknown model {name!r}: tiny | smollm2")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--workload", default="tail", choices=("tail", "equal", "both"))
    ap.add_argument("--max-new", type=int, default=0, help="tail workload; default: 512 (tiny), 256 (smollm2)")
    ap.add_argument("--equal-len", type=int, default=128, help="equal workload: tokens of every request")
    ap.add_argument("--prompt-min", type=int, default=8)
    ap.add_argument("--prompt-max", type=int, default=24)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=0, help="timed rounds; default 3 (tiny), 1 (smollm2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    results = dict(command="python benchmarks/rollout_tail.py " + " ".join(sys.argv[1:] if argv is None else argv),
                   machine=dict(platform=platform.platform(), cpus=os.cpu_count(), jax=jax.__version__,
                                devices=[str(d) for d in jax.devices()]),
                   date=time.strftime("%Y-%m-%d %H:%M:%S"), runs=[])
    kinds = ("equal", "tail") if args.workload == "both" else (args.workload,)
    for name in args.models.split(","):
        model = load(name)
        results["runs"] += [run_model(name, model, args, kind) for kind in kinds]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
