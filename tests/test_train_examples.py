"""`make demo`'s path: a built-in example searched by name trains by name, on synthetic batches of its
shape, with the losses one process gets on the same batches (train needs no --data for it)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from polyparallel.backends.torch._examples import single_process_losses
from polyparallel.cli import main
from polyparallel.models import example_batch, example_module

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_builtin_example_searched_by_name_trains_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = tmp_path / "s.json"
    for argv in (["search", "gpt-tiny", "--cluster", "local-cpu:2", "--batch-size", "16", "--out", str(s)],
                 ["train", str(s), "--model", "gpt-tiny", "--steps", "3", "--lr", "0.05", "--run-dir",
                  str(tmp_path / "r")]):
        with pytest.raises(SystemExit) as exc:  # typer ends every command with SystemExit
            main(argv)
        out = capsys.readouterr()
        assert exc.value.code in (0, None), out.err
    got = [json.loads(line)["loss"] for line in (tmp_path / "r" / "train.jsonl").read_text().splitlines()]
    # one line per step as it ends, the loss as logged, the time left while steps remain (a log: no bar)
    steps = [line for line in out.out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["0/3", "1/3", "2/3"]
    assert [float(line.split()[3]) for line in steps] == pytest.approx(got, abs=1e-6)
    assert "eta" in steps[1] and "eta" not in steps[2] and "\x1b[" not in out.out
    ref = single_process_losses(functools.partial(example_module, "gpt-tiny"),
                                functools.partial(example_batch, "gpt-tiny", 16), steps=3, lr=0.05, seed=0)
    assert got == pytest.approx(ref, rel=1e-5)


def test_planning_only_examples_are_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = tmp_path / "s.json"
    s.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        main(["train", str(s), "--model", "llama-8b"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "planning only" in err and "gpt-tiny" in err
