"""Measure this machine: matmul throughput by size, memory bandwidth, kernel floor, gloo collectives.

The result is a JSON file that ``Cluster.preset("local-cpu:<P>")`` (and any spec whose device
type names it under ``calibration:``) turns into a device type and an intra-node link.

**Threads.** A process of a ``local-cpu:<P>`` run computes on ``THREADS_PER_PROCESS`` (= 1)
intra-op thread, as the torch backend's workers do (``pp.train`` launches them with
``OMP_NUM_THREADS=1``, torchrun's own default). Every per-process rate below is measured
with that many threads, so the calibration describes the processes that actually train.
(Measuring with ``cores // P`` threads instead was the cause of a 129x error for one process:
two OpenMP threads on a core shared with other work spin in their barriers, and a small matmul
then takes milliseconds; a training process on one thread never sees that.)

* ``per_processes``: for each ``P`` in ``1`` and the group sizes, ``P`` processes measure at
  once (the slowest rank per quantity). The same ``max P`` gloo workers measure every ``P`` in
  interleaved rounds (the ranks ``>= P`` wait blocked in a barrier), median over rounds, so all
  process counts see the same mix of other work on a shared machine. Measured: matmul times by
  size (square fp32, ``n``), copy bandwidth, the floor of a 1-element op, and (``P >= 2``) ``dtensor_overhead``, what a
  DTensor op adds to it, ``tp_op_overhead``, what a tensor-parallel Linear adds per kernel, and
  ``optimizer_dtensor_overhead``, the optimizer step per sharded parameter tensor (FSDP2 and
  tensor parallelism hold DTensor parameters; see ``_dtensor_overhead``),
  the training-op floor ``training_op_overhead`` (below), and ``attention``: causal
  ``scaled_dot_product_attention`` forward and backward seconds by shape (torch's fused CPU
  kernel, far slower per FLOP than a matmul at these sizes; the compute model prices CPU
  attention ops by these rows, as it does with a GPU's flash-attention rows), and
  ``optimizer_tensor_overhead``: seconds per parameter tensor of torch's CPU optimizer step
  (SGD, Adam, AdamW: a Python loop over tensors and ~k small kernels each), which the step model
  charges per parameter tensor instead of ``k`` kernel floors;
  ``optimizer_element``: seconds per parameter *element* of the same steps on large tensors, at
  two working-set sizes (in cache and in memory; :func:`optimizer_element_rates`), which prices the
  step's arithmetic and traffic instead of a streaming-bandwidth guess; ``gemm``: matmul
  seconds of *skinny* shapes (:func:`gemm_rows`: one dimension ``s`` small, the other two ``L``;
  a Linear layer on a micro-batch of ``s`` tokens runs such GEMMs, far below the rate of a square
  GEMM of the same FLOPs); ``grad_accumulation``: seconds per gradient element that autograd
  adds into an existing ``.grad`` (every micro-batch after the first; :func:`grad_accumulation_rate`).
  This is what each process of a ``P``-process run gets while its siblings compute too (``P``
  above the core count time-shares); ``local-cpu:<P>`` uses these rates as they are;
* ``matmul``: ``{threads: [{n, flops, seconds}]}`` of this process alone with 1 thread and with
  all cores (for reference; ``local-cpu`` uses ``per_processes``), ``conv``,
  ``memory_bandwidth`` and ``launch_overhead`` (all cores);
* ``collectives``: gloo all-reduce times by message size and group size (2–4 real
  ``torch.distributed`` processes on loopback), and the α–β fit of the ring formula

      t(n, p) = 2(p−1)·α + 2(p−1)/p · n/B

  by weighted least squares (:func:`fit_alpha_beta`) over all points (``fit``) and per group
  size (``fit_by_group_size``: ``local-cpu:<P>`` uses the fit measured with ``P`` processes).

**Training-op floor.** A training step runs every op of the model through the framework:
module call, dispatch, an autograd node forward, its backward through the autograd engine,
gradient accumulation into parameters. On a CPU process this host work is paid in series with
the kernels; a raw 1-element kernel (``launch_overhead`` ``τ``) is only part of it. For each
class ``c`` of tiny op (scale, bias add, GELU, softmax, ``nn.Linear``, ``nn.LayerNorm`` on a
``2 × 8`` tensor) a chain of ``K`` such ops is run forward and backward, less the same chain of
identities (the loss and engine start), divided by ``K``: ``T_c``, seconds per op forward and
backward (:func:`training_op_floor`). The compute model prices a tiny op of class ``c`` at
``τ + ω`` forward and ``τ + κ_c·ω`` backward (``κ_c`` backward kernels,
:data:`polyparallel.cost_models.compute.BACKWARD_FACTOR`), so ``ω`` is the least-squares
solution of ``T_c − 2τ = (1 + κ_c)·ω`` over the classes (:func:`fit_training_op_overhead`):

    ω = max(0, Σ_c (1 + κ_c)(T_c − 2τ) / Σ_c (1 + κ_c)²).

It is measured in the same rounds, with the same ``P`` processes at once, as the kernels.

**Statistic.** Each kernel rate is the *median* over several windows of back-to-back calls
about a training step long, all ``P`` processes busy during the same windows (a barrier starts
each size); each collective time is the median over repetitions of the slowest rank. The
medians match how :mod:`benchmarks.executor` reads a training run (median step time), so on a
machine shared with other work the calibration and the run see the same kind of interference.

Every multi-process run has a timeout: a hung group is killed and reported, never waited on. What
other work took of the machine while it measured is recorded (``other_work``) and turned into the
calibration's ``warnings`` by :mod:`.machine_load`.
"""

