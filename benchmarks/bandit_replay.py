"""Offline replay of the adaptive engine's bandit on measured per-arm speeds: adaptive vs the best fixed arm vs plain,
per starting batch and temperature, before spending real-engine time on a rule.

    python benchmarks/bandit_replay.py [--workload=short|sweep] [--replicates=40] [--off_overhead=1.0]

Speeds: the committed per-arm rows of ``benchmarks/results/speculative_smollm2_cpu_b1.json`` (batch 1) and
``speculative_smollm2_cpu_sweep.json`` (batches 2-32): per (temperature, batch, arm) the mean accept length (tokens per
verify and row) and the milliseconds per decode or verify step. A bucket uses the row of the starting batch equal to
it; an arm not measured at that batch takes its accept length and its step cost relative to plain from the nearest
batch that measured it. Batch 64 is not in the committed data and is not simulated.

A simulated generation is one wave per prompt group, as ``benchmarks/speculative.py`` runs it: rows with per-row lengths
(at the cap with probability 0.6, else uniform in [0.2, 1] of it; the same lengths for every arm, as lossless decoding
emits the same tokens), compacted into the smallest bucket of 1, 2, 4, ... holding the live rows. A round trip is K = 8
plain steps, 4 EAGLE verify steps or 1 n-gram verify step (fewer when every row finishes); a verify emits 1 + the
accepted drafts per row, each depth level accepted with the probability that gives the measured mean accept length
(a truncated geometric). Round-trip time = steps x ms per step; the bandit observes it times log-normal noise
(--noise), the scores use it without (so the ratios measure the bandit's decisions, not the noise of one pass).
``--off_overhead`` scales the adaptive engine's plain steps (the drafter cache kept current; the plain engine's are
unscaled).

The adaptive engine's bandit (``tlt_jax.adaptive.Bandit``) chooses every round trip's arm (the gate always open) and
observes (tokens, seconds) like the engine. Cold = the first pass over the cell's prompts with a fresh bandit; warm =
pass 2, and steady = the mean of passes --steady/2 to --steady over the same prompts with the same bandit (its state
carries across generate calls as in RL). Fixed arms' times are means over 4 draws of the accept lengths.
Reports, per rule variant, the mean and 10th percentile over replicates of adaptive / best fixed arm and adaptive /
plain (decode time only; a prefill, the same in every arm, would pull every ratio towards 1).
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
from absl import app, flags

from tlt_jax.adaptive import Bandit, BanditConfig, parse_arm

_F = flags.FLAGS
RESULTS = pathlib.Path(__file__).parent / "results"
flags.DEFINE_enum("workload", "short", ["short", "sweep"], "short: the short real-engine run; sweep: the full sweep")
flags.DEFINE_integer("replicates", 40, "noise / length seeds per cell")
flags.DEFINE_float("noise", 0.12, "log-normal sigma of a round trip's time")
flags.DEFINE_float("off_overhead", 1.0, "adaptive engine's plain step time over the plain engine's")
flags.DEFINE_integer("steady", 10, "the later warm pass reported")
flags.DEFINE_list("variants", ["beg-mab-orig", "beg-mab", "new"], "bandit rules to replay (VARIANTS)")
flags.DEFINE_float("epsilon", 0.1, "exploration probability")
flags.DEFINE_float("margin", 0.1, "plausible-exploration margin of the new rule")
flags.DEFINE_string("out", None, "optional JSON output")

K, SPEC_STEPS = 8, 4
WORKLOADS = {  # batch -> (max new tokens, prompt groups, fixed tree configs)
    "short": {1: (64, 2, ["3x1x4", "5x1x6"]), 4: (48, 1, ["3x1x4"]), 16: (32, 1, ["2x1x3"])},
    "sweep": {
        1: (192, 8, ["3x1x4", "4x1x5", "4x2x6", "3x2x6", "5x1x6", "6x4x16"]),
        2: (128, 1, ["3x1x4", "4x2x6"]),
        4: (96, 1, ["3x1x4", "4x2x6"]),
        8: (64, 1, ["2x1x3", "3x1x4"]),
        16: (48, 1, ["2x1x3", "3x1x4"]),
        32: (32, 1, ["2x1x3", "3x1x4"]),
    },
}
VARIANTS = {  # BanditConfig fields; per_row=False: the engine reports rows=1 (reward = tokens/s, as before this rule)
    "beg-mab-orig": dict(margin=1.0, transfer=False, time_share=False, per_row=False, min_count=1),
    "beg-mab": dict(margin=1.0, transfer=False, time_share=False, min_count=1),
    "new": dict(transfer=True, time_share=True),
    "new-min1": dict(transfer=True, time_share=True, min_count=1),  # one measurement decides (before min_count)
    "new-min2": dict(transfer=True, time_share=True, min_count=2),
    "transfer-only": dict(margin=1.0, transfer=True, time_share=False),
    "margin-only": dict(transfer=False, time_share=False),
    "new-no-time": dict(transfer=True, time_share=False),
}


def load_speeds() -> dict[tuple[float, int], dict[str, tuple[float, float]]]:
    """(temperature, batch) -> {arm: (mean accept, ms per step)} from the committed JSONs."""
    out: dict = {}
    for name in ("speculative_smollm2_cpu_b1.json", "speculative_smollm2_cpu_sweep.json"):
        for r in json.loads((RESULTS / name).read_text())["rows"]:
            arm = "off" if r["config"] == "plain" else f"{r['drafter']}:{r['config']}"
            out.setdefault((float(r["temperature"]), int(r["batch"])), {})[arm] = (r["mean_accept"], r["ms_per_step"])
    return out


def arm_model(speeds, temp: float, bucket: int, arm: str) -> tuple[float, float]:
    """(accept, ms per step) of ``arm`` in ``bucket``: measured at that batch, else its accept and relative step cost
    from the nearest batch that measured it."""
    here = speeds[temp, bucket]
    if arm in here:
        return here[arm]
    have = [b for (t, b), rows in speeds.items() if t == temp and arm in rows]
    b = min(have, key=lambda x: (abs(math.log2(x / bucket)), -x))
    acc, ms = speeds[temp, b][arm]
    return acc, ms / speeds[temp, b]["off"][1] * here["off"][1]


def accept_q(accept: float, depth: int) -> float:
    """Per-level acceptance q with 1 + q + ... + q^depth = accept (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        q = (lo + hi) / 2
        lo, hi = (q, hi) if sum(q**i for i in range(depth + 1)) < accept else (lo, q)
    return (lo + hi) / 2


class Sim:
    """One (temperature, starting batch) cell: per-bucket arm models and the waves of a pass."""

    def __init__(self, speeds, temp: float, batch: int, arms: list[str], off_overhead: float, noise: float):
        self.temp, self.batch, self.arms, self.noise = temp, batch, arms, noise
        self.off_overhead = off_overhead
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32) if b <= batch]
        self.model = {}
        for b in self.buckets:
            for a in arms:
                acc, ms = arm_model(speeds, temp, b, a)
                depth = parse_arm(a).depth
                self.model[b, a] = (accept_q(acc, depth) if depth else 0.0, depth, ms)

    def wave(self, lengths: np.ndarray, pick, observe, rng, adaptive: bool) -> float:
        """Decode one wave; pick(bucket) -> arm, observe(arm, bucket, tokens, seconds, steps, mean live rows per step)
        as the engine reports them. Returns the
        wave's noise-free seconds (the bandit sees noisy ones)."""
        rem = lengths.astype(np.int64).copy()
        total = 0.0
        while (live := int((rem > 0).sum())) > 0:
            b = next(x for x in self.buckets if x >= live)
            arm = str(pick(b))
            q, depth, ms = self.model[b, arm]
            before = rem.copy()
            if depth == 0:
                steps = int(min(K, rem.max()))
                rem = np.maximum(rem - K, 0)
                ms = ms * (self.off_overhead if adaptive else 1.0)
                row_steps = int((before - rem).sum())  # a live row emits one token per plain step
            else:
                steps = row_steps = 0
                for _ in range(SPEC_STEPS if arm.startswith("eagle") else 1):
                    if not (rem > 0).any():
                        break
                    steps += 1
                    row_steps += int((rem > 0).sum())
                    acc = 1 + np.minimum(rng.geometric(1 - q, size=rem.shape) - 1, depth) if q > 0 else 1
                    rem = np.maximum(rem - acc, 0)
            secs = steps * ms / 1000
            total += secs  # the expected time: noise only misleads the bandit, it is not scored
            secs *= float(np.exp(rng.normal(0, self.noise)))
            observe(arm, b, int((before - rem).sum()), secs, steps, row_steps / steps)
        return total


