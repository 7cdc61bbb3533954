"""The compute model on a real GPU: predicted vs measured training steps, GEMM shapes, NCCL path.

Run on a machine with a CUDA GPU (one is enough)::

    python benchmarks/gpu_validation.py                      # calibrates first (~1 min), then ~2 min
    python benchmarks/gpu_validation.py --calibration FILE   # reuse a `polyparallel calibrate --device cuda`

What it does:

1. **Calibrate** the GPU (:mod:`polyparallel.cost_models.calibrate_gpu`) unless a file is given.
2. **GEMM shapes**: the matmuls of a GPT layer (tokens × hidden × {3h, h, 4h}, 4h × h, the vocabulary
   head) timed in bf16, against (a) the measured square-matmul curve at the same FLOP count and
   (b) the data-sheet roofline at the modelled 80% efficiency: how well a FLOP-keyed curve transfers to
   the skinny shapes of real layers.
3. **Training steps**: GPT models (``polyparallel.models.GPT``, bf16 autocast, Adam, causal SDPA) and
   CNNs (ResNet-50 at batch 16/64/128, the small CNN; SGD with momentum) trained eagerly on the GPU,
   median step time after warm-up (and the host's enqueue time: is the GPU waiting for dispatch?),
   against ``estimate_step`` on the captured graph for a one-GPU cluster (bf16 compute, fp32 master
   weights, ``fused_elementwise=False``: eager PyTorch runs every op as its own kernel), priced twice:
   with the data-sheet device type and with the calibrated one. Flash attention
   (``fused_attention=True``); for GPT-1.7B also the unfused math kernel and full recomputation;
   measured peak memory against the memory model.
   Every distinct convolution of ResNet-50 is timed against the calibrated conv rows.
4. **NCCL path**: ``polyparallel.backends.torch.train`` of the tiny GPT strategy on the GPU (the worker
   picks CUDA + NCCL) equals the single-process CPU loop step by step.

Prints tables and writes ``benchmarks/results/gpu_validation.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, estimate_step
from polyparallel.cost_models.calibrate_gpu import calibrate_gpu, cuda_time
from polyparallel.cost_models.compute import COMPUTE_EFFICIENCY, _curve_rate
from polyparallel.ir import OpKind
from polyparallel.models import GPT, GPTConfig, ResNet, SmallCNN

OUT = Path(__file__).parent / "results" / "gpu_validation.json"
DEVICE = "cuda"  # where workloads run; a smoke test of this script's CPU-side logic sets "cpu"

# name, config, micro-batch; GPT-1.7B is the Megatron-LM SC'21 row that issue 4's published check misses
MODELS: list[tuple[str, GPTConfig, int]] = [
    ("gpt-tiny", GPTConfig(vocab=512, seq=128, layers=2, hidden=128, heads=4), 8),
    ("gpt2-small", GPTConfig(), 8),
    ("gpt2-small-v50304", GPTConfig(vocab=50304), 8),  # the vocabulary padded to a multiple of 64
    ("gpt2-medium", GPTConfig(layers=24, hidden=1024, heads=16), 8),
    ("gpt-1.7b", GPTConfig(vocab=51200, seq=2048, layers=24, hidden=2304, heads=24), 4),
]
# convolutional workloads (SGD with momentum, as vision models train): name -> batches measured
CNNS: dict[str, tuple[int, ...]] = {"resnet50": (16, 64, 128), "smallcnn": (256,)}


def build(name: str, batch: int, device: str) -> tuple[torch.nn.Module, tuple, dict]:
    """``(model, args, kwargs)`` of a workload on ``device`` (``meta`` for capture)."""
    if name in CNNS:
        with torch.device(device):
            model = ResNet() if name == "resnet50" else SmallCNN()
        shape = (3, 224, 224) if name == "resnet50" else (1, 28, 28)
        x = torch.randn(batch, *shape, device=device) if device != "meta" else torch.zeros(batch, *shape,
                                                                                             device="meta")
        y = torch.randint(0, 10, (batch,), device=device) if device != "meta" else \
            torch.zeros(batch, dtype=torch.long, device="meta")
        return model, (x,), {"labels": y}
    cfg = next(c for m, c, _ in MODELS if m == name)
    with torch.device(device):
        model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq), device=device) if device != "meta" else \
        torch.zeros(batch, cfg.seq, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


def optimizer_of(name: str) -> str:
    return "sgd_momentum" if name in CNNS else "adam"


def catalog_type(name: str) -> str:
    """The data-sheet device type for a CUDA device name."""
    for key, t in (("H200", "h200-sxm"), ("H100", "h100-sxm"), ("A100", "a100-80gb-sxm"), ("V100", "v100-sxm2-32gb")):
        if key in name:
            return t
    raise SystemExit(f"no data-sheet device type for {name!r} in polyparallel/presets/devices.yaml")


def one_gpu_cluster(type_name: str, calibration: str | None, n: int = 1) -> Cluster:
    """A cluster of one GPU (``n`` on one node): the catalog type, or a type with its data-sheet
    figures and ``calibration``."""
    device = type_name
    spec: dict[str, Any] = {"name": f"{n}x{type_name}" + ("-calibrated" if calibration else "")}
    if calibration:
        base = one_gpu_cluster(type_name, None).device_types[type_name]
        device = f"{type_name}-calibrated"
        spec["device_types"] = {device: {
            "kind": base.kind, "vendor": base.vendor, "peak": dict(base.peak), "memory": base.memory,
            "memory_bandwidth": base.memory_bandwidth, "launch_overhead": base.launch_overhead,
            "source": base.source, "calibration": str(Path(calibration).resolve())}}
    spec["centers"] = [{"name": "here", "framework": "torch", "nodes": [
        {"name": "gpu", "count": 1, "devices_per_node": n, "device": device}]}]
    return Cluster.from_dict(spec, source=spec["name"])


def math_attention_bmms(cal: dict[str, Any], batch_heads: int = 96, seq: int = 2048,
                        head_dim: int = 96) -> list[dict[str, Any]]:
    """The fp32 ``bmm`` s of torch's math attention kernel (GPT-1.7B: 4 x 24 heads, 2048 tokens, head
    dim 96) against the fp32 square-matmul curve the cost model prices them by. Each has one side of
    ``head_dim``: the scores ``(s×d)·(d×s)`` reduce over it, the others produce ``d`` columns. The
    math-attention step is priced 21% fast on the H200 and these are the largest untimed kernels in it."""
    curve = tuple(sorted((float(r["flops"]), float(r["seconds"])) for r in cal["matmul"]["fp32"]))
    rows = []
    for label, (m, k, n) in {"scores q·kᵀ": (seq, head_dim, seq), "probs·v": (seq, seq, head_dim)}.items():
        a = torch.randn(batch_heads, m, k, device=DEVICE, dtype=torch.float32)
        b = torch.randn(batch_heads, k, n, device=DEVICE, dtype=torch.float32)
        sec = cuda_time(lambda a=a, b=b: torch.bmm(a, b))
        f = 2.0 * batch_heads * m * k * n
        rows.append({"bmm": label, "batch_mkn": [batch_heads, m, k, n], "measured_tflops": f / sec / 1e12,
                     "curve_tflops": _curve_rate(curve, f) / 1e12})
        del a, b
    return rows


def gemm_shapes(cal: dict[str, Any], tokens: int, hidden: int, vocab: int, peak_bf16: float) -> list[dict[str, Any]]:
    curve = tuple(sorted((float(r["flops"]), float(r["seconds"])) for r in cal["matmul"]["bf16"]))
    rows = []
    for label, (m, k, n) in {"qkv": (tokens, hidden, 3 * hidden), "proj": (tokens, hidden, hidden),
                             "fc": (tokens, hidden, 4 * hidden), "fc_out": (tokens, 4 * hidden, hidden),
                             "head": (tokens, hidden, vocab)}.items():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        s = cuda_time(lambda a=a, b=b: a @ b)
        f = 2.0 * m * k * n
        rows.append({"gemm": label, "mkn": [m, k, n], "measured_tflops": f / s / 1e12,
                     "curve_tflops": _curve_rate(curve, f) / 1e12,
                     "datasheet_tflops": peak_bf16 * COMPUTE_EFFICIENCY[OpKind.CONTRACTION] / 1e12})
        del a, b
    return rows


def training_step(name: str, batch: int, recompute: bool = False, fused_opt: bool = False) -> Any:
    """A mixed-precision training step on the GPU, as a function: fp32 weights, gradients and optimizer
    states, forward and backward under bf16 autocast (for Adam 16 bytes per parameter, as the memory
    model's bf16 weights + bf16 gradients + fp32 master/m/v). GPTs train with Adam, CNNs with SGD and
    momentum. ``recompute``: every GPT block under ``torch.utils.checkpoint`` (full recomputation).
    ``fused_opt``: the optimizer's fused kernel, else torch's default multi-tensor (foreach) one."""
    import functools

    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model, args, kwargs = build(name, batch, DEVICE)
    if recompute:
        for blk in model.h:
            blk.forward = functools.partial(checkpoint, blk.forward, use_reentrant=False)
    fused = True if fused_opt else None
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, fused=fused) if name in CNNS else \
        torch.optim.Adam(model.parameters(), lr=1e-4, fused=fused)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, torch.bfloat16):
            loss = model(*args, **kwargs)
        loss.backward()
        opt.step()

    return step


def measure_step(name: str, batch: int, fused: bool, recompute: bool = False, fused_opt: bool = False,
                 steps: int = 10, warmup: int = 3) -> dict[str, float]:
    """Median seconds of one :func:`training_step` and the peak memory; ``fused``: flash attention,
    else torch's math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()  # the peak of what ran before (a calibration) is not this step's
    step = training_step(name, batch, recompute, fused_opt)
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION] if fused else [SDPBackend.MATH]
    times, host = [], []
    with sdpa_kernel(backends):
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            h = time.perf_counter()  # the host has enqueued the whole step (nothing in it synchronises)
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t)
                host.append(h - t)
    peak = torch.cuda.max_memory_allocated()
    del step  # the model and optimizer it holds
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    # host_s close to step_s: the GPU waits for the host (eager dispatch bounds the step)
    return {"step_s": statistics.median(times), "min_s": min(times), "host_s": statistics.median(host),
            "peak_memory_bytes": peak}


