"""Every code block of the README and of ``docs/*.md`` runs as written, or the page says, in a
``<!-- not run by the tests: REASON -->`` line right above it, why not (installing, benchmarks that
take minutes to hours, a deployment across machines).

A page's blocks run in order in one temporary folder, as a reader would type them there: later blocks
read what earlier ones wrote. ``polyparallel`` command lines run in this process (``cli.main``; the
commands that train or federate start their processes themselves), other command lines under bash, a
Python block in a fresh interpreter; a Python block whose first line is ``# NAME.py`` is the file the
page asks the reader to write, and is written there. The repository root is on the import path, so
the pages' ``tests.…:function`` references resolve as they do "from the repository root".
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
pytestmark = pytest.mark.slow

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_NOT_RUN = re.compile(r"<!-- not run by the tests: (.+?) -->\s*$")
#: command lines that name files of the reader's own (an ONNX file, a package) that a page cannot ship
_THEIRS = ("model.onnx", "mypkg.")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    body: str
    not_run: str | None

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = _NOT_RUN.search(before)
        out.append(Block(page, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2),
                         reason.group(1) if reason else None))
    return out


def _commands(body: str) -> list[str]:
    lines = [line.split(" #", 1)[0].strip() for line in body.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_every_code_block_runs_or_says_why_not() -> None:
    """Blocks without a language are output shown, never commands; an exemption names its reason."""
    seen = 0
    for page in PAGES:
        for b in blocks(page):
            if b.lang in ("python", "sh", "bash"):
                seen += 1
                assert b.not_run is None or len(b.not_run) > 10, f"{b}: say why the block is not run"
            elif b.lang == "":
                assert not any(c.startswith(("polyparallel ", "python", "$ ")) for c in _commands(b.body)), \
                    f"{b}: a command block needs its language (```sh) so that it is run"
    assert seen >= 20


def _env(folder: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(folder), str(ROOT), env.get("PYTHONPATH", "")])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _run_block(b: Block, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from polyparallel.cli import main

    if b.lang == "python":
        first = b.body.splitlines()[0]
        name = re.match(r"#\s*(\w+\.py)\b", first)
        if name:  # the file the page asks the reader to write
            (folder / name.group(1)).write_text(b.body)
            code = f"import {name.group(1)[:-3]}"
        else:
            code = b.body
        r = subprocess.run([sys.executable, "-c", code], cwd=folder, env=_env(folder), capture_output=True,
                           text=True, timeout=540)
        assert r.returncode == 0, f"{b} failed:\n{b.body}\n{r.stderr[-3000:]}"
        return
    for cmd in _commands(b.body):
        if any(t in cmd for t in _THEIRS):
            continue
        if cmd.startswith("polyparallel "):
            with pytest.raises(SystemExit) as exc:  # typer ends every command with SystemExit
                main(shlex.split(cmd)[1:])
            out = capsys.readouterr()
            assert exc.value.code in (0, None), f"{b}: {cmd}\nfailed:\n{out.err[-2000:]}"
            assert out.out.strip(), f"{b}: {cmd}\nprinted nothing"
        else:
            r = subprocess.run(["bash", "-c", cmd], cwd=folder, env=_env(folder), capture_output=True, text=True,
                               timeout=540)
            assert r.returncode == 0, f"{b}: {cmd}\nfailed:\n{r.stderr[-3000:]}"


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_runs_as_written(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    for link in (".venv", "benchmarks", "examples"):  # the pages' `.venv/bin/python benchmarks/...` lines
        (tmp_path / link).symlink_to(ROOT / link)
    ran = 0
    for b in blocks(page):
        if b.lang in ("python", "sh", "bash") and b.not_run is None:
            _run_block(b, tmp_path, capsys)
            ran += 1
    assert ran or page.name == "architecture.md"