def run_cell(speeds, temp, batch, spec, variants, replicates, off_overhead, noise, steady, epsilon):
    """Per replicate: fixed arms (plain included) and each variant's cold / pass-2 / steady passes; returns ratios."""
    n_new, groups, configs = spec
    arms = ["off"] + [f"{d}:{c}" for d in ("ngram", "eagle") for c in configs]
    sim = Sim(speeds, temp, batch, arms, off_overhead, noise)
    out = {
        v: {
            k: []
            for k in (
                "cold_vs_best",
                "cold_vs_plain",
                "warm_vs_best",
                "warm_vs_plain",
                "steady_vs_best",
                "steady_vs_plain",
            )
        }
        for v in variants
    }
    best_arms, best_vs_plain = [], []
    for rep in range(replicates):
        lrng = np.random.default_rng(10_000 + rep)
        waves = []
        for _ in range(groups):
            full = lrng.random(batch) < 0.6
            waves.append(np.where(full, n_new, np.ceil(lrng.uniform(0.2, 1.0, batch) * n_new)).astype(np.int64))
        noop = lambda *a: None  # noqa: E731
        fixed = {}
        for a in arms:  # expected time: the mean over a few noise draws
            rng = np.random.default_rng(rep)
            fixed[a] = np.mean([sum(sim.wave(w, lambda b, a=a: a, noop, rng, False) for w in waves) for _ in range(4)])
        best = min(fixed, key=fixed.get)
        best_arms.append(best)
        best_vs_plain.append(fixed["off"] / fixed[best])
        for v in variants:
            kw = dict(VARIANTS[v])
            per_row = kw.pop("per_row", True)
            bandit = Bandit(BanditConfig(tuple(arms), epsilon=epsilon, seed=rep, **kw))
            observe = bandit.observe if per_row else lambda a, b, t, s, n, rows, o=bandit.observe: o(a, b, t, s, n)
            rng = np.random.default_rng(rep)
            passes = []
            for _ in range(steady):
                passes.append(sum(sim.wave(w, bandit.choose, observe, rng, adaptive=True) for w in waves))
            steady_t = float(np.mean(passes[len(passes) // 2 :]))  # the later passes' mean
            for key, t in (("cold", passes[0]), ("warm", passes[1]), ("steady", steady_t)):
                out[v][f"{key}_vs_best"].append(fixed[best] / t)
                out[v][f"{key}_vs_plain"].append(fixed["off"] / t)
    best = max(set(best_arms), key=best_arms.count)
    return dict(arms=arms, best_fixed=best, best_fixed_vs_plain=float(np.mean(best_vs_plain)), ratios=out)


def main(argv):
    del argv
    speeds = load_speeds()
    variants = list(_F.variants)
    for v in variants:
        if v not in VARIANTS:
            raise app.UsageError(f"--variants: unknown {v!r}; one of {sorted(VARIANTS)}")
        if v in ("new", "margin-only", "new-no-time"):
            VARIANTS[v]["margin"] = _F.margin
    results = []
    print(
        f"workload={_F.workload} replicates={_F.replicates} noise={_F.noise} off_overhead={_F.off_overhead} "
        f"epsilon={_F.epsilon} margin={_F.margin}"
    )
    for temp in (0.0, 0.9):
        for batch, spec in WORKLOADS[_F.workload].items():
            cell = run_cell(
                speeds, temp, batch, spec, variants, _F.replicates, _F.off_overhead, _F.noise, _F.steady, _F.epsilon
            )
            cell.update(temperature=temp, batch=batch)
            results.append(cell)
            parts = []
            for v in variants:
                r = cell["ratios"][v]
                parts.append(
                    f"{v}: cold {np.mean(r['cold_vs_best']):.3f}/{np.mean(r['cold_vs_plain']):.2f} "
                    f"warm {np.mean(r['warm_vs_best']):.3f}/{np.mean(r['warm_vs_plain']):.2f} "
                    f"steady {np.mean(r['steady_vs_best']):.3f} (p10 {np.percentile(r['steady_vs_best'], 10):.3f})"
                    f"/{np.mean(r['steady_vs_plain']):.2f}"
                )
            print(
                f"T={temp} b={batch:2d} best fixed {cell['best_fixed']:>12} {cell['best_fixed_vs_plain']:.2f}x: "
                + " | ".join(parts),
                flush=True,
            )
    if _F.out:
        pathlib.Path(_F.out).write_text(
            json.dumps(
                dict(
                    flags={
                        k: getattr(_F, k)
                        for k in ("workload", "replicates", "noise", "off_overhead", "steady", "epsilon", "margin")
                    },
                    cells=results,
                ),
                indent=1,
            )
        )


if __name__ == "__main__":
    app.run(main)
