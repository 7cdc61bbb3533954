"""Bad input, as a new user types it: every case exits 2 (CLI) or raises ``ValueError`` (API) with
one line that names the fix, before anything is written.

Each row is ``(arguments, words the message must contain)``; the words are the fix (the option to
change, the values it takes, the unit to write), not just the symptom.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import polyparallel as pp
from polyparallel.cli import main

BAD_YAML = """\
name: t
centers:
  - name: a
    framework: torch
    nodes:
      - device: a100-80gb-sxm
        devices_per_node: 2
        intra: {bandwidth: 450, latency: "2 us"}
"""

CLI_CASES = [
    (["search", "gpt-tiny", "--batch-size", "0"], ["batch_size=0", "whole number >= 1"]),
    (["search", "gpt-tiny", "--batch-size", "-3"], ["batch_size=-3", "whole number >= 1"]),
    (["search", "gpt-tiny", "--tp", "0"], ["tp=0", ">= 1"]),
    (["search", "gpt-tiny", "--pp", "-1"], ["pp=-1", ">= 1"]),
    (["search", "gpt-tiny", "--sp", "0"], ["sp=0", ">= 1"]),
    (["search", "gpt-tiny", "--microbatches", "0"], ["microbatches=0", ">= 1"]),
    (["search", "gpt-tiny", "--devices", "0"], ["devices=0", ">= 1"]),
    (["search", "gpt-tiny", "--dtype", "int4"], ["dtype='int4'", "bf16"]),
    (["search", "gpt-tiny", "--schedule", "zb"], ["schedule='zb'", "1f1b"]),
    (["search", "gpt-tiny", "--zero", "5"], ["zero_stage=5", "0, 1, 2, 3"]),
    (["search", "gpt-tiny", "--compile", "max"], ["compile='max'", "none, regional"]),
    (["evaluate", "gpt-tiny", "--compile", "max"], ["compile='max'", "none, regional"]),
    (["search", "gpt-tiny", "--recompute", "some"], ["recompute='some'", "selective"]),
    (["search", "gpt-tiny", "--mode", "async"], ["mode='async'", "collaborative"]),
    (["search", "gpt-tiny", "--memory-cap", "-1"], ["memory_cap", "> 0"]),
    (["search", "mlp", "--mode", "collaborative", "--max-local-steps", "0"], ["max_local_steps=0", ">= 1"]),
    (["search", "mlp", "--comm-fraction", "1.5"], ["comm_fraction", "between 0 and 1"]),
    (["search", "gpt-tiny", "--objective", "fastest"], ["objective", "throughput"]),
    (["search", "gpt-tiny", "--placements", "best"], ["placements", "torch"]),
    (["search", "mlp", "--seq", "3"], ["no sequence", "drop --seq"]),
    (["search", "mlp", "--layers", "2"], ["fixed depth", "drop --layers"]),
    (["search", "gpt-tiny", "--seq", "0"], ["sequence length 0", ">= 1"]),
    (["search", "no-such-model"], ["unknown model", "gpt-tiny"]),
    (["search", "missing.onnx"], ["missing.onnx", "does not exist"]),
    (["search", "gpt-tiny", "-c", "no-such-cluster"], ["no-such-cluster", "local-cpu:<P>"]),
    (["search", "gpt-tiny", "-c", "bad.yaml"], ["no unit", "450 GB/s"]),
    (["search", "no_such_module_xyz:build"], ["no_such_module_xyz"]),
    (["search", "gpt-tiny", "-c", "local-cpu:0"], ["local-cpu"]),
    (["evaluate", "gpt-tiny", "--tp", "0"], ["tp=0", ">= 1"]),
    (["evaluate", "gpt-tiny", "--batch-size", "0"], ["batch_size=0", ">= 1"]),
    (["evaluate", "gpt-tiny", "--tp", "4"], ["exceeds", "devices"]),
    (["evaluate", "gpt-tiny", "--dtype", "fp64"], ["dtype='fp64'", "bf16"]),
    (["evaluate", "gpt-tiny", "--schedule", "zb"], ["schedule='zb'", "gpipe"]),
    (["explain", "model.onnx"], ["binary file", "polyparallel search model.onnx"]),
    (["explain", "missing.json"], ["missing.json", "No such file"]),
    (["explain", "notjson.json"], ["not JSON", "line 1"]),
    (["explain", "other.json"], ["schema_version", "re-run `polyparallel search`"]),
    (["cluster", "show", "no-such-cluster"], ["no-such-cluster", "presets are"]),
    (["cluster", "show", "bad.yaml"], ["no unit", "450 GB/s"]),
    (["graph", "no-such-model"], ["unknown model", ".onnx path"]),
    (["graph", "gpt-tiny", "--seq", "0"], ["sequence length 0", ">= 1"]),
    (["train", "missing.json", "--model", "m:f", "--data", "m:g"], ["missing.json"]),
    # it used to enumerate 10^12 micro-batch counts and hang
    (["search", "gpt-tiny", "--batch-size", "1000000000000"], ["4096 micro-batches", "--microbatches"]),
    (["report", "keep.json", "-o", "no-such-dir/r.html"], ["no-such-dir does not exist", "mkdir -p"]),
    (["report", "keep.json", "-o", "."], ["is a folder", "give a file name"]),
    (["search", "user_code_with_a_typo:build"], ["user_code_with_a_typo.py:1", "fix the module's syntax"]),
    (["search", "gpt-tiny", "--mode", "collaborative", "-c", "local-cpu:2"], ["has 1", "several centers"]),
    (["report", "s.json", "-o", "afile/r.html"], ["afile is a file, not a folder"]),
    # refused before launch: neither the run directory nor the runs/ folder made for it is left behind
    (["train", "s.json", "--model", "mlp", "--steps", "0"], ["steps=0", "at least one"]),
    (["train", "s.json", "--model", "mlp", "--lr", "-1"], ["lr=-1", "positive"]),
    (["train", "s.json", "--model", "mlp", "--run-dir", "afile"], ["afile is a file", "give a folder"]),
    (["collab", "--rounds", "1", "--synthetic", "64", "--lr", "-1"], ["--lr -1.0", "positive finite"]),
    # the server's evaluation set with other features than the centers' data: a traceback in round 1
    (["collab", "--rounds", "1", "--synthetic", "64", "--eval-data", "wide.npz"], ["shape (5,)", "same features"]),
    (["collab", "--rounds", "1", "--synthetic", "64", "--data", "wide.npz"], ["is a file", "one CENTER.npz"]),
    (["serve", "--config", "missing.json"], ["no such file", "--save-config"]),
    # the user's own function raising: one line with the exception and the line of their code
    (["search", "user_code_that_raises:build"], ["build() raised RuntimeError: config file missing",
                                                 "user_code_that_raises.py:2"]),
]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text(BAD_YAML)
    (tmp_path / "model.onnx").write_bytes(bytes(range(256)) * 4)  # binary, not a strategy
    (tmp_path / "notjson.json").write_text("dp=2 tp=2\n")
    (tmp_path / "other.json").write_text('{"name": "not a strategy"}\n')
    (tmp_path / "keep.json").write_text("precious\n")
    (tmp_path / "user_code_that_raises.py").write_text('def build():\n    raise RuntimeError("config file missing")\n')
    (tmp_path / "user_code_with_a_typo.py").write_text("def build(:\n    pass\n")
    (tmp_path / "afile").write_text("a file, not a folder\n")
    (tmp_path / "s.json").write_text(_a_strategy())
    import numpy as np

    np.savez(tmp_path / "wide.npz", x=np.zeros((10, 5), np.float32), y=np.zeros(10, np.int64))
    return tmp_path


@functools.cache
def _a_strategy() -> str:
    """A valid strategy (of a small MLP), for commands whose other arguments are wrong."""
    s = pp.evaluate(torch.nn.Sequential(torch.nn.Linear(8, 4)), (torch.zeros(4, 8),), "local-cpu:2", dp=2)
    return s.model_dump_json()


@pytest.mark.parametrize(("argv", "words"), CLI_CASES, ids=[" ".join(a) for a, _ in CLI_CASES])
def test_cli_bad_input_exits_2_with_one_line_naming_the_fix(argv: list[str], words: list[str], workdir: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    before = {p.name: p.read_bytes() for p in workdir.iterdir()}
    with pytest.raises(SystemExit) as exc:
        main([*argv, "-o", "keep.json"] if argv[0] == "search" else argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert "Traceback" not in err and lines[0].startswith("error:"), err
    # one line; a spec error adds one indented line per bad field
    assert len(lines) == 1 or all(ln.startswith("  ") for ln in lines[1:]), err
    for w in words:
        assert w in err, (w, err)
    after = {p.name: p.read_bytes() for p in workdir.iterdir()}
    assert after == before, "a refused command changed files"  # nothing written, nothing lost


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


X = (torch.zeros(4, 8),)

API_CASES = [
    (lambda: pp.search(_mlp(), X, {"labels": 1}), ["third argument", "example_kwargs"]),
    (lambda: pp.search(_mlp(), X, batch_size=0), ["batch_size=0", ">= 1"]),
    (lambda: pp.search(_mlp(), X, batch_size=2.5), ["batch_size=2.5", "whole number"]),
    (lambda: pp.search(_mlp(), X, constraints={"tp": 0}), ["tp=0", ">= 1"]),
    (lambda: pp.search(_mlp(), X, constraints={"bogus": 1}), ["unknown constraint", "tp"]),
    (lambda: pp.search(_mlp(), X, constraints={"dtype": "int8"}), ["dtype='int8'", "bf16"]),
    (lambda: pp.search(_mlp(), X, objective="fast"), ["objective", "throughput"]),
    (lambda: pp.search(torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3))), ["example_inputs=", "Conv2d"]),
    (lambda: pp.search("gpt-tiny", X), ["brings its own example inputs"]),
    (lambda: pp.search("no-such-model"), ["no-such-model"]),
    (lambda: pp.evaluate(_mlp(), X, tp=0), ["tp=0", ">= 1"]),
    (lambda: pp.Constraints(zero_stage=4), ["zero_stage=4", "0, 1, 2, 3"]),
    (lambda: pp.Constraints(comm_fraction=2.0), ["comm_fraction", "between 0 and 1"]),
]


@pytest.mark.parametrize(("call", "words"), API_CASES, ids=[f"api{i}" for i in range(len(API_CASES))])
def test_api_bad_input_raises_a_message_naming_the_fix(call, words: list[str], workdir: Path) -> None:
    with pytest.raises((ValueError, FileNotFoundError)) as exc:
        call()
    msg = str(exc.value)
    for w in words:
        assert w in msg, (w, msg)


def test_the_table_is_large_enough() -> None:
    assert len(CLI_CASES) + len(API_CASES) >= 40


@pytest.mark.parametrize(("edit", "words"), [
    (lambda d: d.update(dtype="fp8x"), ["dtype 'fp8x'", "bf16"]),
    (lambda d: d.pop("stages"), ["stages", "missing or empty"]),
    (lambda d: d["estimate"].update(step_time_s=float("nan")), ["estimate.step_time_s", "finite"]),
    (lambda d: d["estimate"].update(memory_bytes_max=-5), ["estimate.memory_bytes_max", "greater than or equal to 0"]),
])
def test_a_hand_edited_strategy_with_impossible_values_is_refused(edit, words, workdir: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """explain and report read a strategy file: an impossible value (an unknown precision, no stages,
    a NaN step time, negative memory) is refused naming the field, where they printed 'step nan s'."""
    import json

    with pytest.raises(SystemExit) as done:
        main(["search", "gpt-tiny", "-o", "s.json", "--json"])
    assert done.value.code == 0
    capsys.readouterr()
    d = json.loads((workdir / "s.json").read_text())
    edit(d)
    (workdir / "edited.json").write_text(json.dumps(d))
    for argv in (["explain", "edited.json"], ["report", "edited.json", "-o", "r.html"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "Traceback" not in err, err
        for w in words:
            assert w in err, (w, err)
    assert not (workdir / "r.html").exists()


def _float_labels(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    from polyparallel.backends.torch._examples import gpt_data

    x, y = gpt_data(step)
    return x, y.float()


def _narrow_inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    from polyparallel.backends.torch._examples import mlp_data

    x, y = mlp_data(step)
    return x[:, :20], y


@pytest.mark.parametrize(("model", "data", "words"), [
    ("tiny_gpt", _float_labels, ["labels float32 (4, 16)", "Expected dtype int32/int64", "data model(inputs"]),
    ("tiny_mlp", _narrow_inputs, ["inputs float32 (4, 20)", "[4, 20] X [32, 64]", "data model(inputs"]),
], ids=["float labels", "wrong width"])
def test_train_on_data_the_model_cannot_take_is_refused_in_one_line(model: str, data, words: list[str],
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The forward is tried on a micro-batch of data_fn(0) (fake tensors) before the capture, whose
    account of the same failure was several lines of export and fx errors, plus torch's logged tracebacks."""
    from polyparallel.backends.torch import _examples as ex
    from polyparallel.backends.torch import train

    fn = getattr(ex, model)
    good = ex.gpt_data if model == "tiny_gpt" else ex.mlp_data
    s = pp.evaluate(fn(), good(0), "local-cpu:2", batch_size=8, dp=2, microbatches=1, recompute="none")
    with pytest.raises(ValueError, match="the model's forward fails on a micro-batch of data_fn") as exc:
        train(s, fn, data, steps=1)
    msg = str(exc.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # torch's fake-tensor logs held back


def test_a_missing_optional_dependency_names_the_extra_that_installs_it(tmp_path: Path) -> None:
    """A MindSpore center on an install without MindSpore (blocked here in a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['mindspore'] = None\n"
            "from polyparallel.cli import main\n"
            "main(['collab', '--frameworks', 'torch,mindspore,torch', '--rounds', '1', '--holdout', '0.2', "
            f"'--out', {str(tmp_path / 'out')!r}])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "pip install 'polyparallel[mindspore]'" in r.stderr, r.stderr
