"""The type checker is clean on its scope: the public API and the planning core (``[tool.mypy]`` in
pyproject.toml names the files; ``.venv/bin/mypy`` runs the same check)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_is_clean_on_the_public_api_and_the_planning_core() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"mypy found errors (run .venv/bin/mypy):\n{r.stdout}{r.stderr}"