def conv_shapes(cal: dict[str, Any], batch: int) -> list[dict[str, Any]]:
    """Every distinct convolution of ResNet-50 at ``batch`` in bf16: measured forward and backward
    against the calibrated conv rows (by FLOPs, per kernel class): how a FLOP-keyed curve from a
    channel sweep transfers to a real network's layers."""
    import torch.nn.functional as F

    from polyparallel.cost_models.calibrate_gpu import conv_flops

    model = ResNet().to(DEVICE)
    x = torch.zeros(batch, 3, 224, 224, device=DEVICE)
    seen: dict[tuple, tuple[int, int]] = {}

    def hook(mod: torch.nn.Conv2d, inp: tuple, out: torch.Tensor) -> None:
        key = (mod.in_channels, mod.out_channels, mod.kernel_size[0], mod.stride[0], mod.padding[0], inp[0].shape[-1])
        seen.setdefault(key, (out.shape[-1], 0))
        seen[key] = (out.shape[-1], seen[key][1] + 1)

    hs = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        model(x)
    for h in hs:
        h.remove()
    del model, x
    rows = []
    for (c, o, k, st, pad, hw), (ohw, count) in seen.items():
        a = torch.randn(batch, c, hw, hw, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(o, c, k, k, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(batch, o, ohw, ohw, device=DEVICE, dtype=torch.bfloat16)
        fwd = cuda_time(lambda a=a, w=w, st=st, pad=pad: F.conv2d(a, w, stride=st, padding=pad))
        tot = cuda_time(lambda a=a, w=w, g=g, st=st, pad=pad: torch.autograd.grad(
            F.conv2d(a, w, stride=st, padding=pad), (a, w), g))
        f = conv_flops(batch, c, o, k, ohw)
        key = "bf16/1x1" if k == 1 else "bf16/3x3"
        curve = tuple(sorted((float(r["flops"]), float(r["forward_s"])) for r in cal.get("conv", {}).get(key, [])))
        bcurve = tuple(sorted((float(r["flops"]), float(r["backward_s"])) for r in cal.get("conv", {}).get(key, [])))
        rows.append({"conv": f"{k}x{k}/s{st}", "shape": [batch, c, o, hw], "count": count, "flops": f,
                     "forward_s": fwd, "backward_s": max(tot - fwd, 0.0),
                     "curve_forward_s": f / _curve_rate(curve, f) if curve else None,
                     "curve_backward_s": f / _curve_rate(bcurve, f) if bcurve else None})
        del a, w, g
    return rows


KERNEL_CLASSES = (("attention", ("flash", "fmha", "attention")),
                  ("conv", ("conv", "fprop", "dgrad", "wgrad", "implicit", "cudnn")),
                  ("norm", ("batch_norm", "batchnorm", "bn_", "layer_norm", "welford")),
                  ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma")),
                  ("optimizer", ("multi_tensor", "adam", "foreach")),
                  ("other", ("",)))


def profile_step(name: str, batch: int) -> dict[str, Any]:
    """GPU kernel time of one step by class (matmul, conv, attention, norm, optimizer, other) vs the
    step's wall time: where the compute model's time goes and how long the GPU waits for the host."""
    from torch.profiler import ProfilerActivity, profile

    step = training_step(name, batch)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    by: dict[str, float] = {}
    kernels = 0
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        name = e.name.lower()
        cls = next(c for c, keys in KERNEL_CLASSES if any(k in name for k in keys))
        by[cls] = by.get(cls, 0.0) + e.device_time / 1e6  # device_time is in microseconds
        kernels += 1
    return {"wall_s": wall, "kernel_s": by, "kernels": kernels, "gpu_busy_s": sum(by.values())}


def predict(name: str, batch: int, fused: bool, clusters: dict[str, Cluster], recompute: bool = False,
            fused_opt: bool = False) -> dict[str, Any]:
    import polyparallel as pp
    from polyparallel.transforms import canonicalize, fuse_elementwise

    model, args, kwargs = build(name, batch, "meta")
    g = fuse_elementwise(canonicalize(pp.capture(model, args, kwargs)))
    out: dict[str, Any] = {"model_flops": None}
    for key, cl in clusters.items():
        est = estimate_step(g, cl, ParallelConfig(dtype="bf16", fused_attention=fused, optimizer=optimizer_of(name),
                                                  recompute="full" if recompute else "none", fused_optimizer=fused_opt,
                                                  fused_elementwise=False))  # eager PyTorch: one kernel per op
        out[key] = est.step_time
        out["predicted_memory_bytes"] = est.memory[0].total
        out["predicted_memory_terms"] = dict(est.memory[0].terms)
        out[f"{key}_breakdown"] = {k: round(v, 6) for k, v in est.breakdown().items()}
        out["model_flops"] = est.model_flops_per_step
    return out


def nccl_equivalence(steps: int = 3, lr: float = 0.1, seed: int = 0) -> dict[str, Any]:
    """``train`` of the tiny GPT on the GPU (CUDA + NCCL world of 1) vs the CPU single-process loop."""
    import polyparallel as pp
    from polyparallel.backends.torch import _examples as ex
    from polyparallel.backends.torch import train

    x, y = ex.gpt_data(0)
    s = pp.search(ex.tiny_gpt(), (x,), "local-cpu:1", example_kwargs={"labels": y}, batch_size=ex.BATCH,
                  constraints={"pp": 1, "microbatches": 1, "recompute": "none", "dp": 1, "tp": 1})
    m = "polyparallel.backends.torch._examples"
    log = train(s, f"{m}:tiny_gpt", f"{m}:gpt_data", steps=steps, lr=lr, seed=seed, profile_comm=True)
    ref = ex.single_process_losses(ex.tiny_gpt, ex.gpt_data, steps=steps, lr=lr, seed=seed)
    err = max(abs(r["loss"] - w) / abs(w) for r, w in zip(log, ref))
    return {"gpu_losses": [r["loss"] for r in log], "cpu_losses": ref, "max_rel_diff": err,
            "device": [r.get("device") for r in log], "backend": [r.get("backend") for r in log],
            "comm_ops": [r.get("comm_ops") for r in log], "step_time_s": [r["step_time_s"] for r in log]}


def print_header() -> None:
    print("\ntraining step (bf16 autocast, Adam for GPTs, SGD+momentum for CNNs, one GPU): measured vs predicted")
    print(f"  {'model':<12} {'batch':>5} {'variant':<15} {'measured':>9} {'sheet':>9} {'err':>7} "
          f"{'calib.':>9} {'err':>7}")


def price_row(row: dict[str, Any], clusters: dict[str, Cluster]) -> dict[str, Any]:
    """``row`` (a measured step) with the current model's predictions and errors; printed."""
    fopt = row.get("fused_optimizer", False)
    pred = predict(row["model"], row["batch"], row["fused_attention"], clusters, row["recompute"], fopt)
    row = {**row, **pred, "error_datasheet": pred["datasheet"] / row["step_s"] - 1,
           "error_calibrated": pred["calibrated"] / row["step_s"] - 1,
           "measured_tflops": pred["model_flops"] / row["step_s"] / 1e12}
    variant = ("sgd-m" if row["model"] in CNNS else ("flash" if row["fused_attention"] else "math")) + \
        ("+rc" if row["recompute"] else "") + (" fused opt." if fopt else "")
    print(f"  {row['model']:<12} {row['batch']:>5} {variant:<15} {row['step_s'] * 1e3:8.1f}ms "
          f"{pred['datasheet'] * 1e3:8.1f}ms {100 * row['error_datasheet']:+6.1f}% {pred['calibrated'] * 1e3:8.1f}ms "
          f"{100 * row['error_calibrated']:+6.1f}%   memory {row['peak_memory_bytes'] / 2**30:6.2f} GiB "
          f"measured, {pred['predicted_memory_bytes'] / 2**30:6.2f} predicted", flush=True)
    return row


def reprice(path: str, calibration: str, out: str) -> None:
    """Price the measured steps of an earlier run again with the current cost model (no GPU needed)."""
    old = json.loads(Path(path).read_text())
    tname = old["catalog_type"]
    clusters = {"datasheet": one_gpu_cluster(tname, None), "calibrated": one_gpu_cluster(tname, calibration)}
    print(f"re-priced measurements of {path} ({old['device']}, torch {old['torch']}), calibration {calibration}")
    print_header()
    keep = ("model", "batch", "seq", "fused_attention", "recompute", "fused_optimizer", "step_s", "min_s", "host_s",
            "peak_memory_bytes")
    old["steps"] = [price_row({k: r[k] for k in keep if k in r}, clusters) for r in old["steps"]]
    old["repriced"] = {"from": path, "calibration": calibration}
    Path(out).write_text(json.dumps(old, indent=1, default=str))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", help="a `polyparallel calibrate --device cuda` JSON (default: calibrate now)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--models", default=",".join([m[0] for m in MODELS] + list(CNNS)))
    ap.add_argument("--skip-nccl", action="store_true")
    ap.add_argument("--no-math", action="store_true", help="skip the unfused (math) attention variant")
    ap.add_argument("--profile", default="gpt-tiny,gpt-1.7b,resnet50",
                    help="models whose kernels are profiled by class (CNNs at batch 64)")
    ap.add_argument("--reprice", metavar="RESULT_JSON", help="no GPU: price an earlier run's measured steps again "
                    "with the current cost model (give its --calibration)")
    args = ap.parse_args()
    if args.reprice:
        if not args.calibration:
            raise SystemExit("--reprice needs --calibration FILE (the run's GPU calibration)")
        return reprice(args.reprice, args.calibration, args.out)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_validation.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.backends.cuda.matmul.allow_tf32 = False
    out_path = Path(args.out)
    name = torch.cuda.get_device_name(0)
    cal_path = args.calibration or str(out_path.with_name("calibration_" + catalog_type(name) + ".json"))
    if not args.calibration:
        calibrate_gpu(cal_path, progress=lambda s: print("  " + s, flush=True))
    cal = json.loads(Path(cal_path).read_text())
    tname = catalog_type(name)
    clusters = {"datasheet": one_gpu_cluster(tname, None), "calibrated": one_gpu_cluster(tname, cal_path)}
    peak = clusters["datasheet"].devices[0].type.peak_flops("bf16")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"device": name, "host": platform.node(), "torch": torch.__version__,
                              "calibration": cal_path, "catalog_type": tname}

    print(f"\nGEMMs of GPT-1.7B (tokens 8192, hidden 2304) in bf16 on {name}: TFLOP/s")
    rows = gemm_shapes(cal, 8192, 2304, 51200, peak)
    print(f"  {'gemm':<7} {'m x k x n':<20} {'measured':>9} {'sq. curve':>10} {'80% sheet':>10}")
    for r in rows:
        print(f"  {r['gemm']:<7} {'x'.join(map(str, r['mkn'])):<20} {r['measured_tflops']:9.1f} "
              f"{r['curve_tflops']:10.1f} {r['datasheet_tflops']:10.1f}")
    result["gemms"] = rows
    result["math_attention_bmms"] = bmms = math_attention_bmms(cal)
    print("fp32 bmm of the math attention kernel: TFLOP/s measured vs the fp32 square curve")
    for r in bmms:
        print(f"  {r['bmm']:<12} {'x'.join(map(str, r['batch_mkn'])):<20} {r['measured_tflops']:9.1f} "
              f"{r['curve_tflops']:10.1f}")
    save = lambda: out_path.write_text(json.dumps(result, indent=1, default=str))  # noqa: E731 - partial results
    save()

    steps = []
    wanted = set(args.models.split(","))
    print_header()
    for mname, cfg, batch in MODELS:
        if mname not in wanted:
            continue
        variants = [(True, False, False), (False, False, False), (True, True, False), (True, False, True),
                    (True, True, True)] if mname == "gpt-1.7b" else [(True, False, False), (True, False, True)]
        if args.no_math:
            variants = [v for v in variants if v[0]]
        for fused, rec, fopt in variants:
            meas = measure_step(mname, batch, fused, rec, fopt)
            row = {"model": mname, "batch": batch, "seq": cfg.seq, "fused_attention": fused, "recompute": rec,
                   "fused_optimizer": fopt, **meas}
            steps.append(price_row(row, clusters))
            result["steps"] = steps
            save()
    for mname, batches in CNNS.items():
        if mname not in wanted:
            continue
        for batch in batches:
            for fopt in (False, True):
                meas = measure_step(mname, batch, True, False, fopt)
                row = {"model": mname, "batch": batch, "seq": None, "fused_attention": True, "recompute": False,
                       "fused_optimizer": fopt, **meas}
                steps.append(price_row(row, clusters))
                result["steps"] = steps
                save()

    if "resnet50" in wanted and cal.get("conv"):
        print("\nconvolutions of ResNet-50 (batch 64, bf16): measured vs the calibrated conv rows, ms")
        print(f"  {'conv':<8} {'B,C,O,H':<18} {'n':>2} {'fwd':>8} {'curve':>8} {'bwd':>8} {'curve':>8}")
        rows = conv_shapes(cal, 64)
        for r in rows:
            print(f"  {r['conv']:<8} {','.join(map(str, r['shape'])):<18} {r['count']:>2} {r['forward_s'] * 1e3:8.3f} "
                  f"{(r['curve_forward_s'] or 0) * 1e3:8.3f} {r['backward_s'] * 1e3:8.3f} "
                  f"{(r['curve_backward_s'] or 0) * 1e3:8.3f}")
        result["convs"] = rows
        save()
        torch.cuda.empty_cache()

    prof = {}
    for mname, batch in [(m, b) for m, _, b in MODELS] + [(m, 64) for m in CNNS]:
        if mname in set(args.profile.split(",")) - {""}:
            try:
                r = prof[mname] = profile_step(mname, batch)
            except (RuntimeError, AttributeError, StopIteration) as e:
                prof[mname] = {"error": f"{type(e).__name__}: {e}"}
                print(f"profile {mname}: FAILED {e}")
                continue
            torch.cuda.empty_cache()
            print(f"\nprofile {mname}: wall {r['wall_s'] * 1e3:.1f} ms, GPU busy {r['gpu_busy_s'] * 1e3:.1f} ms in "
                  f"{r['kernels']} kernels: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["kernel_s"].items()))
    result["profile"] = prof
    save()

    if not args.skip_nccl:
        print("\nNCCL path: train() of the tiny GPT on the GPU vs the CPU single-process loop")
        try:
            r = nccl_equivalence()
            print(f"  max relative loss difference {r['max_rel_diff']:.2e}; GPU losses {r['gpu_losses']}")
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}"}
            print(f"  FAILED {r['error']}")
        result["nccl"] = r
    save()
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    sys.exit(main())
