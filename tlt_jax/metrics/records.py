"""Per-step files the plots read besides metrics.jsonl: ``lengths.jsonl`` (every response length of a step) and the
controller's ``timeline.jsonl``; on resume both drop the rows of steps after the restored one (they are redone)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

LENGTHS_FILE = "lengths.jsonl"
STEP_FILES = (LENGTHS_FILE, "timeline.jsonl")


def append_lengths(workdir: str, step: int, lengths: Sequence[int]) -> None:
    """One line {"step", "lengths": [every response length of the step]}."""
    with open(os.path.join(workdir, LENGTHS_FILE), "a") as f:
        f.write(json.dumps({"step": int(step), "lengths": [int(n) for n in lengths]}) + "\n")


def drop_steps_after(workdir: str, step: int) -> None:
    """Keep the rows with ``step`` <= step (and no line cut short by a kill) in every per-step file."""
    for name in STEP_FILES:
        path = os.path.join(workdir, name)
        if not os.path.exists(path):
            continue
        keep = []
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("step", 0) <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
        with open(path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)
