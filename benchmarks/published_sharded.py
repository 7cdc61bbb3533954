"""Published runs of sharded data parallelism (FSDP / ZeRO-3), as rows for ``cost_validation.py``.

Every row is a recipe as its source trained it, priced the way a user prices one: the model built
as a module, ``pp.evaluate`` with the published degrees on the source's hardware, and what the
source's framework did differently as ``execution`` options (``cost_validation.run_published``).
The measured figure is the source's tokens per second per GPU; the error is that of the step time.

Sources:

* MosaicML, llm-foundry ``scripts/train/benchmarking/README.md`` ("MPT Training Benchmarks", 2023):
  MPT 125M-70B trained by Composer with torch FSDP (``FULL_SHARD`` over every GPU), tables for
  H100 80GB, A100 80GB and A100 40GB (the A100 nodes "with 1600 Gbps node-node interconnect
  (RoCE)"), each row with its micro-batch, gradient accumulation and activation checkpointing.
  The models are the llm-foundry MPT configurations (``scripts/train/yamls/pretrain/mpt-*.yaml``:
  d_model / n_layers / n_heads below, vocabulary 50368, MLP ratio 4, no dropout); their parameter
  counts grow with the sequence length by ``seq × d_model``, a learned position table, as
  :class:`polyparallel.models.GPT` builds it (1B at 2048: 1,315,950,592 published, the same here to
  0.1%). Execution: eager PyTorch under autocast (``amp_bf16``), FSDP's mixed precision holding
  16-bit parameters, Triton flash attention (``attn_impl: triton``: ``fused_attention``), FSDP1's
  flat parameters (``zero3_gather="flat"``), activation checkpointing of every block where the row
  says so. The attention kernel is FlashAttention (v1)'s Triton port, priced at FlashAttention (v1)'s
  published rates per device (``attention_kernel="fa1"``, ``cost_models/compute.py``): the benchmark
  sweep that made the H100 table (llm-foundry commit b2a43a1, Oct 2023: ``sweep.sh`` with the image
  ``mosaicml/pytorch:2.1.0_cu121``, ``submit_benchmarks.py --attn_impl triton`` by default, the
  ``-e .[gpu]`` install of llm-foundry v0.3.0) ran ``llmfoundry/models/layers/flash_attn_triton.py``,
  a copy of flash-attn's ``flash_attn_triton.py`` on ``triton-pre-mlir`` (the pre-MLIR Triton of
  Dec 2022 with sm90 added: no Hopper wgmma/TMA), whose docstring says its forward + backward is
  "slightly slower" than FlashAttention (v1)'s CUDA kernel; the A100 tables are older (v0.1-v0.2,
  May-July 2023, the same kernel on ``triton==2.0.0.dev20221202``). The rates (FlashAttention-2
  paper, Figures 4 and 7, "FlashAttention" bars, causal, head dimension 128): A100 55-83, H100 98-137
  TFLOP/s forward + backward at sequences 512-16k, where the cost model's defaults price a fused
  attention at ~180 (A100 roofline) and ~400-490 (the H200's torch 2.11 cuDNN run). Chosen from
  these sources and written down before the held-out rows were priced with it; their errors with the
  device defaults (an earlier session's pricing: growing with the sequence length on every GPU) were
  known when it was chosen, and no number of it was set from them. Not modelled: the ``PURE`` rows
  reduce their gradients in bf16 (priced in fp32: their reduce-scatters cost twice what they did;
  hidden behind compute in all but the smallest models).
* PyTorch, torchtitan ``docs/performance.md``: the 2024 tables (Llama 3 8B/70B, Llama 2 13B/70B
  with FSDP2 on 64 A100 80GB; words per second per GPU) and the December 2024 tables (Llama 3.1 8B
  with FSDP2 on 8 and 128 H100 of Meta's Grand Teton platform: 96 GB HBM2e at 2.4 TB/s, 500 W,
  "the actual peak TFLOPs number is between SXM and NVL", 400 Gb/s RDMA per GPU), priced on that
  part as a user would write it, a device type of the rows' own cluster spec (:func:`_grand_teton`:
  its bf16 peak interpolated in power between the H100 NVL's and SXM's datasheet figures, chosen
  before pricing; a name starting ``h100-`` keeps the Hopper GEMM efficiencies and published kernel
  rates, each scaled to its own peak). These four rows are seen rows. Execution: the
  torch backend's own (eager, FSDP2 with bf16 parameters and fp32 reduction, SDPA), ``torch.compile``
  rows as fused elementwise kernels. "Selective op" activation checkpointing is torchtitan's
  operator policy (``recompute="op"``); "selective layer" (every second block) is not a recipe the
  cost model has and those rows are left out.

Held out: the rows whose ``held_out`` is True were priced only once the cost model's changes of
this benchmark were made (the MPT rows at sequence lengths other than 2048, and torchtitan's A100
rows); the MPT rows at 2048 and torchtitan's H100 rows were looked at while making them.
"""

