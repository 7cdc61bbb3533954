"""Every collaborative plan the search writes runs: the per-center plans of both zoos' models.

    .venv/bin/python benchmarks/collab_plan_zoo.py [--models a,b] [--pins searched,tp2] [--out FILE [--update]]

For each model of ``tests/zoo.py`` and ``tests/zoo_recipes.py`` (as a user brings it:
``forward(inputs, labels) -> loss``), the search plans a collaborative job on two centers of 2 CPU
processes each, linked by a WAN (``CLUSTER``): as it chooses, and with every center pinned to tensor
parallelism (``tp=2``) and to FSDP2 (``dp=2, zero_stage=3``), as a user pins them (``PINS``). Each
center's plan (its ``local_strategy``: data, tensor parallelism, ZeRO over its devices, or one of
them) is then run for one round of local steps by the center's trainer (``PlannedTrainer``: the plan
over 2 gloo processes) and compared with the single-process trainer of the same round
(``TorchTrainer``): the updated parameters must be equal (within 1e-5 of the largest change the round
makes to a parameter). A cell is ``exact``, ``inexact``, ``one device`` (the planner gave
the center one process: its trainer is the single-process one), ``refused`` (with the reason, by the
search when no plan a center runs fits the pins, or by the center before any worker starts) or a crash.
Writes benchmarks/results/collab_plan_zoo.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the zoos are importable as tests.zoo
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import polyparallel as pp  # noqa: E402
from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, TorchTrainer, initial_params  # noqa: E402
from polyparallel.backends.collab._center_plan import plan_from_local_strategy  # noqa: E402
from polyparallel.backends.collab._dp_center import PlannedTrainer  # noqa: E402
from polyparallel.plan import Plan  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "collab_plan_zoo.json"
CLUSTER = """
name: two-cpu-centers
device_types:
  cpu-proc: {peak: {fp32: 40 GFLOP/s, bf16: 40 GFLOP/s}, memory: 4 GB, memory_bandwidth: 10 GB/s}
centers:
  - name: a
    nodes: [{device: cpu-proc, devices_per_node: 2, intra: {kind: shm, bandwidth: 5 GB/s, latency: 20 us}}]
    wan: {up: 1 Gb/s, down: 1 Gb/s, latency: 10 ms}
  - name: b
    nodes: [{device: cpu-proc, devices_per_node: 2, intra: {kind: shm, bandwidth: 5 GB/s, latency: 20 us}}]
    wan: {up: 1 Gb/s, down: 1 Gb/s, latency: 10 ms}
