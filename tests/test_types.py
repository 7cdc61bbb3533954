"""The type checker is clean on its scope: the public API and the planning core (``[tool.mypy]`` in
pyproject.toml names the files).

mypy runs on the installed layout: pyproject.toml maps ``cost_models/``, ``backends/`` and
``frontends/`` into ``polyparallel`` through an import hook mypy does not follow, so the test links
them into a ``polyparallel`` folder (under ``.mypy_cache/``) and checks that; ``.venv/bin/mypy`` from the
repository root runs the same check with those three packages typed ``Any``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def installed_layout() -> Path:
    """A folder holding ``polyparallel/`` as it is installed: the package's own entries and the three
    mapped folders, as links into the checkout."""
    tree = ROOT / ".mypy_cache" / "layout"
    pkg = tree / "polyparallel"
    if pkg.exists():
        shutil.rmtree(pkg)  # links only: their targets stay
    pkg.mkdir(parents=True)
    for entry in (ROOT / "polyparallel").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for folder in ("cost_models", "backends", "frontends"):
        (pkg / folder).symlink_to(ROOT / folder)
    return tree


def test_mypy_is_clean_on_the_public_api_and_the_planning_core() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                        "--cache-dir", str(ROOT / ".mypy_cache")], cwd=installed_layout(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"mypy found errors:\n{r.stdout}{r.stderr}"
