"""Speculative vs plain decoding in the RolloutEngine, side by side: accept length (tokens per verify) and tokens/s by
starting batch, drafter and tree shape, with the adaptive engine beside them.

    python benchmarks/speculative.py [--model=PATH|tiny] [--drafter=DIR] [--batches=1,2,4,8,16,32]
        [--temperatures=0,0.9] [--repeats=N] [--out=benchmarks/results/speculative_smollm2_cpu.json]

Prompts: the held-out GSM-style split, chat-templated; batch b = the first b prompts decoded together to EOS or
--tokens (the starting batch; at 1, --b1_prompts one after the other). Per (batch, temperature), interleaved passes:
plain, each drafter (n-gram; EAGLE: --drafter) with each tree ``depth x topk x N`` of the batch (--configs_b1,
--configs_small at 2-4, --configs_large), the adaptive engine (--adaptive: a bandit over off + those arms, <= 32 live
rows; its first pass "cold", the --repeats after it "warm"), plain again. Fixed arms speculate at every batch; every
arm is checked token for token against plain. Time: prefill + decode seconds (no compiles), the median over passes.
Output: ``meta``, ``rows`` (per cell and arm) and ``summary`` (best speedup by batch, the batch from which nothing
beats plain, adaptive against the best fixed arm). --ablate_coupling: EAGLE trees also uncoupled ("eagle_topk"). The
batch-1 step breakdown (--breakdown, now a no-op: ``step_breakdown_b1`` of results/speculative_smollm2_cpu_b1.json)
and --off_overhead are at commit b73bbda.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import platform
import time

import jax
import numpy as np
from absl import app, flags

from tlt_jax.adaptive import Bandit
from tlt_jax.assets import EMBEDDED_DRAFTER, resolve_drafter_path
from tlt_jax.drafter.export import load_drafter
from tlt_jax.drafter.warmup import load_policy_and_prompts
from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig

_F = flags.FLAGS
DEFAULT_DRAFTER = pathlib.Path(resolve_drafter_path(EMBEDDED_DRAFTER))
UNCOUPLED = "eagle_topk"  # --ablate_coupling: the EAGLE drafter's deterministic top-k trees for sampled rows too
flags.DEFINE_string("model", None, "policy (default: embedded SmolLM2; 'tiny' = random tiny model)")
flags.DEFINE_string("drafter", None, "EAGLE drafter directory (default with the embedded SmolLM2: the shipped one)")
flags.DEFINE_list("batches", ["1", "2", "4", "8", "16", "32"], "starting active batch sizes")
flags.DEFINE_list("tokens", ["192", "128", "96", "64", "48", "32"], "new tokens per row, per batch entry")
flags.DEFINE_list("temperatures", ["0", "0.9"], "sampling temperatures")
flags.DEFINE_list("configs_b1", ["3x1x4", "4x1x5", "3x2x6", "5x1x6", "6x4x16", "8x4x48"],
                  "trees (depth x topk x N), batch 1")
flags.DEFINE_list("configs_small", ["3x1x4", "4x1x5", "3x2x6"], "trees at batch 2-4")
flags.DEFINE_list("configs_large", ["2x1x3", "3x1x4", "3x2x6"], "trees at batch > 4")
flags.DEFINE_list("drafters", ["ngram", "eagle"], "drafters to run (eagle needs --drafter)")
flags.DEFINE_integer("b1_prompts", 8, "at batch 1, run this many prompts one after the other (summed)")
flags.DEFINE_integer("repeats", 1, "timed interleaved passes per cell (--adaptive: after one cold pass)")
flags.DEFINE_bool("breakdown", False, "no-op, kept for the commands in benchmarks/README.md (see the docstring)")
flags.DEFINE_bool("adaptive", True, "also run the adaptive engine: a bandit over off + every fixed arm of the batch")
flags.DEFINE_bool("ablate_coupling", False, "also every EAGLE tree with SpecConfig(coupled=False): 'eagle_topk'")
flags.DEFINE_string("out", "benchmarks/results/speculative_smollm2_cpu.json", "JSON output")


class _Tally:
    """One arm's totals over the prompt groups of a (batch, temperature) cell."""

    def __init__(self):
        self.tokens, self.seconds, self.verifies, self.spec_tokens, self.compile_s, self.steps = [], 0.0, 0, 0, 0.0, 0
        self.decode_seconds, self.seconds_passes, self.arm_steps = 0.0, [], {}
        self.aa_ratios: list[float] = []  # plain only: its second run of each pass over its first

    def run(self, engine: RolloutEngine, group, params: SamplingParams) -> None:
        res = engine.generate(group, params)
        st = res.stats
        self.tokens += [s[0] for s in res.tokens]
        self.seconds += st["prefill_seconds"] + st["decode_seconds"]
        self.decode_seconds += st["decode_seconds"]
        self.verifies += st["spec"]["row_verifies"]
        self.spec_tokens += st["spec"]["tokens"]
        self.compile_s += st["compile_seconds_this_call"]
        self.steps += st["steps"]
        for per in st["arm_steps"].values():
            for a, n in per.items():
                self.arm_steps[a] = self.arm_steps.get(a, 0) + n

    def stats(self) -> dict:
        accept = self.spec_tokens / self.verifies if self.verifies else 1.0
        # Decode ms per plain or verify step, round trips included (at batch 1, with the accept length: the speedup)
        total = getattr(self, "decode_seconds_total", self.decode_seconds)  # adaptive warm: over all warm passes
        ms = 1000 * total / self.steps if self.steps else None
        aa = dict(aa_ratios=self.aa_ratios) if self.aa_ratios else {}
        return dict(mean_accept=accept, compile_seconds=self.compile_s, steps=self.steps, ms_per_step=ms,
                    seconds_passes=self.seconds_passes or [self.seconds], **aa)


