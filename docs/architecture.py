"""Regenerate docs/architecture.md from the code: the package import graph (a Mermaid diagram), its
counts (cycles between packages and between modules, imports inside functions), the largest files,
the longest functions and the import cycles between modules.

    .venv/bin/python docs/architecture.py          # writes docs/architecture.md
    .venv/bin/python docs/architecture.py --check  # exit 1 if docs/architecture.md is stale

Reads the source with :mod:`ast` only (nothing is imported). A module's package is its folder
under the installed name (``polyparallel.poly``, ``polyparallel.backends.torch``); an import
inside a function counts like one at the top (it is a dependency all the same), and cycles are
reported between modules, with the lazy (function-level) imports that close them marked.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> installed package (pyproject.toml's package-dir)
PACKAGES = {"polyparallel": "polyparallel", "frontends": "polyparallel.frontends",
            "backends": "polyparallel.backends", "cost_models": "polyparallel.cost_models"}
OUT = ROOT / "docs" / "architecture.md"


def modules() -> dict[str, Path]:
    out = {}
    for folder, pkg in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _deps(mod: str, path: Path, mods: dict[str, Path]) -> dict[str, bool]:
    """The project modules ``mod`` imports -> whether one import of it is at the module's top level."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    deps: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, path.name == "__init__.py", node)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != mod:
                deps[name] = deps.get(name, False) or id(node) in top
    return deps


def imports(mods: dict[str, Path]) -> dict[str, dict[str, bool]]:
    """module -> {imported project module: imported at top level}."""
    return {mod: _deps(mod, path, mods) for mod, path in mods.items()}


def package(mod: str, mods: dict[str, Path]) -> str:
    return mod if mods[mod].name == "__init__.py" else mod.rpartition(".")[0]


def cycles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out, key=lambda c: (-len(c), c))


def function_imports(mods: dict[str, Path]) -> tuple[int, int]:
    """The import statements inside functions (a nested function's counted once): all of them, and
    those of a project module."""
    found = [0, 0]

    def visit(node: ast.AST, mod: str, path: Path, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, ast.Import | ast.ImportFrom):
                found[0] += 1
                names = [a.name for a in child.names] if isinstance(child, ast.Import) else \
                    [_resolve(mod, path.name == "__init__.py", child)]
                found[1] += any(n.split(".")[0] == "polyparallel" for n in names)
            visit(child, mod, path, inside or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    for mod, path in mods.items():
        visit(ast.parse(path.read_text()), mod, path, False)
    return found[0], found[1]


def functions(mods: dict[str, Path]) -> list[tuple[int, str]]:
    out = []
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                out.append((node.end_lineno - node.lineno + 1, f"{mod}.{node.name}"))
    return sorted(out, reverse=True)


def render() -> str:
    mods = modules()
    graph = imports(mods)
    pkgs = sorted({package(m, mods) for m in mods})
    edges: dict[tuple[str, str], int] = defaultdict(int)
    for m, deps in graph.items():
        for d in deps:
            a, b = package(m, mods), package(d, mods)
            if a != b and not b.startswith(a + ".") and not (a == "polyparallel" and b.count(".") == 1):
                edges[(a, b)] += 1
    ident = {p: f"p{i}" for i, p in enumerate(pkgs)}
    pkg_graph: dict[str, dict[str, bool]] = defaultdict(dict)
    for a, b in edges:
        pkg_graph[a][b] = True
    pkg_cyc, cyc = cycles(pkg_graph), cycles(graph)
    lazy_all, lazy_project = function_imports(mods)
    lines = ["# Architecture", "",
             "Generated by `docs/architecture.py` from the source (do not edit by hand; "
             "`make architecture` rewrites it, a test checks it is current).", "",
             "## Packages and what they import", "", "```mermaid", "graph TD"]
    for p in pkgs:
        lines.append(f'    {ident[p]}["{p}"]')
    for (a, b), n in sorted(edges.items()):
        lines.append(f"    {ident[a]} -->|{n}| {ident[b]}")
    lines += ["```", "", "An arrow counts the modules of one package that import the other "
              "(imports inside functions included).", "",
              f"Cycles between packages: {len(pkg_cyc)}"
              + "".join(f" ({', '.join(f'`{p}`' for p in c)})" for c in pkg_cyc) + ".  ",
              f"Cycles between modules: {len(cyc)} (listed at the end).  ",
              f"Imports inside functions: {lazy_all}, {lazy_project} of them of a project module.", "",
              "## Largest files", "",
              "| file | lines |", "|---|---|"]
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(ROOT))) for p in mods.values()),
                   reverse=True)
    lines += [f"| `{f}` | {n} |" for n, f in sizes[:12]]
    lines += ["", "## Longest functions", "", "| function | lines |", "|---|---|"]
    lines += [f"| `{f}` | {n} |" for n, f in functions(mods)[:12]]
    lines += ["", f"## Import cycles between modules ({len(cyc)})", ""]
    for c in cyc:
        lazy = sorted(f"{a} → {b}" for a in c for b, top in graph[a].items() if b in c and not top)
        lines.append(f"- {', '.join(f'`{m}`' for m in c)}" + (f" (closed by function-level imports: "
                                                               f"{'; '.join(lazy[:4])})" if lazy else ""))
    if not cyc:
        lines.append("none")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--stdout", action="store_true")
    a = ap.parse_args()
    text = render()
    if a.stdout:
        print(text)
    elif a.check:
        sys.exit(0 if OUT.exists() and OUT.read_text() == text else 1)
    else:
        OUT.write_text(text)


if __name__ == "__main__":
    main()
