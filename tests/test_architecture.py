"""The architecture page (docs/architecture.md) is generated from the code and must match it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def test_architecture_page_matches_the_tree() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "architecture.py"), "--check"], cwd=ROOT)
    assert r.returncode == 0, "docs/architecture.md does not match the code: run `make architecture` and commit it"


def _arch() -> Any:
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import architecture as arch
    finally:
        sys.path.pop(0)
    return arch


def test_planning_imports_no_backend_and_no_modules_import_each_other() -> None:
    """The executability contract lives in planning and the backends register into it
    (polyparallel.planning.executability), so no planning module imports a backend, even inside a
    function; and no modules import each other, directly or around a cycle (issue 32)."""
    arch = _arch()
    graph = arch.imports(arch.modules())
    into_backends = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith("polyparallel.planning")
                           for d in deps if d.startswith("polyparallel.backends"))
    assert into_backends == []
    assert arch.cycles(graph) == []


def test_import_graph_finds_a_known_edge_and_cycle(tmp_path: Path) -> None:
    """The generator reads imports (top-level and inside functions) and finds cycles: checked on the
    real tree (the planner imports the cost model) and on a two-module cycle it is given."""
    arch = _arch()
    mods = arch.modules()
    graph = arch.imports(mods)
    assert "polyparallel.cost_models.step" in graph["polyparallel.planning.plan_search"] or \
        "polyparallel.cost_models" in graph["polyparallel.planning.plan_search"]
    assert arch.cycles({"a": {"b": True}, "b": {"a": False}, "c": {"a": True}}) == [["a", "b"]]
