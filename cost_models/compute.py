"""Compute cost of one op on one device: a roofline with per-op-class efficiencies.

For an op with ``F`` FLOPs (from its loop nest) moving ``Q`` bytes (its distinct operands,
counted once, at the compute precision), on a device with peak ``P_dtype`` FLOP/s for the
op's unit, memory bandwidth ``W`` and launch overhead ``τ``:

    t_fwd = max( F / (η_c(kind) · P),  Q / (η_m · W),  τ )

An op whose temporaries are materialised (attention without a fused kernel) is priced as one
such kernel per statement, each moving its whole operands, temporaries included, and the
times add up. ``η_c`` is the fraction of peak a kernel of that class reaches (large GEMMs ~0.8 on tensor
cores, convolutions less, unfused attention less still); ``η_m`` the fraction of data-sheet
bandwidth a streaming kernel reaches. Matrix ops (contraction, conv, attention) run at the
dtype's matrix-unit peak; everything else runs on the vector units, priced at the fp32 peak.
A device with a measured ``matmul_curve`` (a calibrated CPU) prices matrix ops by the
throughput measured at the nearest size (interpolated in log–log), which already includes
their memory traffic, so no bandwidth term is added for them. A calibrated GPU
(``polyparallel calibrate --device cuda``) has one curve per dtype: ``η_c·P`` becomes the
measured rate at the kernel's FLOP count, the bandwidth term stays (a skinny GEMM's HBM traffic
is not in a square product's time), ``η_m`` is the measured fraction of data-sheet bandwidth,
and a fused attention op is priced by the measured flash-attention rows, forward and backward
separately (``t_bwd = F / R_bwd(F)`` instead of ``κ·t_fwd``); a convolution likewise by the measured
conv rows of its dtype and kernel class (1×1 or larger), when the calibration has them. A calibrated CPU process has
such rows too (torch's fused CPU attention kernel, measured with one thread under ``P``
processes), and its attention ops are priced fused by them unless told otherwise.

The backward pass of an op costs ``κ(kind)`` times its forward (``κ = 2``: a contraction
computes the input gradient and the weight gradient, each a GEMM as large as the forward;
elementwise and normalisation ops read the output gradient and the saved input and write one
gradient); views cost nothing. ``split`` divides the work when an op is partitioned over
devices (tensor / sequence parallel), before the launch floor is applied — so splitting a
small op buys nothing, as on real hardware.

An op on *sharded parameters* (a tensor-parallel module: torch runs it on DTensors) also pays
the host's DTensor dispatch ``δ`` (``sharded_op_overhead``, measured by ``polyparallel
calibrate``; 0 on accelerators, whose host runs ahead of the device) once per kernel forward
and ``κ`` times backward:

    t_fwd += δ,    t_bwd += κ · δ.

On a CPU process every op of a training step also pays the eager framework's host work in
series with its kernels: the module call, dispatch and autograd node forward, the autograd
engine and gradient accumulation backward. ``ω`` (``training_op_overhead``, measured by
``polyparallel calibrate`` from chains of tiny ops run forward and backward; 0 on accelerators,
whose host runs ahead of the device) is charged per torch op the captured op stands for — the
op itself and each elementwise op fused into it (``attrs["fused"]``: fusion is a planning
abstraction, eager torch runs them one by one), each with its own backward factor:

    t_fwd += (1 + a) · ω,    t_bwd += (κ + 2a) · ω,    a = number of fused elementwise ops.

Examples:
    >>> from polyparallel.cluster import Cluster
    >>> from polyparallel.cost_models.synthetic import mlp_graph
    >>> g = mlp_graph(batch=64, widths=(1024, 1024))
    >>> dt = Cluster.preset("dgx-a100").devices[0].type
    >>> c = op_cost(g, g.ops[0], dt, dtype="bf16")
    >>> c.bound, round(c.flops / 1e6)
    ('launch', 134)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from polyparallel.cluster import DeviceType
from polyparallel.ir import DTYPE_BYTES, Graph, Hint, Op, OpKind

__all__ = [
    "BACKWARD_FACTOR",
    "COMPUTE_EFFICIENCY",
    "MATRIX_KINDS",
    "MEMORY_EFFICIENCY",
    "OpCost",
    "op_bytes",
    "op_cost",
    "streaming_bandwidth",
]

MATRIX_KINDS = frozenset({OpKind.CONTRACTION, OpKind.CONV, OpKind.ATTENTION})

# Fraction of peak a kernel of each class reaches on accelerators (modelled; see module doc).
COMPUTE_EFFICIENCY: Mapping[OpKind, float] = {
    OpKind.CONTRACTION: 0.80,  # cuBLAS large bf16 GEMMs on A100/H100: ~250/312 TFLOP/s
    OpKind.CONV: 0.65,  # cuDNN implicit GEMM with halo/im2col overhead
    OpKind.ATTENTION: 0.50,  # unfused QK^T / softmax / PV with small head dims
}
DEFAULT_COMPUTE_EFFICIENCY = 0.5
MEMORY_EFFICIENCY = 0.8  # STREAM-like kernels reach ~80% of data-sheet HBM bandwidth

BACKWARD_FACTOR: Mapping[OpKind, float] = {
    OpKind.VIEW: 0.0, OpKind.CREATE: 0.0, OpKind.CONCAT: 1.0, OpKind.SPLIT: 1.0,
    OpKind.EMBEDDING: 1.0, OpKind.GATHER: 1.0,
}
DEFAULT_BACKWARD_FACTOR = 2.0

_FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}
_SHORT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class OpCost:
    """Forward and backward seconds of one op on one device, and what bounds it."""

    op: str
    kind: str
    flops: float
    bytes: float
    forward: float
    backward: float
    bound: str  # "compute" | "memory" | "launch" | "free"

    @property
    def total(self) -> float:
        return self.forward + self.backward


def streaming_bandwidth(device: DeviceType) -> float:
    """Bytes/s a streaming kernel reaches: ``η_m · W``, with a calibrated device's measured ``η_m``."""
    return device.memory_bandwidth * (device.memory_efficiency or MEMORY_EFFICIENCY)


