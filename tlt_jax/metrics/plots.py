"""PNG plots of a run, refreshed during the run (:class:`Plotter`) and at its end: what a user looks at to see TLT at
work.

Reads only files the run already writes (``metrics.jsonl``, ``lengths.jsonl``, ``timeline.jsonl``) so the plots can
also be redrawn afterwards for any workdir: ``python -m tlt_jax.metrics.plots WORKDIR``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

__all__ = ["PLOT_FILES", "Plotter", "write_plots"]

PLOT_FILES = {
    "reward": "reward.png",
    "lengths": "response_lengths.png",
    "accept": "accept_length.png",
    "timeline": "timeline.png",
}
_STATE_COLORS = {"busy": "tab:blue", "idle": "lightgray", "training": "tab:orange"}


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
    return rows


def _save(fig, path: str) -> None:
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, path)  # a reader never sees half a PNG


def _series(rows: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def _running_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of each value and the up to ``window - 1`` values before it."""
    out = []
    for i in range(len(values)):
        last = values[max(0, i + 1 - window) : i + 1]
        out.append(sum(last) / len(last))
    return out


def _plot_reward(plt, rows, evals, path, window: int = 4) -> bool:
    keys = [k for k in ("reward/mean", "reward/accuracy", "reward/format") if _series(rows, k)[0]]
    if not keys:
        return False
    same = _series(rows, "reward/accuracy") == _series(rows, "reward/mean")
    if same and "reward/accuracy" in keys:
        keys.remove("reward/accuracy")  # no format reward: the reward is the accuracy; one line, named for both
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for k in keys:
        name = "reward = accuracy" if k == "reward/mean" and same else k.split("/")[1]
        steps, vals = _series(rows, k)
        (line,) = ax.plot(steps, vals, marker="o", alpha=0.45, label=f"{name} (sampled)")
        if len(vals) >= window:  # a step's few samples are noisy: the trend is the running mean
            ax.plot(steps, _running_mean(vals, window), color=line.get_color(), lw=2.2,
                    label=f"{name}, mean of the last {window} steps")
    steps, acc = _series(evals, "eval/accuracy")
    if steps:  # greedy decoding of the held-out prompts (at the start, every eval.every_steps, at the end)
        ax.plot(steps, acc, marker="s", color="black", lw=2.2, label="held-out accuracy (greedy)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean over responses")
    ax.set_title("Reward and accuracy")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path)
    plt.close(fig)
    return True


def _plot_lengths(plt, rows, lengths, path) -> bool:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if lengths:
        steps = [r["step"] for r in lengths]
        ax.boxplot([r["lengths"] for r in lengths], positions=steps, widths=0.6, whis=(0, 100))
        ax.set_xticks(steps)
        ax.set_title("Response lengths per step (box: quartiles, whiskers: min-max)")
    else:
        keys = [k for k in ("response/len_p50", "response/len_p90", "response/len_max") if _series(rows, k)[0]]
        if not keys:
            plt.close(fig)
            return False
        for k in keys:
            ax.plot(*_series(rows, k), marker="o", label=k.split("_")[-1])
        ax.legend()
        ax.set_title("Response length percentiles per step")
    ax.set_xlabel("RL step")
    ax.set_ylabel("tokens")
    ax.grid(alpha=0.3)
    _save(fig, path)
    plt.close(fig)
    return True


def accept_series(rows: Sequence[dict]) -> tuple[list[int], list[float]]:
    """(steps, accept length) with NaN at steps whose rollout ran no verify step (``rollout/verify_steps`` 0): their
    mean accept length is 0 by convention, which a plot must show as a gap ("not speculating"), not as a value."""
    steps, acc = _series(rows, "rollout/accept_length")
    verifies = {r["step"]: r.get("rollout/verify_steps") for r in rows}
    return steps, [float("nan") if verifies.get(s) == 0 else a for s, a in zip(steps, acc, strict=True)]