from __future__ import annotations

import datetime
import datetime as _dt
import json
import os
import platform
import queue
import socket
import statistics
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polyparallel.ir import OpKind

from .compute import BACKWARD_FACTOR, DEFAULT_BACKWARD_FACTOR, attention_flops
from .machine_load import calibration_warnings, cpu_clock, load_average, other_work

__all__ = [
    "ATTENTION_SHAPES",
    "GEMM_LARGE",
    "GEMM_SMALL",
    "OPTIMIZER_WORKING_SETS",
    "THREADS_PER_PROCESS",
    "TRAINING_OP_CLASSES",
    "allreduce_sizes",
    "attention_flops",
    "attention_rows",
    "calibrate",
    "fit_alpha_beta",
    "fit_training_op_overhead",
    "free_port",
    "gemm_rows",
    "grad_accumulation_rate",
    "kernel_rates",
    "optimizer_element_rates",
    "optimizer_tensor_floor",
    "run_group",
    "slowest_rank",
    "tp_kernel_overhead",
    "training_op_floor",
]

# intra-op threads of one training process: what pp.train gives its workers (OMP_NUM_THREADS=1)
THREADS_PER_PROCESS = 1

# causal attention (batch, heads, sequence, head dim) measured by `calibrate`: small-model training sizes,
# and one long sequence (the flash kernel's rate keeps rising with the sequence: 2-3x from 256 to 2048
# positions on a Xeon core; beyond the last row the rate is held, so without it an 8k-position
# attention was priced at the 256-position rate)
ATTENTION_SHAPES = ((2, 4, 64, 32), (4, 4, 128, 32), (4, 8, 256, 64), (1, 8, 2048, 32))

# skinny GEMMs measured by `calibrate`: the small dimension s (tokens of a micro-batch) and the two
# large ones L x L (a layer's width), in both roles a Linear layer's training runs
GEMM_SMALL = (1, 2, 4, 8, 16, 32, 64)  # above 64 rows: the square rate (measured at 64-256: 89-101 vs 97 GFLOP/s)
GEMM_LARGE = (256, 1024)

# the optimizer step per element is measured over (tensors, elements each): Adam's state (16 bytes per
# element) in a core's L2 (1 MB), in a shared L3 (16 MB) and in memory (64 MB)
OPTIMIZER_WORKING_SETS = ((4, 1 << 14), (4, 1 << 18), (4, 1 << 20))

# the tiny ops whose forward + backward make the training-op floor, and the op kind the compute
# model prices each as (its backward kernel count κ comes from that kind)
TRAINING_OP_CLASSES: dict[str, str] = {"scale": "elementwise", "bias_add": "elementwise", "gelu": "elementwise",
                                       "softmax": "softmax", "linear": "contraction", "layer_norm": "norm"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, threads: int, q: Any,
            backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        device = None
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120), device_id=device)
        out = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, "ok", out))
    except Exception:  # the parent reports the worker's traceback
        q.put((rank, "error", traceback.format_exc()))


def run_group(fn: Callable[..., Any], world: int, args: tuple = (), timeout: float = 120.0,
              threads: int = THREADS_PER_PROCESS, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes joined by a process group.

    Each process computes on ``threads`` intra-op threads (default: as a torch-backend worker);
    with ``backend="nccl"`` rank ``r`` drives GPU ``r``.

    ``fn`` must be importable (a module-level function). Returns the per-rank results; raises
    ``RuntimeError`` with the failing rank's traceback, or ``TimeoutError`` after ``timeout``
    seconds (the processes are killed).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, threads, q, backend), daemon=True)
             for r in range(world)]
    for pr in procs:
        pr.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{backend} group of {world} processes did not finish in {timeout:.0f} s")
            try:
                rank, status, out = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [pr for pr in procs if pr.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a {backend} worker exited with code {dead[0].exitcode}") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{out}")
            results[rank] = out
    finally:
        for pr in procs:
            pr.join(timeout=5)
            if pr.is_alive():
                pr.kill()
                pr.join(timeout=5)
    return [results[r] for r in range(world)]


def _time(fn: Callable[[], Any], window: float = 0.03, windows: int = 5, max_calls: int = 100_000) -> float:
    """Seconds per call: the median over ``windows`` windows of back-to-back calls.

    A window (about one training step long) includes the time-sharing with sibling processes
    that a step sees; the median is how a training run's step time is read too.
    """
    fn()
    per_call = []
    for _ in range(windows):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            el = time.perf_counter() - t0
            if el >= window or n >= max_calls:
                break
        per_call.append(el / n)
    return statistics.median(per_call)


