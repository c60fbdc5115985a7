"""Where step metrics go: workdir/metrics.jsonl (one JSON object per step), TensorBoard event files, a console table
with one row per step, and workdir/config.json with the resolved configuration."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["COLUMNS", "ConsoleTable", "MetricsWriter", "read_metrics"]

# (header, metric key, format). Rows show what a user watches; everything else is in metrics.jsonl / TensorBoard.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("step", "step", "{:>5d}"),
    ("reward", "reward/mean", "{:>7.3f}"),
    ("acc", "reward/accuracy", "{:>6.3f}"),
    ("len p50", "response/len_p50", "{:>7.0f}"),
    ("p90", "response/len_p90", "{:>5.0f}"),
    ("max", "response/len_max", "{:>5.0f}"),
    ("rollout s", "time/rollout_s", "{:>9.2f}"),
    ("tail s", "time/tail_s", "{:>7.2f}"),
    ("reward s", "time/reward_s", "{:>8.2f}"),
    ("logp s", "time/logprob_s", "{:>7.2f}"),
    ("train s", "time/train_s", "{:>7.2f}"),
    ("tok/s", "rollout/tokens_per_s", "{:>8.1f}"),
    ("kl", "train/kl_loss", "{:>8.5f}"),
    ("skip", "train/skipped_total", "{:>4.0f}"),
)
ACCEPT_COLUMN = ("accept", "rollout/accept_length", "{:>6.2f}")


def speculative_arm(metrics: Mapping[str, float]) -> str | None:
    """The speculative arm an adaptive rollout ran most (by decode / verify steps) with its share of the step's
    steps, e.g. "eagle:3x1x4 35%"; "off" when it never speculated; None when the rollout is not adaptive."""
    prefix = "rollout/arm_share/"
    shares = {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)}
    if not shares:
        return None
    spec = {a: v for a, v in shares.items() if a != "off" and v > 0}
    if not spec:
        return "off"
    arm = max(sorted(spec), key=spec.get)
    return f"{arm} {100 * spec[arm]:.0f}%"


ARM_COLUMN = ("arm (share)", speculative_arm, "{:>17s}")


def _width(fmt: str) -> int:
    m = re.search(r">(\d+)", fmt)
    return int(m.group(1)) if m else 0


def _fmt(fmt: str, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(_width(fmt))
    if fmt.endswith("d}"):
        value = int(value)
    return fmt.format(value)


class ConsoleTable:
    """Fixed-width table: a header line, then one row per step. ``speculative`` adds the accept-length column,
    ``adaptive`` the arm the bandit ran most. A column's key is a metric name or a function of the metrics."""

    def __init__(self, speculative: bool = False, out=None, columns: Sequence[tuple[str, Any, str]] = COLUMNS,
                 adaptive: bool = False):
        self.columns = list(columns) + ([ACCEPT_COLUMN] if speculative else []) + ([ARM_COLUMN] if adaptive else [])
        self.out = out
        self._header_done = False

    def _widths(self):
        return [max(len(h), _width(f)) for h, _, f in self.columns]

    def header(self) -> str:
        return " ".join(h.rjust(w) for (h, _, _), w in zip(self.columns, self._widths(), strict=True))

    def row(self, metrics: Mapping[str, float]) -> str:
        return " ".join(
            _fmt(f, k(metrics) if callable(k) else metrics.get(k)).rjust(w)
            for (_, k, f), w in zip(self.columns, self._widths(), strict=True)
        )

    def print(self, metrics: Mapping[str, float], write=None) -> None:
        write = write or (lambda s: print(s, file=self.out or sys.stdout, flush=True))
        if not self._header_done:
            write(self.header())
            self._header_done = True
        write(self.row(metrics))


def _jsonable(v):
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


def read_metrics(workdir: str) -> list[dict]:
    """The rows of workdir/metrics.jsonl."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
    """Appends step metrics to metrics.jsonl and TensorBoard; on resume drops rows newer than the restored step."""

    def __init__(self, workdir: str, *, tensorboard: bool = True, resume_step: int = 0):
        os.makedirs(workdir, exist_ok=True)
        self.workdir = workdir
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._truncate_after(resume_step)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step drops events a killed run wrote after the checkpoint we resumed from.
            self._tb = SummaryWriter(
                os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1 if resume_step else None, flush_secs=10
            )

    def _truncate_after(self, step: int) -> None:
        """Keep rows with step <= ``step`` and no final-evaluation row (a resumed run writes those again)."""
        if not os.path.exists(self.path):
            return
        rows = []
        with open(self.path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a kill
                    continue
                if row.get("step", 0) <= step and row.get("kind") != "final":
                    rows.append(line if line.endswith("\n") else line + "\n")
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(rows)
        os.replace(tmp, self.path)

    def write(self, step: int, metrics: Mapping[str, float], kind: str = "train") -> None:
        row = {"step": int(step), "kind": kind, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row, sort_keys=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            prefix = "" if kind == "train" else f"{kind}/"
            for k, v in metrics.items():  # a NaN or infinite value (nothing measured) is no point on a curve
                if isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and math.isfinite(float(v)):
                    self._tb.add_scalar(prefix + k, float(v), step)

    def write_config(self, config_json: str) -> None:
        path = os.path.join(self.workdir, "config.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(config_json)
        os.replace(tmp, path)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