def _run_cell(arms: dict, groups, params: SamplingParams, repeats: int = 1, adaptive=None):
    """Every arm on every prompt group in interleaved passes (per group: plain, each arm, plain again); each arm's
    seconds the median over ``repeats`` passes, plain's the mean of its two runs per pass; tokens identical in every
    pass. ``adaptive`` joins every pass after the arms, with an extra "cold" pass first; its tallies come back under
    ("adaptive", "cold" | "warm") with plain's ``ref_seconds`` / ``ref_decode_seconds`` of the same passes and the
    bandit's ``choices``. Returns (the speculative arms' tallies, plain's)."""
    runs = [*arms, "adaptive"] if adaptive is not None else list(arms)
    engines = arms | ({"adaptive": adaptive} if adaptive is not None else {})
    passes = []
    for k in range(repeats + (adaptive is not None)):
        tallies, again = {key: _Tally() for key in runs}, _Tally()
        # Every other pass reverses the arms' order, so no arm always follows the same one (an order effect)
        order = runs if k % 2 == 0 else [runs[0], *runs[:0:-1]]
        for g in groups:
            for key in order:
                tallies[key].run(engines[key], g, params)
            again.run(arms["plain"], g, params)
        plain = tallies["plain"]
        if again.tokens != plain.tokens or (passes and plain.tokens != passes[0]["plain"].tokens):
            raise AssertionError("plain decoding is not deterministic across passes")
        plain.aa_ratio = again.seconds / plain.seconds  # an A/A pair: the machine's noise between two equal runs
        plain.seconds = (plain.seconds + again.seconds) / 2
        plain.decode_seconds = (plain.decode_seconds + again.decode_seconds) / 2
        if adaptive is not None:
            tallies["adaptive"].choices = adaptive.bandit.stats()["choices"]
        passes.append(tallies)
    extra = {}
    if adaptive is not None:
        cold = passes[0]["adaptive"]
        cold.ref_seconds, cold.ref_decode_seconds = passes[0]["plain"].seconds, passes[0]["plain"].decode_seconds
        extra["adaptive", "cold"] = cold
        passes = passes[1:]
    out = {}
    for key in runs:
        t = passes[-1][key]
        if any(p[key].tokens != passes[0][key].tokens for p in passes):
            raise AssertionError(f"{key}: tokens differ between repeated passes")
        t.seconds_passes = [p[key].seconds for p in passes]
        if key == "plain":
            t.aa_ratios = [p[key].aa_ratio for p in passes]
        t.seconds = float(np.median(t.seconds_passes))
        t.decode_seconds = float(np.median([p[key].decode_seconds for p in passes]))
        if key == "adaptive":  # the arm steps and verifies of every warm pass together
            for p in passes[:-1]:
                for a, n in p[key].arm_steps.items():
                    t.arm_steps[a] = t.arm_steps.get(a, 0) + n
                t.verifies, t.spec_tokens, t.steps = (
                    t.verifies + p[key].verifies, t.spec_tokens + p[key].spec_tokens, t.steps + p[key].steps)
            t.decode_seconds_total = sum(p[key].decode_seconds for p in passes)
        out[key] = t
    plain = out.pop("plain")
    if adaptive is not None:
        warm = out.pop("adaptive")
        warm.ref_seconds, warm.ref_decode_seconds = plain.seconds, plain.decode_seconds
        extra["adaptive", "warm"] = warm
    return out | extra, plain


