"""Memory traffic of a compiled XLA program, read from its optimised HLO text (``compiled.as_text()``).

What a program's kernels read and write, against what it must move, shows the copies a compiler added: XLA:GPU's
per-layer weight-slice copies and cache concatenations / transposes in a decode step (``../shared/gpu-profile``) are
plain to see in the HLO of a compile-only H100 (``tlt_jax.plan.targets.compile_only_devices``).

Counted ops: every fusion, custom call, copy and other array op of the entry computation and of the computations it
runs (``while`` bodies and conditions, ``call``, the most expensive ``conditional`` branch), each op's bytes = the
operands it reads + the result it writes, where

- a fusion operand that the fused computation reads only through ``slice`` / ``dynamic-slice`` / ``gather`` counts
  the sliced bytes, and the buffer a ``dynamic-update-slice`` or ``scatter`` updates in place counts nothing (its
  written bytes are the update's);
- a custom call's scratch buffer (a trailing ``s8`` / ``u8`` tuple element) counts nothing;
- a Pallas kernel's cache operand (a Triton or Mosaic custom call taking a cache buffer whole) counts
  ``kernel_cache_fraction`` of its bytes: the tree-attention kernels load no block at or past a row's length, so a
  caller that knows the committed share (the length bucket over the cache's length) passes it (default 1: whole);
- ``parameter``, ``constant``, ``tuple``, ``get-tuple-element``, ``bitcast`` and control ops move nothing.

A ``while`` body counts ``known_trip_count`` times where XLA knows it, else once (the rollout's decode chunk, a
``lax.while_loop`` with an early exit: its body is one token step; ``unknown_trip_loops`` says so).

Copies are found by where data comes from: entry parameters chosen by name (``weights`` / ``cache`` predicates, e.g.
JAX's ``params...`` / ``state_cache...`` argument names) mark their buffers, and an op that only moves data
(``copy``, ``transpose``, ``slice``, ``dynamic-slice``, ``concatenate``, ``convert``, or a fusion of such ops) keeps
the mark on its result. Reported: data-movement ops writing a copy of a weight (a dynamic slice of a
stacked weight inside the layer loop: ``weight_slice_copies``; a layout change of a whole weight outside every loop,
once per call: ``weight_layout_copies``), of the cache (``cache_copies``), and concatenates / transposes
that take cache data directly (``cache_concats``, ``cache_transposes``; a layout-changing ``copy`` is a transpose;
a matmul fusion's operand transposes are strided reads, no copy, and do not count).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from tlt_jax.plan.hlo import shape_bytes

__all__ = ["Traffic", "hlo_traffic"]

_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_CALLEE = re.compile(r"\b(?:to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_LAYOUT = re.compile(r"\{([0-9,]*)\}")
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "add-dependency",
         "opt-barrier", "partition-id", "replica-id", "iota", "domain", "while", "conditional", "call"}
_MOVE = {"copy", "transpose", "slice", "dynamic-slice", "concatenate", "convert", "bitcast", "reshape", "broadcast",
         "parameter", "constant", "tuple", "get-tuple-element", "pad", "reverse"}
_SLICING = {"slice", "dynamic-slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}
_KERNEL = re.compile(r'custom_call_target="(__gpu\$xla\.gpu\.triton|tpu_custom_call)"')


def _flat(mark) -> frozenset:
    return mark if not isinstance(mark, list) else frozenset().union(*mark)


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    rest: str  # the attributes after the operand list
    root: bool
    number: int = -1  # a parameter's number


def _split_operands(rest: str) -> tuple[list[str], str]:
    """The operand names of ``op(...)`` (``rest`` starts after the open paren) and the attributes after it."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += ch in "({[" and 1 or 0
        depth -= ch in ")}]" and 1 or 0
        if depth == 0:
            return re.findall(r"%([\w.\-]+)", rest[:i]), rest[i + 1:]
    return re.findall(r"%([\w.\-]+)", rest), ""


def _parse(text: str) -> tuple[dict[str, dict[str, _Instr]], str | None]:
    """{computation: {instruction name: instruction}} in program order, and the entry computation's name."""
    comps: dict[str, dict[str, _Instr]] = {}
    entry = current = None
    for line in text.splitlines():
        if current is None:
            if line and not line[0].isspace() and line.rstrip().endswith("{") and "(" in line:
                head = line.split("(", 1)[0].split()
                current = head[-1].lstrip("%")
                comps[current] = {}
                entry = current if head[0] == "ENTRY" else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            root, name, shape, opcode, rest = m.groups()
            operands, attrs = _split_operands(rest)
            number = int(rest.split(")", 1)[0]) if opcode == "parameter" else -1
            comps[current][name] = _Instr(name, shape, opcode, operands, attrs, bool(root), number)
    return comps, entry


def _layout(shape: str) -> str:
    m = _LAYOUT.search(shape.split("]", 1)[1]) if "]" in shape else None
    return m.group(1) if m else ""


@dataclasses.dataclass
class Traffic:
    """Bytes the ops of one call read and write (loops as the module docstring says), and the copies found."""

    moved_bytes: int = 0
    loop_bytes: int = 0  # of moved_bytes, inside while bodies (per iteration where the trip count is unknown)
    matmul_bytes: int = 0  # of moved_bytes, by matmuls (fusions around a dot, gemm custom calls)
    ops: int = 0
    weight_slice_copies: int = 0  # copies of weight data inside a loop (per step) or of a slice of a weight
    weight_layout_copies: int = 0  # whole-weight copies outside every loop (a layout change, once per call)
    weight_copy_bytes: int = 0
    cache_copies: int = 0
    cache_copy_bytes: int = 0
    cache_concats: int = 0
    cache_transposes: int = 0
    unknown_trip_loops: int = 0
    top_ops: list = dataclasses.field(default_factory=list)  # the largest (bytes, op name, opcode, repeat)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["top_ops"] = [list(t) for t in self.top_ops]
        return d


class _Analysis:
    def __init__(self, text: str, weights: Callable[[str], bool], cache: Callable[[str], bool],
                 kernel_cache_fraction: float = 1.0):
        self.comps, self.entry = _parse(text)
        self.weights, self.cache = weights, cache
        self.kernel_cache_fraction = kernel_cache_fraction
        self.t = Traffic()
        self.rows: list[tuple[int, str, str, int]] = []

    # -- what a fused computation reads and writes, and whether it only moves data
    def _param_read(self, comp: dict[str, _Instr], pname: str, full: int) -> int:
        users = [(u, u.operands.index(pname)) for u in comp.values() if pname in u.operands]
        total = 0
        for u, pos in users:
            if u.opcode == "bitcast":
                total += self._param_read(comp, u.name, full)
            elif u.opcode in _SLICING and pos == 0:
                total += shape_bytes(u.shape)
            elif u.opcode in _IN_PLACE and pos == 0:
                continue
            else:
                return full
        return min(total, full)

    def _written(self, comp: dict[str, _Instr], ins: _Instr) -> int:
        if ins.opcode == "tuple":
            return sum(self._written(comp, comp[o]) for o in ins.operands if o in comp)
        if ins.opcode == "bitcast" and ins.operands and ins.operands[0] in comp:
            return self._written(comp, comp[ins.operands[0]])
        if ins.opcode == "dynamic-update-slice":
            return shape_bytes(comp[ins.operands[1]].shape) if ins.operands[1] in comp else shape_bytes(ins.shape)
        if ins.opcode == "scatter":
            return sum(shape_bytes(comp[o].shape) for o in ins.operands[len(ins.operands) // 2 + 1:] if o in comp)
        return shape_bytes(ins.shape)

    def _fusion_bytes(self, name: str, operand_shapes: list[str]) -> tuple[int, int]:
        comp = self.comps.get(name, {})
        params = {i.number: i for i in comp.values() if i.opcode == "parameter"}
        read = sum(self._param_read(comp, params[k].name, shape_bytes(s)) if k in params else shape_bytes(s)
                   for k, s in enumerate(operand_shapes))
        root = next((i for i in comp.values() if i.root), None)
        return read, 0 if root is None else self._written(comp, root)

    def _moves_only(self, name: str) -> bool:
        return all(i.opcode in _MOVE for i in self.comps.get(name, {}).values())

    def _fused_has(self, name: str, opcode: str, marked: set[int]) -> bool:
        """Whether the fused computation applies ``opcode`` to data coming (through data-movement ops only) from one
        of its ``marked`` parameters."""
        comp = self.comps.get(name, {})
        frontier = {i.name for i in comp.values() if i.opcode == "parameter" and i.number in marked}
        seen = set(frontier)
        while frontier:
            nxt = set()
            for u in comp.values():
                if u.name in seen or not frontier.intersection(u.operands):
                    continue
                if u.opcode == opcode:
                    return True
                if u.opcode in _MOVE:
                    nxt.add(u.name)
            seen |= nxt
            frontier = nxt
        return False

    # -- walking the program
    def run(self) -> Traffic:
        if self.entry is not None:
            self._walk(self.entry, None, 1, False)
        self.rows.sort(reverse=True)
        self.t.top_ops = self.rows[:12]
        return self.t

    def _walk(self, cname: str, param_marks, times: int, in_loop: bool) -> None:
        comp = self.comps.get(cname, {})
        marks: dict[str, object] = {}  # name -> frozenset of "w"/"c" marks, or a list of them for tuples

        def mark(n: str):
            return marks.get(n, frozenset())

        for ins in comp.values():
            ops = ins.operands
            if ins.opcode == "parameter":
                k = ins.number
                if param_marks is None:  # the entry: marks by argument name
                    m = {"w"} if self.weights(ins.name) else {"c"} if self.cache(ins.name) else set()
                    marks[ins.name] = frozenset(m)
                else:
                    marks[ins.name] = param_marks[k] if k < len(param_marks) else frozenset()
                continue
            if ins.opcode == "tuple":
                marks[ins.name] = [mark(o) for o in ops]
                continue
            if ins.opcode == "get-tuple-element":
                src = mark(ops[0])
                j = int(re.search(r"index=(\d+)", ins.rest).group(1))
                marks[ins.name] = src[j] if isinstance(src, list) and j < len(src) else frozenset()
                continue
            if ins.opcode == "bitcast":
                marks[ins.name] = mark(ops[0])
                continue
            if ins.opcode == "while":
                body = re.search(r"body=%?([\w.\-]+)", ins.rest).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", ins.rest).group(1)
                trip = _TRIP.search(ins.rest)
                n = int(trip.group(1)) if trip else 1
                self.t.unknown_trip_loops += trip is None
                for sub in (cond, body):
                    self._walk(sub, [mark(ops[0])], times * n, True)
                marks[ins.name] = mark(ops[0])
                continue
            if ins.opcode in ("conditional", "call"):
                names = _BRANCHES.search(ins.rest)
                subs = [b.strip().lstrip("%") for b in names.group(1).split(",")] if names else \
                    _CALLEE.findall(ins.rest) + _CALLS.findall(ins.rest)
                self._walk_branches(subs, [mark(o) for o in ops], ins.opcode, times, in_loop)
                continue
            if ins.opcode in _FREE:
                continue
            self._count(comp, ins, [mark(o) for o in ops], marks, times, in_loop)

    def _walk_branches(self, subs: list[str], op_marks: list, opcode: str, times: int, in_loop: bool) -> None:
        """A ``call`` runs its computation; a ``conditional`` the branch that moves the most (branch i takes operand
        i + 1)."""
        if opcode == "call":
            for s in subs:
                self._walk(s, op_marks, times, in_loop)
            return
        best = None
        for i, s in enumerate(subs):
            trial = _Analysis.__new__(_Analysis)
            trial.comps, trial.entry, trial.weights, trial.cache = self.comps, None, self.weights, self.cache
            trial.kernel_cache_fraction = self.kernel_cache_fraction
            trial.t, trial.rows = Traffic(), []
            trial._walk(s, [op_marks[i + 1]] if i + 1 < len(op_marks) else [], times, in_loop)
            if best is None or trial.t.moved_bytes > best.t.moved_bytes:
                best = trial
        if best is not None:
            for f in dataclasses.fields(Traffic):
                if f.name != "top_ops":
                    setattr(self.t, f.name, getattr(self.t, f.name) + getattr(best.t, f.name))
            self.rows += best.rows

    def _count(self, comp, ins: _Instr, op_marks: list, marks: dict, times: int, in_loop: bool) -> None:
        shapes = [comp[o].shape if o in comp else "" for o in ins.operands]
        flat = [_flat(m) for m in op_marks]
        fused = _CALLS.search(ins.rest).group(1) if ins.opcode == "fusion" else None
        if fused is not None:
            read, written = self._fusion_bytes(fused, shapes)
            moves = self._moves_only(fused)
        else:
            read = sum(shape_bytes(s) for s in shapes)
            written = self._written(comp, ins) if ins.opcode in _IN_PLACE else shape_bytes(ins.shape)
            if ins.opcode in _IN_PLACE:
                read -= shape_bytes(shapes[0]) if shapes else 0
            if ins.opcode == "custom-call" and _KERNEL.search(ins.rest):  # reads each row's prefix only
                read -= int(sum(shape_bytes(s) for s, m in zip(shapes, flat, strict=True) if "c" in m)
                            * (1 - self.kernel_cache_fraction))
            if ins.opcode == "custom-call" and ins.shape.startswith("("):
                scratch = re.findall(r"[su]8\[[0-9,]*\][^,)]*\)\s*$", ins.shape)
                written -= shape_bytes(scratch[0]) if scratch else 0
            moves = ins.opcode in _MOVE
        matmul = (ins.opcode == "custom-call" and re.search(r"gemm|matmul", ins.rest, re.I) is not None) or (
            fused is not None and any(i.opcode == "dot" for i in self.comps.get(fused, {}).values()))
        source = frozenset().union(*flat) if flat else frozenset()
        marks[ins.name] = source if moves else frozenset()
        total = (read + written) * times
        self.t.moved_bytes += total
        self.t.loop_bytes += total if in_loop else 0
        self.t.matmul_bytes += total if matmul else 0
        self.t.ops += times
        self.rows.append((total, ins.name, ins.opcode if fused is None else fused, times))
        if moves and "w" in source:
            sliced = ins.opcode in _SLICING or (fused is not None and any(
                i.opcode in _SLICING for i in self.comps.get(fused, {}).values()))
            if in_loop or sliced:
                self.t.weight_slice_copies += times
            else:
                self.t.weight_layout_copies += times
            self.t.weight_copy_bytes += written * times
        if moves and "c" in source and ins.opcode not in _IN_PLACE:
            self.t.cache_copies += times
            self.t.cache_copy_bytes += written * times
        cached = {k for k, m in enumerate(flat) if "c" in m}
        if not cached:
            return
        if fused is not None:
            if matmul:  # a matmul fusion reads its operands through these: strided reads, no copy made
                return
            self.t.cache_concats += times * self._fused_has(fused, "concatenate", cached)
            self.t.cache_transposes += times * (self._fused_has(fused, "transpose", cached) or
                                                self._fused_has(fused, "copy", cached))
        elif ins.opcode == "concatenate":
            self.t.cache_concats += times
        elif ins.opcode == "transpose" or (ins.opcode == "copy" and _layout(ins.shape) != _layout(shapes[0])):
            self.t.cache_transposes += times


def hlo_traffic(text: str, weights: Callable[[str], bool] = lambda n: n.startswith("params"),
                cache: Callable[[str], bool] = lambda n: n.startswith("state_cache_k") or
                n.startswith("state_cache_v"), kernel_cache_fraction: float = 1.0) -> Traffic:
    """The traffic of one call of the program in ``text``; ``weights`` / ``cache`` pick entry parameters by name
    (JAX names them by the argument's pytree path: ``params__layers___0___mlp...``, ``state_cache_k_0_``);
    ``kernel_cache_fraction``: the share of a cache operand a Pallas kernel reads (module docstring)."""
    return _Analysis(text, weights, cache, kernel_cache_fraction).run()