"""
# one local step: the first update, before a chaotic model (BatchNorm over 4 rows) amplifies rounding
STEPS, LR, EXACT = 1, 0.05, 1e-5
# the searched plans, and the plans written when every center is pinned to one parallelism
PINS: dict[str, dict[str, Any]] = {"searched": {}, "tp2": {"tp": 2}, "fsdp2": {"dp": 2, "zero_stage": 3}}


def _zoo() -> dict[str, tuple[str, Any, Any]]:
    from tests.zoo import ZOO
    from tests.zoo_recipes import ZOO as ZOO2
    return {**{n: ("tests.zoo", m, d) for n, (m, d) in ZOO.items()},
            **{n: ("tests.zoo_recipes", m, d) for n, (m, d) in ZOO2.items()}}


def _gap(got: dict, ref: dict, start: dict) -> float:
    """The largest difference between the two rounds' parameters over the largest change the round
    made to any parameter (a tensor the round barely moves, an attention key bias whose gradient is
    zero up to rounding, is not measured against its own size)."""
    moved = max(float(np.abs(ref[k] - start[k]).max()) for k in ref)
    return max(float(np.abs(got[k] - ref[k]).max()) for k in ref) / max(moved, 1e-12)


def cell(name: str, module: str, model_fn: Any, data_fn: Any, cluster: Path, pins: dict[str, Any]) -> dict[str, Any]:
    rec: dict[str, Any] = {"model": name, "pinned": pins}
    x, y = data_fn(0)
    torch.manual_seed(0)
    try:
        s = pp.search(model_fn(), (x, y), str(cluster), batch_size=len(x),
                      constraints={"mode": "collaborative", **pins})
    except pp.DoesNotFit as e:  # no plan a center runs: refused by the search, with the reason
        return {**rec, "status": "refused", "by": "search", "reason": str(e).splitlines()[0][:300]}
    except Exception as e:
        return {**rec, "status": "crash", "by": "search", "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    assert s.collaborative is not None
    spec = ModelSpec(f"{module}:{model_fn.__name__}")
    X = np.concatenate([data_fn(i)[0].numpy() for i in range(2)])
    Y = np.concatenate([data_fn(i)[1].numpy() for i in range(2)])
    p0 = initial_params(CollabConfig(centers=(CenterSpec("a"),), model=spec))
    kw = dict(batch_size=len(x), lr=LR, seed=0, center_index=1)
    centers = []
    for c in s.collaborative.centers:
        plan = plan_from_local_strategy(c.local_strategy)
        # the table shows the plan's degrees; the per-op placements it runs are in the strategy
        row: dict[str, Any] = {"center": c.name, "plan": {k: v for k, v in plan.items() if k != "op_placements"}}
        devices = Plan.from_record(plan).world
        if devices < 2:
            centers.append({**row, "status": "one device"})
            continue
        t0 = time.perf_counter()
        try:
            ref, _ = TorchTrainer(spec, X, Y, **kw).train(p0, steps=STEPS, round_idx=1)
            with PlannedTrainer(spec, X, Y, devices=devices, plan=plan, **kw) as center:
                got, _ = center.train(p0, steps=STEPS, round_idx=1)
        except ValueError as e:
            centers.append({**row, "status": "refused", "reason": str(e).splitlines()[0][:300]})
            continue
        except Exception as e:
            centers.append({**row, "status": "crash", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
            continue
        err = _gap(got, ref, p0)
        centers.append({**row, "status": "exact" if err <= EXACT else "inexact", "max_rel": err,
                        "train_s": round(time.perf_counter() - t0, 1)})
    return {**rec, "H": s.collaborative.local_steps, "centers": centers}


def _write(out: Path, rows: list[dict[str, Any]]) -> dict[str, int]:
    """The table with its counts of center plans by status (rewritten after every cell)."""
    counts: dict[str, int] = {}
    for r in rows:
        for c in r.get("centers", [r]):
            counts[c["status"]] = counts.get(c["status"], 0) + 1
    out.write_text(json.dumps({"steps": STEPS, "lr": LR, "rows": rows, "counts": counts}, indent=1) + "\n")
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    zoo = _zoo()
    ap.add_argument("--models", default=",".join(zoo))
    ap.add_argument("--pins", default=",".join(PINS), help="which of " + ", ".join(PINS))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--update", action="store_true",
                    help="replace only the cells run in --out's table, keep its others (each row says its commit)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    out = Path(args.out)
    rows = json.loads(out.read_text())["rows"] if args.update and out.exists() else []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Path(tmp) / "two-cpu-centers.yaml"
        cluster.write_text(CLUSTER)
        for name, label in itertools.product(args.models.split(","), args.pins.split(",")):
            rec = {**cell(name, *zoo[name], cluster, PINS[label]), "commit": commit}
            rows = [r for r in rows if (r["model"], r["pinned"]) != (name, PINS[label])] + [rec]
            _write(out, rows)
            cells = rec.get("centers", [rec])
            print(f"{name:20s} {label:9s} " + "  ".join(f"{c.get('center', '-')}: {c.get('plan', '')} {c['status']}"
                                             + (f" {c['max_rel']:.1e}" if "max_rel" in c else "")
                                             + (f" ({(c.get('reason') or c.get('error'))[:90]})"
                                                if c.get("reason") or c.get("error") else "") for c in cells),
                  flush=True)
    counts = _write(out, rows)
    print(", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f" of {sum(counts.values())} center plans")


if __name__ == "__main__":
    main()