def main(argv):
    del argv
    split = None if _F.model == "tiny" else "eval"
    batches = [int(b) for b in _F.batches]
    tokens = [int(t) for t in _F.tokens]
    policy, prompts, stops = load_policy_and_prompts(_F.model, max(batches + [_F.b1_prompts]), 1000, split)
    drafters = {}
    if "ngram" in _F.drafters:
        drafters["ngram"] = "ngram"
    if "eagle" in _F.drafters and _drafter_dir():
        drafters["eagle"] = load_drafter(_drafter_dir())
        if _F.ablate_coupling:
            drafters[UNCOUPLED] = drafters["eagle"]
    max_len = max(len(p) for p in prompts) + max(tokens) + 64
    max_batch = max(batches)
    plain = RolloutEngine(policy, max_batch=max_batch, max_len=max_len)
    engines: dict[tuple[str, str], RolloutEngine] = {}

    def engine(name: str, config: str) -> RolloutEngine:
        if (name, config) not in engines:
            depth, topk, n = (int(x) for x in config.split("x"))
            spec = SpecConfig(depth=depth, topk=topk, verify_tokens=n, threshold=max_batch,
                              coupled=name != UNCOUPLED)
            engines[name, config] = RolloutEngine(policy, drafter=drafters[name], spec=spec, max_batch=max_batch,
                                                  max_len=max_len)
        return engines[name, config]

    rows = []
    t_start = time.perf_counter()
    for b, n_new in zip(batches, tokens, strict=False):
        engines.clear()  # each batch compiles its own shapes anyway; keeping every engine's executables ran out of
        gc.collect()  # memory (24 GB) by batch 32
        groups = [prompts[i: i + 1] for i in range(_F.b1_prompts)] if b == 1 else [prompts[:b]]
        configs = _F.configs_b1 if b == 1 else _F.configs_small if b <= 4 else _F.configs_large
        arms = {"plain": plain} | {(name, c): engine(name, c) for c in configs for name in drafters}
        ada = None
        if _F.adaptive:  # one engine per batch, a fresh bandit per (batch, temperature): see _run_cell
            bandit_arms = ("off", *(f"{name}:{c}" for name in drafters if name != UNCOUPLED for c in configs))
            spec = SpecConfig(arms=bandit_arms)  # SpecConfig's defaults: epsilon, margin, threshold, steps per call
            ada = RolloutEngine(policy, drafter=drafters.get("eagle"), spec=spec, max_batch=max_batch, max_len=max_len)
        for temp in (float(t) for t in _F.temperatures):
            params = SamplingParams(temperature=temp, max_new_tokens=n_new, seed=0, stop_token_ids=stops)
            if ada is not None:
                ada.bandit = Bandit(ada.spec.bandit_config())
            tallies, pt = _run_cell(arms, groups, params, _F.repeats, ada)
            n_tok, t_plain, d_plain = sum(len(t) for t in pt.tokens), pt.seconds, pt.decode_seconds
            base = dict(batch=b, prompts=sum(len(g) for g in groups), temperature=temp, tokens=n_tok,
                        plain_seconds=t_plain, plain_tokens_per_s=n_tok / t_plain, load_average=os.getloadavg())
            rows.append(dict(base, drafter="none", config="plain", seconds=t_plain, tokens_per_s=n_tok / t_plain,
                             speedup=1.0, decode_seconds=d_plain, decode_speedup=1.0, lossless=True, **pt.stats()))
            print(f"b={b:2d} T={temp}: plain {n_tok / t_plain:7.1f} tok/s ({n_tok} tokens); A/A (plain's 2nd run / "
                  f"1st, per pass) {', '.join(f'{r:.3f}' for r in pt.stats()['aa_ratios'])}", flush=True)
            for (name, c), tl in tallies.items():
                t, lossless = tl.seconds, tl.tokens == pt.tokens
                ref, dref = (tl.ref_seconds, tl.ref_decode_seconds) if name == "adaptive" else (t_plain, d_plain)
                rows.append(dict(base, drafter=name, config=c, seconds=t, tokens_per_s=n_tok / t,
                                 speedup=ref / t, decode_seconds=tl.decode_seconds,
                                 decode_speedup=dref / tl.decode_seconds, lossless=lossless, **tl.stats()))
                label = f"{name:>5} {c:>7}"
                if name == "adaptive":  # speedups against plain of the same pass
                    rows[-1].update(arm_steps=tl.arm_steps, bandit_choices=tl.choices, plain_seconds_pass=ref,
                                    bandit_best=ada.bandit.stats()["best"], arms=list(bandit_arms))
                    if c == "warm":  # plain's time over the adaptive engine's, pass by pass
                        rows[-1]["speedup_passes"] = [p / a for p, a in zip(pt.seconds_passes, tl.seconds_passes,
                                                                            strict=True)]
                    label = ("adaptive, cold (1st pass, fresh bandit)" if c == "cold"
                             else f"adaptive, warm (median of {_F.repeats} passes)")
                print(f"b={b:2d} T={temp}: {label}: accept {tl.stats()['mean_accept']:.2f} tok/verify, "
                      f"{tl.stats()['ms_per_step']:.1f} ms/step (plain {pt.stats()['ms_per_step']:.1f}), "
                      f"{n_tok / t:7.1f} tok/s, {ref / t:.2f}x plain "
                      f"(decode only {dref / tl.decode_seconds:.2f}x), lossless={lossless}", flush=True)
                if name == "adaptive":
                    per = rows[-1].get("speedup_passes")
                    print(f"    arm steps {tl.arm_steps}; bandit choices {tl.choices}"
                          + (f"; x plain per pass {', '.join(f'{r:.3f}' for r in per)}" if per else ""), flush=True)
                write(rows, drafters, split, t_start, final=False)  # partial results survive a kill
    write(rows, drafters, split, t_start, final=True)


