"""Collective traffic of a compiled XLA program, read from its optimised HLO text (``compiled.as_text()``).

The text is the per-device (SPMD-partitioned) program, so a collective's result shape is what one device receives:
the gathered array of an all-gather, the reduced array of an all-reduce, the shard of a reduce-scatter, the
exchanged buffer of an all-to-all or collective-permute. Tuple results (combined collectives) count every element.
Asynchronous pairs (``all-gather-start`` / ``-done``) count once, at the ``-done``; ``async-start`` wrappers count the
collective inside their called computation.

Loops: a collective inside a ``while`` body runs once per iteration. :func:`collective_stats` multiplies by the trip
count where XLA knows it (``known_trip_count`` in the loop's backend config, as XLA:CPU and XLA:GPU print it:
``lax.scan`` over layers or micro-batches; libtpu prints none, so a condition that is ``i < N`` alone gives N) and
counts a loop of unknown trip count once (``lax.while_loop`` with an early exit, e.g. the rollout's
K-step decode chunk: its figure is then per token step); ``unknown_trip_loops`` says how many such loops hold
collectives. A ``conditional`` counts its most expensive branch. ``static_bytes`` is the plain sum, every op once.

Groups: with ``group_size`` = G (an engine's tensor-parallel size), ``cross_group_bytes`` counts the collectives whose
replica groups (or a permute's source-target pairs) hold devices of more than one block of G consecutive device
positions, i.e. more than one TP group of a mesh whose last axis is ``tensor`` (the positions are those of the
program's device assignment, the mesh's flat order). Every group form XLA prints is read: explicit ``{{0,1},{2,3}}``,
iota ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, the mesh form ``mesh['axis_0'=2,'axis_1'=4] {'axis_0'}`` (with or
without ``device_ids=(...)``), and ``{}`` (all devices); a form it cannot read counts as crossing.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

__all__ = ["COLLECTIVES", "CollectiveStats", "collective_stats", "parse_groups", "shape_bytes", "spans_groups"]

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DONE = {f"{k}-done": k for k in COLLECTIVES}

_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16,
         "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_OPERAND = re.compile(r"^\s*%?([\w.\-]+)")
_GROUPS = re.compile(r"replica_groups=(\{\}|\{\{[\d,{}\s]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|"
                     r"mesh\[[^\]]*\](?:, device_ids=\((?:[^()]|\([^()]*\))*\))?(?: \{[^}]*\})?)")
_PAIRS = re.compile(r"source_target_pairs=(\{[\d,{}\s]*\})")
_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")


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
    cross_group_bytes: int | None = None  # of ``bytes``, those whose groups span several device groups (``group_size``)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Instr:
    opcode: str
    shape: str
    callees: list[str]
    branches: list[str]
    trip: int | None
    name: str = ""
    operand: str = ""  # the first operand's name (an async ``-done`` names its ``-start``)
    groups: str | None = None  # the replica groups' (or source-target pairs') text
    condition: str = ""  # a while's condition computation
    attrs: str = ""  # a constant's value or a compare's direction (for trip counts read from a loop's condition)


def _iota(dims: str, reshape: str | None = None, perm: str | None = None) -> np.ndarray:
    ints = lambda t: [int(v) for v in t.split(",") if v]
    a = np.arange(math.prod(ints(dims))).reshape(ints(dims))
    if perm:
        a = a.transpose(ints(perm))
    return a.reshape(ints(reshape)) if reshape else a


def parse_groups(text: str | None, devices: int) -> list[list[int]] | None:
    """The device positions of each group of a collective's ``replica_groups=`` / ``source_target_pairs=`` text (None:
    all ``devices`` in one group when the text is absent or ``{}``); a ValueError for a form it cannot read."""
    if text is None or text == "{}":
        return None
    if text.startswith("{"):
        return [[int(v) for v in g.split(",") if v.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]
    m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m:
        return _iota(m.group(2), m.group(1), m.group(3)).tolist()
    m = re.fullmatch(r"mesh\[([^\]]*)\](?:, device_ids=\((.*)\))?(?: \{([^}]*)\})?", text)
    if not m:
        raise ValueError(f"unknown replica group form: {text}")
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    ids = m.group(2)
    if ids is None:
        mesh = np.arange(math.prod(sizes))
    elif (t := re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", ids.strip())):
        mesh = _iota(t.group(1), None, t.group(2))
    elif re.fullmatch(r"[\d,\s]+", ids):
        mesh = np.array([int(v) for v in ids.split(",") if v.strip()])
    else:
        raise ValueError(f"unknown device_ids form: {text}")
    mesh = mesh.reshape(sizes)
    chosen = [a.strip().strip("'") for a in (m.group(3) or "").split(",") if a.strip()]
    if any(a not in names for a in chosen):  # sub-axes ('axis_0':(1)2) and the like
        raise ValueError(f"unknown replica group axes: {text}")
    group_axes = [names.index(a) for a in chosen]
    rest = [i for i in range(len(names)) if i not in group_axes]
    size = math.prod(sizes[i] for i in group_axes)
    return mesh.transpose(rest + group_axes).reshape(-1, size).tolist()


def spans_groups(text: str | None, devices: int, group_size: int) -> bool:
    """Whether a collective's groups hold devices of more than one block of ``group_size`` consecutive positions."""
    try:
        groups = parse_groups(text, devices)
    except ValueError:
        return True
    if groups is None:
        return devices > group_size
    return any(len({d // group_size for d in g}) > 1 for g in groups)


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
        g = _GROUPS.search(rest) or _PAIRS.search(rest)
        operand = _OPERAND.match(rest)
        branches = [b.strip().lstrip("%") for b in m2.group(1).split(",")] if (m2 := _BRANCHES.search(rest)) else []
        trip, condition = None, ""
        if opcode == "while":
            t = _TRIP.search(rest)
            trip = int(t.group(1)) if t else None
            c = re.search(r"\bcondition=%?([\w.\-]+)", rest)
            condition = c.group(1) if c else ""
        comps[current].append(_Instr(opcode, shape, _CALLEE.findall(rest), [b for b in branches if b], trip,
                                     _NAME.match(line).group(1), operand.group(1) if operand else "",
                                     g.group(1) if g else None, condition, _attrs(opcode, rest)))
    return comps, entry


_CROSS = "\0cross"  # the per-call tally's key of the bytes crossing device groups


def _attrs(opcode: str, rest: str) -> str:
    if opcode == "constant":
        return rest.split(")", 1)[0].strip()
    if opcode == "compare":
        d = re.search(r"direction=(\w+)", rest)
        return d.group(1) if d else ""
    return ""


def _condition_trip(cond: list[_Instr] | None) -> int | None:
    """The trip count of a loop whose condition is ``i < N`` alone (an induction variable against one integer
    constant: libtpu keeps no ``known_trip_count``, but ``lax.scan`` / ``fori_loop`` conditions are of this form)."""
    if not cond or any(i.opcode not in ("parameter", "get-tuple-element", "constant", "compare") for i in cond):
        return None
    consts = [i for i in cond if i.opcode == "constant"]
    compares = [i for i in cond if i.opcode == "compare"]
    if len(consts) != 1 or len(compares) != 1 or compares[0].attrs != "LT" or not consts[0].attrs.isdigit():
        return None
    return int(consts[0].attrs)


def _own(instr: _Instr) -> tuple[str, int] | None:
    """(kind, bytes) when the instruction is a collective counted at this op."""
    kind = instr.opcode if instr.opcode in COLLECTIVES else _DONE.get(instr.opcode)
    return None if kind is None else (kind, shape_bytes(instr.shape))


def collective_stats(hlo_text: str, group_size: int | None = None) -> CollectiveStats:
    """Collective bytes per device of one call of the program in ``hlo_text`` (``compiled.as_text()``); with
    ``group_size``, also the bytes whose groups span several blocks of ``group_size`` devices (module docstring)."""
    comps, entry = _parse(hlo_text)
    m = _PARTITIONS.search(hlo_text)
    devices = int(m.group(1)) if m else 1
    memo: dict[str, tuple[dict[str, int], int]] = {}

    def groups_of(ins: _Instr, by_name: dict[str, _Instr]) -> str | None:
        start = by_name.get(ins.operand) if ins.opcode.endswith("-done") else None
        return start.groups if start is not None else ins.groups

    def per_call(name: str, stack: tuple[str, ...] = ()) -> tuple[dict[str, int], int]:
        if name in memo:
            return memo[name]
        if name not in comps or name in stack:
            return {}, 0
        kinds: dict[str, int] = {}
        unknown = 0
        by_name = {i.name: i for i in comps[name]}

        def add(sub: dict[str, int], times: int) -> None:
            for k, v in sub.items():
                kinds[k] = kinds.get(k, 0) + v * times

        for ins in comps[name]:
            own = _own(ins)
            if own is not None:
                add({own[0]: own[1]}, 1)
                if group_size and spans_groups(groups_of(ins, by_name), devices, group_size):
                    add({_CROSS: own[1]}, 1)
            if ins.branches:
                options = [per_call(b, stack + (name,)) for b in ins.branches]
                best = max(options, key=lambda o: sum(v for k, v in o[0].items() if k != _CROSS))
                add(best[0], 1)
                unknown += best[1]
                continue
            trip = ins.trip
            if ins.opcode == "while" and trip is None:
                trip = _condition_trip(comps.get(ins.condition))
            times = trip if ins.opcode == "while" and trip is not None else 1
            inside = 0
            for callee in ins.callees:  # a while's condition and body run once per iteration
                sub, sub_unknown = per_call(callee, stack + (name,))
                add(sub, times)
                unknown += sub_unknown * times
                inside += sum(sub.values())
            if ins.opcode == "while" and trip is None and inside:
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
    kinds = dict(kinds)
    cross = kinds.pop(_CROSS, 0)
    return CollectiveStats(
        bytes=sum(kinds.values()), static_bytes=sum(static.values()), by_kind=dict(sorted(kinds.items())), ops=ops,
        unknown_trip_loops=unknown, cross_group_bytes=cross if group_size else None,
    )
