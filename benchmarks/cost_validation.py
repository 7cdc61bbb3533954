"""Validate the cost models: measured step times on this machine, and published GPU-cluster runs.

Part 1 (``--part local``): a small MLP (``L`` linear layers of width ``W``, ReLU, cross-entropy,
plain SGD) trained by 1–4 real ``torch.distributed`` gloo processes in ten different ways —
data parallel, Megatron tensor parallel (column/row pairs with the f/g all-reduces), GPipe and
1F1B pipelines with point-to-point activations, and their combinations. Each configuration's
measured median step time is compared with ``estimate_step`` on ``local-cpu:<P>`` priced with
this machine's calibration (``polyparallel calibrate``; run here first if missing).
Reported: the error per configuration and the Spearman rank correlation (target >= 0.8).

Part 2 (``--part published``): published training throughputs of large models on GPU
clusters, re-priced with the same cost model on the matching cluster preset and parallel
configuration (target: within ±25% of the published per-GPU throughput). The FLOPs per
step are counted with the formula each source used, so the comparison is a comparison of
step times. Parameters a source does not state (micro-batch size, interleaving depth) are
marked as assumptions in the table.

    .venv/bin/python benchmarks/cost_validation.py              # both parts
    .venv/bin/python benchmarks/cost_validation.py --part published
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from polyparallel.cluster import Cluster, default_calibration_path
from polyparallel.cost_models import ParallelConfig, estimate_step
from polyparallel.cost_models.synthetic import gpt_graph, mlp_graph

OUT = Path(__file__).parent / "results" / "cost_validation.json"

# --------------------------------------------------------------------------------------------
# part 2: published runs
# --------------------------------------------------------------------------------------------


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True) -> float:
    """Narayanan et al. (2021), eq. in §5.1: FLOPs per iteration, with full recomputation (factor 4)."""
    passes = 4 if recompute else 3
    return passes * 24 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


BLOOM_CLUSTER = {
    "name": "jean-zay-a100",
    "description": "Jean Zay A100 partition as described for BLOOM: 8 x A100 80GB per node, 4 x 100 Gb/s Omni-Path",
    "centers": [{"name": "idris", "framework": "torch", "nodes": [{
        "name": "node", "count": 48, "device": "a100-80gb-sxm", "devices_per_node": 8,
        "intra": {"kind": "nvlink", "bandwidth": "300 GB/s", "latency": "3 us", "efficiency": 0.8,
                  "source": "A100 SXM4 NVLink 600 GB/s bidirectional"},
        "nic": {"kind": "omni-path", "bandwidth": "100 Gb/s", "ports": 4, "latency": "5 us", "efficiency": 0.9,
                "source": "BLOOM paper §3.4.1: 4 x 100 Gbps Omni-Path links per node"}}]}],
}

PUBLISHED: list[dict[str, Any]] = [
    {
        "name": "GPT 1T (Megatron-LM)",
        "citation": "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using "
                    "Megatron-LM, SC'21, Table 1 (1008B row): 3072 A100, t=8 p=64, batch 3072, 163 TFLOP/s/GPU",
        "cluster": "dgx-a100x384",
        "model": {"layers": 128, "hidden": 25600, "heads": 160, "seq": 2048, "vocab": 51200, "batch": 1,
                  "dropout": True},
        "config": {"dp": 6, "tp": 8, "pp": 64, "microbatches": 512, "schedule": "interleaved", "chunks": 2,
                   "dtype": "fp16", "recompute": "full", "partition": "layers"},
        "global_batch": 3072, "published_tflops": 163.0,
        "flops": "megatron",
        "assumptions": "micro-batch 1; interleaved with 2 chunks per stage; equal layers per stage",
    },
    {
        "name": "GPT 1.7B (Megatron-LM)",
        "citation": "Narayanan et al., SC'21, Table 1 (1.7B row): 32 A100, t=1 p=1 (d=32), batch 512, "
                    "137 TFLOP/s/GPU",
        "cluster": "dgx-a100x4",
        "model": {"layers": 24, "hidden": 2304, "heads": 24, "seq": 2048, "vocab": 51200, "batch": 4,
                  "dropout": True},
        "config": {"dp": 32, "tp": 1, "pp": 1, "microbatches": 4, "schedule": "1f1b", "dtype": "fp16",
                   "recompute": "full"},
        "global_batch": 512, "published_tflops": 137.0,
        "flops": "megatron", "assumptions": "micro-batch 4 (4 accumulation steps per DP rank)",
    },
    {
        "name": "BLOOM 176B",
        "citation": "BigScience, BLOOM (Le Scao et al., arXiv:2211.05100, §3.4) and its model card: 384 A100 80GB, "
                    "TP4 PP12 DP8, ZeRO-1, bf16, global batch 2048 x 2048 tokens, ~150 TFLOP/s/GPU",
        "cluster": BLOOM_CLUSTER,
        "model": {"layers": 70, "hidden": 14336, "heads": 112, "seq": 2048, "vocab": 250880, "batch": 2,
                  "positions": False},
        "config": {"dp": 8, "tp": 4, "pp": 12, "microbatches": 128, "schedule": "1f1b", "dtype": "bf16",
                   "recompute": "full", "zero_stage": 1, "partition": "layers"},
        "global_batch": 2048, "published_tflops": 150.0,
        "flops": "megatron",
        "assumptions": "micro-batch 2 (Megatron-DeepSpeed BLOOM config); full recompute; DeepSpeed uniform layer "
                       "partition (70 layers: 6 x 10 stages, 5 x 2)",
    },
    {
        "name": "Llama 3 405B",
        "citation": "Llama Team, The Llama 3 Herd of Models (arXiv:2407.21783), Table 4 row 1: 8192 H100, "
                    "TP8 CP1 PP16 DP64, seq 8192, 16M tokens/batch, 430 TFLOP/s/GPU (43% BF16 MFU)",
        "cluster": "dgx-h100x1024",
        "model": {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "ffn": 53248, "seq": 8192,
                  "vocab": 128256, "batch": 1, "norm": "rms", "mlp": "swiglu", "bias": False, "tied": False,
                  "positions": False, "causal": True},
        "config": {"dp": 64, "tp": 8, "pp": 16, "microbatches": 32, "schedule": "interleaved", "chunks": 2,
                   "dtype": "bf16", "recompute": "full", "zero_stage": 2, "sequence_parallel": True,
                   "fused_attention": True},
        "global_batch": 2048, "published_tflops": 430.0,
        "flops": "model", "assumptions": "micro-batch 1; interleaved with 2 chunks; full recompute (without it "
                                         "our memory model finds 117 GB of activations on stage 0); FLOP-balanced "
                                         "stages (the source moves layers off the end stages)",
    },
]


def run_published() -> list[dict[str, Any]]:
    rows = []
    for case in PUBLISHED:
        t0 = time.perf_counter()
        mk = dict(case["model"])
        g = gpt_graph(**mk)
        cl = case["cluster"]
        cluster = Cluster.from_dict(cl, source=cl["name"]) if isinstance(cl, dict) else Cluster.preset(cl)
        cfg = ParallelConfig(**case["config"])
        est = estimate_step(g, cluster, cfg)
        n = cfg.world
        if case["flops"] == "megatron":
            flops = megatron_flops(case["global_batch"], mk["seq"], mk["layers"], mk["hidden"], mk["vocab"],
                                   recompute=cfg.recompute == "full")
        else:
            flops = est.model_flops_per_step
        pred = flops / est.step_time / n / 1e12
        pub = case["published_tflops"]
        rows.append({
            "name": case["name"], "citation": case["citation"], "assumptions": case["assumptions"],
            "cluster": cluster.name, "gpus": n, "config": str(cfg), "params": g.param_count(),
            "published_tflops_per_gpu": pub, "predicted_tflops_per_gpu": round(pred, 1),
            "error": round(pred / pub - 1, 4), "within_25pct": abs(pred / pub - 1) <= 0.25,
            "predicted_step_s": round(est.step_time, 3), "published_step_s": round(flops / (pub * 1e12 * n), 3),
            "breakdown_s": {k: round(v, 4) for k, v in est.breakdown().items()},
            "fits": est.fits, "memory": [r.why() for r in est.memory[:1]] + est.why_not_fit()[:1],
            "price_s": round(time.perf_counter() - t0, 2),
        })
        r = rows[-1]
        print(f"  {r['name']:<24} {r['gpus']:>5} GPUs  {r['config']:<58} published {pub:6.1f}  predicted "
              f"{r['predicted_tflops_per_gpu']:6.1f} TFLOP/s/GPU  error {100 * r['error']:+6.1f}%", flush=True)
    return rows


# --------------------------------------------------------------------------------------------
# part 1: measured on this machine
# --------------------------------------------------------------------------------------------

WIDTH, LAYERS, BATCH = 512, 8, 64
LOCAL_CONFIGS = [
    {"dp": 1, "tp": 1, "pp": 1, "m": 1, "schedule": "1f1b"},
    {"dp": 2, "tp": 1, "pp": 1, "m": 1, "schedule": "1f1b"},
    {"dp": 4, "tp": 1, "pp": 1, "m": 1, "schedule": "1f1b"},
    {"dp": 1, "tp": 2, "pp": 1, "m": 1, "schedule": "1f1b"},
    {"dp": 1, "tp": 4, "pp": 1, "m": 1, "schedule": "1f1b"},
    {"dp": 1, "tp": 1, "pp": 2, "m": 4, "schedule": "gpipe"},
    {"dp": 1, "tp": 1, "pp": 2, "m": 4, "schedule": "1f1b"},
    {"dp": 1, "tp": 1, "pp": 4, "m": 4, "schedule": "1f1b"},
    {"dp": 2, "tp": 2, "pp": 1, "m": 1, "schedule": "1f1b"},
    {"dp": 2, "tp": 1, "pp": 2, "m": 2, "schedule": "1f1b"},
    {"dp": 1, "tp": 2, "pp": 2, "m": 4, "schedule": "1f1b"},
]


def _train(rank: int, world: int, spec: dict[str, Any]) -> list[float]:
    """One process of a DP x TP x PP MLP training run; returns its step times (seconds)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    dp, tp, pp, m = spec["dp"], spec["tp"], spec["pp"], spec["m"]
    w, layers, batch = spec["width"], spec["layers"], spec["batch"]
    tp_i, dp_i, pp_i = rank % tp, (rank // tp) % dp, rank // (tp * dp)

    def rank_of(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    tp_group = dp_group = None
    for p in range(pp):  # every rank creates every group, in the same order
        for d in range(dp):
            g = dist.new_group([rank_of(p, d, t) for t in range(tp)])
            if (p, d) == (pp_i, dp_i):
                tp_group = g
        for t in range(tp):
            g = dist.new_group([rank_of(p, d, t) for d in range(dp)])
            if (p, t) == (pp_i, tp_i):
                dp_group = g

    class Copy(torch.autograd.Function):  # Megatron f: identity forward, all-reduce backward
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            dist.all_reduce(g, group=tp_group)
            return g

    class Reduce(torch.autograd.Function):  # Megatron g: all-reduce forward, identity backward
        @staticmethod
        def forward(ctx, x):
            x = x.clone()
            dist.all_reduce(x, group=tp_group)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    torch.manual_seed(1234)
    full = [torch.randn(w, w) / math.sqrt(w) for _ in range(layers)]
    per = layers // pp
    mine = list(range(pp_i * per, (pp_i + 1) * per))
    params = []
    for li in mine:
        wt = full[li]
        if tp > 1:  # even layers column-parallel (split outputs), odd layers row-parallel (split inputs)
            k = w // tp
            wt = wt[tp_i * k:(tp_i + 1) * k, :] if li % 2 == 0 else wt[:, tp_i * k:(tp_i + 1) * k]
        params.append(wt.clone().requires_grad_(True))

    def stage(x):
        for j, li in enumerate(mine):
            if tp > 1 and li % 2 == 0:
                x = F.linear(Copy.apply(x), params[j])
            elif tp > 1:
                x = Reduce.apply(F.linear(x, params[j]))
            else:
                x = F.linear(x, params[j])
            if li < layers - 1:
                x = F.relu(x)
        return x

    gen = torch.Generator().manual_seed(dp_i)
    mb = batch // dp // m
    xs = [torch.randn(mb, w, generator=gen) for _ in range(m)]
    ys = [torch.randint(0, w, (mb,), generator=gen) for _ in range(m)]
    prev = rank_of(pp_i - 1, dp_i, tp_i) if pp_i > 0 else None
    nxt = rank_of(pp_i + 1, dp_i, tp_i) if pp_i < pp - 1 else None

    if spec["schedule"] == "gpipe":
        order = [("F", j) for j in range(m)] + [("B", j) for j in reversed(range(m))]
    else:
        warm = min(pp - pp_i - 1, m)
        order = [("F", j) for j in range(warm)]
        nf = warm
        for j in range(m):
            if nf < m:
                order.append(("F", nf))
                nf += 1
            order.append(("B", j))

    def step() -> None:
        saved: dict[int, tuple] = {}
        pending = []
        for kind, j in order:
            if kind == "F":
                if prev is None:
                    inp = xs[j]
                else:
                    inp = torch.empty(mb, w)
                    dist.recv(inp, src=prev)
                    inp.requires_grad_(True)
                out = stage(inp)
                if nxt is None:
                    out = F.cross_entropy(out, ys[j]) / m
                else:
                    pending.append(dist.isend(out.detach(), dst=nxt))
                saved[j] = (inp, out)
            else:
                inp, out = saved.pop(j)
                if nxt is None:
                    out.backward()
                else:
                    grad = torch.empty(mb, w)
                    dist.recv(grad, src=nxt)
                    out.backward(grad)
                if prev is not None:
                    pending.append(dist.isend(inp.grad, dst=prev))
        for h in pending:
            h.wait()
        if dp > 1:  # one bucket: all gradients in a single all-reduce, as DDP does for small models
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=dp_group)
            flat /= dp
            off = 0
            for p in params:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
        with torch.no_grad():
            for p in params:
                p -= 0.01 * p.grad
                p.grad = None

    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        t = time.perf_counter() - t0
        if i >= spec["warmup"]:
            times.append(t)
    return times


def run_local(steps: int, warmup: int, recalibrate: bool, repeats: int) -> dict[str, Any]:
    from scipy.stats import spearmanr

    from polyparallel.cost_models.calibrate import calibrate, run_gloo

    cal_path = default_calibration_path()
    if recalibrate or not cal_path.is_file():
        print(f"  calibrating this machine -> {cal_path}", flush=True)
        calibrate(cal_path, progress=lambda s: print("    " + s, flush=True))
    cal = json.loads(cal_path.read_text())
    rows = []
    times: dict[int, list[list[float]]] = {i: [] for i in range(len(LOCAL_CONFIGS))}
    failed: dict[int, str] = {}
    cores = cal["cores"]
    for rep in range(repeats):  # configurations interleaved, so slow phases of the machine hit all alike
        for i, c in enumerate(LOCAL_CONFIGS):
            if i in failed:
                continue
            world = c["dp"] * c["tp"] * c["pp"]
            spec = {**c, "width": WIDTH, "layers": LAYERS, "batch": BATCH, "steps": steps, "warmup": warmup}
            try:
                per_rank = run_gloo(_train, world, (spec,), timeout=300, threads=max(1, cores // world))
            except (TimeoutError, RuntimeError) as e:
                failed[i] = str(e).splitlines()[0]
                print(f"  {c}: FAILED {failed[i]}", flush=True)
                continue
            # a step ends when its slowest rank ends
            times[i].append([max(r[k] for r in per_rank) for k in range(steps)])
            print(f"  run {rep + 1}/{repeats} {c}: best step {1e3 * min(times[i][-1]):.1f} ms", flush=True)
    for i, c in enumerate(LOCAL_CONFIGS):
        world = c["dp"] * c["tp"] * c["pp"]
        if i in failed and not times[i]:
            rows.append({**c, "world": world, "error": failed[i]})
            continue
        allt = [t for run in times[i] for t in run]
        measured = min(allt)  # the least disturbed step, as for the calibration
        g = mlp_graph(batch=BATCH // c["dp"] // c["m"], widths=(WIDTH,) * LAYERS, classes=WIDTH, bias=False)
        cfg = ParallelConfig(dp=c["dp"], tp=c["tp"], pp=c["pp"], microbatches=c["m"], schedule=c["schedule"],
                             optimizer="sgd")
        est = estimate_step(g, Cluster.preset(f"local-cpu:{world}"), cfg)
        row = {**c, "world": world, "config": str(cfg), "measured_s": measured,
               "measured_median_s": statistics.median(allt), "predicted_s": est.step_time,
               "error": est.step_time / measured - 1,
               "predicted_breakdown_s": {k: v for k, v in est.breakdown().items() if v}}
        rows.append(row)
        print(f"  {row['config']:<34} P={world}  measured {1e3 * measured:8.1f} ms (median "
              f"{1e3 * row['measured_median_s']:.1f})  predicted {1e3 * est.step_time:8.1f} ms  error "
              f"{100 * row['error']:+6.1f}%", flush=True)
    ok = [r for r in rows if "measured_s" in r]
    multi = [r for r in ok if r["world"] >= 2]
    rho_all = spearmanr([r["measured_s"] for r in ok], [r["predicted_s"] for r in ok]).statistic if len(ok) > 2 \
        else float("nan")
    rho = spearmanr([r["measured_s"] for r in multi], [r["predicted_s"] for r in multi]).statistic \
        if len(multi) > 2 else float("nan")
    fit = cal.get("collectives", {}).get("fit", {})
    return {
        "model": f"MLP {LAYERS} x linear({WIDTH},{WIDTH}) + ReLU + cross-entropy, batch {BATCH}, SGD, fp32",
        "calibration": {"path": str(cal_path), "cores": cal["cores"], "date": cal.get("date"),
                        "gloo_alpha_s": fit.get("alpha"), "gloo_bandwidth_Bps": fit.get("bandwidth")},
        "steps": steps, "warmup": warmup, "repeats": repeats, "measured": "fastest step (max over ranks)",
        "rows": rows,
        "spearman_multi_process": rho, "spearman_all": rho_all,
        "median_abs_error": statistics.median(abs(r["error"]) for r in ok) if ok else None,
        "configs_with_2_to_4_processes": len(multi),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["local", "published", "both"], default="both")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="runs of every configuration (interleaved)")
    ap.add_argument("--recalibrate", action="store_true", help="measure this machine again first")
    args = ap.parse_args()
    result: dict[str, Any] = json.loads(OUT.read_text()) if OUT.is_file() else {}
    result["host"] = {"machine": platform.machine(), "cores": os.cpu_count(), "python": sys.version.split()[0]}
    if args.part in ("published", "both"):
        print("published large-model runs (per-GPU TFLOP/s, source's FLOP formula):")
        rows = run_published()
        result["published"] = {"rows": rows, "within_25pct": sum(r["within_25pct"] for r in rows),
                               "cases": len(rows),
                               "median_abs_error": statistics.median(abs(r["error"]) for r in rows)}
        print(f"  within ±25%: {result['published']['within_25pct']} of {len(rows)}")
    if args.part in ("local", "both"):
        print(f"this machine ({os.cpu_count()} cores), gloo processes, best of {args.repeats} x {args.steps} steps:")
        loc = run_local(args.steps, args.warmup, args.recalibrate, args.repeats)
        result["local"] = loc
        print(f"  Spearman rank correlation (2-4 processes, {loc['configs_with_2_to_4_processes']} configs): "
              f"{loc['spearman_multi_process']:.3f}; all configs: {loc['spearman_all']:.3f}; "
              f"median |error| {100 * (loc['median_abs_error'] or 0):.1f}%")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1, default=float))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
