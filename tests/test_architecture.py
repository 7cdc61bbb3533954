"""The architecture page (docs/architecture.md) is generated from the code and must match it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_architecture_page_matches_the_tree() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "architecture.py"), "--check"], cwd=ROOT)
    assert r.returncode == 0, "docs/architecture.md does not match the code: run `make architecture` and commit it"


def test_import_graph_finds_a_known_edge_and_cycle(tmp_path: Path) -> None:
    """The generator reads imports (top-level and inside functions) and finds cycles: checked on the
    real tree (the planner imports the cost model) and on a two-module cycle it is given."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import architecture as arch
    finally:
        sys.path.pop(0)
    mods = arch.modules()
    graph = arch.imports(mods)
    assert "polyparallel.cost_models.step" in graph["polyparallel.planning.plan_search"] or \
        "polyparallel.cost_models" in graph["polyparallel.planning.plan_search"]
    assert arch.cycles({"a": {"b": True}, "b": {"a": False}, "c": {"a": True}}) == [["a", "b"]]
