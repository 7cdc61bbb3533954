"""Launch latency: from the ``polyparallel train`` command to the end of the first training step.

A tiny model (``--model gpt``: the backend's 2-layer GPT; ``mlp``: its MLP) is searched for
``local-cpu:2`` with dp=2 (DDP) and trained for 2 steps through the CLI, ``--repeats`` times. The
command runs in a driver process that is ``polyparallel train`` with clocks around its phases
(the functions are wrapped, not changed); the workers' model and data functions are the
backend's, wrapped to note when each rank reaches them. Every time is wall-clock on this machine:

- ``import``: interpreter start and importing polyparallel's CLI and the torch backend;
- ``capture``: ``data_fn(0)`` and the capture of the model for the fingerprint check;
- ``plan check``: building the model and checking the plan (``plan_for``);
- ``run dir, job``: the rest before the launch (checkpoint check, run directory, job.pkl);
- ``agent start``: from the launch until the first worker process exists: torch.distributed.run's
  agent starting (interpreter, its imports, the rendezvous store) and starting the workers. Where
  the agent is started ahead and imports while the checks run, only what is left of its start
  when the checks are done counts here;
- ``worker start``: a worker's interpreter, its imports and ``init_process_group`` (the ranks'
  rendezvous) until the last rank calls ``model_fn`` (the step needs all);
- ``model build``: ``model_fn()``, parallelising it, the optimiser, until rank 0 calls
  ``data_fn(0)``;
- ``first step``: until rank 0 calls ``data_fn(1)`` (step 0's record written).

``--pythonpath DIR[:DIR]`` runs another checkout's code (e.g. the code before a change: a git
worktree, with a ``sitecustomize.py`` that removes the editable install's finder). The load
(``uptime``) before each run is reported with it: on 2 shared cores the numbers move with it.

    .venv/bin/python benchmarks/launch_latency.py                 # table + results/launch_latency.json
    .venv/bin/python benchmarks/launch_latency.py --repeats 3 --label before --pythonpath /tmp/basepath:/tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "launch_latency.json"
MARKS = "LAUNCH_LATENCY_MARKS"
PHASES = ["import", "capture", "plan check", "run dir, job", "agent start", "worker start", "model build",
          "first step"]


def _exec_time() -> float:
    """Wall-clock time this process was started (exec), from /proc (10 ms resolution)."""
    stat = Path("/proc/self/stat").read_text()
    ticks = int(stat[stat.rindex(")") + 2:].split()[19])
    btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                 if line.startswith("btime"))
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def _note(event: str) -> None:
    where = os.environ.get(MARKS)
    if where and "RANK" in os.environ:
        (Path(where) / f"{os.environ['RANK']}-{event}").write_text(f"{time.time():.6f}")


def _model(name: str) -> Any:
    from polyparallel.backends.torch import _examples as ex

    if "RANK" in os.environ:
        (Path(os.environ[MARKS]) / f"{os.environ['RANK']}-exec").write_text(f"{_exec_time():.6f}")
        _note("model")
    return ex.tiny_gpt() if name == "gpt" else ex.tiny_mlp()


def timed_gpt() -> Any:
    return _model("gpt")


def timed_mlp() -> Any:
    return _model("mlp")


def _data(name: str, step: int) -> Any:
    from polyparallel.backends.torch import _examples as ex

    if step <= 1:
        _note(f"data{step}")
    return ex.gpt_data(step) if name == "gpt" else ex.mlp_data(step)


def timed_gpt_data(step: int) -> Any:
    return _data("gpt", step)


def timed_mlp_data(step: int) -> Any:
    return _data("mlp", step)


def drive(out: Path, argv: list[str]) -> None:
    """``polyparallel train ARGV`` with clocks around its phases, written to ``out``."""
    t: dict[str, float] = {"exec": _exec_time()}
    import polyparallel.backends.torch._launch as launch
    from polyparallel.cli import main

    t["imported"] = time.time()

    def clocked(name: str, fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            t.setdefault(f"{name}_start", time.time())
            try:
                return fn(*a, **k)
            finally:
                t.setdefault(f"{name}_end", time.time())
        return run

    launch.strategy_graph = clocked("capture", launch.strategy_graph)
    launch.plan_for = clocked("plan", launch.plan_for)
    popen = launch.subprocess.Popen

    class Popen(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **k: Any) -> None:
            t.setdefault("popen", time.time())
            super().__init__(*a, **k)

    launch.subprocess.Popen = Popen
    if hasattr(launch, "go"):  # the agent is started early and told to launch here
        launch.go = clocked("go", launch.go)
    try:
        main(["train", *argv])
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        out.write_text(json.dumps(t))


def _strategy(model: str, path: Path) -> None:
    import polyparallel as pp
    from polyparallel.backends.torch import _examples as ex

    net, data = (ex.tiny_gpt(), ex.gpt_data) if model == "gpt" else (ex.tiny_mlp(), ex.mlp_data)
    x, y = data(0)
    s = pp.search(net, (x,), "local-cpu:2", example_kwargs={"labels": y}, batch_size=ex.BATCH,
                  constraints={"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0, "microbatches": 1, "recompute": "none"})
    s.to_json(path)


def measure_once(model: str, strategy: Path, work: Path, pythonpath: str | None) -> dict[str, Any]:
    marks, driver = work / "marks", work / "driver.json"
    marks.mkdir(parents=True)
    env = {**os.environ, MARKS: str(marks)}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    argv = [str(strategy), "--model", f"launch_latency:timed_{model}", "--data", f"launch_latency:timed_{model}_data",
            "--steps", "2", "--log-dir", str(work / "run")]
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--drive", str(driver), "--", *argv],
                          env=env, cwd=HERE, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    d = json.loads(driver.read_text())
    m = {p.name: float(p.read_text()) for p in marks.iterdir()}
    first_worker = min(v for k, v in m.items() if k.endswith("-exec"))
    workers_ready = max(v for k, v in m.items() if k.endswith("-model"))
    phases = {
        "import": d["imported"] - t0,
        "capture": d["capture_end"] - d["capture_start"],
        "plan check": d["plan_end"] - d["plan_start"],
        "run dir, job": d.get("go_start", d["popen"]) - d["plan_end"],
        "agent start": first_worker - d.get("go_start", d["popen"]),
        "worker start": workers_ready - first_worker,
        "model build": m["0-data0"] - workers_ready,
        "first step": m["0-data1"] - m["0-data0"],
    }
    unaccounted = (d["capture_start"] - d["imported"])  # CLI parsing, reading the strategy
    phases["import"] += unaccounted
    return {"load": load, "phases": phases, "total": m["0-data1"] - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--label", default="after", help="key of this measurement in the JSON (e.g. before, after)")
    ap.add_argument("--pythonpath", default=None, help="prepended to PYTHONPATH: measure another checkout")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--drive", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive is not None:
        drive(args.drive, args.rest)
        return
    runs = []
    with tempfile.TemporaryDirectory(prefix="launch-latency-") as tmp:
        strategy = Path(tmp) / "strategy.json"
        _strategy(args.model, strategy)
        for i in range(args.repeats):
            r = measure_once(args.model, strategy, Path(tmp) / f"r{i}", args.pythonpath)
            runs.append(r)
            print(f"run {i}: {r['total']:.2f} s to the end of step 0 (load {r['load']})", flush=True)
    med = {p: statistics.median(r["phases"][p] for r in runs) for p in PHASES}
    total = statistics.median(r["total"] for r in runs)
    print(f"\n{args.label}: {args.model}, 2 processes (dp=2, DDP), median of {len(runs)} "
          f"(loads before each run: {'; '.join(r['load'] for r in runs)})")
    print(f"{'phase':<16}{'median s':>10}  " + "  ".join(f"run {i:<3}" for i in range(len(runs))))
    for p in PHASES:
        print(f"{p:<16}{med[p]:>10.2f}  " + "  ".join(f"{r['phases'][p]:>7.2f}" for r in runs))
    print(f"{'total':<16}{total:>10.2f}  " + "  ".join(f"{r['total']:>7.2f}" for r in runs))
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data[args.label] = {"model": args.model, "processes": 2, "runs": runs, "median": med, "median_total": total,
                        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                    "python": platform.python_version()},
                        "pythonpath": args.pythonpath, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