def _plot_accept(plt, rows, evals, path) -> bool:
    steps, acc = accept_series(rows)
    held_steps, held = _series(evals, "eval/accept_length")
    if not steps and not held_steps:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if steps:
        ax.plot(steps, acc, marker="o", label="training rollouts")
        idle = [s for s, a in zip(steps, acc, strict=True) if a != a]
        if idle:  # steps with no speculative round trip: marked on the axis, no value drawn
            ax.plot(idle, [0.0] * len(idle), "x", color="gray", label="not speculating")
    if held_steps:  # the same held-out prompts at every evaluation
        ax.plot(held_steps, held, marker="s", color="black", label="held-out prompts (greedy)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("tokens per verify step")
    ax.set_title("Speculative accept length")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path)
    plt.close(fig)
    return True


def _plot_timeline(plt, intervals, path) -> bool:
    if not intervals:
        return False
    last = max(r["step"] for r in intervals)
    ivs = [r for r in intervals if r["step"] == last]
    slices = sorted({r["slice"] for r in ivs})
    t0 = min(r["start"] for r in ivs)
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(slices) + 1.2))
    for state, color in _STATE_COLORS.items():
        for s in slices:
            bars = [(r["start"] - t0, r["end"] - r["start"]) for r in ivs if r["slice"] == s and r["state"] == state]
            if bars:
                ax.broken_barh(bars, (s - 0.4, 0.8), color=color, label=state if s == slices[0] else None)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _STATE_COLORS.values()]
    ax.legend(handles, list(_STATE_COLORS), loc="upper right", fontsize=8)
    proc = {r["slice"]: r.get("process") for r in ivs}  # sliced rollouts across processes: whose slice it is
    ax.set_yticks(slices, [f"slice {s}" if proc[s] is None else f"process {proc[s]} slice {s}" for s in slices])
    ax.set_xlabel("seconds since the rollout started")
    ax.set_title(f"Step {last}: mesh slices busy / idle / training the drafter")
    _save(fig, path)
    plt.close(fig)
    return True


def write_plots(workdir: str) -> list[str]:
    """Redraws every plot the workdir has data for into ``workdir/plots``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    every = _read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    rows = [r for r in every if r.get("kind", "train") == "train"]
    by_step = {r["step"]: r for r in every if r.get("eval/accuracy") is not None}  # the last eval of a step counts
    evals = [by_step[k] for k in sorted(by_step)]
    lengths = _read_jsonl(os.path.join(workdir, "lengths.jsonl"))
    intervals = _read_jsonl(os.path.join(workdir, "timeline.jsonl"))
    out = os.path.join(workdir, "plots")
    os.makedirs(out, exist_ok=True)
    written = []
    for name, ok in (
        ("reward", lambda p: _plot_reward(plt, rows, evals, p)),
        ("lengths", lambda p: _plot_lengths(plt, rows, lengths, p)),
        ("accept", lambda p: _plot_accept(plt, rows, evals, p)),
        ("timeline", lambda p: _plot_timeline(plt, intervals, p)),
    ):
        path = os.path.join(out, PLOT_FILES[name])
        if ok(path):
            written.append(path)
    return written


class Plotter:
    """Redraws a run's plots after a step when ``every_s`` seconds have passed since the run started or the last
    redraw, and always at the end: the four figures are drawn on the step's critical path, which a small run's
    steps (seconds each) should not pay for every step."""

    def __init__(self, workdir: str, every_s: float = 60.0, clock=time.monotonic):
        self.workdir, self.every_s, self.clock = workdir, every_s, clock
        self.drawn_at = clock()
        self.redraws = 0

    def __call__(self, final: bool = False) -> None:
        if final or self.clock() - self.drawn_at >= self.every_s:
            write_plots(self.workdir)
            self.drawn_at, self.redraws = self.clock(), self.redraws + 1


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: python -m tlt_jax.metrics.plots WORKDIR  (a run's --workdir)")
    for p in write_plots(sys.argv[1]):
        print(p)