def allreduce_sizes(sizes: Sequence[int], iters: int, group: Any = None, device: str = "cpu"
                    ) -> list[tuple[int, float]]:
    """Seconds of an all-reduce of ``n`` bytes (fp32) per size, in a running process group: per
    repetition the slowest rank, then the median. On a GPU each call is timed to completion."""
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    out = []
    for n in sizes:
        x = torch.ones(max(1, n // 4), device=device)
        for _ in range(2):
            dist.all_reduce(x, group=group)
        ts = []
        for _ in range(iters):
            dist.barrier(group=group)
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            sync()
            ts.append(time.perf_counter() - t0)
        # a collective ends when its slowest rank does: per repetition the max over ranks, then the median
        t = torch.tensor(ts, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        out.append((n, float(t.median())))
    return out


def kernel_rates(matmul_sizes: Sequence[int], sync: Callable[[], Any] = lambda: None,
                 attention_shapes: Sequence[tuple[int, int, int, int]] = (),
                 gemm: tuple[Sequence[int], Sequence[int]] = (GEMM_SMALL, GEMM_LARGE),
                 optimizer_sets: Sequence[tuple[int, int]] = OPTIMIZER_WORKING_SETS) -> dict[str, Any]:
    """Matmul times by size, copy bandwidth, the 1-element op floor, the training-op floor,
    fused-attention times by shape (:func:`attention_rows`), the optimizer step per tensor and
    per element (at ``optimizer_sets``), skinny GEMMs (``gemm = (small sizes, large sizes)``) and
    gradient accumulation, in this process.

    ``sync`` (a barrier when several processes measure together) starts every quantity at the
    same moment on all of them, so each window is timed while all siblings are busy.
    """
    import torch

    rows = []
    for n in matmul_sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        sync()
        rows.append({"n": n, "flops": 2.0 * n**3, "seconds": _time(lambda a=a, b=b: torch.mm(a, b))})
    big = torch.empty(16 << 20)
    dst = torch.empty_like(big)
    sync()
    bw = 2 * big.numel() * 4 / _time(lambda: dst.copy_(big), window=0.1)
    one = torch.ones(1)
    sync()
    floor = _time(lambda: torch.add(one, one), window=0.01)
    sync()
    per_op = training_op_floor()
    sync()
    att = attention_rows(attention_shapes)
    sync()
    opt = optimizer_tensor_floor()
    sync()
    opt_elem = optimizer_element_rates(working_sets=optimizer_sets)
    sync()
    skinny = gemm_rows(*gemm)
    sync()
    acc = grad_accumulation_rate()
    return {"matmul": rows, "memory_bandwidth": bw, "launch_overhead": floor, "threads": torch.get_num_threads(),
            "training_ops": per_op, "training_op_overhead": fit_training_op_overhead(per_op, floor), "attention": att,
            "optimizer_tensor_overhead": opt, "optimizer_element": opt_elem, "gemm": skinny, "grad_accumulation": acc}


def gemm_rows(smalls: Sequence[int] = GEMM_SMALL, larges: Sequence[int] = GEMM_LARGE,
              window: float = 0.02, *, timer: Callable[[Callable[[], Any]], float] | None = None,
              device: str = "cpu", dtype: Any = None) -> list[dict[str, Any]]:
    """Seconds of skinny GEMMs in this process: one dimension ``s`` small, the other two ``L``.

    A Linear layer ``y = x·Wᵀ`` on ``s`` tokens of width ``L`` runs, per micro-batch, the forward
    ``(s×L)·(L×L)`` and the input gradient ``(s×L)·(L×L)`` — role ``"out"``: the small dimension
    is a dimension of the output — and the weight gradient ``gᵀ·x = (L×s)·(s×L)`` — role
    ``"reduce"``: the small dimension is the one summed over, and the output is the whole
    ``L×L`` matrix. With few tokens both run far below a square GEMM of the same FLOPs (packing
    the weight dominates, and BLAS picks other kernels), which a FLOP-indexed square curve
    cannot see. Each row: ``{"role", "small", "large", "flops" = 2·s·L², "seconds"}``; the
    compute model prices a contraction's three GEMMs by these rows
    (:func:`polyparallel.cost_models.compute.gemm_rate`). Pairs with ``s ≥ L`` are skipped.
    Defaults: fp32 on this CPU timed by :func:`_time`; the GPU calibration passes CUDA events, its
    device and a 16-bit ``dtype`` (a torch dtype).
    """
    import torch

    timer = timer or (lambda fn: _time(fn, window=window))
    dt = dtype or torch.float32
    rows = []
    for big in larges:
        w = torch.randn(big, big, device=device, dtype=dt)
        for small in smalls:
            if small >= big:
                continue
            x, g = torch.randn(small, big, device=device, dtype=dt), torch.randn(small, big, device=device, dtype=dt)
            fwd = timer(lambda x=x, w=w: torch.mm(x, w.t()))
            wgrad = timer(lambda x=x, g=g: torch.mm(g.t(), x))
            flops = 2.0 * small * big * big
            rows += [{"role": "out", "small": small, "large": big, "flops": flops, "seconds": fwd},
                     {"role": "reduce", "small": small, "large": big, "flops": flops, "seconds": wgrad}]
    return rows


def grad_accumulation_rate(width: int = 1024, tokens: int = 8, pairs: int = 50) -> float:
    """Seconds per gradient element that autograd accumulates into an existing ``.grad``.

    With gradient accumulation (micro-batches, pipeline schedules) every micro-batch after the
    first adds its weight gradient into the parameter's ``.grad`` instead of storing it. The
    cost is the difference of one ``nn.Linear(width, width)`` forward + backward on ``tokens``
    rows with the gradient present and with it cleared, per weight element. The two are timed
    in alternating pairs and the median of the pairwise differences taken, so that a change of
    the machine's load between them cancels:

        a = median_i (t_accumulate,i − t_fresh,i) / width².
    """
    import torch

    lin = torch.nn.Linear(width, width, bias=False)
    x = torch.randn(tokens, width)
    diffs = []
    for i in range(pairs + 2):
        lin.weight.grad = None
        t0 = time.perf_counter()
        lin(x).sum().backward()  # fresh: the gradient is stored
        t1 = time.perf_counter()
        lin(x).sum().backward()  # accumulated into the gradient just stored
        t2 = time.perf_counter()
        if i >= 2:  # warm-up pairs left out
            diffs.append((t2 - t1) - (t1 - t0))
    return max(0.0, statistics.median(diffs) / width**2)


def optimizer_element_rates(optimizers: Sequence[str] = ("sgd", "adam", "adamw"),
                            working_sets: Sequence[tuple[int, int]] = OPTIMIZER_WORKING_SETS,
                            window: float = 0.02) -> dict[str, list[list[float]]]:
    """Seconds per parameter element of torch's CPU optimizer step, at each working-set size (in caches, in memory).

    For ``(n, e)`` in ``working_sets``: a step over ``n`` tensors of ``e`` elements less a step
    over ``n`` tensors of 8 elements (the per-tensor host work cancels, see
    :func:`optimizer_tensor_floor`), divided by ``n·(e − 8)``:

        r(n·e) = (t(n × e) − t(n × 8)) / (n·(e − 8)).

    torch's single-tensor Adam runs ~7 kernels per tensor with ``sqrt`` and divisions at one
    thread: its time per element is not a bandwidth figure, and it depends on whether the
    parameters and their state stay in cache. Returns ``{optimizer: [[elements, seconds per
    element], ...]}`` by total elements ``n·e``.
    """
    import torch

    classes = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}

    def step_time(name: str, n: int, e: int) -> float:
        params = [torch.zeros(e, requires_grad=True) for _ in range(n)]
        for q in params:
            q.grad = torch.full((e,), 1e-3)
        opt = classes[name](params, lr=1e-3)
        return _time(opt.step, window=window, windows=5)

    out: dict[str, list[list[float]]] = {}
    for name in optimizers:
        out[name] = []
        for n, e in working_sets:
            rate = (step_time(name, n, e) - step_time(name, n, 8)) / (n * (e - 8))
            out[name].append([float(n * e), max(rate, 0.0)])
    return out


def optimizer_tensor_floor(optimizers: Sequence[str] = ("sgd", "adam", "adamw"), counts: tuple[int, int] = (8, 32),
                           window: float = 0.01) -> dict[str, float]:
    """Seconds per parameter tensor of a torch CPU optimizer step, on tiny tensors, per optimizer.

    torch's CPU optimizers update tensor by tensor (no multi-tensor kernels on a CPU): a Python
    loop and ~k small kernels per tensor. The per-tensor cost is the slope between steps over
    ``n₁ < n₂`` 8-element tensors, ``(t(n₂) − t(n₁)) / (n₂ − n₁)`` (the step's fixed cost cancels).
    The optimizers are built as the torch backend builds them on a CPU (defaults, ``lr``).
    """
    import torch

    classes = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    out = {}
    for name in optimizers:
        per = []
        for n in counts:
            params = [torch.zeros(8, requires_grad=True) for _ in range(n)]
            for q in params:
                q.grad = torch.ones(8)
            opt = classes[name](params, lr=1e-3)
            per.append(_time(opt.step, window=window))
        out[name] = max(0.0, (per[1] - per[0]) / (counts[1] - counts[0]))
    return out


def attention_rows(shapes: Sequence[tuple[int, int, int, int]] = ATTENTION_SHAPES) -> list[dict[str, Any]]:
    """Causal ``scaled_dot_product_attention`` forward and backward seconds by ``(B, H, S, d)`` in this process.

    torch runs it on a CPU as one fused (flash) kernel each way whatever the model's size; its
    rate is far below a matmul's at training sizes (blocked softmax, per-block exponentials),
    so the compute model prices CPU attention ops by these rows. FLOPs as the IR counts them
    (:func:`attention_flops`).
    """
    import torch
    import torch.nn.functional as F


    rows = []
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
        g = torch.randn(b, h, s, d)
        fwd = _time(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True), window=0.02)
        both = _time(lambda q=q, k=k, v=v, g=g: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g),
                     window=0.02)
        rows.append({"shape": [b, h, s, d], "flops": attention_flops(b, h, s, d), "forward_s": fwd,
                     "backward_s": max(both - fwd, 0.0)})
    return rows


