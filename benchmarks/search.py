"""Search time and plan quality.

    .venv/bin/python benchmarks/search.py            # all parts (slow on 2 cores)
    .venv/bin/python benchmarks/search.py --part big|memory|quality|baselines|placements

Part ``big``: capture and search time and the plan found for the issue's cases (with the machine's
load average when each started: CPU time grows when the cores are shared).
Part ``memory``: the planning process's peak memory: the peak resident set (``VmHWM``, Linux's
``ru_maxrss`` of the process image) of a fresh Python process that imports polyparallel, builds the
model and searches (and the peak before the search, after the imports and after building the
model), for the cases of ``MEMORY``.
Part ``quality``: on small problems (<= 8 devices, <= 6 layers, mixed model kinds) the
planner's step time vs the exhaustive optimum (gap must be <= 1%).
Part ``baselines``: on the big cases, the planner vs pure data parallel, FSDP (ZeRO-3) and
Megatron's recipe (tensor parallel inside a node, pipeline across nodes, data parallel
over the rest), all priced by the same cost model.
Writes benchmarks/results/search.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from polyparallel.models import EXAMPLES, GPT, MLP, GPTConfig, Llama, LlamaConfig, ResNet, SmallCNN
from polyparallel.planning import DoesNotFit, evaluate, search
from polyparallel.planning.model_graphs import ModelGraphs
from polyparallel.planning.stage_solver import FORBIDDEN

OUT = Path(__file__).parent / "results" / "search.json"
BIG = [("gpt2-small", "dgx-a100x1", 64), ("llama-8b", "dgx-a100x8", 512), ("gpt3-175b", "dgx-a100x192", 1536),
       ("resnet50", "dgx-a100x4", 1024), ("gpt2-small", "aisynergy-5", 512)]
MEMORY = [("llama-8b", "dgx-a100x8", 512), ("gpt3-175b", "dgx-a100x192", 1536)]


def _row(name, cluster, B, s, wall):
    e = s.estimate
    return {"model": name, "cluster": cluster, "global_batch": B, "mode": s.mode, "dp": s.dp, "tp": s.tp,
            "pp": s.pp, "sp": s.sp, "microbatches": s.microbatches, "schedule": s.schedule, "zero": s.zero_stage,
            "recompute": s.recompute, "step_time_s": e.step_time_s, "samples_per_s": e.samples_per_s,
            "mfu_tflops_per_device": e.model_flops_per_s_per_device / 1e12, "memory_gb": e.memory_bytes_max / 1e9,
            "capture_s": s.search.capture_s, "search_s": s.search.search_s, "candidates": s.search.candidates,
            "wall_s": round(wall, 2), "solver": s.search.solver,
            "stages_placed_by": [st.placed_by for st in s.stages]}


def big() -> list[dict]:
    """The issue's cases, each searched in this process; CPU time split into capture and the rest
    (the search: enumeration, pricing, placing and checking the plan), both load-independent."""
    import polyparallel.planning.plan_search as ps

    made: list[ModelGraphs] = []

    class Recorded(ModelGraphs):  # the search's own ModelGraphs, kept to read its capture CPU time
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    rows = []
    ps.ModelGraphs = Recorded
    try:
        for name, cluster, B in BIG:
            m, a, k = EXAMPLES[name].build(1, None)
            made.clear()
            load = os.getloadavg()[0]
            t, c = time.perf_counter(), time.process_time()
            s = search(m, a, cluster, example_kwargs=k, batch_size=B)
            rows.append(_row(name, cluster, B, s, time.perf_counter() - t))
            r = rows[-1]
            r["cpu_s"] = round(time.process_time() - c, 2)  # capture + search, this process only
            r["capture_cpu_s"] = round(sum(x.capture_cpu_s for x in made), 2)
            r["search_cpu_s"] = round(r["cpu_s"] - r["capture_cpu_s"], 2)
            r["load_1min"] = round(load, 2)
            print(f"{name:11s} {cluster:13s} B={B:5d} {r['mode']:12s} dp={r['dp']} tp={r['tp']} pp={r['pp']} "
                  f"sp={r['sp']} m={r['microbatches']} {r['schedule']} z{r['zero']} {r['recompute']:9s} "
                  f"step {r['step_time_s']:.3f}s cpu {r['cpu_s']:.1f}s = capture {r['capture_cpu_s']:.1f}s + search "
                  f"{r['search_cpu_s']:.1f}s (wall: capture {r['capture_s']:.1f}s search {r['search_s']:.1f}s; "
                  f"{r['candidates']} plans; load {load:.2f})")
    finally:
        ps.ModelGraphs = ModelGraphs
    return rows


# run in a fresh interpreter: the peak is the whole planning process's. Its own image's peak (VmHWM):
# getrusage's ru_maxrss would carry over this benchmark's resident set, which the child had when it
# was forked, across the exec
_PEAK = r"""
import json, sys, warnings
warnings.simplefilter("ignore")

