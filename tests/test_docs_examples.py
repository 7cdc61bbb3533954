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


# The README's `polyparallel` command lines that plan (no training, no federation, no files of the
# reader's own), run in order in one folder as a reader would type them: later lines read what
# earlier ones wrote. Lines that train or start processes are run by their own tests.
_RUN = {"examples", "graph", "search", "explain", "evaluate", "cluster", "report"}
_THEIRS = ("model.onnx", "mypkg.", "--run ", "collab.json")


def _readme_commands() -> list[list[str]]:
    import shlex

    out = []
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("polyparallel ") and line.split()[1] in _RUN and not any(t in line for t in _THEIRS):
                out.append(shlex.split(line)[1:])
    return out


COMMANDS = _readme_commands()


def test_readme_planning_commands_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from polyparallel.cli import main

    assert len(COMMANDS) >= 10, COMMANDS
    monkeypatch.chdir(tmp_path)
    for argv in COMMANDS:
        with pytest.raises(SystemExit) as exc:  # typer ends every command with SystemExit
            main(argv)
        captured = capsys.readouterr()
        assert exc.value.code in (0, None), f"polyparallel {' '.join(argv)} failed:\n{captured.err[-2000:]}"
        assert captured.out.strip(), f"polyparallel {' '.join(argv)} printed nothing"