def training_op_floor(ops: int = 16, window: float = 0.01) -> dict[str, float]:
    """Seconds per op of forward + autograd backward of tiny ops, per class of :data:`TRAINING_OP_CLASSES`.

    For each class a chain of ``ops`` ops on a ``2 × 8`` tensor that requires grad is run
    forward, summed and run backward; the same chain of identities (the sum and the engine's
    start) is subtracted and the rest divided by ``ops``. Modules (``nn.Linear``,
    ``nn.LayerNorm``) are called as modules, as a model calls them, and their parameters
    receive gradients.
    """
    import torch
    import torch.nn.functional as F

    width = 8
    x0 = torch.ones(2, width, requires_grad=True)
    lin = [torch.nn.Linear(width, width) for _ in range(ops)]
    ln = [torch.nn.LayerNorm(width) for _ in range(ops)]
    bias = [torch.zeros(width, requires_grad=True) for _ in range(ops)]
    steps: dict[str, Callable[[int, Any], Any]] = {
        "scale": lambda i, y: y * 0.5, "bias_add": lambda i, y: y + bias[i], "gelu": lambda i, y: F.gelu(y),
        "softmax": lambda i, y: F.softmax(y, dim=-1), "linear": lambda i, y: lin[i](y),
        "layer_norm": lambda i, y: ln[i](y)}
    assert set(steps) == set(TRAINING_OP_CLASSES)

    def chain(step: Callable[[int, Any], Any] | None) -> Callable[[], None]:
        def run() -> None:
            y = x0
            for i in range(ops if step is not None else 0):
                y = step(i, y)  # type: ignore[misc]
            y.sum().backward()
        return run

    base = _time(chain(None), window=window)
    return {c: max(0.0, (_time(chain(f), window=window) - base) / ops) for c, f in steps.items()}


