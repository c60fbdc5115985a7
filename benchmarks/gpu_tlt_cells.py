"""The cells of ``gpu_tlt.py``: speculative decoding beside plain decoding (``speculative.py``'s workload and tallies)
and the adaptive engine, and one RL run of ``e2e_step.py``. Token mismatches against plain (bf16 / TF32, batch-shaped
reduction orders on a GPU) are counted in ``mismatched_rows``, never raised.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import e2e_step as e2e
import jax
import speculative as spec_bench

from tlt_jax.adaptive import Bandit
from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig

BUCKETS = (1, 4, 16, 64)  # batch buckets of the decoding cells (few shapes: compiles dominate on a GPU)


def temp_key(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"t{temperature:g}"


class Decoding:
    """The decoding cells' engines, one set per batch (kept across cells, so a later cell reuses the compiles)."""

    def __init__(self, policy, drafters: dict, prompts, stops, *, steps_per_call: int = 4, layers: str = "auto"):
        self.policy, self.drafters, self.prompts, self.stops = policy, drafters, prompts, stops
        if layers == "auto":  # the main job's choice on this backend
            layers = "unstacked" if jax.default_backend() == "gpu" else "stacked"
        self.steps_per_call, self.layout = steps_per_call, {"layers": layers}
        self.engines: dict[tuple[int, str], RolloutEngine] = {}

    def _kw(self, b: int, n_new: int) -> dict:
        max_len = max(len(p) for p in self.prompts) + n_new + 64  # one cache-length bucket for every prompt
        buckets = tuple(x for x in BUCKETS if x < b) + (b,)
        return dict(max_batch=b, max_len=max_len, batch_buckets=buckets, length_buckets=(max_len,), **self.layout)

    def engine(self, b: int, n_new: int, arm: str) -> RolloutEngine:
        """ "plain", "ngram:DxKxN" / "eagle:DxKxN" (a fixed tree, speculating at every batch) or "adaptive:ARM,ARM"
        (the bandit over off + those arms, the engine's default speculation gate)."""
        key = (b, arm)
        if key not in self.engines:
            kw = self._kw(b, n_new)
            if arm == "plain":
                self.engines[key] = RolloutEngine(self.policy, **kw)
            elif arm.startswith("adaptive:"):
                arms = ("off", *arm.split(":", 1)[1].split(","))
                spec = SpecConfig(arms=arms, steps_per_call=self.steps_per_call)
                self.engines[key] = RolloutEngine(self.policy, drafter=self.drafters.get("eagle"), spec=spec, **kw)
            else:
                name, tree = arm.split(":")
                d, k, n = (int(x) for x in tree.split("x"))
                spec = SpecConfig(depth=d, topk=k, verify_tokens=n, threshold=b, steps_per_call=self.steps_per_call)
                self.engines[key] = RolloutEngine(self.policy, drafter=self.drafters[name], spec=spec, **kw)
        return self.engines[key]

    def groups(self, b: int, b1_prompts: int):
        return [self.prompts[i : i + 1] for i in range(b1_prompts)] if b == 1 else [self.prompts[:b]]

    def cell(self, b: int, n_new: int, temperature: float, arms: list[str], *, b1_prompts: int, passes: int,
             log=print) -> dict:
        """Plain and ``arms`` at starting batch ``b``: one untimed pass (compiles; an adaptive engine's "cold" pass),
        then ``passes`` interleaved timed passes; each arm's figures are medians of its per-pass ratios to plain."""
        engines = {"plain": self.engine(b, n_new, "plain")} | {a: self.engine(b, n_new, a) for a in arms}
        for a, e in engines.items():
            if a.startswith("adaptive:"):
                e.bandit = Bandit(e.spec.bandit_config())  # fresh per (batch, temperature), as speculative.py
        params = SamplingParams(temperature=temperature, max_new_tokens=n_new, seed=0, stop_token_ids=self.stops)
        groups, keys = self.groups(b, b1_prompts), list(engines)
        runs: dict[str, list] = {k: [] for k in keys}
        again = []
        for p in range(passes + 1):
            order = keys if p % 2 == 0 else [keys[0], *keys[:0:-1]]
            tallies, t2 = {k: spec_bench._Tally() for k in keys}, spec_bench._Tally()
            for g in groups:
                for k in order:
                    tallies[k].run(engines[k], g, params)
                t2.run(engines["plain"], g, params)
            for k in keys:
                runs[k].append(tallies[k])
            again.append(t2)
        return summarise_cell(runs, again, b, n_new, temperature, log)


def _mismatches(a: list, b: list) -> int:
    return sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))


