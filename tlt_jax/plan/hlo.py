"""Collective traffic of a compiled XLA program, read from its optimised HLO text (``compiled.as_text()``).

The text is the per-device (SPMD-partitioned) program, so a collective's result shape is what one device receives:
the gathered array of an all-gather, the reduced array of an all-reduce, the shard of a reduce-scatter, the
exchanged buffer of an all-to-all or collective-permute. Tuple results (combined collectives) count every element.
Asynchronous pairs (``all-gather-start`` / ``-done``) count once, at the ``-done``; ``async-start`` wrappers count the
collective inside their called computation.

Loops: a collective inside a ``while`` body runs once per iteration. :func:`collective_stats` multiplies by the trip
count where XLA knows it (``known_trip_count`` in the loop's backend config: ``lax.scan`` over layers or
micro-batches) and counts a loop of unknown trip count once (``lax.while_loop`` with an early exit, e.g. the rollout's
K-step decode chunk: its figure is then per token step); ``unknown_trip_loops`` says how many such loops hold
collectives. A ``conditional`` counts its most expensive branch. ``static_bytes`` is the plain sum, every op once.
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = ["COLLECTIVES", "CollectiveStats", "collective_stats", "shape_bytes"]

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DONE = {f"{k}-done": k for k in COLLECTIVES}

_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16,
         "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO result type: ``bf16[8,2560,3584]{2,1,0}`` or a tuple of them (tokens and opaque types: 0)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = _BITS.get(dtype)
        if bits is None and dtype.startswith("f8"):
            bits = 8
        if bits is None:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += (n * bits + 7) // 8
    return total


@dataclasses.dataclass(frozen=True)
class CollectiveStats:
    """Per-device collective bytes of one call of a program (see the module docstring for how loops count)."""

    bytes: int
    static_bytes: int
    by_kind: dict[str, int]
    ops: int  # collective ops in the program text
    unknown_trip_loops: int  # while loops holding collectives whose trip count XLA does not know (counted once)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Instr:
    opcode: str
    shape: str
    callees: list[str]
    branches: list[str]
    trip: int | None


def _parse(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    """{computation name: its instructions}, and the entry computation's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            if line and not line[0].isspace() and line.rstrip().endswith("{") and "(" in line:
                head = line.split("(", 1)[0].split()
                if head:
                    current = head[-1].lstrip("%")
                    comps[current] = []
                    if head[0] == "ENTRY":
                        entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        shape, opcode, rest = m.groups()
        branches = [b.strip().lstrip("%") for b in m2.group(1).split(",")] if (m2 := _BRANCHES.search(rest)) else []
        trip = None
        if opcode == "while":
            t = _TRIP.search(rest)
            trip = int(t.group(1)) if t else None
        comps[current].append(_Instr(opcode, shape, _CALLEE.findall(rest), [b for b in branches if b], trip))
    return comps, entry


def _own(instr: _Instr) -> tuple[str, int] | None:
    """(kind, bytes) when the instruction is a collective counted at this op."""
    kind = instr.opcode if instr.opcode in COLLECTIVES else _DONE.get(instr.opcode)
    return None if kind is None else (kind, shape_bytes(instr.shape))


def collective_stats(hlo_text: str) -> CollectiveStats:
    """Collective bytes per device of one call of the program in ``hlo_text`` (``compiled.as_text()``)."""
    comps, entry = _parse(hlo_text)
    memo: dict[str, tuple[dict[str, int], int]] = {}

    def per_call(name: str, stack: tuple[str, ...] = ()) -> tuple[dict[str, int], int]:
        if name in memo:
            return memo[name]
        if name not in comps or name in stack:
            return {}, 0
        kinds: dict[str, int] = {}
        unknown = 0

        def add(sub: dict[str, int], times: int) -> None:
            for k, v in sub.items():
                kinds[k] = kinds.get(k, 0) + v * times

        for ins in comps[name]:
            own = _own(ins)
            if own is not None:
                add({own[0]: own[1]}, 1)
            if ins.branches:
                options = [per_call(b, stack + (name,)) for b in ins.branches]
                best = max(options, key=lambda o: sum(o[0].values()))
                add(best[0], 1)
                unknown += best[1]
                continue
            times = ins.trip if ins.opcode == "while" and ins.trip is not None else 1
            inside = 0
            for callee in ins.callees:  # a while's condition and body run once per iteration
                sub, sub_unknown = per_call(callee, stack + (name,))
                add(sub, times)
                unknown += sub_unknown * times
                inside += sum(sub.values())
            if ins.opcode == "while" and ins.trip is None and inside:
                unknown += 1
        memo[name] = (kinds, unknown)
        return memo[name]

    static: dict[str, int] = {}
    ops = 0
    for instrs in comps.values():
        for ins in instrs:
            own = _own(ins)
            if own is not None:
                static[own[0]] = static.get(own[0], 0) + own[1]
                ops += 1
    kinds, unknown = per_call(entry) if entry is not None else ({}, 0)
    return CollectiveStats(
        bytes=sum(kinds.values()), static_bytes=sum(static.values()), by_kind=dict(sorted(kinds.items())), ops=ops,
        unknown_trip_loops=unknown,
    )