def fit_training_op_overhead(per_op: Mapping[str, float], floor: float) -> float:
    r"""The per-op host cost ``ω`` that makes the compute model's price of a tiny op match :func:`training_op_floor`.

    A tiny op of class ``c`` is priced ``τ + ω`` forward and ``τ + κ_c·ω`` backward (``τ`` =
    ``floor``, the raw kernel floor; ``κ_c`` the backward factor of the class's op kind), so

    .. math:: ω = \max\Big(0, \frac{\sum_c (1+κ_c)(T_c − 2τ)}{\sum_c (1+κ_c)^2}\Big)

    (least squares over the measured classes; unknown class names are an error).
    """
    if not per_op:
        raise ValueError("fitting the training-op floor needs at least one measured op class")
    unknown = sorted(set(per_op) - set(TRAINING_OP_CLASSES))
    if unknown:
        raise ValueError(f"unknown training-op classes {unknown}; known: {sorted(TRAINING_OP_CLASSES)}")
    num = den = 0.0
    for c, t in per_op.items():
        kb = BACKWARD_FACTOR.get(OpKind(TRAINING_OP_CLASSES[c]), DEFAULT_BACKWARD_FACTOR)
        num += (1 + kb) * (t - 2 * floor)
        den += (1 + kb) ** 2
    return max(0.0, num / den)


