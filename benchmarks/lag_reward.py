"""Which per-round-trip reward ranks "off" and a fixed EAGLE arm the way their decode times do: the mean row's tokens/s
(the bandit's reward before) or the wave's lagging row's (its reward now, ``tlt_jax.adaptive.bandit``)?

    python benchmarks/lag_reward.py [--cells=4:0.9:64,4:0:64,16:0:48,16:0.9:48] [--passes=7] [--out=FILE.json]

Per cell (batch : temperature : new tokens), SmolLM2 with the committed EAGLE drafter on the held-out prompts, a plain
engine and a fixed EAGLE engine (3x1x4 up to batch 4, 2x1x3 above, as ``speculative.py``'s goal table; speculating
from the first chunk) decode the same prompts alternately, ``--passes`` times (the first pass is dropped: compiles).
From every round trip of the wave's first batch bucket: the mean row's reward (tokens / seconds / mean live rows) and
the lagging row's (its tokens / seconds). Reported: EAGLE over off for decode time (the truth) and for both rewards'
medians. A reward that puts EAGLE ahead while its decode time is behind misleads the bandit.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from absl import app, flags  # noqa: E402

flags.DEFINE_list("cells", ["4:0.9:64", "4:0:64", "16:0:48", "16:0.9:48"], "batch:temperature:new tokens")
flags.DEFINE_integer("passes", 7, "alternating passes per cell (the first is dropped)")
flags.DEFINE_string("out", "benchmarks/results/lag_reward_smollm2_cpu.json", "JSON output")
_F = flags.FLAGS


def rewards(stats: dict, batch: int, speculative: bool) -> tuple[float, float]:
    """Medians over the round trips in ``batch`` of the engine's arm (a compiled step's first run left out; the
    EAGLE engine's plain chunks before its gate opens too) of the mean row's and the lagging row's tokens/s."""
    mean_row, lag = [], []
    for c in stats["chunks"]:
        if c["batch"] != batch or c["first_run"] or (c["arm"] != "plain") != speculative:
            continue
        rows = c.get("row_verifies", c["tokens"]) / max(c["steps"], 1)
        mean_row.append(c["tokens"] / c["seconds"] / rows)
        lag.append(c["lag_tokens"] / c["seconds"])
    return statistics.median(mean_row), statistics.median(lag)


def main(argv):
    del argv
    import jax

    from tlt_jax.assets import EMBEDDED_DRAFTER, resolve_drafter_path
    from tlt_jax.drafter.export import load_drafter
    from tlt_jax.drafter.warmup import load_policy_and_prompts
    from tlt_jax.main import _enable_compilation_cache
    from tlt_jax.rollout import RolloutEngine, SamplingParams, SpecConfig

    _enable_compilation_cache()
    cells = [(int(b), float(t), int(n)) for b, t, n in (c.split(":") for c in _F.cells)]
    policy, prompts, stops = load_policy_and_prompts(None, max(b for b, _, _ in cells), 1000, "eval")
    drafter = load_drafter(resolve_drafter_path(EMBEDDED_DRAFTER))
    max_len = max(map(len, prompts)) + max(n for _, _, n in cells) + 64
    out = dict(meta=dict(machine=f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
                         jax=jax.__version__, device=jax.devices()[0].device_kind, passes=_F.passes), cells=[])
    for b, temp, n_new in cells:
        shape = (3, 1, 4) if b <= 4 else (2, 1, 3)
        arm = "eagle:{}x{}x{}".format(*shape)
        spec = SpecConfig(depth=shape[0], topk=shape[1], verify_tokens=shape[2], threshold=b)
        engines = {"off": RolloutEngine(policy, max_batch=b, max_len=max_len),
                   arm: RolloutEngine(policy, drafter=drafter, spec=spec, max_batch=b, max_len=max_len)}
        sp = SamplingParams(temperature=temp, max_new_tokens=n_new, seed=0, stop_token_ids=stops)
        runs: dict[str, list] = {k: [] for k in engines}
        tokens = {}
        for p in range(_F.passes):
            for name in list(engines)[:: 1 if p % 2 == 0 else -1]:
                res = engines[name].generate(prompts[:b], sp)
                tokens.setdefault(name, res.tokens)
                if res.tokens != tokens[name] or res.tokens != next(iter(tokens.values())):
                    raise AssertionError(f"b={b} T={temp}: {name} sampled other tokens (lossless and deterministic)")
                if p > 0:
                    runs[name].append((res.stats["decode_seconds"], *rewards(res.stats, b, name != "off")))
        med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in runs.items()}
        cell = dict(batch=b, temperature=temp, new_tokens=n_new, arm=arm, passes=runs,
                    decode_seconds={k: m[0] for k, m in med.items()},
                    mean_row_reward={k: m[1] for k, m in med.items()},
                    lag_reward={k: m[2] for k, m in med.items()},
                    eagle_over_off=dict(speed=med["off"][0] / med[arm][0], mean_row_reward=med[arm][1] / med["off"][1],
                                        lag_reward=med[arm][2] / med["off"][2]))
        out["cells"].append(cell)
        r = cell["eagle_over_off"]
        print(f"b={b} T={temp} {n_new} tokens: {arm} over off: speed {r['speed']:.2f}x, mean-row reward "
              f"{r['mean_row_reward']:.2f}x, lagging-row reward {r['lag_reward']:.2f}x", flush=True)
        for e in engines.values():
            e.close()
    pathlib.Path(_F.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    app.run(main)