from __future__ import annotations

from typing import Any

# d_model, n_layers, n_heads of the llm-foundry MPT configurations
MPT_SHAPES = {"125m": (768, 12, 12), "350m": (1024, 24, 16), "760m": (1536, 24, 12), "1b": (2048, 24, 16),
              "3b": (2560, 32, 20), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 48, 64),
              "70b": (8192, 80, 64)}
MPT_VOCAB = 50368

# (model, sequence, GPUs, micro-batch, gradient accumulation, activation checkpointing, tokens/s/GPU)
MPT_H100 = (
    ("70b", 2048, 64, 8, 4, True, 1039), ("70b", 2048, 32, 2, 16, True, 882),
    ("30b", 2048, 32, 14, 3, True, 2308), ("30b", 2048, 16, 10, 3, True, 2263), ("30b", 2048, 8, 3, 21, True, 2002),
    ("13b", 2048, 64, 2, 1, False, 4800), ("13b", 2048, 32, 2, 1, False, 4811), ("13b", 2048, 16, 2, 1, False, 4767),
    ("13b", 2048, 8, 2, 1, False, 4792), ("7b", 2048, 8, 6, 1, False, 10643),
    ("3b", 2048, 64, 6, 3, False, 22525), ("3b", 2048, 32, 6, 3, False, 23021), ("3b", 2048, 16, 10, 3, False, 24142),
    ("1b", 2048, 64, 20, 1, False, 44402), ("1b", 2048, 32, 20, 1, False, 45130), ("1b", 2048, 16, 20, 1, False, 46037),
    ("1b", 2048, 8, 14, 1, False, 45455), ("760m", 2048, 32, 24, 1, False, 67971),
    ("760m", 2048, 16, 24, 1, False, 68551), ("760m", 2048, 8, 24, 2, False, 63147),
    # held out: other sequence lengths
    ("30b", 8192, 8, 1, 21, True, 1384), ("30b", 4096, 8, 1, 21, True, 1802), ("30b", 1024, 8, 6, 21, True, 2084),
    ("13b", 32768, 8, 1, 3, True, 1976), ("13b", 16384, 8, 3, 3, True, 2985), ("13b", 4096, 8, 10, 3, True, 4717),
    ("13b", 1024, 8, 40, 3, True, 5502), ("7b", 65536, 8, 1, 2, True, 1956), ("7b", 32768, 8, 2, 2, True, 3318),
    ("7b", 8192, 8, 8, 2, True, 6935), ("7b", 4096, 8, 16, 2, True, 8611), ("7b", 1024, 8, 64, 2, True, 10203),
    ("3b", 65536, 8, 1, 2, True, 3262), ("3b", 16384, 8, 1, 6, False, 11152), ("3b", 8192, 8, 3, 6, False, 16578),
    ("3b", 4096, 8, 5, 6, False, 20964), ("3b", 1024, 8, 20, 6, False, 27046), ("1b", 16384, 8, 2, 4, False, 19649),
    ("1b", 8192, 8, 3, 4, False, 29157), ("1b", 4096, 8, 7, 4, False, 38535), ("1b", 1024, 8, 18, 4, False, 48910),
    ("760m", 8192, 8, 6, 2, False, 41825), ("760m", 4096, 8, 12, 2, False, 55459),
)
MPT_A100_80 = (
    ("70b", 2048, 64, 8, 4, True, 410), ("70b", 2048, 32, 2, 16, True, 373), ("30b", 2048, 8, 3, 21, True, 916),
    ("13b", 2048, 8, 2, 3, False, 2262), ("7b", 2048, 8, 6, 2, False, 4641), ("3b", 2048, 8, 10, 2, False, 10811),
    ("1b", 2048, 8, 14, 4, False, 20513), ("760m", 2048, 8, 24, 2, False, 32434),
    ("350m", 2048, 8, 32, 2, False, 58782), ("125m", 2048, 8, 40, 2, False, 142830),
    # held out
    ("30b", 8192, 8, 1, 21, True, 574), ("30b", 4096, 8, 1, 21, True, 814), ("30b", 1024, 8, 6, 21, True, 946),
    ("13b", 16384, 8, 3, 3, True, 1431), ("13b", 8192, 8, 5, 3, True, 1795), ("13b", 4096, 8, 10, 3, True, 2060),
    ("13b", 1024, 8, 40, 3, True, 2330), ("7b", 32768, 8, 2, 2, True, 1672), ("7b", 16384, 8, 4, 2, True, 2453),
    ("7b", 8192, 8, 8, 2, True, 3206), ("7b", 4096, 8, 16, 2, True, 3684), ("7b", 1024, 8, 64, 2, True, 4357),
    ("3b", 16384, 8, 1, 6, False, 5529), ("3b", 8192, 8, 3, 6, False, 7695), ("3b", 4096, 8, 5, 6, False, 9457),
    ("1b", 16384, 8, 2, 4, False, 9956), ("1b", 8192, 8, 3, 4, False, 13814), ("1b", 4096, 8, 7, 4, False, 17807),
    ("760m", 8192, 8, 6, 2, False, 20933), ("350m", 8192, 8, 8, 2, False, 36569),
)
MPT_A100_40 = (
    ("70b", 2048, 128, 4, 1, True, 376), ("70b", 2048, 64, 2, 1, True, 276), ("30b", 2048, 128, 6, 1, True, 865),
    ("30b", 2048, 32, 4, 1, True, 857), ("13b", 2048, 128, 16, 1, True, 1972), ("13b", 2048, 64, 16, 1, True, 1976),
    ("13b", 2048, 32, 14, 1, True, 1998), ("13b", 2048, 16, 10, 1, True, 1993), ("13b", 2048, 8, 4, 16, True, 1668),
    ("7b", 2048, 128, 18, 1, True, 3623), ("7b", 2048, 64, 18, 1, True, 3665), ("7b", 2048, 32, 18, 1, True, 3725),
    ("7b", 2048, 16, 16, 1, True, 3645), ("7b", 2048, 8, 12, 4, True, 3679), ("3b", 2048, 128, 6, 1, False, 9538),
    ("3b", 2048, 64, 6, 1, False, 9736), ("3b", 2048, 32, 6, 1, False, 9914), ("3b", 2048, 16, 5, 1, False, 9750),
    ("1b", 2048, 128, 10, 1, False, 18647), ("1b", 2048, 64, 10, 1, False, 19001), ("1b", 2048, 16, 8, 1, False, 19085),
    ("760m", 2048, 128, 12, 1, False, 28940), ("760m", 2048, 32, 12, 1, False, 29648),
    ("350m", 2048, 128, 18, 1, False, 51934), ("350m", 2048, 16, 18, 1, False, 55413),
    # held out
    ("13b", 8192, 8, 1, 16, True, 1407), ("13b", 4096, 8, 2, 16, True, 1603), ("13b", 1024, 8, 8, 16, True, 1727),
    ("7b", 16384, 8, 1, 4, True, 2249), ("7b", 8192, 8, 3, 4, True, 2887), ("7b", 4096, 8, 6, 4, True, 3366),
    ("7b", 1024, 8, 24, 4, True, 3854), ("3b", 32768, 8, 1, 4, True, 2955), ("3b", 8192, 8, 1, 8, False, 7149),
    ("3b", 4096, 8, 2, 8, False, 8777), ("1b", 8192, 8, 2, 8, False, 13474), ("1b", 4096, 8, 4, 8, False, 16856),
    ("760m", 8192, 8, 3, 4, False, 20106), ("350m", 8192, 8, 4, 4, False, 34933),
)