def _dtensor_overhead(procs: int) -> dict[str, Any]:
    """What sharded-tensor (DTensor) ops cost over plain ones on the host, measured with ``procs`` ranks.

    Tensor-parallel modules and FSDP2's sharded parameters run every op on them (forward,
    backward, each optimizer update) through DTensor's dispatch: sharding propagation and
    wrapping on the host, before the local kernel. Three figures:

    * ``dtensor_overhead``: a 1-element-per-rank in-place add, less the plain add's floor;
    * ``tp_op_overhead``: per kernel of a tensor-parallel op: a ``ColwiseParallel`` tiny
      ``nn.Linear`` (``8·procs`` wide, 2 rows) run forward and backward, less the same plain
      Linear, per kernel. Its input needs no gradient, so the backward is the weight gradient
      alone and no collective runs (the sharded output stays local): the difference is the
      host's DTensor work on the forward and the weight-gradient kernel,

          δ_tp = max(0, t_column − t_plain) / 2;

    * ``optimizer_dtensor_overhead``: seconds per *sharded* parameter tensor of torch's CPU
      optimizer step (SGD, Adam, AdamW), the slope over 8 and 32 tiny DTensor parameters, as
      :func:`optimizer_tensor_floor` measures plain ones.

    Ranks ``>= procs`` return zeros.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = DeviceMesh("cpu", list(range(procs)))  # ranks 0..procs-1 (every rank creates it)
    if int(dist.get_rank()) >= procs:
        return {"dtensor_overhead": 0.0, "tp_op_overhead": 0.0, "optimizer_dtensor_overhead": {}}
    a, b = (distribute_tensor(torch.ones(procs), mesh, [Shard(0)]) for _ in range(2))
    x, y = torch.ones(1), torch.ones(1)
    sharded = _time(lambda: a.add_(b, alpha=0.5), window=0.02)
    plain = _time(lambda: x.add_(y, alpha=0.5), window=0.02)
    width = 8 * procs
    tp, ref = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
    parallelize_module(tp, mesh, ColwiseParallel())
    inp = torch.ones(2, width)  # no gradient wanted: the backward runs no collective
    t_tp = _time(lambda: tp(inp).sum().backward(), window=0.02)
    t_ref = _time(lambda: ref(inp).sum().backward(), window=0.02)
    opt = {}
    for name in ("sgd", "adam", "adamw"):
        per = []
        for n in (8, 32):
            params = [torch.nn.Parameter(distribute_tensor(torch.zeros(8 * procs), mesh, [Shard(0)])) for _ in range(n)]
            for q in params:
                q.grad = distribute_tensor(torch.ones(8 * procs), mesh, [Shard(0)])
            cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
            per.append(_time(cls(params, lr=1e-3).step, window=0.01))
        opt[name] = max(0.0, (per[1] - per[0]) / 24)
    return {"dtensor_overhead": max(0.0, sharded - plain), "tp_op_overhead": tp_kernel_overhead(t_tp, t_ref),
            "optimizer_dtensor_overhead": opt}


def tp_kernel_overhead(t_column: float, t_plain: float, kernels: int = 2) -> float:
    """Host seconds per kernel of a tensor-parallel Linear: ``max(0, t_column − t_plain) / kernels``.

    ``t_column``: a column-parallel Linear forward + backward whose input needs no gradient (one
    forward and one weight-gradient kernel, no collective); ``t_plain``: the same plain Linear.
    """
    return max(0.0, t_column - t_plain) / kernels


def _interleaved_measure(rank: int, world: int, counts: Sequence[int], sizes: Sequence[int], iters: int,
                         matmul_sizes: Sequence[int], rounds: int,
                         attention_shapes: Sequence[tuple[int, int, int, int]] = (),
                         gemm: tuple[Sequence[int], Sequence[int]] = (GEMM_SMALL, GEMM_LARGE),
                         optimizer_sets: Sequence[tuple[int, int]] = OPTIMIZER_WORKING_SETS) -> dict[str, Any]:
    """Every process count measured by the same ``world`` workers, in interleaved rounds.

    Round ``r`` measures ``P = counts[0], counts[1], ...`` in turn: ranks ``< P`` compute at once
    while the others wait in a barrier (blocked, off the cores). On a machine shared with other
    work every ``P`` then sees the same mix of load, and one process alone is a worker like
    the others (not the parent process, measured at another moment).
    """
    import torch.distributed as dist

    groups = {p: dist.new_group(list(range(p))) for p in counts if p > 1}  # every rank creates every group
    kernels: dict[int, list[dict[str, Any]]] = {p: [] for p in counts}
    for _ in range(rounds):
        for p in counts:
            dist.barrier()
            if rank < p:
                sync = (lambda g=groups[p]: dist.barrier(group=g)) if p > 1 else (lambda: None)
                kernels[p].append(kernel_rates(matmul_sizes, sync=sync, attention_shapes=attention_shapes, gemm=gemm,
                                               optimizer_sets=optimizer_sets))
    dtensor: dict[int, dict[str, Any]] = {}
    allreduce: dict[int, list[tuple[int, float]]] = {}
    for p in counts:
        if p == 1:
            continue
        dist.barrier()
        dtensor[p] = _dtensor_overhead(p)
        dist.barrier()
        if rank < p:
            allreduce[p] = allreduce_sizes(sizes, iters, group=groups[p])
    dist.barrier()
    return {"kernels": kernels, "dtensor": dtensor, "allreduce": allreduce}


def _median_rounds(per_round: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per quantity, the median over rounds (each round already the slowest rank's)."""
    med = statistics.median
    out = {**per_round[0], "memory_bandwidth": med(k["memory_bandwidth"] for k in per_round),
           "launch_overhead": med(k["launch_overhead"] for k in per_round)}
    if all(k.get("attention") for k in per_round):
        out["attention"] = [{**r, "forward_s": med(k["attention"][i]["forward_s"] for k in per_round),
                             "backward_s": med(k["attention"][i]["backward_s"] for k in per_round)}
                            for i, r in enumerate(per_round[0]["attention"])]
    if all("optimizer_tensor_overhead" in k for k in per_round):
        out["optimizer_tensor_overhead"] = {o: med(k["optimizer_tensor_overhead"][o] for k in per_round)
                                            for o in per_round[0]["optimizer_tensor_overhead"]}
    if all("optimizer_element" in k for k in per_round):
        out["optimizer_element"] = {o: [[e, med(k["optimizer_element"][o][i][1] for k in per_round)]
                                        for i, (e, _) in enumerate(rows)]
                                    for o, rows in per_round[0]["optimizer_element"].items()}
    if all("gemm" in k for k in per_round):
        out["gemm"] = [{**r, "seconds": med(k["gemm"][i]["seconds"] for k in per_round)}
                       for i, r in enumerate(per_round[0]["gemm"])]
    if all("grad_accumulation" in k for k in per_round):
        out["grad_accumulation"] = med(k["grad_accumulation"] for k in per_round)
    if all("training_op_overhead" in k for k in per_round):
        out["training_op_overhead"] = med(k["training_op_overhead"] for k in per_round)
        out["training_ops"] = {c: med(k["training_ops"][c] for k in per_round) for c in per_round[0]["training_ops"]}
    out["matmul"] = [{**r, "seconds": med(k["matmul"][i]["seconds"] for k in per_round)}
                     for i, r in enumerate(per_round[0]["matmul"])]
    return out