def op_bytes(graph: Graph, op: Op, dtype: str) -> float:
    """Bytes an op moves: distinct operands once; floating tensors at the compute precision."""
    width = _SHORT_BYTES.get(dtype, DTYPE_BYTES.get(dtype, 4))
    total = 0.0
    for t in dict.fromkeys(op.inputs + op.outputs):
        spec = graph.tensors[t]
        b = width if spec.dtype in _FLOAT_DTYPES else DTYPE_BYTES.get(spec.dtype, 4)
        total += spec.numel * b
    return total


def _curve_rate(curve: tuple[tuple[float, float], ...], flops: float) -> float:
    """Measured FLOP/s at ``flops``: log-log interpolation of a (flops, seconds) curve, clamped."""
    pts = [(math.log(f), math.log(f / s)) for f, s in curve if f > 0 and s > 0]
    x = math.log(max(flops, 1.0))
    if x <= pts[0][0]:
        return math.exp(pts[0][1])
    if x >= pts[-1][0]:
        return math.exp(pts[-1][1])
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 <= x <= x1:
            w = (x - x0) / (x1 - x0) if x1 > x0 else 0.0
            return math.exp(y0 + w * (y1 - y0))
    return math.exp(pts[-1][1])  # pragma: no cover - the loop covers the range


def _kernels(graph: Graph, op: Op, dtype: str, fused: bool) -> list[tuple[float, float, bool]]:
    """``(flops, bytes, on_matrix_units)`` per kernel: one for a fused op, one per statement otherwise.

    An unfused op materialises its temporaries (attention scores): each statement is a kernel
    that reads and writes whole operands, temporaries included, and does the work of its whole
    iteration box (a causal mask is applied to the full score matrix, not skipped).
    """
    kind = OpKind(op.kind)
    if fused or op.nest is None or len(op.nest.statements) == 1:
        return [(float(op.flops), op_bytes(graph, op, dtype), kind in MATRIX_KINDS)]
    width = _SHORT_BYTES.get(dtype, DTYPE_BYTES.get(dtype, 4))
    ext = op.nest.extents
    out = []
    for st in op.nest.statements:
        nbytes = 0.0
        for acc in dict((a.operand, a) for a in st.reads + st.writes).values():
            name = op.operand_name(acc.operand)
            if name is not None:
                spec = graph.tensors[name]
                nbytes += spec.numel * (width if spec.dtype in _FLOAT_DTYPES else DTYPE_BYTES.get(spec.dtype, 4))
            else:
                nbytes += math.prod(ext[d] for d in acc.dims) * width
        reads = {a.operand for a in st.reads}
        matrix = len(reads) >= 2 and bool(st.reduction_dims()) and st.flops_per_point >= 2
        # an unfused kernel computes its whole box and masks afterwards (a causal mask halves the
        # useful points, not the work); only a fused kernel skips masked blocks
        box = math.prod(ext[d] for d in st.dims)
        out.append((box * st.flops_per_point, nbytes, matrix))
    return out