# The nodes of the MPT A100 tables: eight GPUs on NVSwitch, "1600 Gbps node-node interconnect
# (RoCE)", i.e. 8 x 200 Gb/s; the links' efficiencies are the presets' (nccl-tests figures)
_ROCE = {"kind": "roce", "bandwidth": "200 Gb/s", "ports": 8, "latency": "5 us", "efficiency": 0.9,
         "source": "llm-foundry benchmarking README: 1600 Gbps node-node interconnect (RoCE)"}
_NVSWITCH_A100 = {"kind": "nvswitch", "bandwidth": "300 GB/s", "latency": "3 us", "efficiency": 0.8,
                  "source": "NVIDIA DGX A100 datasheet"}


def _mosaic_a100(device: str, gpus: int) -> dict[str, Any]:
    return {"name": f"mosaic-{device}", "description": f"MosaicML {device} nodes, 8 x 200 Gb/s RoCE",
            "centers": [{"name": "dc", "framework": "torch", "nodes": [{
                "name": "node", "count": max(1, gpus // 8), "device": device, "devices_per_node": 8,
                "intra": _NVSWITCH_A100, "nic": _ROCE}]}]}


def _mpt_row(table: str, model: str, seq: int, gpus: int, micro: int, accum: int, ckpt: bool, tps: float,
             held_out: bool) -> dict[str, Any]:
    d, layers, heads = MPT_SHAPES[model]
    cluster = f"dgx-h100x{gpus // 8}" if table == "H100 80GB" else \
        _mosaic_a100("a100-80gb-sxm" if table == "A100 80GB" else "a100-40gb-sxm", gpus)
    return {
        "name": f"MPT-{model} s{seq} ({gpus} {table.split()[0]} {table.split()[1]})",
        "citation": f"MosaicML llm-foundry benchmarking README, {table} table: MPT-{model}, seq {seq}, {gpus} GPUs, "
                    f"micro-batch {micro} x {accum}, activation checkpointing {ckpt}, {tps:g} tokens/s/GPU",
        "cluster": cluster,
        "model": {"layers": layers, "hidden": d, "heads": heads, "seq": seq, "vocab": MPT_VOCAB, "batch": micro,
                  "attention": "sdpa"},
        "config": {"dp": gpus, "tp": 1, "pp": 1, "microbatches": accum, "dtype": "bf16", "zero_stage": 3,
                   "recompute": "full" if ckpt else "none", "fused_elementwise": None, "fused_attention": True,
                   # llm-foundry's ComposerMPTCausalLM: loss_fn defaults to 'fused_crossentropy', flash-attn's
                   # CrossEntropyLoss (llmfoundry/models/mpt/modeling_mpt.py)
                   "zero3_gather": "flat", "fused_loss": True,
                   # attn_impl: triton, flash-attn 1.x's Triton kernel (llmfoundry/models/layers/flash_attn_triton.py)
                   "attention_kernel": "fa1"},
        "global_batch": gpus * micro * accum, "published_tokens_per_s_per_gpu": float(tps), "held_out": held_out,
        "assumptions": "Composer's FSDP (FULL_SHARD) with flat parameters, bf16 autocast, Triton flash attention "
                       "(flash-attn 1.x's port, priced at FlashAttention v1's published rates), "
                       "flash-attn's fused cross entropy; gradients reduced in fp32 (the PURE rows reduced in bf16)",
    }


# torchtitan: the December 2024 H100 tables' platform (docs/performance.md): Grand Teton hosts of 8
# H100 with 96 GB HBM2e at 2.4 TB/s and "the default 500W power limit", NVLink inside a host, 400 Gb/s
# RDMA per GPU; "HBM2e-based SXM H100 with lower TDP, the actual peak TFLOPs number is between SXM and
# NVL". The bracket's ends, NVIDIA's H100 datasheet (dense = half the "with sparsity" figure): H100 SXM
# 989.5 TFLOP/s bf16 at 700 W (1,979 with sparsity), H100 NVL 835.5 at 350-400 W (1,671 with sparsity,
# configurable power), the same GH100 with 132 SMs: their peaks differ by the clock each power envelope
# sustains. The part's one stated figure that places it in the bracket is its power limit, so its peak is
# interpolated linearly in power between the two parts, the NVL at the top of its range (400 W, where its
# datasheet clocks are stated): 835.5 + (500 - 400) / (700 - 400) x (989.5 - 835.5) = 886.8 TFLOP/s.
# (The bracket's midpoint, 912.5, used no fact of the part.) Chosen before the rows were priced with it;
# the rows are seen rows (their error with the midpoint, +25..+26%, was known). The vector fp32 peak the
# same way (NVL 60, SXM 67 TFLOP/s: 62.3).
def _at_500w(nvl: float, sxm: float) -> float:
    return nvl + (500 - 400) / (700 - 400) * (sxm - nvl)


GRAND_TETON_PEAK_TFLOPS = _at_500w(835.5, 989.5)


def _grand_teton(gpus: int) -> dict[str, Any]:
    return {
        "name": "grand-teton-h100",
        "description": "Meta Grand Teton: 8 x H100 96GB HBM2e (500 W) per host, 400 Gb/s RDMA per GPU",
        "device_types": {"h100-hbm2e-500w": {
            "kind": "gpu", "vendor": "NVIDIA", "sms": 132, "memory": "96 GB", "memory_bandwidth": "2400 GB/s",
            "peak": {"bf16": f"{GRAND_TETON_PEAK_TFLOPS:.1f} TFLOP/s", "fp16": f"{GRAND_TETON_PEAK_TFLOPS:.1f} TFLOP/s",
                     "fp32": f"{_at_500w(60, 67):.1f} TFLOP/s", "tf32": f"{GRAND_TETON_PEAK_TFLOPS / 2:.1f} TFLOP/s"},
            "launch_overhead": "4 us",
            "source": "torchtitan docs/performance.md (96GB HBM2e, 2.4 TB/s, 500W; peak between H100 SXM and NVL): "
                      "bf16 peak interpolated in power between H100 NVL (835.5 TFLOP/s, 400 W) and SXM (989.5, "
                      "700 W) to 500 W"}},
        "centers": [{"name": "dc", "framework": "torch", "nodes": [{
            "name": "host", "count": max(1, gpus // 8), "device": "h100-hbm2e-500w", "devices_per_node": 8,
            "intra": {"kind": "nvlink", "bandwidth": "450 GB/s", "latency": "3 us", "efficiency": 0.8,
                      "source": "H100 SXM NVLink 900 GB/s bidirectional"},
            "nic": {"kind": "rdma", "bandwidth": "400 Gb/s", "ports": 8, "latency": "5 us", "efficiency": 0.9,
                    "source": "torchtitan docs/performance.md: 400 Gb/s per GPU"}}]}],
    }


LLAMA_SHAPES = {  # hidden, layers, heads, kv heads, ffn, vocabulary
    "Llama 3 8B": (4096, 32, 32, 8, 14336, 128256), "Llama 3 70B": (8192, 80, 64, 8, 28672, 128256),
    "Llama 2 13B": (5120, 40, 40, 40, 13824, 32000), "Llama 2 70B": (8192, 80, 64, 8, 28672, 32000),
}

# (model, sequence, GPUs, local batch, recompute, compiled, tokens/s/GPU, held out, cluster)
TORCHTITAN = (
    ("Llama 3 8B", 8192, 64, 1, "op", False, 2973, True, "a100"),
    ("Llama 3 70B", 8192, 64, 1, "full", False, 331, True, "a100"),
    ("Llama 2 13B", 4096, 64, 2, "none", False, 2162, True, "a100"),
    ("Llama 2 13B", 4096, 64, 2, "op", False, 1904, True, "a100"),
    ("Llama 2 70B", 4096, 64, 1, "op", False, 355, True, "a100"),
    ("Llama 2 70B", 4096, 64, 2, "full", False, 353, True, "a100"),
    ("Llama 3 8B", 8192, 8, 2, "op", False, 5762, False, "h100"),
    ("Llama 3 8B", 8192, 8, 2, "op", True, 6667, False, "h100"),
    ("Llama 3 8B", 8192, 128, 2, "op", False, 5605, False, "h100"),
    ("Llama 3 8B", 8192, 128, 2, "op", True, 6514, False, "h100"),
)


def _torchtitan_row(model: str, seq: int, gpus: int, local: int, recompute: str, compiled: bool, tps: float,
                    held_out: bool, hw: str) -> dict[str, Any]:
    hidden, layers, heads, kv, ffn, vocab = LLAMA_SHAPES[model]
    name = ("Llama 3.1 8B" if hw == "h100" else model)
    return {
        "name": f"torchtitan {name} rc={recompute}{' compiled' if compiled else ''} ({gpus} {hw.upper()})",
        "citation": f"torchtitan docs/performance.md: {name}, FSDP2 on {gpus} {hw.upper()}, local batch {local}, seq "
                    f"{seq}, activation checkpointing {recompute}{', torch.compile' if compiled else ''}: "
                    f"{tps:g} tokens/s/GPU",
        "cluster": f"dgx-a100x{gpus // 8}" if hw == "a100" else _grand_teton(gpus),
        "model": {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv, "ffn": ffn, "seq": seq,
                  "vocab": vocab, "batch": local, "norm": "rms"},
        "config": {"dp": gpus, "tp": 1, "pp": 1, "microbatches": 1, "dtype": "bf16", "zero_stage": 3,
                   "recompute": recompute, "fused_elementwise": True if compiled else None,
                   # torchtitan runs SDPA's flash backend (FlashAttention-2) off Blackwell; the A100
                   # has no published rates of it here, so its attention keeps the roofline price
                   **({"attention_kernel": "fa2"} if hw == "h100" else {})},
        "global_batch": gpus * local, "published_tokens_per_s_per_gpu": float(tps), "held_out": held_out,
        "assumptions": "FSDP2 with bf16 parameters and fp32 gradient reduction, eager (torch.compile rows: fused "
                       "elementwise kernels), SDPA flash attention; A100 hosts as DGX A100 nodes (not stated)",
    }


def sharded_rows() -> list[dict[str, Any]]:
    """Every published sharded-data-parallel row, MPT then torchtitan."""
    rows = []
    for table, data in (("H100 80GB", MPT_H100), ("A100 80GB", MPT_A100_80), ("A100 40GB", MPT_A100_40)):
        rows += [_mpt_row(table, *r, held_out=r[1] != 2048) for r in data]
    rows += [_torchtitan_row(*r) for r in TORCHTITAN]
    return rows