def slowest_rank(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Merge per-rank :func:`kernel_rates`: per quantity the slowest rank (a synchronous step waits for it)."""
    rows = [{**r, "seconds": max(k["matmul"][i]["seconds"] for k in per_rank)}
            for i, r in enumerate(per_rank[0]["matmul"])]
    return {"matmul": rows, "memory_bandwidth": min(k["memory_bandwidth"] for k in per_rank),
            "launch_overhead": max(k["launch_overhead"] for k in per_rank),
            "threads": max(k.get("threads", THREADS_PER_PROCESS) for k in per_rank),
            **({"dtensor_overhead": max(k["dtensor_overhead"] for k in per_rank)}
               if all("dtensor_overhead" in k for k in per_rank) else {}),
            **({"training_op_overhead": max(k["training_op_overhead"] for k in per_rank),
                "training_ops": {c: max(k["training_ops"][c] for k in per_rank) for c in per_rank[0]["training_ops"]}}
               if all("training_op_overhead" in k for k in per_rank) else {}),
            **({"attention": [{**r, "forward_s": max(k["attention"][i]["forward_s"] for k in per_rank),
                               "backward_s": max(k["attention"][i]["backward_s"] for k in per_rank)}
                              for i, r in enumerate(per_rank[0]["attention"])]}
               if all(k.get("attention") for k in per_rank) else {}),
            **({"optimizer_tensor_overhead": {o: max(k["optimizer_tensor_overhead"][o] for k in per_rank)
                                              for o in per_rank[0]["optimizer_tensor_overhead"]}}
               if all("optimizer_tensor_overhead" in k for k in per_rank) else {}),
            **({"optimizer_element": {o: [[e, max(k["optimizer_element"][o][i][1] for k in per_rank)]
                                          for i, (e, _) in enumerate(rows)]
                                      for o, rows in per_rank[0]["optimizer_element"].items()}}
               if all("optimizer_element" in k for k in per_rank) else {}),
            **({"gemm": [{**r, "seconds": max(k["gemm"][i]["seconds"] for k in per_rank)}
                         for i, r in enumerate(per_rank[0]["gemm"])]}
               if all("gemm" in k for k in per_rank) else {}),
            **({"grad_accumulation": max(k["grad_accumulation"] for k in per_rank)}
               if all("grad_accumulation" in k for k in per_rank) else {})}


def fit_alpha_beta(points: Sequence[tuple[int, float, float]], bandwidth: float | None = None) -> dict[str, float]:
    r"""Fit ``t = 2(p−1)α + 2(p−1)/p · n/B`` to ``(p, n, t)`` points.

    The model is linear in ``x = (α, 1/B)``: row ``a_i = (2(p_i−1), 2(p_i−1)/p_i · n_i)``.
    Each row is weighted by ``1/t_i`` so that small and large messages count alike (the
    residuals are relative errors), and ``x ≥ 0`` is enforced (non-negative least squares):

    .. math:: \min_{x \ge 0} \sum_i \big((a_i·x − t_i)/t_i\big)^2

    Exact points (``t_i = a_i·x*``) give back ``x*``; ``median_rel_error`` says how well the
    formula describes the measurements. With ``bandwidth`` given, ``B`` is that and ``α ≥ 0``
    alone is fitted, by the same weighted least squares.
    """
    from scipy.optimize import nnls

    if len(points) < 2 and bandwidth is None:
        raise ValueError(f"fitting alpha and bandwidth needs at least 2 (p, bytes, seconds) points, got {len(points)}")
    if not points or any(p < 2 or t <= 0 for p, _, t in points):
        raise ValueError("every point needs a group size p >= 2 and a positive time")
    a = np.array([[2 * (p - 1), 2 * (p - 1) / p * n] for p, n, _ in points], dtype=float)
    y = np.array([t for _, _, t in points], dtype=float)
    w = 1.0 / y
    if bandwidth is not None:
        inv_b = 1.0 / bandwidth
        r = (y - a[:, 1] * inv_b) * w
        col = a[:, 0] * w
        sol = np.array([max(0.0, float(col @ r / (col @ col))), inv_b])
    else:
        sol, _ = nnls(a * w[:, None], y * w)
    alpha, inv_b = float(sol[0]), float(sol[1])
    pred = a @ sol
    rel = float(np.median(np.abs(pred - y) / y))
    return {"alpha": alpha, "bandwidth": 1.0 / inv_b if inv_b > 0 else float("inf"), "median_rel_error": rel}


def calibrate(out: str | os.PathLike[str] | None = None, *, group_sizes: Sequence[int] = (2, 3, 4),
              sizes: Sequence[int] = (4096, 65536, 1 << 20, 8 << 20), matmul_sizes: Sequence[int] = (
                  32, 64, 128, 256, 512, 1024), iters: int = 7, rounds: int = 3, timeout: float = 600.0,
              attention_shapes: Sequence[tuple[int, int, int, int]] = ATTENTION_SHAPES,
              gemm: tuple[Sequence[int], Sequence[int]] = (GEMM_SMALL, GEMM_LARGE),
              optimizer_sets: Sequence[tuple[int, int]] = OPTIMIZER_WORKING_SETS,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure this machine and write the calibration JSON to ``out`` (if given); returns it.

    ``rounds``: how many times every process count's kernels are measured, interleaved (median; 3 by
    default, so that one round hit by a burst of other work is outvoted — the median of 2 is their mean);
    ``gemm``: the (small, large) sizes of the skinny GEMMs; ``optimizer_sets``: the (tensors,
    elements) working sets of the optimizer step per element.
    """
    import torch

    say = progress or (lambda s: None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    prev_threads = torch.get_num_threads()
    result: dict[str, Any] = {
        "host": platform.node(), "machine": platform.machine(), "processor": platform.processor(),
        "cores": cores, "torch": torch.__version__, "threads_per_process": THREADS_PER_PROCESS,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "memory_bytes": _total_memory(), "load_average": load_average(),
    }
    clock = cpu_clock()
    per_procs: dict[str, Any] = {}
    try:
        mm: dict[str, list[dict[str, float]]] = {}
        for threads in sorted({1, cores}):
            torch.set_num_threads(threads)
            rows = []
            for n in matmul_sizes:
                a, b = torch.randn(n, n), torch.randn(n, n)
                s = _time(lambda a=a, b=b: torch.mm(a, b))
                rows.append({"n": n, "flops": 2.0 * n**3, "seconds": s})
                say(f"matmul {n}x{n} on {threads} thread(s): {2 * n**3 / s / 1e9:.1f} GFLOP/s")
            mm[str(threads)] = rows
        result["matmul"] = mm
        torch.set_num_threads(cores)
        conv = []
        for c in (16, 64):
            x, w = torch.randn(8, c, 32, 32), torch.randn(c, c, 3, 3)
            s = _time(lambda x=x, w=w: torch.nn.functional.conv2d(x, w, padding=1))
            conv.append({"channels": c, "flops": 2.0 * 8 * c * c * 9 * 32 * 32, "seconds": s})
            say(f"conv2d {c} channels: {conv[-1]['flops'] / s / 1e9:.1f} GFLOP/s")
        result["conv"] = conv
        big = torch.empty(16 << 20)
        dst = torch.empty_like(big)
        s = _time(lambda: dst.copy_(big), window=0.1)
        result["memory_bandwidth"] = 2 * big.numel() * 4 / s
        say(f"memory bandwidth: {result['memory_bandwidth'] / 1e9:.1f} GB/s")
        one = torch.ones(1)
        result["launch_overhead"] = _time(lambda: torch.add(one, one), window=0.01)
    finally:
        torch.set_num_threads(prev_threads)
    counts = sorted({1, *group_sizes})
    points = []
    runs = []
    try:
        res = run_group(_interleaved_measure, max(counts), (tuple(counts), tuple(sizes), iters, tuple(matmul_sizes),
                                                           rounds, tuple(attention_shapes),
                                                           (tuple(gemm[0]), tuple(gemm[1])), tuple(optimizer_sets)),
                       timeout=timeout, threads=THREADS_PER_PROCESS)
    except (TimeoutError, RuntimeError) as e:
        res = []
        runs.append({"p": max(counts), "error": str(e).splitlines()[0]})
        say(f"{max(counts)} gloo processes: FAILED {e}")
    for p in counts if res else ():
        # per round the slowest of the P ranks that computed together, then the median over rounds
        per_round = [slowest_rank([res[r]["kernels"][p][i] for r in range(p)]) for i in range(rounds)]
        per_procs[str(p)] = _median_rounds(per_round)
        if p > 1:
            d = [res[r]["dtensor"][p] for r in range(p)]  # the slowest rank per figure
            per_procs[str(p)].update(
                dtensor_overhead=max(x["dtensor_overhead"] for x in d),
                tp_op_overhead=max(x["tp_op_overhead"] for x in d),
                optimizer_dtensor_overhead={o: max(x["optimizer_dtensor_overhead"][o] for x in d)
                                            for o in d[0]["optimizer_dtensor_overhead"]})
        _say_rates(say, p, per_procs[str(p)])
        for n, t in res[0]["allreduce"].get(p, []):
            points.append((p, n, t))
            runs.append({"p": p, "bytes": n, "seconds": t})
            say(f"gloo all_reduce p={p} {n} B: {t * 1e6:.0f} us")
    result["per_processes"] = per_procs
    coll: dict[str, Any] = {"op": "all_reduce", "backend": "gloo", "points": runs}
    if len(points) >= 2:
        coll["fit"] = fit_alpha_beta(points)
        # P processes alive change gloo's latency (time-sharing): a fit per group size as well
        coll["fit_by_group_size"] = {str(p): fit_alpha_beta([x for x in points if x[0] == p])
                                     for p in sorted({x[0] for x in points}) if sum(x[0] == p for x in points) >= 2}
        say(f"fit: alpha {coll['fit']['alpha'] * 1e6:.1f} us, bandwidth {coll['fit']['bandwidth'] / 1e9:.2f} GB/s")
    result["collectives"] = coll
    # not the load average after: the calibration's own 2-4 processes raise it; what other work took
    result["other_work"] = other_work(clock, cpu_clock(), cores)
    result["warnings"] = calibration_warnings(result)  # the CLI prints them; a search's device source names them
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    return result


def _say_rates(say: Callable[[str], None], p: int, k: dict[str, Any]) -> None:
    best = max(r["flops"] / r["seconds"] for r in k["matmul"])
    dt = f", DTensor op +{k['dtensor_overhead'] * 1e6:.0f} us" if "dtensor_overhead" in k else ""
    if "tp_op_overhead" in k:
        dt += (f", tensor-parallel kernel +{k['tp_op_overhead'] * 1e6:.0f} us, Adam per DTensor "
               f"{k['optimizer_dtensor_overhead'].get('adam', 0) * 1e6:.0f} us")
    tr = f", training op +{k['training_op_overhead'] * 1e6:.1f} us" if "training_op_overhead" in k else ""
    if k.get("optimizer_tensor_overhead"):
        tr += ", optimizer per tensor " + ", ".join(f"{o} {v * 1e6:.0f} us"
                                                    for o, v in k["optimizer_tensor_overhead"].items())
    if k.get("optimizer_element", {}).get("adam"):
        tr += ", adam per element " + "/".join(f"{r * 1e9:.2f}" for _, r in k["optimizer_element"]["adam"]) + " ns"
    if k.get("gemm"):
        r = min((r for r in k["gemm"] if r["role"] == "reduce"), key=lambda r: (r["small"], -r["large"]))
        tr += f", weight-gradient GEMM at {r['small']} token(s) {r['flops'] / r['seconds'] / 1e9:.1f} GFLOP/s"
    if "grad_accumulation" in k:
        tr += f", gradient accumulation {k['grad_accumulation'] * 1e9:.2f} ns/element"
    if k.get("attention"):
        r = k["attention"][-1]
        tr += (f", attention {r['flops'] / r['forward_s'] / 1e9:.1f}/"
               f"{r['flops'] / max(r['backward_s'], 1e-12) / 1e9:.1f} GFLOP/s fwd/bwd")
    say(f"{p} process(es) at once, {THREADS_PER_PROCESS} thread each: best matmul {best / 1e9:.1f} GFLOP/s per "
        f"process, copy {k['memory_bandwidth'] / 1e9:.1f} GB/s, 1-element op {k['launch_overhead'] * 1e6:.1f} us"
        f"{dt}{tr}")


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8 << 30