def _drafter_dir():
    """--drafter, else the committed drafter when the policy is the embedded SmolLM2 it was trained for."""
    return _F.drafter or (DEFAULT_DRAFTER if _F.model is None else None)


def write(rows, drafters, split, t_start, final: bool) -> None:
    summary = _summarise(rows, list(drafters), log=final)
    if _F.adaptive:
        summary.append(dict(adaptive_vs_fixed=_adaptive_vs_fixed(rows, log=final)))
    out = pathlib.Path(_F.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": _F.model or "SmolLM2-135M-Instruct (embedded)", "drafter": str(_drafter_dir() or ""),
            "prompts": split or "tiny", "device": str(jax.devices()[0]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)", "jax": jax.__version__,
            "dtype": "float32", "steps_per_call": SpecConfig.steps_per_call, "adaptive_threshold": SpecConfig.threshold,
            "complete": final, "total_seconds": time.perf_counter() - t_start, "load_average_end": os.getloadavg()}
    if "eagle" in drafters and (pathlib.Path(_drafter_dir()) / "warmup.json").exists():
        meta["warmup"] = json.loads((pathlib.Path(_drafter_dir()) / "warmup.json").read_text())
    out.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1, default=_np))
    if final:
        print(f"wrote {out} in {meta['total_seconds']:.0f}s")