def peak():  # bytes
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

from polyparallel.models import EXAMPLES
from polyparallel.planning import search
imported = peak()
model, args, kwargs = EXAMPLES[sys.argv[1]].build(1, None)
built = peak()
s = search(model, args, sys.argv[2], example_kwargs=kwargs, batch_size=int(sys.argv[3]))
print(json.dumps({"imported_bytes": imported, "built_bytes": built, "peak_bytes": peak(),
                  "step_time_s": s.estimate.step_time_s}))
"""


def memory() -> list[dict]:
    """Peak resident memory of a planning process, one fresh process per case (Linux)."""
    rows = []
    for name, cluster, B in MEMORY:
        out = subprocess.run([sys.executable, "-c", _PEAK, name, cluster, str(B)], capture_output=True, text=True,
                             check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        gib = {k.replace("_bytes", "_gib"): round(v / 2**30, 3) for k, v in r.items() if k.endswith("_bytes")}
        rows.append({"model": name, "cluster": cluster, "global_batch": B, **gib, "step_time_s": r["step_time_s"],
                     "measured": "peak resident set (VmHWM) of a fresh process: imports, model build, search"})
        print(f"{name:11s} {cluster:13s} B={B:5d} peak {gib['peak_gib']:.3f} GiB (after imports "
              f"{gib['imported_gib']:.3f} GiB, after building the model {gib['built_gib']:.3f} GiB)")
    return rows


def _small_models():
    yield "mlp", MLP((64, 128, 128, 128, 10)), (torch.zeros(4, 64),), {}
    yield "cnn", SmallCNN(), (torch.zeros(4, 1, 28, 28),), {}
    for layers in (2, 4, 6):
        ids = torch.zeros(2, 32, dtype=torch.long)
        yield f"gpt-{layers}l", GPT(GPTConfig(vocab=256, seq=32, layers=layers, hidden=64, heads=4)), (ids,), \
            {"labels": ids}
    ids = torch.zeros(2, 32, dtype=torch.long)
    yield "llama-4l", Llama(LlamaConfig(vocab=256, seq=32, layers=4, hidden=64, heads=4, kv_heads=2, ffn=128)), \
        (ids,), {"labels": ids}
    yield "resnet-mini", ResNet((1, 1), classes=10), (torch.zeros(2, 3, 32, 32),), {}


def quality() -> list[dict]:
    rows = []
    clusters = [("local-cpu:2", 8), ("local-cpu:4", 16), ("dgx-a100x1", 64)]
    for name, m, a, k in _small_models():
        g = ModelGraphs(m, a, k).graph(a[0].shape[0])  # a fixed micro-batch: the two solvers see the same space
        for cl, B in clusters:
            try:
                fast = search(g, cluster=cl, batch_size=B)
                full = search(g, cluster=cl, batch_size=B, exhaustive=True)
            except DoesNotFit as e:
                print(f"{name} on {cl}: {e}")
                continue
            gap = fast.estimate.step_time_s / full.estimate.step_time_s - 1
            rows.append({"model": name, "cluster": cl, "global_batch": B, "planner_s": fast.estimate.step_time_s,
                         "exhaustive_s": full.estimate.step_time_s, "gap": gap,
                         "planner_candidates": fast.search.candidates,
                         "exhaustive_candidates": full.search.candidates})
            print(f"{name:12s} {cl:12s} planner {fast.estimate.step_time_s * 1e3:9.3f} ms "
                  f"({fast.search.candidates:4d} plans)  exhaustive {full.estimate.step_time_s * 1e3:9.3f} ms "
                  f"({full.search.candidates:4d} plans)  gap {100 * gap:+.2f}%")
    return rows


def baselines() -> list[dict]:
    import polyparallel.planning.plan_search as planner_mod

    rows = []
    for name, cluster, B in BIG[:3]:
        m, a, k = EXAMPLES[name].build(1, None)
        # one capture serves the planner and the recipes (prices only; timings are part big's)
        shared = ModelGraphs(m, a, k)
        planner_mod.ModelGraphs = lambda *_, **__: shared  # noqa: B023
        try:
            row = _baseline_row(name, cluster, B, m, a, k)
        finally:
            planner_mod.ModelGraphs = ModelGraphs
        rows.append(row)
        print(json.dumps(row))
    return rows


def _baseline_row(name, cluster, B, m, a, k) -> dict:
    planner = search(m, a, cluster, example_kwargs=k, batch_size=B)
    recipes = {"data parallel": {"tp": 1, "pp": 1, "zero_stage": 0}, "FSDP": {"tp": 1, "pp": 1, "zero_stage": 3},
               "Megatron tp8+pp+dp": {"tp": 8, "pp": max(1, planner.pp)}}
    if name == "gpt3-175b":  # Megatron-style: tensor parallel in the node, 16 stages, micro-batch 1
        recipes["Megatron tp8 pp16 dp12 m128"] = {"tp": 8, "pp": 16, "microbatches": 128}
    row = {"model": name, "cluster": cluster, "planner_s": planner.estimate.step_time_s,
           "planner": f"dp{planner.dp} tp{planner.tp} pp{planner.pp} sp{planner.sp} m{planner.microbatches} "
                      f"{planner.schedule} zero{planner.zero_stage} {planner.recompute}"}
    for rname, kw in recipes.items():
        try:
            s = evaluate(m, a, cluster, example_kwargs=k, batch_size=B, **kw)
            fits = not s.search.notes
            row[rname] = s.estimate.step_time_s if fits else None
        except ValueError as e:
            row[rname] = None
            print(f"{name} {rname}: {e}")
    return row


# (model, cluster, global batch, tp, dp): recipes with a tensor-parallel axis, placed three ways
PLACEMENT_CASES = [("gpt2-small", "dgx-a100x1", 64, 2, 4), ("gpt2-small", "dgx-a100x1", 64, 8, 1),
                   ("llama-8b", "dgx-a100x8", 512, 8, 8), ("gpt3-175b", "dgx-a100x192", 1536, 8, 192)]


def placements() -> list[dict]:
    """Per recipe: the stage objective (per micro-batch, placement cost) of Megatron's rule and of the
    solver (torch-expressible and unrestricted), the step time the strategy keeps, and the time the
    placing takes (evaluate's search time with the solver minus with the rule)."""
    rows = []
    for name, cluster, B, tp, dp in PLACEMENT_CASES:
        m, a, k = EXAMPLES[name].build(1, None)
        g = ModelGraphs(m, a, k).exact(1)  # one capture (micro-batch 1) priced three ways
        row = {"model": name, "cluster": cluster, "global_batch": B, "tp": tp, "dp": dp}
        for mode in ("rule", "torch", "any"):
            t, c = time.perf_counter(), time.process_time()
            s = evaluate(g, None, cluster, batch_size=B, tp=tp, dp=dp, sp=1, placements=mode)
            st = s.stages
            row[mode] = {"step_time_s": s.estimate.step_time_s, "placed_by": [x.placed_by for x in st],
                         "solver_objective_s": sum(x.objective_s for x in st),
                         "rule_objective_s": sum(x.rule_objective_s for x in st),
                         "notes": sorted({x.placement_note for x in st if x.placement_note}),
                         "wall_s": round(time.perf_counter() - t, 2), "cpu_s": round(time.process_time() - c, 2)}
        for mode in ("torch", "any"):
            r = row[mode]
            # the rule as written can break the torch target's edge rules (LLaMA: rotary ops written
            # replicated between column-parallel q/k and head-split attention): FORBIDDEN-priced
            rule_obj = "infeasible as written" if r["rule_objective_s"] >= FORBIDDEN else \
                f"{1e3 * r['rule_objective_s']:.3f} ms"
            print(f"{name:11s} {cluster:13s} tp={tp} dp={dp} {mode:5s}: objective rule "
                  f"{rule_obj} solver {1e3 * r['solver_objective_s']:.3f} ms; "
                  f"kept {','.join(r['placed_by'])}; step "
                  f"{row['rule']['step_time_s']:.4f} s (rule) -> {r['step_time_s']:.4f} s; cpu {r['cpu_s']:.1f} s "
                  f"(rule {row['rule']['cpu_s']:.1f} s) {'; '.join(r['notes'])[:120]}")
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["big", "memory", "quality", "baselines", "placements", "all"], default="all")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    res = json.loads(OUT.read_text()) if OUT.exists() else {}
    if args.part in ("quality", "all"):
        res["quality"] = quality()
    if args.part in ("big", "all"):
        res["big"] = big()
    if args.part in ("memory", "all"):
        res["memory"] = memory()
    if args.part in ("baselines", "all"):
        res["baselines"] = baselines()
    if args.part in ("placements", "all"):
        res["placements"] = placements()
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