def _pointwise(op: Op) -> bool:
    """A convolution whose kernel covers one point (1x1): cuDNN runs it as a plain GEMM."""
    return op.nest is None or math.prod(d.extent for d in op.nest.dims if d.hint is Hint.KERNEL) == 1


def op_cost(graph: Graph, op: Op, device: DeviceType, dtype: str = "fp32", split: float = 1.0,
            flops_scale: float = 1.0, fused: bool | None = None, sharded: bool = False) -> OpCost:
    """Roofline time of ``op`` on ``device`` at compute precision ``dtype``.

    Args:
        split: the op's work (FLOPs and bytes) is divided by ``split`` (TP / SP shards).
        flops_scale: multiplies the FLOPs (e.g. 0 for an op whose work is recomputed elsewhere).
        fused: whether a multi-statement op runs as one kernel; default: everything except
            attention (unfused attention writes its score matrix to memory and reads it back).
        sharded: the op runs on sharded parameters (DTensor): each kernel pays the device's
            ``sharded_op_overhead`` forward and ``κ`` times backward.
    """
    if split <= 0:
        raise ValueError(f"split must be > 0, got {split}")
    kind = OpKind(op.kind)
    if kind in (OpKind.VIEW, OpKind.CREATE) and op.flops == 0:
        return OpCost(op.name, str(kind), 0.0, 0.0, 0.0, 0.0, "free")
    if fused is None:
        # eager torch runs CPU attention as one fused kernel: priced by its rows where measured
        fused = kind is not OpKind.ATTENTION or (device.kind == "cpu" and bool(device.attention_curve(dtype)))
    kb = BACKWARD_FACTOR.get(kind, DEFAULT_BACKWARD_FACTOR)
    curve = device.curve(dtype)
    # a calibrated GPU's measured flash-attention rows price a fused attention op, its conv rows (per
    # kernel class) a convolution: forward and backward each by its own measured rate
    att = device.attention_curve(dtype) if kind is OpKind.ATTENTION and fused else \
        device.conv_curve(dtype, _pointwise(op)) if kind is OpKind.CONV and device.conv_curves else ()
    stream = streaming_bandwidth(device)
    t = t_b = flops_tot = bytes_tot = 0.0
    bound, worst = "launch", -1.0
    for f, b, matrix in _kernels(graph, op, dtype, fused):
        f, b = f * flops_scale / split, b / split
        t_cb = None
        if att:
            rate = _curve_rate(tuple((x, fw) for x, fw, _ in att), f)
            t_cb = f / _curve_rate(tuple((x, bw) for x, _, bw in att), f) if f else 0.0
        elif matrix and curve:
            rate = _curve_rate(curve, f)
        elif matrix:
            eff = COMPUTE_EFFICIENCY.get(kind, DEFAULT_COMPUTE_EFFICIENCY) if fused else \
                COMPUTE_EFFICIENCY[OpKind.CONTRACTION]
            rate = device.peak_flops(dtype) * eff
        else:
            rate = device.peak_flops("fp32") * DEFAULT_COMPUTE_EFFICIENCY
        t_c = f / rate if f else 0.0
        # a matmul measured on a CPU already contains its memory traffic at that size (in cache or
        # not); a GPU's HBM traffic of a skinny GEMM is not in a square curve, so it stays a bound
        t_m = 0.0 if matrix and curve and device.kind == "cpu" else b / stream
        k = max(t_c, t_m, device.launch_overhead)
        dispatch = device.sharded_op_overhead if sharded else 0.0
        t += k + dispatch
        if kb > 0:
            t_b += max(t_c * kb if t_cb is None else t_cb, t_m * kb, device.launch_overhead) + kb * dispatch
        flops_tot += f
        bytes_tot += b
        if k > worst:
            worst, bound = k, "compute" if k == t_c else "memory" if k == t_m else "launch"
    if device.training_op_overhead:
        absorbed = len(op.attr.get("fused", ()))
        t += (1 + absorbed) * device.training_op_overhead
        t_b += (kb + absorbed * BACKWARD_FACTOR.get(OpKind.ELEMENTWISE, DEFAULT_BACKWARD_FACTOR)) \
            * device.training_op_overhead
    return OpCost(op.name, str(kind), flops_tot, bytes_tot, t, t_b, bound)