def _summarise(rows, names, log: bool = True):
    """Best configuration per (temperature, drafter, batch) and the batch from which none beats plain."""
    summary = []
    for temp in sorted({r["temperature"] for r in rows}):
        for name in names:
            best = {}
            for r in rows:
                if r["temperature"] == temp and r["drafter"] == name:
                    if r["batch"] not in best or r["speedup"] > best[r["batch"]]["speedup"]:
                        best[r["batch"]] = r
            stop_at = next((b for b in sorted(best) if best[b]["speedup"] < 1.0), None)
            summary.append(dict(temperature=temp, drafter=name, stops_paying_off_at_batch=stop_at,
                                best={b: dict(config=r["config"], speedup=r["speedup"], mean_accept=r["mean_accept"],
                                              decode_speedup=r.get("decode_speedup"),
                                              tokens_per_s=r["tokens_per_s"]) for b, r in sorted(best.items())}))
            if not log:
                continue
            print(f"T={temp} {name}: best speedup by batch "
                  + ", ".join(f"{b}: {r['speedup']:.2f}x ({r['config']}, accept {r['mean_accept']:.2f})"
                              for b, r in sorted(best.items()))
                  + f"; no configuration beats plain from batch {stop_at}")
    return summary


def _adaptive_vs_fixed(rows, log: bool = True) -> list[dict]:
    """Per (temperature, batch) and adaptive pass (cold: the first, with a fresh bandit; warm: the passes after it):
    the adaptive engine's speedup over plain (plain of the same passes) and its ratio to the best fixed arm's speedup
    (goals: >= 1.0x plain, >= 0.95x the best fixed arm); for several warm passes also the paired ratios."""
    out = []
    for temp, b in sorted({(r["temperature"], r["batch"]) for r in rows}):
        cell = [r for r in rows if r["temperature"] == temp and r["batch"] == b]
        fixed = [r for r in cell if r["drafter"] not in ("adaptive", UNCOUPLED)]  # the adaptive engine's arms
        best = max(fixed, key=lambda r: r["speedup"])
        plain = next(r for r in fixed if r["config"] == "plain")
        for ada in (r for r in cell if r["drafter"] == "adaptive"):
            row = dict(temperature=temp, batch=b, adaptive_pass=ada["config"], adaptive_vs_plain=ada["speedup"],
                       best_fixed=f"{best['drafter']} {best['config']}", best_fixed_vs_plain=best["speedup"],
                       adaptive_vs_best=ada["speedup"] / best["speedup"], arm_steps=ada.get("arm_steps"),
                       bandit_choices=ada.get("bandit_choices"))
            paired = ""
            if ada["config"] == "warm" and len(ada["seconds_passes"]) > 1:
                # Paired: the median over warm passes of the ratio to plain's / the best arm's time in the same pass
                a_s = np.asarray(ada["seconds_passes"])
                row["adaptive_vs_plain_paired"] = float(np.median(np.asarray(plain["seconds_passes"]) / a_s))
                row["adaptive_vs_best_paired"] = float(np.median(np.asarray(best["seconds_passes"]) / a_s))
                paired = (f"; paired per pass (median): {row['adaptive_vs_plain_paired']:.2f}x plain, "
                          f"{row['adaptive_vs_best_paired']:.2f}x the best")
            out.append(row)
            if log:
                print(f"T={temp} b={b}: adaptive {ada['config']:>4}: {ada['speedup']:.2f}x plain, "
                      f"{ada['speedup'] / best['speedup']:.2f}x the best fixed arm ({best['drafter']} {best['config']} "
                      f"{best['speedup']:.2f}x){paired}")
    return out


def _np(x):
    return x.item() if isinstance(x, np.generic) else str(x)


if __name__ == "__main__":
    app.run(main)
