"""Decisions, not prices: does the cost model order published recipes as they were measured?

A *comparison* is two or more recipes measured side by side on one model (the same source, the
same kind of cluster): ZeRO-3 against tensor + pipeline parallelism, full recomputation against
sequence parallelism + selective recomputation, one recipe at several scales. Each recipe is
priced the way a user prices it (``benchmarks/cost_validation.py``'s :func:`run_published`:
the model captured as a module, ``pp.evaluate`` with the published degrees and the source's
``execution`` options), and every pair of recipes of a comparison whose measured per-GPU
throughputs (tokens per second per GPU: recipes with and without recomputation count different
FLOPs, recipes at other sequence lengths different samples) differ by more than 3% counts as
ordered right when the predicted ones differ the same way. ``--search`` also runs ``pp.search`` on
the held-out comparison of recipe families (SC'21 Table 2) at its largest cluster and reports its
plan against the best published recipe: at least as fast as it, and not of a kind the comparison
measured slower.

Held out: the comparisons marked ``tuned: False`` were not used to set any figure of the cost
model: Narayanan et al. SC'21 Table 2 (added with this benchmark, priced once as is, then its
ZeRO-3 rows given DeepSpeed's 2021 gathers), and the sharded-data-parallel rows
``published_sharded.py`` holds out (MPT at other sequence lengths than 2048, torchtitan's A100
recipes). The others regroup rows the cost model's recent changes were checked against: the
published table (``cost_validation.py``), MPT at 2048 at several scales, torchtitan's H100 rows.

    .venv/bin/python benchmarks/recipe_comparisons.py            # orders only (~1 min)
    .venv/bin/python benchmarks/recipe_comparisons.py --search   # + the search on the held-out models (minutes)

Writes ``benchmarks/results/recipe_comparisons.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost_validation import PUBLISHED, _megatron_schedule, published_module, run_published
from published_sharded import sharded_rows

OUT = Path(__file__).parent / "results" / "recipe_comparisons.json"
MARGIN = 0.03  # pairs measured closer than this are not counted (run-to-run noise of the sources)

# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
# SC'21, Table 2 (§5.2, "Comparison to ZeRO-3"): GPT 174.6B (96 layers, hidden 12288, 96 heads,
# sequence 2048, vocabulary 51200) at global batch 1536 on Selene (DGX A100 80GB, 8 x HDR 200 Gb/s
# per node), fp16: ZeRO-3 (DeepSpeed, no model parallelism, micro-batch 4/2/1) and PTD-P (t=8, p=12,
# micro-batch 1), per-GPU TFLOP/s at 384, 768 and 1536 GPUs. ZeRO-3: (GPUs, micro-batch, TFLOP/s).
SC21_ZERO3 = ((384, 4, 144), (768, 2, 88), (1536, 1, 44))
SC21_PTDP = ((384, 153), (768, 149), (1536, 141))
GPT175 = {"layers": 96, "hidden": 12288, "heads": 96, "seq": 2048, "vocab": 51200, "dropout": True}


def _sc21_zero3(gpus: int, micro: int, tflops: float) -> dict[str, Any]:
    return {
        "name": f"GPT 175B ZeRO-3 ({gpus} GPUs)",
        "citation": f"Narayanan et al., SC'21, Table 2: ZeRO-3 without model parallelism, {gpus} A100, batch 1536, "
                    f"micro-batch {micro}, {tflops:g} TFLOP/s/GPU",
        "cluster": f"dgx-a100x{gpus // 8}",
        "model": {**GPT175, "batch": micro},
        # DeepSpeed ZeRO-3 on Megatron's GPT model: its fused kernels, the attention dropout on its own,
        # weights gathered tensor by tensor (zero3_gather), gradients reduce-scattered during the backward
        "config": {"dp": gpus, "tp": 1, "pp": 1, "microbatches": 1536 // (gpus * micro), "dtype": "fp16",
                   "recompute": "full", "zero_stage": 3, "fused_dropout": False, "zero3_gather": "parameter"},
        "global_batch": 1536, "published_tflops": float(tflops), "flops": "megatron",
        "assumptions": "activation checkpointing (175B cannot train without it at these micro-batches); "
                       "Megatron's dropouts; DeepSpeed's 2021 gathers (zero3_gather='parameter': one list "
                       "all_gather per parameter tensor after a device synchronize); its reduce-scatters as FSDP2's",
    }


def _sc21_ptdp(gpus: int, tflops: float) -> dict[str, Any]:
    d = gpus // 96
    sched = _megatron_schedule(96, 12)
    return {
        "name": f"GPT 175B PTD-P ({gpus} GPUs)",
        "citation": f"Narayanan et al., SC'21, Table 2: PTD-P t=8 p=12 (d={d}), {gpus} A100, batch 1536, "
                    f"micro-batch 1, {tflops:g} TFLOP/s/GPU",
        "cluster": f"dgx-a100x{gpus // 8}",
        "model": {**GPT175, "batch": 1},
        "config": {"dp": d, "tp": 8, "pp": 12, "microbatches": 1536 // d, **sched, "dtype": "fp16",
                   "recompute": "full", "grad_overlap": 0.0, "fused_dropout": False, "partition": "layers"},
        "global_batch": 1536, "published_tflops": float(tflops), "flops": "megatron",
        "assumptions": "as the Table 1 rows: interleaved with 2 chunks (96 layers over 12 stages), full "
                       "recomputation, gradients reduced after the last backward",
    }


def _rows(prefix: str) -> list[dict[str, Any]]:
    return [r for r in PUBLISHED if r["name"].startswith(prefix)]


def _sharded_comparisons() -> list[dict[str, Any]]:
    """The sharded rows of one source, table and model measured side by side (several scales, sequence
    lengths, recomputation or compilation), the rows looked at and the held-out ones apart."""
    groups: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for r in sharded_rows():
        # "MPT-13b s2048 (8 H100 80GB)" -> "MPT-13b on H100 80GB"; torchtitan rows by model and hardware
        head, where = r["name"].rsplit(" (", 1)
        model = head.split(" s")[0] if head.startswith("MPT") else head.split(" rc=")[0]
        key = f"{model} on {where[:-1].split(' ', 1)[1]}"
        groups.setdefault((key, r["held_out"]), []).append(r)
    return [{"name": f"{key}: sharded data parallelism, {len(rows)} recipes" + (" [held-out rows]" if held else ""),
             "tuned": not held, "recipes": rows} for (key, held), rows in sorted(groups.items()) if len(rows) > 1]


COMPARISONS: list[dict[str, Any]] = [
    {"name": "GPT 175B: ZeRO-3 vs PTD-P at 384/768/1536 A100 (SC'21 Table 2)", "tuned": False,
     "recipes": [*(_sc21_zero3(*r) for r in SC21_ZERO3), *(_sc21_ptdp(*r) for r in SC21_PTDP)]},
    *({"name": f"GPT {p}B: full recomputation vs sequence parallelism + selective (Korthikanti Table 5)",
       "tuned": True, "recipes": _rows(f"GPT {p}B ")} for p in (22, 175, 530, 1000)),
    {"name": "MT-NLG 530B on 280/350/420 nodes (Smith et al.)", "tuned": True, "recipes": _rows("MT-NLG")},
    {"name": "Llama 3 405B on 8K/16K H100 (Llama 3 Table 4)", "tuned": True, "recipes": _rows("Llama 3 405B")},
    *_sharded_comparisons(),
]


def ordered_pairs(pub: list[float], pred: list[float], margin: float = MARGIN) -> tuple[int, int, list[tuple]]:
    """``(right, counted, wrong pairs)`` over the pairs ``i < j`` whose published values differ by
    more than ``margin`` (relative to the smaller): right when the predictions differ the same way.

    >>> ordered_pairs([100, 150, 101], [1, 2, 3])
    (1, 2, [(1, 2)])
    """
    right, counted, wrong = 0, 0, []
    for i, j in itertools.combinations(range(len(pub)), 2):
        if abs(pub[i] - pub[j]) <= margin * min(pub[i], pub[j]):
            continue
        counted += 1
        if (pub[i] - pub[j]) * (pred[i] - pred[j]) > 0:
            right += 1
        else:
            wrong.append((i, j))
    return right, counted, wrong


def run_comparisons() -> list[dict[str, Any]]:
    out = []
    for comp in COMPARISONS:
        print(comp["name"] + (" [held out]" if not comp["tuned"] else ""), flush=True)
        rows = run_published(comp["recipes"])
        # tokens per second per GPU: recipes with and without recomputation count different FLOPs
        # (the sources' TFLOP/s are not comparable across them), the tokens are the same
        tokens = [c["global_batch"] * c["model"]["seq"] for c in comp["recipes"]]
        pub = [t / (r["published_step_s"] * r["gpus"]) for t, r in zip(tokens, rows)]
        pred = [t / (r["predicted_step_s"] * r["gpus"]) for t, r in zip(tokens, rows)]
        right, counted, wrong = ordered_pairs(pub, pred)
        print(f"  ordered as measured: {right} of {counted} pairs more than {MARGIN:.0%} apart", flush=True)
        for i, j in wrong:
            print(f"    wrong: {rows[i]['name']} ({pub[i]:.1f} tokens/s/GPU measured, {pred[i]:.1f} priced) vs "
                  f"{rows[j]['name']} ({pub[j]:.1f}, {pred[j]:.1f})")
        out.append({"name": comp["name"], "tuned": comp["tuned"], "pairs_right": right, "pairs_counted": counted,
                    "wrong": [[rows[i]["name"], rows[j]["name"]] for i, j in wrong],
                    "published_tokens_per_s_per_gpu": [round(x, 2) for x in pub],
                    "predicted_tokens_per_s_per_gpu": [round(x, 2) for x in pred],
                    "best_published": rows[max(range(len(rows)), key=pub.__getitem__)]["name"],
                    "best_priced": rows[max(range(len(rows)), key=pred.__getitem__)]["name"], "rows": rows})
    return out


def _family(zero_stage: int, tp: int, pp: int) -> str:
    """A recipe's kind as the comparisons name them: sharded data parallelism without model
    parallelism (SC'21's "ZeRO-3 without any model parallelism"), the same with tensor parallelism
    inside a node (torchtitan's FSDP + TP; no comparison measured it), or tensor + pipeline
    parallelism (with data parallelism over the rest)."""
    if zero_stage == 3 and pp == 1:
        return "ZeRO-3" if tp == 1 else f"ZeRO-3 + TP{tp}"
    return "PTD-P" if tp > 1 and pp > 1 else f"tp{tp} pp{pp}"


def run_search(comp: dict[str, Any], priced: dict[str, Any]) -> list[dict[str, Any]]:
    """``pp.search`` on the comparison's model at the largest cluster its recipes ran on, with the
    torch backend's defaults (what polyparallel would run), against the best published recipe there:
    its measured step and its price under the model (``priced``: the comparison's priced rows). Twice:
    the model as the recipes trained it, and the same model with torch's fused attention (SDPA), as a
    user of the torch backend writes it today."""
    import polyparallel as pp

    gpus = max(int(r["cluster"].removeprefix("dgx-a100x").removeprefix("dgx-h100x")) for r in comp["recipes"])
    there = [r for r in comp["recipes"] if r["cluster"].endswith(f"x{gpus}")]
    best = max(there, key=lambda r: r["published_tflops"])
    best_row = next(r for r in priced["rows"] if r["name"] == best["name"])
    slower = sorted({_family(r["config"].get("zero_stage", 0), r["config"]["tp"], r["config"]["pp"]) for r in there
                     if r["published_tflops"] < best["published_tflops"] * (1 - MARGIN)})
    out = []
    for variant, attention in (("as published", best["model"].get("attention", "explicit")), ("with SDPA", "sdpa")):
        model, args, kwargs = published_module({**best["model"], "attention": attention})
        t0 = time.perf_counter()
        s = pp.search(model, args, best["cluster"], example_kwargs=kwargs, batch_size=best["global_batch"])
        plan = f"dp{s.dp} tp{s.tp} pp{s.pp} m={s.microbatches} {s.schedule} zero{s.zero_stage} rc={s.recompute}"
        row = {"comparison": comp["name"], "model": variant, "cluster": best["cluster"], "search_plan": plan,
               "search_priced_step_s": round(s.estimate.step_time_s, 3),
               "best_published": best["name"], "best_published_step_s": best_row["published_step_s"],
               "best_published_priced_step_s": best_row["predicted_step_s"],
               "search_s": round(time.perf_counter() - t0, 1), "search_family": _family(s.zero_stage, s.tp, s.pp),
               "families_measured_slower": slower}
        row["at_least_as_fast_as_best_under_the_model"] = row["search_priced_step_s"] <= row[
            "best_published_priced_step_s"]
        row["search_writes_a_slower_family"] = row["search_family"] in slower
        print(f"  search on {best['cluster']} ({variant}): {plan}, priced {row['search_priced_step_s']} s per step; "
              f"best published {best['name']}: {row['best_published_step_s']} s measured, "
              f"{row['best_published_priced_step_s']} s priced; family {row['search_family']}"
              f"{' (measured slower)' if row['search_writes_a_slower_family'] else ''}", flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--search", action="store_true", help="also run the search on the held-out comparisons")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    comps = run_comparisons()
    summary: dict[str, Any] = {}
    for label, keep in (("held_out", False), ("tuned", True)):
        sel = [c for c in comps if c["tuned"] is keep]
        summary[label] = {"pairs_right": sum(c["pairs_right"] for c in sel),
                          "pairs_counted": sum(c["pairs_counted"] for c in sel), "comparisons": len(sel)}
        print(f"{label}: {summary[label]['pairs_right']} of {summary[label]['pairs_counted']} pairs ordered as "
              f"measured over {len(sel)} comparisons")
    result: dict[str, Any] = {"command": "python benchmarks/recipe_comparisons.py " + " ".join(sys.argv[1:]),
                              "margin": MARGIN, "summary": summary, "comparisons": comps,
                              "load_average_start": load0}
    if args.search:
        result["search"] = [row for c, got in zip(COMPARISONS, comps) if not c["tuned"] and "SC'21" in c["name"]
                            for row in run_search(c, got)]
    result["load_average_end"] = os.getloadavg()[0]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
