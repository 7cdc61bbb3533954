"""Calibrate a CUDA device with torch: what its kernels and collectives really reach.

``polyparallel calibrate --device cuda`` measures, on the GPU this process sees:

* **matmul throughput by size and dtype**: square ``n×n·n×n`` products for ``n`` = 256…8192 in
  fp32 (TF32 off), tf32, bf16 and fp16, timed with CUDA events (median of windows, after warm-up).
  The compute model prices a matrix kernel of ``F`` FLOPs at the rate measured at the nearest
  FLOP count (log–log interpolation, :func:`polyparallel.cost_models.compute._curve_rate`);
* **fused attention** (``scaled_dot_product_attention``, causal, head dim 64/128) forward and
  backward by size, in bf16/fp16: the rate a flash-attention kernel reaches, which the compute
  model uses for attention ops priced as fused;
* **convolutions** (``conv2d``, NCHW, 3×3 and 1×1, batch 32, channels 16…1024) forward and backward
  by FLOP count, per dtype: cuDNN's rate differs from a GEMM's of the same FLOPs (small channel
  counts, im2col/implicit-GEMM tiles), so conv ops are priced by their own curve, per kernel class;
* **HBM bandwidth**: a device-to-device copy of 1 GiB (bytes read + written per second), stored as
  the fraction ``η_m`` of the data sheet's figure that the cluster's device type declares;
* **streaming kernels**: batch norm (training, NCHW) and layer norm forward and backward by size,
  and ReLU / GELU / add by size: what normalisation and elementwise kernels reach, which a copy's
  bandwidth overstates;
* **the host's cost per eager op** by class (elementwise, linear, conv, batch/layer norm, view,
  attention, cross entropy, embedding), forward and backward through autograd on tiny tensors: what
  bounds a step when its kernels are shorter than their dispatch;
* **the kernel floor**: the time per op of back-to-back tiny eager ops (host dispatch included:
  the rate at which PyTorch feeds a GPU with kernels that do no work);
* **NCCL all-reduce** by message size for every group size 2…G the machine's GPUs allow, fitted
  with the ring α–β model (:func:`polyparallel.cost_models.calibrate.fit_alpha_beta`). With one
  GPU only the 1-rank world is run (it proves the NCCL path works; it prices nothing).

The JSON written has ``"kind": "cuda"``. A cluster spec uses it through its device type::

    device_types:
      h200-here: {kind: gpu, peak: {...data sheet...}, memory: 141 GB, memory_bandwidth: 4800 GB/s,
                  calibration: calibration_h200.json}

Then :func:`polyparallel.cluster.gpu_calibrated_type` keeps the data-sheet peaks (for anything
not measured) and adds the measured curves, bandwidth fraction and floor.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from polyparallel.cost_models.calibrate import allreduce_sizes, attention_flops, fit_alpha_beta, gemm_rows, run_group

__all__ = ["CONV_SHAPES", "HOST_OP_CLASSES", "attention_flops", "calibrate_gpu", "conv_flops", "conv_rows",
           "cuda_time", "gemm_rows_gpu", "host_op_seconds", "misaligned_rows", "norm_rows", "optimizer_host"]

_TORCH_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def cuda_time(fn: Callable[[], Any], *, min_window: float = 0.02, windows: int = 5, warmup: int = 3) -> float:
    """Median seconds per call of ``fn`` on the current CUDA stream, timed with CUDA events.

    Each window runs ``fn`` ``k`` times between two events, ``k`` grown until a window lasts
    ``min_window`` seconds, so launch gaps between calls count as they do in a training loop.
    """
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    k = 1
    while True:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(k):
            fn()
        b.record()
        b.synchronize()
        s = a.elapsed_time(b) / 1e3
        if s >= min_window or k >= 1 << 16:
            break
        k = max(k * 2, int(k * min_window / max(s, 1e-7)) + 1)
    out = [s / k]
    for _ in range(windows - 1):
        a.record()
        for _ in range(k):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / k)
    return statistics.median(out)


def _matmul_rows(dtypes: Sequence[str], sizes: Sequence[int], say: Callable[[str], None]) -> dict[str, list]:
    import torch

    out: dict[str, list[dict[str, float]]] = {}
    prev = torch.backends.cuda.matmul.allow_tf32
    try:
        for dt in dtypes:
            torch.backends.cuda.matmul.allow_tf32 = dt == "tf32"
            rows = []
            for n in sizes:
                a = torch.randn(n, n, device="cuda", dtype=getattr(torch, _TORCH_DTYPES[dt]))
                b = torch.randn(n, n, device="cuda", dtype=a.dtype)
                s = cuda_time(lambda a=a, b=b: torch.mm(a, b))
                rows.append({"n": n, "flops": 2.0 * n**3, "seconds": s})
                say(f"matmul {dt} {n}x{n}: {2 * n**3 / s / 1e12:.1f} TFLOP/s")
                del a, b
            out[dt] = rows
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return out


def _attention_rows(dtypes: Sequence[str], say: Callable[[str], None]) -> dict[str, list]:
    import torch
    import torch.nn.functional as F

    shapes = [(4, 16, 512, 64), (4, 16, 1024, 64), (4, 16, 2048, 64), (4, 16, 4096, 128), (2, 32, 8192, 128)]
    out: dict[str, list[dict[str, float]]] = {}
    for dt in dtypes:
        rows = []
        for b, h, s, d in shapes:
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=getattr(torch, _TORCH_DTYPES[dt]),
                                   requires_grad=True) for _ in range(3))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            g = torch.randn_like(y)
            fwd = cuda_time(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True))

            def both(q=q, k=k, v=v, g=g) -> None:
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

            total = cuda_time(both)
            f = attention_flops(b, h, s, d)
            rows.append({"shape": [b, h, s, d], "flops": f, "forward_s": fwd, "backward_s": max(total - fwd, 0.0)})
            say(f"attention {dt} B{b} H{h} S{s} d{d}: forward {f / fwd / 1e12:.1f} TFLOP/s, "
                f"backward/forward {max(total - fwd, 0.0) / fwd:.2f}")
            del q, k, v, y, g
        out[dt] = rows
    return out


# (in channels = out channels, spatial size) swept at batch 32 for a 3x3 (padding 1) and a 1x1
# convolution: FLOP counts from ~5e7 to ~5e11, the range of a ResNet's layers
CONV_SHAPES: tuple[tuple[int, int], ...] = ((16, 56), (32, 56), (64, 56), (128, 28), (256, 28), (512, 14),
                                            (1024, 14))


def conv_flops(batch: int, cin: int, cout: int, kernel: int, out_hw: int) -> float:
    """FLOPs of a 2-D convolution as the IR counts them: ``2·B·O·H'·W'·C·k²`` (one multiply-add = 2)."""
    return 2.0 * batch * cout * out_hw * out_hw * cin * kernel * kernel


def conv_rows(dtypes: Sequence[str], say: Callable[[str], None] = lambda s: None, *, batch: int = 32,
              shapes: Sequence[tuple[int, int]] = CONV_SHAPES, kernels: Sequence[int] = (3, 1),
              timer: Callable[[Callable[[], Any]], float] | None = None,
              device: str = "cuda") -> dict[str, list[dict[str, Any]]]:
    """Forward and backward seconds of ``conv2d`` by FLOP count, per dtype and kernel class.

    Returns ``{"bf16/3x3": rows, "bf16/1x1": rows, ...}``; a row is ``{"shape": [B, C, O, k, H],
    "flops", "forward_s", "backward_s"}`` with ``backward_s`` = (forward + backward of input and
    weight gradients) − forward. Stride 1, ``padding = k // 2``, NCHW (the memory format of a model
    that does not ask for another), cuDNN's autotuner off (torch's default). ``fp32`` runs with
    TF32 off, ``tf32`` with it on. ``timer``/``device`` default to CUDA events on the GPU; tests pass
    a CPU timer.
    """
    import torch
    import torch.nn.functional as F

    timer = timer or cuda_time
    out: dict[str, list[dict[str, Any]]] = {}
    prev = torch.backends.cudnn.allow_tf32
    try:
        for dt in dtypes:
            torch.backends.cudnn.allow_tf32 = dt == "tf32"
            dtype = getattr(torch, _TORCH_DTYPES[dt])
            for k in kernels:
                rows = []
                for c, hw in shapes:
                    x = torch.randn(batch, c, hw, hw, device=device, dtype=dtype, requires_grad=True)
                    w = torch.randn(c, c, k, k, device=device, dtype=dtype, requires_grad=True)
                    y = F.conv2d(x, w, padding=k // 2)
                    g = torch.randn_like(y)
                    fwd = timer(lambda x=x, w=w, p=k // 2: F.conv2d(x, w, padding=p))

                    def both(x=x, w=w, g=g, p=k // 2) -> None:
                        torch.autograd.grad(F.conv2d(x, w, padding=p), (x, w), g)

                    total = timer(both)
                    f = conv_flops(batch, c, c, k, hw)
                    rows.append({"shape": [batch, c, c, k, hw], "flops": f, "forward_s": fwd,
                                 "backward_s": max(total - fwd, 0.0)})
                    say(f"conv {dt} {k}x{k} B{batch} C{c} {hw}x{hw}: forward {f / fwd / 1e12:.2f} TFLOP/s, "
                        f"backward/forward {max(total - fwd, 0.0) / fwd:.2f}")
                    del x, w, y, g
                out[f"{dt}/{k}x{k}"] = rows
    finally:
        torch.backends.cudnn.allow_tf32 = prev
    return out


# host classes of eager ops timed by :func:`host_op_seconds` (the compute model maps op kinds onto them)
HOST_OP_CLASSES = ("elementwise", "linear", "conv", "batch_norm", "layer_norm", "view", "attention",
                   "cross_entropy", "embedding", "backward_call")


def host_op_seconds(chain: int = 32, device: str = "cuda",
                    timer: Callable[[Callable[[], Any]], float] | None = None,
                    autocast: str | None = None) -> dict[str, float]:
    """Seconds per eager op of each class, forward and backward through autograd, on tiny tensors.

    A chain of ``chain`` ops of one class (each the input of the next, so autograd records them
    all) runs forward and backward; the time of the chain's input reduction and backward alone is
    subtracted and the rest divided by ``chain``. On a GPU the kernels do no work, so this is the
    host's dispatch, autograd and launch cost of one op, both passes: when a step's kernels are
    shorter than this, the GPU waits for the host (eager training of a small model is bound by it).
    ``autocast`` (``bf16``/``fp16``): the chains run under ``torch.autocast``, as mixed-precision
    training runs them (matrix ops then also cast their fp32 weights, one more op each).
    """
    import torch
    import torch.nn.functional as F

    base_timer = timer or (lambda fn: cuda_time(fn, min_window=0.02))
    if autocast:
        def timer(fn: Callable[[], Any]) -> float:
            def under() -> None:
                with torch.autocast(device, getattr(torch, _TORCH_DTYPES[autocast])):
                    fn()
            return base_timer(under)
    else:
        timer = base_timer
    dev = torch.device(device)
    x0 = torch.ones(8, 8, device=dev, requires_grad=True)
    img = torch.ones(2, 4, 6, 6, device=dev, requires_grad=True)
    seq = torch.ones(1, 2, 8, 8, device=dev, requires_grad=True)  # (batch, heads, seq, head dim)
    lin = [torch.nn.Linear(8, 8, device=dev) for _ in range(chain)]
    convs = [torch.nn.Conv2d(4, 4, 3, padding=1, device=dev) for _ in range(chain)]
    bns = [torch.nn.BatchNorm2d(4, device=dev) for _ in range(chain)]
    lns = [torch.nn.LayerNorm(8, device=dev) for _ in range(chain)]
    emb = [torch.nn.Embedding(8, 8, device=dev) for _ in range(chain)]
    ids = torch.zeros(8, dtype=torch.long, device=dev)
    tgt = torch.zeros(8, dtype=torch.long, device=dev)

    def run(x: torch.Tensor, step: Callable[[int, torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def chain_fn() -> None:
            y = x
            for i in range(chain):
                y = step(i, y)
            y.sum().backward()
        return chain_fn

    def embed(i: int, y: torch.Tensor) -> torch.Tensor:
        return emb[i](ids) + y  # the add keeps the chain connected (its cost is the elementwise class's)

    chains = {
        "elementwise": (x0, lambda i, y: y * 1.0001),
        "linear": (x0, lambda i, y: lin[i](y)),
        "conv": (img, lambda i, y: convs[i](y)),
        "batch_norm": (img, lambda i, y: bns[i](y)),
        "layer_norm": (x0, lambda i, y: lns[i](y)),
        "view": (x0, lambda i, y: y.t()),
        "attention": (seq, lambda i, y: F.scaled_dot_product_attention(y, y, y, is_causal=True)),
        "cross_entropy": (x0, lambda i, y: y + F.cross_entropy(y, tgt)),  # + elementwise (its class)
        "embedding": (x0, embed),
    }
    out: dict[str, float] = {}
    base = 0.0
    for name, (x, step) in chains.items():
        base = timer(lambda x=x: x.sum().backward())  # the reduction + backward call alone
        out[name] = max(timer(run(x, step)) - base, 0.0) / chain
    # what every step pays once: a loss reduction and the backward call (the autograd engine's start)
    out["backward_call"] = base
    for name in ("cross_entropy", "embedding"):  # each link also ran one elementwise add
        out[name] = max(out[name] - out["elementwise"], 0.0)
    return out


def optimizer_host(counts: tuple[int, int] = (8, 64), device: str = "cuda",
                   timer: Callable[[Callable[[], Any]], float] | None = None) -> dict[str, dict[str, float]]:
    """Host seconds of one ``optimizer.step()`` on tiny parameters: a fixed part and a part per tensor.

    For SGD with momentum and Adam, each with torch's default multi-tensor (``foreach``) kernels and
    with ``fused=True``: the step over ``n₁`` and ``n₂`` parameter tensors of 8 elements (the kernels
    do no work, the host's Python and dispatch is what is timed), fitted as ``fixed + n·per_tensor``.
    A step over a model's parameters lasts at least this on the host.
    """
    import torch

    timer = timer or (lambda fn: cuda_time(fn, min_window=0.02))
    out: dict[str, dict[str, float]] = {}
    for name in ("sgd_momentum", "adam"):
        for mode in ("foreach", "fused"):
            times = []
            for n in counts:
                ps = [torch.zeros(8, device=device, requires_grad=True) for _ in range(n)]
                for p in ps:
                    p.grad = torch.ones_like(p)
                kw = {"fused": True} if mode == "fused" else {"foreach": True}
                opt = torch.optim.SGD(ps, lr=1e-3, momentum=0.9, **kw) if name == "sgd_momentum" else \
                    torch.optim.Adam(ps, lr=1e-3, **kw)
                times.append(timer(opt.step))
            per = max((times[1] - times[0]) / (counts[1] - counts[0]), 0.0)
            out[f"{name}/{mode}"] = {"fixed": max(times[0] - per * counts[0], 0.0), "per_tensor": per}
    return out


GEMM_GPU_SMALL = (128, 256, 512, 768, 1024, 2048, 4096)
GEMM_GPU_LARGE = (2048, 4096, 8192, 16384)


def gemm_rows_gpu(dtype: str = "bf16", smalls: Sequence[int] = GEMM_GPU_SMALL,
                  larges: Sequence[int] = GEMM_GPU_LARGE, say: Callable[[str], None] = lambda s: None,
                  timer: Callable[[Callable[[], Any]], float] | None = None,
                  device: str = "cuda") -> list[dict[str, Any]]:
    """Seconds of GEMMs with one dimension ``s`` smaller than the other two (``L``), in ``dtype``.

    The rows of :func:`polyparallel.cost_models.calibrate.gemm_rows` (role ``out``: ``(s×L)·(L×L)``,
    the small dimension in the output, as a Linear's forward and input gradient on ``s`` tokens or
    to ``s`` features; role ``reduce``: ``(L×s)·(s×L)``, the small dimension summed, as a weight
    gradient or a Linear with ``s`` input features) at GPU sizes, timed with CUDA events. (On the
    H200, from ``s`` = 512 up they run within 10–20% of a square product of the same FLOPs.)
    """
    import torch


    rows = gemm_rows(smalls, larges, timer=timer or (lambda fn: cuda_time(fn, min_window=0.01)), device=device,
                     dtype=getattr(torch, _TORCH_DTYPES[dtype]))
    for out, red in zip(rows[::2], rows[1::2], strict=True):
        say(f"gemm {dtype} s={out['small']} L={out['large']}: out {out['flops'] / out['seconds'] / 1e12:.0f}, "
            f"reduce {red['flops'] / red['seconds'] / 1e12:.0f} TFLOP/s")
    return rows


# (m, k, n) GEMMs whose n is not a multiple of 8, each timed against n rounded up to one: a
# language model's head over a 50257-token vocabulary (GPT-2), and its two backward GEMMs
MISALIGNED_SHAPES = ((8192, 768, 50257), (8192, 50257, 768), (768, 8192, 50257), (8192, 1024, 50257),
                     (4096, 4096, 4099), (8192, 2048, 1001))


def misaligned_rows(dtype: str = "bf16", shapes: Sequence[tuple[int, int, int]] = MISALIGNED_SHAPES,
                    say: Callable[[str], None] = lambda s: None,
                    timer: Callable[[Callable[[], Any]], float] | None = None,
                    device: str = "cuda") -> list[dict[str, Any]]:
    """Seconds of GEMMs with a dimension that is not a multiple of 8, and of the same GEMM padded.

    16-bit tensor-core GEMMs want every dimension a multiple of 8 (16 bytes); otherwise cuBLAS falls
    back to kernels that can run several times slower (the reason GPT-2's vocabulary is padded to
    50304 in fast implementations). Each row: ``{"mkn", "padded", "seconds", "padded_seconds"}``.
    """
    import torch

    timer = timer or (lambda fn: cuda_time(fn, min_window=0.01))
    dt = getattr(torch, _TORCH_DTYPES[dtype])
    rows = []
    for m, k, n in shapes:
        pad = tuple(-(-d // 8) * 8 for d in (m, k, n))
        ts = []
        for a, b, c in ((m, k, n), pad):
            x, w = torch.randn(a, b, device=device, dtype=dt), torch.randn(b, c, device=device, dtype=dt)
            ts.append(timer(lambda x=x, w=w: torch.mm(x, w)))
            del x, w
        rows.append({"mkn": [m, k, n], "padded": list(pad), "seconds": ts[0], "padded_seconds": ts[1]})
        say(f"gemm {dtype} {m}x{k}x{n}: {ts[0] / ts[1]:.2f}x the time of {'x'.join(map(str, pad))}")
    return rows


def norm_rows(dtypes: Sequence[str], say: Callable[[str], None] = lambda s: None, *,
              timer: Callable[[Callable[[], Any]], float] | None = None,
              device: str = "cuda") -> dict[str, list[dict[str, Any]]]:
    """Forward and backward seconds of batch norm (training mode, NCHW) and layer norm by size, and
    of elementwise kernels (ReLU, GELU, add) by size, per dtype.

    Rows are keyed by the input's element count: ``{"numel", "forward_s", "backward_s"}``;
    ``"{dtype}/batch_norm"``, ``"{dtype}/layer_norm"``, ``"{dtype}/elementwise"`` (the mean of ReLU,
    GELU and a two-input add, forward only in ``forward_s``; ``backward_s`` the same ops' backward).
    Streaming kernels reach different fractions of a copy's bandwidth (a batch norm in NCHW reads
    its input twice, for the statistics and to normalise, and reduces across the batch and the image).
    """
    import torch
    import torch.nn.functional as F

    timer = timer or (lambda fn: cuda_time(fn, min_window=0.01))
    dev = torch.device(device)
    out: dict[str, list[dict[str, Any]]] = {}
    for dt in dtypes:
        dtype = getattr(torch, _TORCH_DTYPES[dt])
        bn_rows, ln_rows, ew_rows = [], [], []
        for b, c, hw in ((32, 64, 56), (32, 256, 56), (32, 512, 28), (32, 1024, 14), (64, 2048, 7)):
            x = torch.randn(b, c, hw, hw, device=dev, dtype=dtype, requires_grad=True)
            bn = torch.nn.BatchNorm2d(c, device=dev)  # fp32 parameters, as under autocast
            g = torch.randn_like(x)
            fwd = timer(lambda x=x, bn=bn: bn(x))
            tot = timer(lambda x=x, bn=bn, g=g: torch.autograd.grad(bn(x), (x, bn.weight), g))
            bn_rows.append({"shape": [b, c, hw, hw], "numel": x.numel(), "forward_s": fwd,
                            "backward_s": max(tot - fwd, 0.0)})
            say(f"batch norm {dt} {b}x{c}x{hw}x{hw}: forward {x.numel() * x.element_size() / fwd / 1e9:.0f} GB/s "
                f"of input, backward/forward {max(tot - fwd, 0.0) / fwd:.2f}")
            del x, g
        for t, h in ((8192, 768), (8192, 2304), (16384, 4096), (4096, 12288)):
            x = torch.randn(t, h, device=dev, dtype=dtype, requires_grad=True)
            ln = torch.nn.LayerNorm(h, device=dev, dtype=dtype)
            g = torch.randn_like(x)
            fwd = timer(lambda x=x, ln=ln: ln(x))
            tot = timer(lambda x=x, ln=ln, g=g: torch.autograd.grad(ln(x), (x, ln.weight), g))
            ln_rows.append({"shape": [t, h], "numel": x.numel(), "forward_s": fwd, "backward_s": max(tot - fwd, 0.0)})
            say(f"layer norm {dt} {t}x{h}: forward {x.numel() * x.element_size() / fwd / 1e9:.0f} GB/s of input")
            del x, g
        for n in (1 << 16, 1 << 20, 1 << 23, 1 << 25, 1 << 27):
            x = torch.randn(n, device=dev, dtype=dtype, requires_grad=True)
            y = torch.randn(n, device=dev, dtype=dtype, requires_grad=True)
            g = torch.randn_like(x)
            fw = [timer(lambda x=x: F.relu(x)), timer(lambda x=x: F.gelu(x)), timer(lambda x=x, y=y: x + y)]
            tot = [timer(lambda x=x, g=g: torch.autograd.grad(F.relu(x), x, g)),
                   timer(lambda x=x, g=g: torch.autograd.grad(F.gelu(x), x, g)),
                   timer(lambda x=x, y=y, g=g: torch.autograd.grad(x + y, (x, y), g))]
            f = statistics.mean(fw)
            ew_rows.append({"numel": n, "forward_s": f, "backward_s": max(statistics.mean(tot) - f, 0.0),
                            "relu_gelu_add_s": fw})
            say(f"elementwise {dt} {n}: relu {2 * n * x.element_size() / fw[0] / 1e9:.0f} GB/s, "
                f"add {3 * n * x.element_size() / fw[2] / 1e9:.0f} GB/s")
            del x, y, g
        out[f"{dt}/batch_norm"], out[f"{dt}/layer_norm"], out[f"{dt}/elementwise"] = bn_rows, ln_rows, ew_rows
    return out


def _nccl_allreduce(rank: int, world: int, sizes: Sequence[int], iters: int) -> list[tuple[int, float]]:

    return allreduce_sizes(sizes, iters, device="cuda")


def calibrate_gpu(out: str | os.PathLike[str] | None = None, *, dtypes: Sequence[str] = ("fp32", "tf32", "bf16",
                  "fp16"), matmul_sizes: Sequence[int] = (256, 512, 1024, 2048, 4096, 8192),
                  nccl_sizes: Sequence[int] = (1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 27), iters: int = 10,
                  timeout: float = 300.0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure the visible CUDA GPU(s) and write the calibration JSON to ``out`` (if given); return it."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("calibrate --device cuda: torch sees no CUDA device here (torch.cuda.is_available() "
                           "is False); run it on the GPU machine, or calibrate this CPU without --device")
    for dt in dtypes:
        if dt not in _TORCH_DTYPES:
            raise ValueError(f"unknown dtype {dt!r}: choose from {', '.join(_TORCH_DTYPES)}")
    say = progress or (lambda s: None)
    prop = torch.cuda.get_device_properties(0)
    res: dict[str, Any] = {
        "kind": "cuda", "host": platform.node(), "device_name": prop.name,
        "multiprocessors": prop.multi_processor_count, "memory_bytes": prop.total_memory,
        "gpus": torch.cuda.device_count(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    say(f"{prop.name}: {prop.multi_processor_count} SMs, {prop.total_memory / 2**30:.0f} GiB, "
        f"{res['gpus']} GPU(s) visible")
    res["matmul"] = _matmul_rows(dtypes, matmul_sizes, say)
    res["attention"] = _attention_rows([d for d in dtypes if d in ("bf16", "fp16")], say)
    res["conv"] = conv_rows(dtypes, say)
    src = torch.empty(1 << 28, device="cuda")  # 1 GiB of fp32
    dst = torch.empty_like(src)
    s = cuda_time(lambda src=src, dst=dst: dst.copy_(src), min_window=0.05)
    res["memory_bandwidth"] = 2 * src.numel() * 4 / s
    say(f"copy bandwidth: {res['memory_bandwidth'] / 1e9:.0f} GB/s (read + write)")
    del src, dst
    one = torch.ones(1, device="cuda")
    res["launch_overhead"] = cuda_time(lambda: torch.add(one, one), min_window=0.01)
    say(f"tiny eager op: {res['launch_overhead'] * 1e6:.1f} us")
    res["training_ops"] = host_op_seconds()
    say("tiny ops through autograd, forward + backward per op: " +
        ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in res["training_ops"].items()))
    for dt in ("bf16", "fp16"):
        if dt in dtypes:
            res[f"training_ops_{dt}"] = host_op_seconds(autocast=dt)
            say(f"the same under {dt} autocast: " +
                ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in res[f"training_ops_{dt}"].items()))
    res["optimizer_host"] = optimizer_host()
    say("optimizer step on the host: " + ", ".join(f"{k} {v['fixed'] * 1e6:.0f} us + {v['per_tensor'] * 1e6:.1f} "
                                                     "us/tensor" for k, v in res["optimizer_host"].items()))
    res["streaming"] = norm_rows([d for d in dtypes if d in ("bf16", "fp32")], say)
    res["gemm"] = {dt: gemm_rows_gpu(dt, say=say) for dt in dtypes if dt in ("bf16",)}
    res["misaligned"] = {dt: misaligned_rows(dt, say=say) for dt in dtypes if dt in ("bf16",)}

    coll: dict[str, Any] = {"op": "all_reduce", "backend": "nccl", "points": []}
    points = []
    for p in range(1, res["gpus"] + 1):
        if p > 1 and p & (p - 1):
            continue  # group sizes 1, 2, 4, 8
        try:
            rows = run_group(_nccl_allreduce, p, (tuple(nccl_sizes), iters), timeout=timeout, backend="nccl")[0]
        except Exception as e:  # a failed collective must not discard the kernels measured above
            coll["points"].append({"p": p, "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"})
            say(f"NCCL all_reduce on {p} GPU(s): FAILED {e}")
            continue
        for n, t in rows:
            coll["points"].append({"p": p, "bytes": n, "seconds": t})
            say(f"NCCL all_reduce p={p} {n} B: {t * 1e6:.1f} us")
            if p > 1:
                points.append((p, n, t))
    if len(points) >= 2:
        coll["fit"] = fit_alpha_beta(points)
    else:
        coll["note"] = "fewer than 2 GPUs: the 1-rank NCCL world was run to check the path; no α–β fit"
    res["collectives"] = coll
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))
    return res
