"""Validate the cost models: measured step times on this machine, and published GPU-cluster runs.

Part 1 (``--part local``): a small MLP (six ``Linear(1024, 1024)`` + ReLU, cross-entropy, Adam,
global batch 8) trained by the torch backend (``pp.train``: 1–4 ``torch.distributed`` gloo
processes, one thread each) in twelve ways — one process, DDP, FSDP2, Megatron tensor parallel
(column/row pairs), GPipe and 1F1B pipelines, and their combinations. Each recipe's measured
median step time is compared with ``pp.evaluate`` on ``local-cpu:<P>`` priced with this
machine's calibration (``polyparallel calibrate``; run first with ``--recalibrate`` or when
missing). The measuring and pricing code is ``benchmarks/executor.py``'s (the torch backend's
GPT benchmark), so both benchmarks read a run the same way; a recipe the backend refuses is
listed with the reason. Reported: the error per recipe and the Spearman rank correlation
(target >= 0.8).

Part 2 (``--part published``): published training throughputs of large models on GPU
clusters, priced the way a user prices a recipe: the row's model built as a module
(``polyparallel.models``' GPT or Llama on the meta device), captured by ``pp.evaluate`` with the
published degrees on the matching cluster preset (target: within ±25% of the published per-GPU
throughput, 80% of the rows within ±15%). There is no synthetic side path: what the source's
framework did differently is passed as ``evaluate(..., execution=...)``, the options a user has too
(``polyparallel evaluate -x KEY=VALUE``). The FLOPs per step are counted with the formula each
source used, so the comparison is a comparison of step times. Parameters a source does not state
(micro-batch size, interleaving depth) are marked as assumptions in the table. What the training
framework of the source did is part of the recipe: Megatron-LM of 2021-2022 computed attention as separate kernels
(``GPTConfig(attention="explicit")``) with dropouts of 0.1 and ran the attention dropout as its
own kernel after its fused scale-mask-softmax (``fused_dropout`` False), its other elementwise ops
hand-fused (``fused_elementwise``); Megatron-LM (2021) and DeepSpeed's pipeline engine reduced the gradients
after the last backward (``grad_overlap`` 0), torch DDP overlaps them bucket by bucket (the
default on accelerators); Megatron-LM scatters a boundary activation over the tensor-parallel
ranks and sends it asynchronously, DeepSpeed's engine sends the same slices with a synchronous
send/recv and all-gathers them on the receiver (``pipeline_p2p="deepspeed"``, the MT-NLG and
BLOOM rows), and its bf16 ZeRO-1 all-reduces the fp32 gradients where FSDP2 and Megatron
reduce-scatter them (``grad_reduce="all_reduce"``). The rows: Megatron-LM SC'21 Table 1 (10),
MT-NLG 530B (3), BLOOM 176B, Llama 3 405B (2), and Korthikanti et al. 2022's four models with full
recomputation and with sequence parallelism + selective recomputation (8). No figure of the cost
model is fitted to these rows: the GEMM and attention efficiencies of the H100 and the host costs
come from the H200 measurement (``polyparallel/cluster/devices.py`` says where each comes from).

    .venv/bin/python benchmarks/cost_validation.py              # both parts
    .venv/bin/python benchmarks/cost_validation.py --part published
    # measure this machine into FILE, then run and price every recipe with it (about 7 min on 2 idle cores)
    .venv/bin/python benchmarks/cost_validation.py --part local --recalibrate --calibration /tmp/cal.json

Without ``--calibration`` the file is ``$POLYPARALLEL_CALIBRATION``, else
``~/.cache/polyparallel/calibration.json``; the result records which file priced it. The
calibration and the runs should see the same machine: on a machine shared with other work,
recalibrate right before (``--recalibrate``) and read the load averages recorded in the result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from polyparallel.cluster import Cluster, default_calibration_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from executor import MLP, Recipe, calibrate_now, print_table, run_recipes, spearman
from published_sharded import sharded_rows

OUT = Path(__file__).parent / "results" / "cost_validation.json"

# --------------------------------------------------------------------------------------------
# part 2: published runs
# --------------------------------------------------------------------------------------------


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True) -> float:
    """Narayanan et al. (2021), eq. in §5.1: FLOPs per iteration, with full recomputation (factor 4)."""
    passes = 4 if recompute else 3
    return passes * 24 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def palm_flops(batch: int, seq: int, params: int, layers: int, hidden: int) -> float:
    """Chowdhery et al. (PaLM, 2022), Appendix B, the model FLOPs of MFU: ``6N + 12·L·H·Q·T`` per token
    (``H·Q`` = the hidden size; attention counted over the whole sequence, causal or not)."""
    return batch * seq * (6 * params + 12 * layers * hidden * seq)


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

# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
# SC'21, Table 1 (weak scaling, GPT, vocabulary 51200, sequence 2048, mixed precision, Selene DGX A100
# 80GB nodes): params (B), heads, hidden, layers, t, p, GPUs, global batch, TFLOP/s per GPU. Every row
# is priced, whatever the result. Not in the table, so assumed the same way for every row: micro-batch
# 4 when p = 1 (gradient accumulation) and 1 when p > 1; the interleaved schedule with 2 chunks where
# the layers divide into 2p chunks, else 1F1B; full activation recomputation; equal layers per stage.
MEGATRON_TABLE1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def _megatron_schedule(layers: int, p: int) -> dict[str, Any]:
    """The schedule assumed for Megatron-LM's own runs, whose tables do not give it: the interleaved
    schedule with 2 chunks per stage where the layers divide into ``2p`` equal chunks, else 1F1B."""
    if p > 1 and layers % (2 * p) == 0:
        return {"schedule": "interleaved", "chunks": 2}
    return {"schedule": "1f1b"}


def _megatron_row(params: float, heads: int, hidden: int, layers: int, t: int, p: int, gpus: int, batch: int,
                  tflops: float) -> dict[str, Any]:
    d = gpus // (t * p)
    micro = 4 if p == 1 else 1
    sched = _megatron_schedule(layers, p)
    interleaved = sched["schedule"] == "interleaved"
    return {
        "name": f"GPT {params:g}B (Megatron-LM)",
        "citation": f"Narayanan et al., SC'21, Table 1 ({params:g}B row): {gpus} A100, t={t} p={p} (d={d}), "
                    f"batch {batch}, {tflops:g} TFLOP/s/GPU",
        "cluster": f"dgx-a100x{gpus // 8}",
        "model": {"layers": layers, "hidden": hidden, "heads": heads, "seq": 2048, "vocab": 51200, "batch": micro,
                  "dropout": True},
        # grad_overlap 0: Megatron-LM's local DDP of the time all-reduced the gradients after the last
        # micro-batch's backward (megatron/training.py train_step: forward_backward_func, then
        # allreduce_gradients); overlapping them came later (--overlap-grad-reduce, 2023)
        "config": {"dp": d, "tp": t, "pp": p, "microbatches": batch // (d * micro), **sched, "dtype": "fp16",
                   "recompute": "full", "grad_overlap": 0.0, "fused_dropout": False,
                   **({"partition": "layers"} if p > 1 else {})},
        "global_batch": batch, "published_tflops": float(tflops), "flops": "megatron",
        "assumptions": f"micro-batch {micro}; {'interleaved, 2 chunks per stage' if interleaved else '1F1B'}; "
                       "full recompute; equal layers per stage; Megatron's default dropouts (0.1, on the hidden "
                       "states and the attention probabilities)",
    }


# Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198,
# MLSys 2023), Table 3 (GPT configurations: heads, hidden, layers, t, p, GPUs, global batch; sequence 2048,
# vocabulary 51200, Selene DGX A100 80GB, mixed precision, data parallelism 1) and Table 5 (end-to-end
# iteration seconds with full recomputation, and with sequence parallelism + selective recomputation,
# "present work"; its MFU column, 41.5 / 51.4 / 56.0 / 56.3 %, equals the model FLOPs of the Megatron
# formula over these seconds at 312 TFLOP/s, so the rows are read as the paper meant them).
KORTHIKANTI_TABLE = (
    (22, 64, 6144, 48, 8, 1, 8, 4, 1.42, 1.10), (175, 96, 12288, 96, 8, 8, 64, 64, 18.13, 13.75),
    (530, 128, 20480, 105, 8, 35, 280, 280, 49.05, 37.83), (1000, 160, 25600, 128, 8, 64, 512, 512, 94.42, 71.49),
)


def _korthikanti_rows(params: int, heads: int, hidden: int, layers: int, t: int, p: int, gpus: int, batch: int,
                      full_s: float, selective_s: float) -> list[dict[str, Any]]:
    sched = _megatron_schedule(layers, p)
    out = []
    for recompute, seconds in (("full", full_s), ("selective", selective_s)):
        what = "full recomputation" if recompute == "full" else "sequence parallelism + selective recomputation"
        out.append({
            "name": f"GPT {params}B {'full rc' if recompute == 'full' else 'SP+sel rc'} (Korthikanti)",
            "citation": f"Korthikanti et al., arXiv:2205.05198, Tables 3 and 5 ({params}B): {gpus} A100, t={t} p={p} "
                        f"(d=1), batch {batch}, {what}: {seconds:g} s/iteration",
            "cluster": f"dgx-a100x{gpus // 8}",
            "model": {"layers": layers, "hidden": hidden, "heads": heads, "seq": 2048, "vocab": 51200, "batch": 1,
                      "dropout": True},
            # Megatron-LM of 2022: gradients reduced after the last backward (there is no data
            # parallelism here anyway); the selective rows keep the attention's score-side activations
            # out of the checkpoint and recompute them (the paper's §4.2)
            "config": {"dp": 1, "tp": t, "pp": p, "microbatches": batch, **sched, "dtype": "fp16",
                       "recompute": recompute, "sequence_parallel": recompute == "selective", "grad_overlap": 0.0,
                       "fused_dropout": False,
                       **({"partition": "layers"} if p > 1 else {})},
            "global_batch": batch, "published_step_s": seconds, "flops": "megatron",
            "assumptions": f"micro-batch 1; {'interleaved, 2 chunks per stage' if 'chunks' in sched else '1F1B'} "
                           "(the rule of the SC'21 rows: the paper does not give the schedule); Megatron's default "
                           "dropouts; 16-bit mixed precision; equal layers per stage; TFLOP/s from the published "
                           "seconds by the Megatron formula as the SC'21 rows (4 passes with full recomputation, 3 "
                           "with selective), so the error is that of the step time",
        })
    return out


# Smith et al., "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B" (arXiv:2201.11990),
# §3 and its throughput table: 105 layers, hidden 20480, 128 heads, sequence 2048, global batch 1920,
# tensor 8 x pipeline 35 on DGX A100 80GB nodes (Selene), per-GPU TFLOP/s by the Megatron formula:
# (nodes, seconds per iteration, TFLOP/s per GPU).
MTNLG_TABLE = ((280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113))


def _mtnlg_row(nodes: int, seconds: float, tflops: float) -> dict[str, Any]:
    d = nodes * 8 // (8 * 35)
    return {
        "name": f"MT-NLG 530B ({nodes} nodes)",
        "citation": f"Smith et al., arXiv:2201.11990, system throughput table: {nodes * 8} A100, t=8 p=35 (d={d}), "
                    f"batch 1920, {seconds:g} s/iteration, {tflops:g} TFLOP/s/GPU",
        "cluster": f"dgx-a100x{nodes}",
        "model": {"layers": 105, "hidden": 20480, "heads": 128, "seq": 2048, "vocab": 51200, "batch": 1,
                  "dropout": True},
        # DeepSpeed's pipeline engine: 1F1B, gradients reduced after the last backward (grad_overlap 0)
        "config": {"dp": d, "tp": 8, "pp": 35, "microbatches": 1920 // d, "schedule": "1f1b", "dtype": "bf16",
                   "recompute": "full", "zero_stage": 1, "partition": "layers", "grad_overlap": 0.0,
                   "pipeline_p2p": "deepspeed", "grad_reduce": "all_reduce",
                   "grad_accumulation": "cast_add", "fused_dropout": False},
        "global_batch": 1920, "published_tflops": float(tflops), "flops": "megatron",
        "assumptions": "micro-batch 1; ZeRO-1 (Megatron-DeepSpeed's usual data-parallel optimizer); Megatron's "
                       "default dropouts (0.1, attention included); vocabulary 51200 (GPT-2 BPE, padded); "
                       "3 layers per stage; DeepSpeed's pipeline engine p2p (1/tp slices by synchronous send/recv, "
                       "all-gathered by the receiver: deepspeed/runtime/pipe/p2p.py, engine.py, schedule.py); "
                       "its bf16 gradients reduced as fp32 by an all-reduce (pipe/engine.py _bf16_reduce_grads: "
                       "BF16_Optimizer's ZeRO-1, and ZeRO-0 in the 2021 engine, which refused bf16 with ZeRO-1)",
    }


# Llama Team, "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 4, the two 8K-sequence rows of the
# 405B pre-training: (GPUs, DP, sequences per DP group, TFLOP/s per GPU). §3.3.2 gives the recipe:
# interleaved schedule with V stages per pipeline rank, "we reduce one Transformer layer each from the
# first and the last stages ... the first model chunk on the first stage has only the embedding, and the
# last model chunk on the last stage has only output projection and loss calculation" (so a chunk holds
# one layer: 126 layers + 2 = 128 chunks = 16 ranks x V = 8), "we could pre-train Llama 3 on sequences of
# 8K tokens without activation checkpointing", FSDP sharding optimizer states and gradients, FP32
# gradient accumulation over the micro-batches and FP32 reduce-scatter; MFU as Chowdhery et al. (PaLM).
LLAMA3_TABLE4 = ((8192, 64, 32, 430), (16384, 128, 16, 400))


def _llama3_row(gpus: int, dp: int, per_dp: int, tflops: float) -> dict[str, Any]:
    return {
        "name": f"Llama 3 405B ({gpus // 1024}K GPUs)",
        "citation": f"Llama Team, The Llama 3 Herd of Models (arXiv:2407.21783), Table 4: {gpus} H100, TP8 CP1 "
                    f"PP16 DP{dp}, seq 8192, batch {per_dp} per DP group (16M tokens), {tflops:g} TFLOP/s/GPU; "
                    "recipe from §3.3.2",
        "cluster": f"dgx-h100x{gpus // 8}",
        "model": {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "ffn": 53248, "seq": 8192,
                  "vocab": 128256, "batch": 1, "norm": "rms", "mlp": "swiglu", "bias": False, "tied": False,
                  "positions": False, "causal": True},
        # zero_stage 1: the gradients are accumulated in fp32 over the micro-batches and reduce-scattered
        # once per step (a reduce-scatter of the stage's 12.7 GB of fp32 gradients in every micro-batch
        # would take longer than the micro-batch's compute); the weights stay gathered (not resharded)
        "config": {"dp": dp, "tp": 8, "pp": 16, "microbatches": per_dp, "schedule": "interleaved", "chunks": 8,
                   "dtype": "bf16", "recompute": "none", "zero_stage": 1, "sequence_parallel": True,
                   "fused_attention": True, "partition": "flops"},
        "global_batch": dp * per_dp, "published_tflops": float(tflops), "flops": "palm",
        "assumptions": "micro-batch 1 (M = batch per DP group); V = 8 chunks of one layer each, the embedding "
                       "and the output layer as chunks of their own (the FLOP-balanced cut gives exactly that); "
                       "no recomputation (the source's; our memory model finds it over 80 GB, the source's "
                       "tensor deallocation is not modelled); gradients reduce-scattered once per step; "
                       "FLOPs per token 6N + 12·L·H·Q·T (PaLM's MFU formula, attention counted in full)",
    }


PUBLISHED: list[dict[str, Any]] = [
    *(_megatron_row(*r) for r in MEGATRON_TABLE1),
    *(_mtnlg_row(*r) for r in MTNLG_TABLE),
    {
        "name": "BLOOM 176B",
        "citation": "BigScience, BLOOM (Le Scao et al., arXiv:2211.05100, §3.4) and its model card: 384 A100 80GB, "
                    "TP4 PP12 DP8, ZeRO-1, bf16, global batch 2048 x 2048 tokens, ~150 TFLOP/s/GPU",
        "cluster": BLOOM_CLUSTER,
        "model": {"layers": 70, "hidden": 14336, "heads": 112, "seq": 2048, "vocab": 250880, "batch": 2,
                  "positions": False},
        # grad_overlap 0: DeepSpeed's pipeline engine reduces the gradients after the schedule's last
        # backward (deepspeed/runtime/pipe/schedule.py TrainSchedule: ReduceTiedGrads, ReduceGrads, OptimizerStep)
        # grad_reduce all_reduce: BF16_Optimizer's fp32 gradients are all-reduced, then each rank
        # updates its shard and the bf16 weights are all-gathered (pipe/engine.py _bf16_reduce_grads)
        "config": {"dp": 8, "tp": 4, "pp": 12, "microbatches": 128, "schedule": "1f1b", "dtype": "bf16",
                   "recompute": "full", "zero_stage": 1, "partition": "layers", "grad_overlap": 0.0,
                   "pipeline_p2p": "deepspeed", "grad_reduce": "all_reduce",
                   "grad_accumulation": "cast_add"},
        "global_batch": 2048, "published_tflops": 150.0,
        "flops": "megatron",
        "assumptions": "from bigscience train/tr11-176B-ml (slurm script, README): micro-batch 2, bf16 with "
                       "DeepSpeed's BF16_Optimizer (its own ZeRO-1: fp32 gradients all-reduced, bf16 weights "
                       "all-gathered), --checkpoint-activations, "
                       "partition [embed|5], 6 x 10, [5|embed]; ours cuts [embed|6], 6 x 9, 5, [5|head]: the same "
                       "slowest stage (the last); DeepSpeed's pipeline engine p2p (1/tp slices by synchronous "
                       "send/recv, all-gathered by the receiver); its CUDA_LAUNCH_BLOCKING=1 not modelled (the "
                       "host's dispatch, ~1% of these kernels' time, would add to the device time)",
    },
    *(_llama3_row(*r) for r in LLAMA3_TABLE4),
    *(row for r in KORTHIKANTI_TABLE for row in _korthikanti_rows(*r)),
]


# the recipe's fields that say what the plan is (pp.evaluate's keywords); the others say how the
# source's framework ran it (pp.evaluate's ``execution``)
_PLAN_FIELDS = ("dp", "tp", "pp", "microbatches", "schedule", "chunks", "dtype", "recompute", "zero_stage",
                "sequence_parallel", "partition")


def published_module(model: dict[str, Any]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The row's model as a user would write it: the package's own GPT or Llama module on the meta
    device (no weights), with the example batch of one micro-batch. GPT rows compute attention as the
    source's framework did before flash attention (explicit scores, mask, softmax, dropout; Megatron-LM
    and DeepSpeed of 2021-2022) unless the row says ``attention: sdpa`` (a fused kernel), with
    Megatron's dropouts of 0.1 where the source trained with them."""
    import torch

    from polyparallel.models import GPT, GPTConfig, Llama, LlamaConfig

    with torch.device("meta"):
        if model.get("norm") == "rms":
            m = Llama(LlamaConfig(vocab=model["vocab"], seq=model["seq"], layers=model["layers"],
                                  hidden=model["hidden"], heads=model["heads"], kv_heads=model["kv_heads"],
                                  ffn=model["ffn"]))
        else:
            m = GPT(GPTConfig(vocab=model["vocab"], seq=model["seq"], layers=model["layers"], hidden=model["hidden"],
                              heads=model["heads"], dropout=0.1 if model.get("dropout") else 0.0,
                              attention=model.get("attention", "explicit"), positions=model.get("positions", True)))
    ids = torch.zeros(model["batch"], model["seq"], dtype=torch.long)
    return m, (ids,), {"labels": ids}


