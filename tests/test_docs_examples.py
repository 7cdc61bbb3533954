"""The README's Python examples run as written (each block in a fresh interpreter, in a temporary
folder, so files it writes land there)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
pytestmark = pytest.mark.slow


def test_the_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2  # capture, search


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_example_runs(index: int, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", BLOCKS[index]], cwd=tmp_path, capture_output=True, text=True,
                       timeout=540)
    assert r.returncode == 0, f"README python block {index} failed:\n{BLOCKS[index]}\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), "the example prints what it shows"
