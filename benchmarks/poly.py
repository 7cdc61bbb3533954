"""Speed of the polyhedral model: legal placements and exact reshard prices of whole models.

For each model (captured on the meta device, canonicalised, elementwise chains fused)
and each mesh, with an empty cache:

1. every op: enumerate its legal placements and price each one's own collectives
   (``comm_of_op``: partial temporaries, partial outputs, gradient all-reduces);
2. every producer -> consumer edge: price every (producer placement, consumer
   placement) pair (``edge_costs``; placements that leave or need the same
   distribution share one exact reshard).

Reports the wall time, time per distinct op signature (target <= 50 ms), the cache hit
rate, the share of time inside isl, and the number of placements and pairs priced.
Target: GPT-3 175B on the 3-axis 1024-device mesh <= 5 s with the cache.

Run: ``.venv/bin/python benchmarks/poly.py [--models gpt2-small llama-8b gpt3-175b]
[--meshes dp=2,tp=4 ...] [--edge-budget SECONDS]``. Writes ``benchmarks/results/poly.json``;
with a budget, edge pricing stops after that many seconds and the row says how many
edges were priced (``complete: false``).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

import polyparallel as pp
from polyparallel import poly
from polyparallel.ir import Graph
from polyparallel.models import load_model
from polyparallel.transforms import canonicalize, fuse_elementwise

RESULTS = Path(__file__).parent / "results" / "poly.json"
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
    isl0 = poly.ISL_TIME["seconds"]
    t0 = time.perf_counter()
    placements = comm = 0
    for op in g.ops:
        legal = poly.legal_placements(g, op, mesh)
        placements += len(legal)
        for p in legal:
            poly.comm_of_op(g, op, p, mesh)
            comm += 1
    t_ops = time.perf_counter() - t0
    pairs = distinct = edges = 0
    todo = [(op, i, t) for op in g.ops for i, t in enumerate(op.inputs)
            if not g.tensors[t].is_param and not (g.producer(t) is None and op.nest is None)]
    t1 = time.perf_counter()
    for op, i, t in todo:
        if time.perf_counter() - t1 > edge_budget:
            break
        ec = poly.edge_costs(g, t, op, f"in{i}", mesh)
        edges += 1
        pairs += ec.pairs
        distinct += len(ec.reshards) * len(ec.reshards[0]) if ec.reshards else 0
    total = time.perf_counter() - t0
    sigs = len({g.signature(op) for op in g.ops})
    stats = poly.cache_stats()
    return {
        "model": name, "mesh": str(mesh), "devices": mesh.size, "ops": len(g.ops), "signatures": sigs,
        "placements": placements, "edges": edges, "edges_total": len(todo), "complete": edges == len(todo),
        "pairs": pairs, "reshards": distinct,
        "t_ops_s": t_ops, "t_edges_s": total - t_ops, "t_total_s": total,
        "ms_per_signature_ops": 1e3 * t_ops / sigs, "ms_per_signature": 1e3 * total / sigs,
        "hit_rate": stats["all"]["hit_rate"], "isl_share": (poly.ISL_TIME["seconds"] - isl0) / total,
        "cache": {k: v for k, v in stats.items() if k != "all"},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=MODELS)
    ap.add_argument("--meshes", nargs="*", default=MESHES)
    ap.add_argument("--edge-budget", type=float, default=float("inf"),
                    help="stop pricing edges after this many seconds per (model, mesh); reported as incomplete")
    a = ap.parse_args()
    rows = []
    for name in a.models:
        g, t_cap = build(name)
        print(f"{name}: {len(g.ops)} ops after canonicalise + fuse (capture {t_cap:.1f} s)", flush=True)
        for m in a.meshes:
            r = measure(g, name, poly.DeviceMesh.parse(m), a.edge_budget)
            rows.append(r)
            done = "" if r["complete"] else f" (stopped at {r['edges']}/{r['edges_total']} edges)"
            print(f"  {r['mesh']:>16} {r['devices']:>5} dev  sigs {r['signatures']:>3}  placements "
                  f"{r['placements']:>6}  ops {r['t_ops_s']:6.2f} s ({r['ms_per_signature_ops']:6.1f} ms/sig)  "
                  f"pairs {r['pairs']:>9}  edges {r['t_edges_s']:7.2f} s  total {r['t_total_s']:7.2f} s  "
                  f"hit {r['hit_rate']:.2f}  isl {100 * r['isl_share']:4.1f}%{done}", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