def run_published(cases: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Each row priced the way a user prices a recipe: its model captured by ``pp.evaluate`` with the
    published degrees, and what the source's framework did differently as ``execution`` options."""
    import polyparallel as pp

    rows = []
    for case in PUBLISHED if cases is None else cases:
        t0 = time.perf_counter()
        mk = dict(case["model"])
        cl = case["cluster"]
        cluster = Cluster.from_dict(cl, source=cl["name"]) if isinstance(cl, dict) else Cluster.preset(cl)
        recipe = {k: v for k, v in case["config"].items() if k in _PLAN_FIELDS}
        # the sources' frameworks ran hand-fused kernels in 16 bits (Megatron-LM, DeepSpeed, Llama 3's),
        # not eager autocast: fused_elementwise unless a row says otherwise
        execution = {"fused_elementwise": True, **{k: v for k, v in case["config"].items() if k not in _PLAN_FIELDS}}
        dp, micro = recipe.pop("dp"), recipe.pop("microbatches")
        zero = recipe.pop("zero_stage", 0)
        model, args, kwargs = published_module(mk)
        s = pp.evaluate(model, args, cluster, example_kwargs=kwargs, dp=dp, microbatches=micro, zero_stage=zero,
                        batch_size=case["global_batch"], execution=execution, **recipe)
        est = s.estimate
        n = len(s.mesh.devices)
        if "published_tokens_per_s_per_gpu" in case:
            # a source that publishes tokens per second per GPU is compared in them: the step's
            # tokens are its work, no FLOP formula needed
            work, unit, metric = case["global_batch"] * mk["seq"], 1.0, "tokens/s/GPU"
            pub = case["published_tokens_per_s_per_gpu"]
        else:
            work = megatron_flops(case["global_batch"], mk["seq"], mk["layers"], mk["hidden"], mk["vocab"],
                                  recompute=s.recompute == "full") if case["flops"] == "megatron" else \
                palm_flops(case["global_batch"], mk["seq"], s.model.params, mk["layers"], mk["hidden"])
            unit, metric = 1e12, "TFLOP/s/GPU"
            # a source that publishes seconds per iteration: its TFLOP/s by the same FLOP count
            pub = case["published_tflops"] if "published_tflops" in case else \
                work / case["published_step_s"] / n / unit
        pred = work / est.step_time_s / n / unit
        config = (f"dp{s.dp} tp{s.tp} pp{s.pp} m={s.microbatches} {s.schedule} zero{s.zero_stage} "
                  f"rc={s.recompute}" + (" seqpar" if recipe.get("sequence_parallel") else ""))
        rows.append({
            "name": case["name"], "citation": case["citation"], "assumptions": case["assumptions"],
            "cluster": cluster.name, "gpus": n, "config": config, "execution": execution, "params": s.model.params,
            "metric": metric, "published_per_gpu": round(pub, 1), "predicted_per_gpu": round(pred, 1),
            "error": round(pred / pub - 1, 4), "within_25pct": abs(pred / pub - 1) <= 0.25,
            "within_15pct": abs(pred / pub - 1) <= 0.15, "held_out": case.get("held_out", False),
            "predicted_step_s": round(est.step_time_s, 5), "published_step_s": round(work / (pub * unit * n), 5),
            "breakdown_s": {k: round(v, 4) for k, v in est.breakdown.items()},
            "memory_bytes_max": est.memory_bytes_max, "does_not_fit": s.search.notes[:1],
            "price_s": round(time.perf_counter() - t0, 2),
        })
        r = rows[-1]
        print(f"  {r['name']:<24} {r['gpus']:>5} GPUs  {r['config']:<52} published {pub:8.1f}  predicted "
              f"{pred:8.1f} {metric}  error {100 * r['error']:+6.1f}%", flush=True)
    return rows


def sharded_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The sharded rows' errors per source table, apart for the rows looked at while the cost model
    changed and the held-out ones (``published_sharded.py``), printed and returned with the rows."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        table = r["name"][r["name"].rfind("(") + 1:-1].split(" ", 1)[1] if "(" in r["name"] else "?"
        source = "torchtitan" if r["name"].startswith("torchtitan") else "MPT"
        for key in (f"{source} {table} {'held out' if r['held_out'] else 'seen'}",
                    "all held out" if r["held_out"] else "all seen"):
            groups.setdefault(key, []).append(r)
    out: dict[str, Any] = {"rows": rows, "groups": {}}
    for key, sel in sorted(groups.items()):
        g = {"rows": len(sel), "within_25pct": sum(r["within_25pct"] for r in sel),
             "within_15pct": sum(r["within_15pct"] for r in sel),
             "median_error": round(statistics.median(r["error"] for r in sel), 4),
             "priced_slow": sum(r["error"] < 0 for r in sel)}
        out["groups"][key] = g
        print(f"  {key:<34} {g['rows']:3d} rows  within ±25% {g['within_25pct']:3d}  within ±15% "
              f"{g['within_15pct']:3d}  median error {100 * g['median_error']:+6.1f}%  priced slow {g['priced_slow']}")
    return out


# --------------------------------------------------------------------------------------------
# part 1: measured on this machine (the torch backend, measured and priced by benchmarks/executor.py)
# --------------------------------------------------------------------------------------------

MLP_RECIPES = (
    Recipe(batch=8),
    Recipe(dp=2, batch=8),
    Recipe(dp=4, batch=8),
    Recipe(dp=2, zero_stage=3, batch=8),
    Recipe(tp=2, batch=8),
    Recipe(tp=4, batch=8),
    Recipe(dp=2, tp=2, zero_stage=3, batch=8),
    Recipe(pp=2, microbatches=4, schedule="gpipe", batch=8),
    Recipe(pp=2, microbatches=4, schedule="1f1b", batch=8),
    Recipe(pp=4, microbatches=4, schedule="1f1b", batch=8),
    Recipe(dp=2, pp=2, microbatches=2, schedule="1f1b", batch=8),
    Recipe(tp=2, pp=2, microbatches=4, schedule="1f1b", batch=8),
)


def run_local(steps: int, warmup: int, recalibrate: bool, repeats: int) -> dict[str, Any]:
    """The MLP through ``pp.train`` in every recipe, against ``pp.evaluate`` on ``local-cpu:<P>``.

    The measuring and pricing code is :func:`executor.run_recipes`, shared with the GPT
    benchmark of the torch backend (``benchmarks/executor.py``).
    """
    cal_path = default_calibration_path()
    load0 = os.getloadavg()[0]
    if recalibrate or not cal_path.is_file():
        calibrate_now(lambda s: print("  " + s, flush=True))
    rows = run_recipes(MLP, MLP_RECIPES, steps=steps, warmup=warmup, repeats=repeats,
                       say=lambda s: print(s, flush=True))
    print_table(rows)
    ok = [r for r in rows if r.get("status") == "ok"]
    multi = [r for r in ok if r["world"] >= 2]
    cal = json.loads(cal_path.read_text())
    return {
        "model": MLP.description, "calibration": {"path": str(cal_path), "cores": cal["cores"],
                                                  "date": cal.get("date"), "load_average": cal.get("load_average"),
                                                  "threads_per_process": cal.get("threads_per_process")},
        "command": "python benchmarks/cost_validation.py " + " ".join(sys.argv[1:]),
        "load_average_start": load0, "load_average_end": os.getloadavg()[0],
        "steps": steps, "warmup": warmup, "repeats": repeats,
        "measured": "median over runs of rank 0's logged step times after warm-up (benchmarks/executor.py)",
        "rows": rows, "spearman_multi_process": spearman(multi), "spearman_all": spearman(ok),
        "median_abs_error": statistics.median(abs(r["error"]) for r in ok) if ok else None,
        "configs_with_2_to_4_processes": len(multi),
        "not_executed": [f"{r['recipe']}: {r.get('status')}" for r in rows if r.get("status") != "ok"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["local", "published", "sharded", "both"], default="both",
                    help="both: local and published; sharded: the FSDP/ZeRO-3 rows of published_sharded.py")
    ap.add_argument("--steps", type=int, default=20, help="training steps per run (warm-up included)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2, help="runs of every configuration (interleaved)")
    ap.add_argument("--recalibrate", action="store_true", help="measure this machine again first")
    ap.add_argument("--calibration", metavar="FILE",
                    help="the calibration file to price with (and to write with --recalibrate); default "
                         "$POLYPARALLEL_CALIBRATION, else ~/.cache/polyparallel/calibration.json")
    args = ap.parse_args()
    if args.calibration:  # the pricing and every worker read it from the environment
        os.environ["POLYPARALLEL_CALIBRATION"] = str(Path(args.calibration).resolve())
    result: dict[str, Any] = json.loads(OUT.read_text()) if OUT.is_file() else {}
    result["host"] = {"machine": platform.machine(), "cores": os.cpu_count(), "python": sys.version.split()[0]}
    if args.part in ("published", "both"):
        print("published large-model runs (per-GPU TFLOP/s, source's FLOP formula):")
        rows = run_published()
        result["published"] = {"rows": rows, "within_25pct": sum(r["within_25pct"] for r in rows),
                               "within_15pct": sum(r["within_15pct"] for r in rows), "cases": len(rows),
                               "median_abs_error": statistics.median(abs(r["error"]) for r in rows)}
        print(f"  within ±25%: {result['published']['within_25pct']} of {len(rows)}; within ±15%: "
              f"{result['published']['within_15pct']}")
    if args.part == "sharded":
        print("published sharded-data-parallel runs (tokens/s/GPU; benchmarks/published_sharded.py):")
        result["sharded"] = sharded_summary(run_published(sharded_rows()))
    if args.part in ("local", "both"):
        print(f"this machine ({os.cpu_count()} cores), pp.train on gloo processes, {args.repeats} x {args.steps} steps "
              f"per recipe, first {args.warmup} left out:")
        loc = run_local(args.steps, args.warmup, args.recalibrate, args.repeats)
        result["local"] = loc
        rho, rho_all = loc["spearman_multi_process"], loc["spearman_all"]
        print(f"  Spearman rank correlation (2-4 processes, {loc['configs_with_2_to_4_processes']} configs): "
              f"{'n/a' if rho is None else f'{rho:.3f}'}; all configs: {'n/a' if rho_all is None else f'{rho_all:.3f}'}"
              f"; median |error| {100 * (loc['median_abs_error'] or 0):.1f}%")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1, default=float))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
