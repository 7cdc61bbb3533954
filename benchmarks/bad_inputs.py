"""Bad input as a new user types it, through the installed CLI: exit code, first line, no traceback, no hang.

A second table, written apart from ``tests/test_bad_inputs.py`` (whose cases the project fixed one by
one): 94 mistakes across every command — malformed numbers, files of the wrong kind, cluster specs
with wrong fields, user modules that do not import or return the wrong thing, data functions that
return the wrong shapes, strategies edited by hand, collaborative options out of range. Each case
runs ``polyparallel ...`` in a fresh process in a scratch folder (timeout 120 s) and is counted
``ok`` when it exits 2 with no traceback, names something to change in its first lines, and leaves
the folder as it was. Prints the table; writes ``benchmarks/results/bad_inputs.json``.

    .venv/bin/python benchmarks/bad_inputs.py [--only search,train] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "polyparallel"]

_NODE = "name: t\ncenters:\n  - name: a\n    nodes:\n      - device: {dev}\n        devices_per_node: {n}\n"
CLUSTERS = {
    "empty.yaml": "",
    "list.yaml": "- name: a\n- name: b\n",
    "nodevice.yaml": _NODE.format(dev="b300-ultra", n=2),
    "negbw.yaml": _NODE.format(dev="a100-80gb-sxm", n=2) + "        intra: {bandwidth: -5 GB/s, latency: 2 us}\n",
    "zerodev.yaml": _NODE.format(dev="a100-80gb-sxm", n=0),
    "typo.yaml": "name: t\ncentres:\n  - name: a\n",
    "tabs.yaml": "name: t\ncenters:\n\t- name: a\n",
}

MODULES = {
    "mod_noattr.py": "def other():\n    return 1\n",
    "mod_const.py": "VALUE = 3\n",
    "mod_int.py": "def build():\n    return 7\n",
    "mod_syntax.py": "def build(:\n    pass\n",
    "mod_imports.py": "import no_such_package_abc\n\ndef build():\n    return None\n",
    "mod_pair.py": ("import torch\n\ndef example():\n"
                    "    return torch.nn.Linear(4, 2), (torch.zeros(2, 4),), {}, 'extra'\n"),
    "mod_noinput.py": "import torch\n\ndef build():\n    return torch.nn.Conv2d(3, 8, 3)\n",
    "baddata.py": (
        "import numpy as np\nimport torch\nfrom polyparallel.backends.torch._examples import gpt_data\n\n"
        "def three(step):\n    x, y = gpt_data(step)\n    return x, y, y\n\n"
        "def numpy(step):\n    x, y = gpt_data(step)\n    return x.numpy(), y.numpy()\n\n"
        "def raises(step):\n    raise FileNotFoundError('/data/shard-%d.bin' % step)\n\n"
        "def short(step):\n    x, y = gpt_data(step)\n    return x[:5], y[:5]\n\n"
        "def nan_inputs(step):\n    x, y = gpt_data(step)\n    return x.float() * float('nan'), y\n"),
}


def _files(d: Path) -> None:
    """The scratch folder: cluster specs, user modules, data files, strategies (a good one made here)."""
    import numpy as np

    for name, text in {**CLUSTERS, **MODULES}.items():
        (d / name).write_text(text)
    (d / "empty.onnx").write_bytes(b"")
    (d / "notes.txt").write_text("dp=2 tp=2\n")
    (d / "empty.json").write_text("")
    (d / "array.json").write_text("[]\n")
    (d / "afile").write_text("not a folder\n")
    (d / "emptydir").mkdir()
    np.savez(d / "noxy.npz", a=np.zeros(3))
    np.savez(d / "ragged.npz", x=np.zeros((10, 4), np.float32), y=np.zeros(7, np.int64))
    np.savez(d / "badlabels.npz", x=np.zeros((10, 784), np.float32), y=np.full(10, 99, np.int64))
    np.savez(d / "wide.npz", x=np.zeros((10, 5), np.float32), y=np.zeros(10, np.int64))
    env = {**os.environ, "POLYPARALLEL_CALIBRATION": str(d / "no-calibration.json")}
    subprocess.run([*CLI, "search", "gpt-tiny", "-c", "local-cpu:2", "--batch-size", "8", "--out", "s.json"],
                   cwd=d, env=env, check=True, capture_output=True, timeout=300)
    subprocess.run([*CLI, "search", "mlp", "-c", "aisynergy-5", "--mode", "collaborative", "--out", "collab.json"],
                   cwd=d, env=env, check=True, capture_output=True, timeout=300)
    s = json.loads((d / "s.json").read_text())
    (d / "truncated.json").write_text((d / "s.json").read_text()[:400])
    for name, edit in {"neg_dp.json": {"dp": -1}, "v99.json": {"schema_version": 99},
                       "no_mesh.json": {"mesh": None}, "huge_tp.json": {"tp": 10 ** 6}}.items():
        bad = dict(s)
        for k, v in edit.items():
            if v is None:
                bad.pop(k)
            else:
                bad[k] = v
        (d / name).write_text(json.dumps(bad))


T = ["train", "s.json", "--model", "gpt-tiny", "--steps", "2"]
C = ["collab", "--rounds", "1", "--synthetic", "64"]
CASES: list[list[str]] = [
    # search: numbers, names, files, user modules
    ["search", "gpt-tiny", "--batch-size", "abc"],
    ["search", "gpt-tiny", "--tp", "1.5"],
    ["search", "gpt-tiny", "-c", "local-cpu:-2"],
    ["search", "gpt-tiny", "-c", "local-cpu:two"],
    ["search", "gpt-tiny", "-c", "dgx-a100x0"],
    ["search", "gpt-tiny", "-c", "empty.yaml"],
    ["search", "gpt-tiny", "-c", "list.yaml"],
    ["search", "gpt-tiny", "-c", "nodevice.yaml"],
    ["search", "gpt-tiny", "-c", "negbw.yaml"],
    ["search", "gpt-tiny", "-c", "zerodev.yaml"],
    ["search", "gpt-tiny", "-c", "typo.yaml"],
    ["search", "gpt-tiny", "-c", "tabs.yaml"],
    ["search", "gpt-tiny", "--out", "no/such/dir/s.json"],
    ["search", "gpt-tiny", "--out", "emptydir"],
    ["search", "gpt-tiny", "--memory-cap", "abc"],
    ["search", "gpt-tiny", "--memory-cap", "12 XB"],
    ["search", "notes.txt"],
    ["search", "empty.onnx"],
    ["search", "mod_noattr:build"],
    ["search", "mod_const:VALUE"],
    ["search", "mod_int:build"],
    ["search", "mod_syntax:build"],
    ["search", "mod_imports:build"],
    ["search", "mod_pair:example"],
    ["search", "mod_noinput:build"],
    ["search", "gpt-tiny", "--pp", "1000"],
    ["search", "gpt-tiny", "--sp", "64"],
    ["search", "gpt-tiny", "--dtype", "FP16X"],
    ["search", "gpt-tiny", "--devices", "99"],
    ["search", "gpt-tiny", "--mode", "collaborative", "-c", "local-cpu:2"],
    ["search", "gpt-tiny", "--execution", "turbo=1"],
    ["search", "gpt-tiny", "--chunks", "0"],
    ["search", "gpt-tiny", "--partition", "random"],
    # evaluate
    ["evaluate", "gpt-tiny", "--pp", "3"],
    ["evaluate", "gpt-tiny", "--dp", "2", "--microbatches", "3", "--batch-size", "16"],
    ["evaluate", "gpt-tiny", "--zero", "4"],
    ["evaluate", "gpt-tiny", "--ep", "2"],
    ["evaluate", "gpt-tiny", "--sp", "3"],
    ["evaluate", "gpt-tiny", "--recompute", "everything"],
    ["evaluate", "gpt-tiny", "--layers", "0"],
    # explain / report / simulate: files of the wrong kind, strategies edited by hand
    ["explain", "empty.json"],
    ["explain", "array.json"],
    ["explain", "neg_dp.json"],
    ["explain", "v99.json"],
    ["explain", "no_mesh.json"],
    ["explain", "emptydir"],
    ["explain", "truncated.json"],
    ["explain", "huge_tp.json"],
    ["report", "missing.json"],
    ["report", "s.json", "--run", "missing_dir"],
    ["report", "s.json", "--run", "emptydir"],
    ["report", "truncated.json"],
    ["report", "s.json", "-o", "afile/r.html"],
    ["simulate", "missing.json"],
    ["simulate", "collab.json", "--jitter", "-1"],
    ["simulate", "collab.json", "--dropout", "1.5"],
    ["simulate", "empty.json"],
    # train
    [*T[:-1], "0"],
    [*T[:-1], "-1"],
    [*T, "--lr", "0"],
    [*T, "--lr", "inf"],
    [*T, "--optimizer", "lamb"],
    [*T, "--timeout", "0"],
    ["train", "s.json", "--model", "mlp", "--steps", "1"],
    [*T, "--data", "mod_noattr:data"],
    [*T, "--data", "baddata:three"],
    [*T, "--data", "baddata:numpy"],
    [*T, "--data", "baddata:raises"],
    [*T, "--data", "baddata:short"],
    [*T, "--checkpoint-every", "0"],
    [*T, "--keep-checkpoints", "-1"],
    [*T, "--node-rank", "5"],
    [*T, "--run-dir", "afile"],
    ["train", "collab.json", "--model", "mlp", "--steps", "1"],
    ["train", "truncated.json", "--model", "gpt-tiny"],
    # collab
    [*C[:1], "--rounds", "0", *C[3:]],
    [*C, "--model", "nosuch"],
    [*C, "--data", "missing.npz"],
    [*C, "--data", "noxy.npz"],
    [*C, "--data", "ragged.npz"],
    [*C, "--fusion", "nosuch"],
    [*C, "--frameworks", "tensorflow,torch,torch"],
    [*C, "--holdout", "1.5"],
    [*C, "--lr", "-1"],
    [*C, "--strategy", "notes.txt"],
    [*C, "--engine", "grpc"],
    [*C, "--eval-data", "wide.npz"],
    [*C, "--compression", "zip9"],
    [*C, "--min-centers", "9"],
    # cluster, calibrate, deployment
    ["cluster", "show", "local-cpu:abc"],
    ["cluster", "show", "empty.yaml"],
    ["calibrate", "--group-sizes", "0"],
    ["serve", "--config", "missing.json"],
    ["center", "--name", "a", "--superlink", "127.0.0.1:1", "--data", "missing.npz"],
]


def _snapshot(d: Path) -> dict[str, float]:
    return {str(p.relative_to(d)): p.stat().st_mtime for p in d.rglob("*") if "__pycache__" not in p.parts}


def run_case(d: Path, argv: list[str], timeout: float = 120.0) -> dict[str, Any]:
    env = {**os.environ, "POLYPARALLEL_CALIBRATION": str(d / "no-calibration.json"), "COLUMNS": "160"}
    before = _snapshot(d)
    t0 = time.perf_counter()
    try:
        r = subprocess.run([*CLI, *argv], cwd=d, env=env, capture_output=True, text=True, timeout=timeout)
        code, err = r.returncode, r.stderr + r.stdout
    except subprocess.TimeoutExpired:
        code, err = None, "(hung: killed after the timeout)"
    lines = [ln.strip() for ln in err.splitlines() if ln.strip() and not ln.strip().startswith(("[", "E1", "W1"))]
    first = next((ln for ln in lines if ln.startswith(("error", "Error", "│ ", "Usage"))), lines[0] if lines else "")
    changed = sorted(set(_snapshot(d)) ^ set(before))
    rec = {"argv": argv, "exit": code, "first_line": first[:300], "traceback": "Traceback" in err,
           "seconds": round(time.perf_counter() - t0, 1), "files_changed": changed}
    rec["ok"] = code == 2 and not rec["traceback"] and not changed
    for p in changed:  # leave the folder as the next case expects it
        q = d / p
        if q.is_dir() and p not in before:
            shutil.rmtree(q, ignore_errors=True)
        elif q.exists() and p not in before:
            q.unlink()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated commands to run (default: all)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bad_inputs.json"))
    a = ap.parse_args()
    only = set(filter(None, a.only.split(",")))
    cases = [c for c in CASES if not only or c[0] in only]
    rows = []
    with tempfile.TemporaryDirectory(prefix="pp-bad-") as tmp:
        d = Path(tmp)
        _files(d)
        for argv in cases:
            r = run_case(d, argv)
            rows.append(r)
            mark = "ok " if r["ok"] else "BAD"
            extra = (" [traceback]" if r["traceback"] else "") + (
                f" [wrote {r['files_changed']}]" if r["files_changed"] else "")
            print(f"{mark} exit={r['exit']!s:<4} {r['seconds']:>5.1f}s  {' '.join(argv)[:60]:<60}  "
                  f"{r['first_line'][:150]}{extra}", flush=True)
    ok = sum(r["ok"] for r in rows)
    print(f"\n{ok} of {len(rows)} cases exit 2 with one line and no traceback, leaving the folder as it was; "
          f"{sum(r['traceback'] for r in rows)} tracebacks, {sum(r['exit'] is None for r in rows)} hangs")
    Path(a.out).write_text(json.dumps({"cases": len(rows), "ok": ok, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
