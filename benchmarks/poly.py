"""Speed of the polyhedral model: legal placements and exact reshard prices of whole models.

For each model (captured on the meta device, canonicalised, elementwise chains fused)
and each mesh, with an empty cache:

1. every op: enumerate its legal placements and price each one's own collectives
   (``comm_of_op``: partial temporaries, partial outputs, gradient all-reduces);
2. every producer -> consumer edge: price every (producer placement, consumer
   placement) pair (``edge_costs``; placements that leave or need the same
   distribution share one exact reshard).

Reports the wall and CPU time (CPU time is the honest number on a shared machine), time
per distinct op signature (target <= 50 ms), the time per layer once blocks repeat (ops of
the third and later instance of a repeated block: every price is then a cache lookup, so
the model's cost does not grow with its depth), the cache hit rate, the share of time
inside isl, and the number of placements and pairs priced.
Target: GPT-3 175B on the 3-axis 1024-device mesh <= 5 s with the cache.

``--solve K`` also runs :func:`polyparallel.planning.stage_solver.solve_stage` on each (model, mesh)
(the whole model as one stage, K candidates per op; cluster dgx-a100 with the mesh's
device count) and reports its time and the chosen solver.

Run: ``nice -n 10 .venv/bin/python benchmarks/poly.py [--models gpt2-small llama-8b gpt3-175b]
[--meshes dp=2,tp=4 ...] [--edge-budget SECONDS] [--solve K]`` (about a minute of CPU for the
default 3 models x 3 meshes; time it on a quiet machine: each row records the load average
before and after it, ``load``). Writes ``benchmarks/results/poly.json`` (and ``poly_solve.json``
with ``--solve``); with a budget, edge pricing stops after that many seconds and the row says
how many edges were priced (``complete: false``). Each row starts after ``gc.collect()``
(untimed), so its time does not depend on which rows ran before it. ``distinct_pairs`` counts the distinct
(have, need) pairs of the edges, every one priced exactly (``EdgeCosts.table``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import polyparallel as pp
from polyparallel import poly
from polyparallel.ir import Graph
from polyparallel.models import load_model
from polyparallel.transforms import canonicalize, find_repeated_blocks, fuse_elementwise

RESULTS = Path(__file__).parent / "results" / "poly.json"
SOLVE_RESULTS = Path(__file__).parent / "results" / "poly_solve.json"
MODELS = ["gpt2-small", "llama-8b", "gpt3-175b"]
MESHES = ["dp=2,tp=4", "dp=4,tp=4,sp=4", "dp=16,tp=8,sp=8"]


def build(name: str) -> tuple[Graph, float]:
    model, args, kwargs = load_model(name)
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = fuse_elementwise(canonicalize(pp.capture(model, args, kwargs)))
    return g, time.perf_counter() - t


def measure(g: Graph, name: str, mesh: poly.DeviceMesh, edge_budget: float = float("inf")) -> dict[str, Any]:
    poly.clear_cache()
    # every row starts from the same collector state, outside the timing: otherwise which row pays
    # a full collection of what earlier rows left (one pass over a process holding the captured
    # models is ~0.2 s) depends on the order of the rows
    gc.collect()
    load0 = os.getloadavg()[0]
    isl0 = poly.ISL_TIME["seconds"]
    blocks = find_repeated_blocks(g)
    # ops of the third and later instance of a block: by then every signature has been seen
    repeated = {i for b in blocks for inst in b.instances[2:] for i in inst}
    layers_repeated = sum(max(b.count - 2, 0) for b in blocks)
    t0, c0 = time.perf_counter(), time.process_time()
    placements = comm = 0
    pairs = distinct = edges = todo = 0
    t_ops = t_repeat = 0.0
    complete = True
    for k, op in enumerate(g.ops):
        ta = time.perf_counter()
        legal = poly.legal_placements(g, op, mesh)
        placements += len(legal)
        for p in legal:
            poly.comm_of_op(g, op, p, mesh)
            comm += 1
        tb = time.perf_counter()
        t_ops += tb - ta
        for i, t in enumerate(op.inputs):
            if g.tensors[t].is_param or (g.producer(t) is None and op.nest is None):
                continue
            todo += 1
            if time.perf_counter() - t0 > edge_budget:
                complete = False
                continue
            ec = poly.edge_costs(g, t, op, f"in{i}", mesh)
            edges += 1
            pairs += ec.pairs
            distinct += ec.table.elements.size  # distinct (have, need) pairs, each priced exactly
        if k in repeated:
            t_repeat += time.perf_counter() - ta
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    sigs = len({g.signature(op) for op in g.ops})
    stats = poly.cache_stats()
    return {
        "model": name, "mesh": str(mesh), "devices": mesh.size, "ops": len(g.ops), "signatures": sigs,
        "placements": placements, "edges": edges, "edges_total": todo, "complete": complete,
        "pairs": pairs, "distinct_pairs": distinct,
        "t_ops_s": t_ops, "t_edges_s": total - t_ops, "t_total_s": total, "cpu_total_s": cpu,
        "ms_per_signature_ops": 1e3 * t_ops / sigs, "ms_per_signature": 1e3 * total / sigs,
        "cpu_ms_per_signature": 1e3 * cpu / sigs,
        "layers_repeated": layers_repeated, "t_repeated_layers_s": t_repeat,
        "ms_per_repeated_layer": 1e3 * t_repeat / layers_repeated if layers_repeated else None,
        "hit_rate": stats["all"]["hit_rate"], "isl_share": (poly.ISL_TIME["seconds"] - isl0) / total,
        "cache": {k: v for k, v in stats.items() if k != "all"},
        "load": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }


CLUSTER_OF = {8: "dgx-a100x1", 64: "dgx-a100x8", 1024: "dgx-a100x128"}


def solve(g: Graph, name: str, mesh: poly.DeviceMesh, k: int) -> dict[str, Any]:
    """Per-op placements of the whole model as one stage (``placement.solve_stage``), empty caches."""
    from polyparallel.cluster import Cluster
    from polyparallel.planning.stage_solver import solve_stage

    poly.clear_cache()
    cluster = Cluster.preset(CLUSTER_OF.get(mesh.size, f"dgx-a100x{max(1, mesh.size // 8)}"))
    t0, c0 = time.perf_counter(), time.process_time()
    plan = solve_stage(g, mesh, cluster, k=k)
    preset = CLUSTER_OF.get(mesh.size, f"dgx-a100x{max(1, mesh.size // 8)}")
    return {"model": name, "mesh": str(mesh), "cluster": preset,
            "k": k, "solver": plan.solver, "status": plan.status, "t_s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - c0, "objective_s": plan.objective_s, **plan.breakdown()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=MODELS)
    ap.add_argument("--meshes", nargs="*", default=MESHES)
    ap.add_argument("--edge-budget", type=float, default=float("inf"),
                    help="stop pricing edges after this many seconds per (model, mesh); reported as incomplete")
    ap.add_argument("--solve", type=int, default=0, metavar="K",
                    help="also solve per-op placements (placement.solve_stage) with K candidates per op")
    a = ap.parse_args()
    rows = []
    solves = []
    for name in a.models:
        g, t_cap = build(name)
        print(f"{name}: {len(g.ops)} ops after canonicalise + fuse (capture {t_cap:.1f} s)", flush=True)
        for m in a.meshes:
            r = measure(g, name, poly.DeviceMesh.parse(m), a.edge_budget)
            rows.append(r)
            done = "" if r["complete"] else f" (stopped at {r['edges']}/{r['edges_total']} edges)"
            print(f"  {r['mesh']:>16} {r['devices']:>5} dev  sigs {r['signatures']:>3}  placements "
                  f"{r['placements']:>6}  ops {r['t_ops_s']:6.2f} s ({r['ms_per_signature_ops']:6.1f} ms/sig)  "
                  f"pairs {r['pairs']:>9} (distinct {r['distinct_pairs']:>8})  edges {r['t_edges_s']:7.2f} s  "
                  f"total {r['t_total_s']:7.2f} s "
                  f"(cpu {r['cpu_total_s']:6.2f} s, {r['cpu_ms_per_signature']:6.1f} ms/sig)  "
                  f"layer>2 {r['ms_per_repeated_layer'] or 0:6.2f} ms  "
                  f"hit {r['hit_rate']:.2f}  isl {100 * r['isl_share']:4.1f}%  load {r['load'][0]:.1f}{done}",
                  flush=True)
            if a.solve:
                s_ = solve(g, name, poly.DeviceMesh.parse(m), a.solve)
                solves.append(s_)
                print(f"  {'':>16} solve_stage k={a.solve}: {s_['solver']} {s_['t_s']:.2f} s "
                      f"(cpu {s_['cpu_s']:.2f} s), objective {s_['objective_s'] * 1e3:.1f} ms", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))
    print(f"wrote {RESULTS}")
    if solves:
        SOLVE_RESULTS.write_text(json.dumps(solves, indent=1))
        print(f"wrote {SOLVE_RESULTS}")


if __name__ == "__main__":
    main()