def summarise_cell(runs: dict, again: list, b: int, n_new: int, temperature: float, log=print) -> dict:
    """Figures of one cell from its tallies (pass 0 untimed)."""
    plain, timed = runs["plain"], range(1, len(again))
    plain_s = [(plain[p].seconds + again[p].seconds) / 2 for p in timed]
    ref = plain[0].tokens
    n_plain = sum(len(t) for t in ref)
    out = dict(batch=b, max_new_tokens=n_new, temperature=temperature, rows=len(ref), arms={}, plain=dict(
        tokens=n_plain, seconds=statistics.median(plain_s), tokens_per_s=n_plain / statistics.median(plain_s),
        ms_per_step=_ms_per_step(plain[1:] + again[1:]), aa_ratios=[again[p].seconds / plain[p].seconds for p in timed],
        deterministic=all(t.tokens == ref for t in plain + again)))
    for k, tallies in runs.items():
        if k == "plain":
            continue
        n_tok = sum(len(t) for t in tallies[1].tokens)
        secs = [tallies[p].seconds for p in timed]
        ratios = [(n_tok / s) / (n_plain / ps) for s, ps in zip(secs, plain_s, strict=True)]
        verifies = sum(t.verifies for t in tallies[1:])
        row = dict(tokens=n_tok, seconds=statistics.median(secs), tokens_per_s=n_tok / statistics.median(secs),
                   speedup=statistics.median(ratios), speedup_passes=ratios,
                   accept=sum(t.spec_tokens for t in tallies[1:]) / verifies if verifies else 1.0,
                   ms_per_step=_ms_per_step(tallies[1:]),
                   mismatched_rows=max(_mismatches(t.tokens, ref) for t in tallies))
        if k.startswith("adaptive:"):
            row["arm_steps"] = {a: n for t in tallies[1:] for a, n in t.arm_steps.items()}
            row["cold_speedup"] = (n_tok / tallies[0].seconds) / (n_plain / plain[0].seconds)
        out["arms"][k] = row
        log(f"b={b} {temp_key(temperature)} {k}: accept {row['accept']:.2f}, {row['ms_per_step']:.2f} ms/step "
            f"(plain {out['plain']['ms_per_step']:.2f}), {row['tokens_per_s']:.0f} tok/s, {row['speedup']:.2f}x plain, "
            f"mismatched rows {row['mismatched_rows']}/{out['rows']}")
    fixed = {k: r for k, r in out["arms"].items() if not k.startswith("adaptive:")}
    if fixed:
        k = max(fixed, key=lambda a: fixed[a]["speedup"])
        out["best_spec"] = dict(arm=k, speedup=fixed[k]["speedup"], accept=fixed[k]["accept"])
        no_spec = dict(arm="plain", speedup=1.0, accept=1.0)
        out["best_fixed"] = out["best_spec"] if fixed[k]["speedup"] > 1.0 else no_spec
    return out


def _ms_per_step(tallies) -> float | None:
    steps = sum(t.steps for t in tallies)
    return 1000 * sum(t.decode_seconds for t in tallies) / steps if steps else None


def e2e_run(name: str, mode: str, steps: int, extra: dict, drafter: str, arms: str = e2e.ADAPTIVE_ARMS) -> dict:
    """One run of the main job (``e2e_step.bench``) with every response's length per step and the engine's shape
    (``pod_model.validate_run`` reads them); steady figures: sums over the steps after the first (compiles)."""
    r = e2e.bench(name, steps, mode, arms, drafter, "5x1x6", extra)
    per_step = [dict(step=s["step"], step_s=s["time/step_s"], rollout_s=s["time/rollout_s"],
                     compile_s=s["rollout/compile_s"] or 0.0, train_s=s["time/train_s"],
                     accept_length=s["rollout/accept_length"], reward=s["reward/mean"], lengths=n)
                for s, n in zip(r["per_step"], r["lengths"], strict=True)]
    steady = per_step[1:] or per_step
    return dict(mode=mode, config=r["config"], overrides=r["overrides"], group=r["group"], **r["engine"],
                wall_s=r["wall_s_including_setup_and_final_eval"], steps=per_step, steady_steps=len(steady),
                **{f"steady_{k}": sum(x[k] for x in steady) for k in ("step_s", "rollout_s", "compile_s")})


def drafter_for_tiny_e2e(out_dir: str) -> str:
    """--smoke: a random EAGLE drafter of configs/tiny.py's model, saved (the adaptive mode loads one from a path)."""
    from flax import nnx

    from tlt_jax.builders import tiny_model_config
    from tlt_jax.drafter.eagle import EagleDrafter
    from tlt_jax.drafter.export import save_drafter

    path = Path(out_dir) / "tiny_e2e_drafter"
    save_drafter(EagleDrafter(tiny_model_config(e2e.load_config("tiny", {})), rngs=nnx.Rngs(0)), path)
    return str(path)
