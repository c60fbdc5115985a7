"""The import graph is acyclic, between packages and between modules: no module of tlt_jax.X imports (at module or
function level) tlt_jax.Y while a module of tlt_jax.Y imports tlt_jax.X, directly or through other packages, and no
module (of tlt_jax, or a script under benchmarks/) imports one that imports it back. Static (ast), so lazy and
``TYPE_CHECKING`` imports count too.

Layering this keeps: models < sampling < speculative < rollout < drafter tooling (warm-up, evaluation) < generate /
main; a top-level module (tlt_jax/config.py) is a package of its own.
"""

from __future__ import annotations

import ast
import collections
import gc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tlt_jax"


def parse_file(path: Path) -> ast.Module:
    """``ast.parse`` with the garbage collector paused: on CPython 3.11.7 a finalizer that runs inside the parser's
    AST conversion (e.g. an asyncio task left by an earlier test) can end it in "SystemError: AST constructor
    recursion depth mismatch" (fixed in later CPython releases)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text(), str(path))
    finally:
        if was_enabled:
            gc.enable()


def module_imports(root: Path, flat: bool = False) -> dict[str, set[str]]:
    """{module: the modules of the package rooted at ``root`` it imports}, every import statement in the file.

    ``from pkg import sub`` names the submodule ``pkg.sub`` and not ``pkg``'s ``__init__`` when ``sub`` is a module.
    flat: ``root`` is a folder of scripts that import each other by file name (benchmarks/, put on ``sys.path``).
    """
    top = root.name
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root if flat else root.parent).with_suffix("").parts
        if flat and len(parts) > 1:
            continue
        is_pkg = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    out: dict[str, set[str]] = {}
    for name, (path, is_pkg) in files.items():
        here = name if is_pkg else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(parse_file(path)):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = here.split(".")
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                subs = {f"{base}.{a.name}" for a in node.names} & files.keys()  # `from pkg import submodule`
                targets.update(subs)
                if len(subs) < len(node.names):
                    targets.add(base)
        out[name] = {t for t in targets if t in files and (flat or t == top or t.startswith(top + ".")) and t != name}
    return out


def package_of(module: str) -> str:
    """tlt_jax.rollout.engine -> tlt_jax.rollout; tlt_jax.config -> tlt_jax.config."""
    return ".".join(module.split(".")[:2])


def package_cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Cycles between packages (at least one through every package on a cycle), each hop as
    'pkg -> pkg (module imports module)'."""
    witness: dict[tuple[str, str], tuple[str, str]] = {}
    for src, dsts in sorted(imports.items()):
        for dst in sorted(dsts, key=lambda d: (-d.count("."), d)):  # name the submodule, not its package
            a, b = package_of(src), package_of(dst)
            if a != b and b != src.split(".")[0]:
                witness.setdefault((a, b), (src, dst))
    graph = collections.defaultdict(set)
    for a, b in witness:
        graph[a].add(b)
    cycles, seen = [], set()
    for start in sorted(graph):
        if start in seen:
            continue
        path = _find_cycle(graph, start)
        if path:
            seen.update(path)
            hops = zip(path, path[1:] + path[:1], strict=True)
            cycles.append([f"{a} -> {b} ({witness[a, b][0]} imports {witness[a, b][1]})" for a, b in hops])
    return cycles


def module_cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other (strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str):  # Tarjan; the graphs here are a few hundred modules, well inside the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(imports.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(imports):
        if v not in index:
            visit(v)
    return sorted(out)


def _find_cycle(graph, start) -> list[str] | None:
    """Shortest cycle through ``start`` (breadth-first), as the list of packages on it."""
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for u in frontier:
            for v in sorted(graph[u]):
                if v == start:
                    path = [u]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return path[::-1]
                if v not in prev:
                    prev[v] = u
                    nxt.append(v)
        frontier = nxt
    return None


def test_no_import_cycles_between_packages():
    cycles = package_cycles(module_imports(ROOT))
    assert not cycles, "import cycles between packages:\n" + "\n\n".join("\n".join(c) for c in cycles)


def test_no_import_cycles_between_modules():
    assert module_cycles(module_imports(ROOT)) == []


def test_no_import_cycles_between_benchmark_scripts():
    assert module_cycles(module_imports(ROOT.parent / "benchmarks", flat=True)) == []


def test_detector_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    for d in ("a", "b", "c"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "top.py").write_text("import os\n")
    (pkg / "a" / "x.py").write_text("from pkg.b import y\n")
    (pkg / "b" / "y.py").write_text("def f():\n    from ..c import z\n    return z\n")
    (pkg / "c" / "z.py").write_text("from pkg import top\n")
    imports = module_imports(pkg)
    assert imports["pkg.b.y"] == {"pkg.c.z"} and imports["pkg.c.z"] == {"pkg.top"}
    assert package_cycles(imports) == [] and module_cycles(imports) == []
    (pkg / "c" / "w.py").write_text("import pkg.a.x\n")
    (cycle,) = package_cycles(module_imports(pkg))
    assert cycle == [
        "pkg.a -> pkg.b (pkg.a.x imports pkg.b.y)",
        "pkg.b -> pkg.c (pkg.b.y imports pkg.c.z)",
        "pkg.c -> pkg.a (pkg.c.w imports pkg.a.x)",
    ]
    assert module_cycles(module_imports(pkg)) == []  # a cycle of packages, not of modules
    (pkg / "c" / "z.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n")
    (pkg / "a" / "x.py").write_text("from pkg.c import z\n")
    assert module_cycles(module_imports(pkg)) == [["pkg.a.x", "pkg.c.z"]]


def test_flat_detector_sees_scripts_importing_each_other(tmp_path):
    (tmp_path / "one.py").write_text("import two\n")
    (tmp_path / "two.py").write_text("def f():\n    import three\n")
    (tmp_path / "three.py").write_text("import numpy\n")
    assert module_cycles(module_imports(tmp_path, flat=True)) == []
    (tmp_path / "three.py").write_text("from one import f\n")
    assert module_cycles(module_imports(tmp_path, flat=True)) == [["one", "three", "two"]]
