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
On a GPU without a calibration a 16-bit contraction's ``η_c`` depends on its GEMM's shape
(:func:`gemm_efficiency`: measured by shape on an H200, ``polyparallel.cluster.devices``), its
backward pricing the input- and weight-gradient GEMMs each at its own shape, as below for CPUs.
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

**Skinny GEMMs on a CPU.** A Linear layer on a micro-batch of few tokens multiplies a thin
matrix by its weight; at one thread such GEMMs run far below the rate of a square GEMM of the
same FLOPs (a FLOP-indexed curve would price ``(2×1024)·(1024×1024)`` like a ``128³`` product,
in cache, 3–20× too fast). A calibrated CPU process carries measured skinny-GEMM rows
(``gemm_rates``: role, small dimension ``s``, large dimension ``L``, seconds; see
:func:`polyparallel.cost_models.calibrate.gemm_rows`). A contraction's main statement gives
its GEMM ``(m, k, n)`` (:func:`gemm_shape`: output rows ``m``, summed ``k``, output columns ``n``;
batch dims left out, a ``split`` divides the largest dimension) and it is priced at

    rate(m, k, n) = min( R_square(F),  R_skinny(role, s, L) ),    s = min(m, k, n),

with role ``reduce`` when ``s = k`` is the summed dimension (a weight gradient), ``out``
otherwise, and ``L`` the geometric mean of the other two dimensions (:func:`gemm_rate`:
log–log interpolation in ``s`` and in ``L``, clamped; no penalty for ``s`` above the largest
measured). The backward pass runs its own two GEMMs, the input gradient ``(m, n, k)`` and the
weight gradient ``(k, m, n)``, each at its own rate: ``t_bwd = κ/2 · (F/rate(m,n,k) + F/rate(k,m,n))``.

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

import functools
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from polyparallel.cluster import DeviceType
from polyparallel.cluster.devices import (
    HOPPER_GEMM_EFFICIENCY,
    HOPPER_SQUARE_GEMM_EFFICIENCY,
    TORCH_TO_SHORT,
    is_hopper,
)
from polyparallel.ir import (
    FLOAT_DTYPES,
    TRAINING_DTYPE_BYTES,
    Graph,
    Hint,
    Op,
    OpKind,
    TensorKind,
    element_bytes,
    target_base,
)

from .memo import PRICES

__all__ = [
    "ATTENTION_KERNELS",
    "AUTOCAST_LOW",
    "BACKWARD_FACTOR",
    "COMPUTE_EFFICIENCY",
    "MATRIX_KINDS",
    "MEMORY_EFFICIENCY",
    "OpCost",
    "attention_flops",
    "attention_rows",
    "attention_shape",
    "autocast_seconds",
    "batch_statistics_ops",
    "gemm_efficiency",
    "gemm_rate",
    "gemm_shape",
    "host_class",
    "host_seconds",
    "host_step_fixed",
    "math_sdpa_saved_bytes",
    "math_sdpa_upcasts",
    "op_bytes",
    "op_classes",
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


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool = True) -> float:
    """FLOPs of ``softmax(QKᵀ)V`` as the IR counts them: ``2·2·B·H·d`` per (query, key) pair kept.

    A causal mask keeps ``S(S+1)/2`` pairs (the IR's closed-form point count), else ``S²``.
    """
    pairs = seq * (seq + 1) / 2 if causal else seq * seq
    return 4.0 * batch * heads * head_dim * pairs


def streaming_bandwidth(device: DeviceType) -> float:
    """Bytes/s a streaming kernel reaches: ``η_m · W``, with a calibrated device's measured ``η_m``."""
    return device.memory_bandwidth * (device.memory_efficiency or MEMORY_EFFICIENCY)


def op_bytes(graph: Graph, op: Op, dtype: str) -> float:
    """Bytes an op moves: distinct operands once; floating tensors at the compute precision."""
    return sum(graph.tensors[t].numel * element_bytes(graph.tensors[t].dtype, dtype)
               for t in dict.fromkeys(op.inputs + op.outputs))


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
    width = TRAINING_DTYPE_BYTES.get(dtype, 4)  # temporaries are floating point
    ext = op.nest.extents
    out = []
    probs = 0
    for st in op.nest.statements:
        nbytes = 0.0
        for acc in dict((a.operand, a) for a in st.reads + st.writes).values():
            name = op.operand_name(acc.operand)
            if name is not None:
                spec = graph.tensors[name]
                nbytes += spec.numel * element_bytes(spec.dtype, dtype)
            else:
                nbytes += math.prod(ext[d] for d in acc.dims) * width
        reads = {a.operand for a in st.reads}
        matrix = len(reads) >= 2 and bool(st.reduction_dims()) and st.flops_per_point >= 2
        temp_read = max((math.prod(ext[d] for d in a.dims) for a in st.reads
                         if op.operand_name(a.operand) is None), default=0)
        if not matrix and temp_read > sum(math.prod(ext[d] for d in a.dims) for a in st.writes):
            # a normalising statement (softmax) that the loop nest reduces to row statistics writes,
            # run eagerly, the normalised matrix the size of its input (torch.softmax returns it)
            nbytes += temp_read * width
            probs = temp_read
        # an unfused kernel computes its whole box and masks afterwards (a causal mask halves the
        # useful points, not the work); only a fused kernel skips masked blocks
        box = math.prod(ext[d] for d in st.dims)
        out.append((box * st.flops_per_point, nbytes, matrix))
    if probs and op.attr.get("dropout"):
        # dropout on the attention probabilities (GPT-2/3, Megatron's attention_dropout): one more
        # kernel reads them and writes them back with a one-byte mask (torch's native dropout)
        out.append((float(probs), probs * (2 * width + 1), False))
    return out


def gemm_shape(op: Op, split: float = 1.0) -> tuple[float, float, float] | None:
    """``(m, k, n)`` of a contraction's main GEMM: output rows, summed dimension, output columns.

    From the first statement reading two operands with a reduction: with ``A``, ``B`` the dims of
    its two reads and ``O`` of its write, ``m = Π(A∩O∖B)``, ``n = Π(B∩O∖A)``, ``k = Π(reduction
    dims)`` (dims in ``A∩B∩O`` are batch dims: each batch is a GEMM of this shape). A ``split``
    (tensor / sequence parallel) divides the largest of the three. ``None`` when the op has no
    such statement.
    """
    if op.nest is None:
        return None
    ext = op.nest.extents
    for st in op.nest.statements:
        reads = list(dict((a.operand, a.dims) for a in st.reads).values())
        red = st.reduction_dims()
        if len(reads) < 2 or not red or not st.writes:
            continue
        a, b = reads[0], reads[1]
        o = frozenset().union(*(w.dims for w in st.writes))
        dims = [float(math.prod(ext[d] for d in (a & o) - b)), float(math.prod(ext[d] for d in red)),
                float(math.prod(ext[d] for d in (b & o) - a))]
        big = max(range(3), key=lambda i: dims[i])
        dims[big] /= split
        return dims[0], dims[1], dims[2]
    return None


@functools.lru_cache(maxsize=64)
def _skinny_tables(rows: tuple[tuple[str, int, int, float], ...]) -> dict[str, dict[float, list[tuple[float, float]]]]:
    """``{role: {L: [(log s, log rate), ...] sorted}}`` from a device's ``gemm_rates``."""
    out: dict[str, dict[float, list[tuple[float, float]]]] = {}
    for role, small, large, sec in rows:
        rate = 2.0 * small * large * large / sec
        out.setdefault(role, {}).setdefault(float(large), []).append((math.log(small), math.log(rate)))
    for by_l in out.values():
        for pts in by_l.values():
            pts.sort()
    return out


def _interp(pts: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear interpolation through sorted ``(x, y)`` points, clamped at both ends."""
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 <= x <= x1:
            return y0 + (x - x0) / (x1 - x0) * (y1 - y0) if x1 > x0 else y0
    return pts[-1][1]  # pragma: no cover - the loop covers the range


def gemm_rate(device: DeviceType, m: float, k: float, n: float) -> float:
    """Measured FLOP/s of an ``(m×k)·(k×n)`` GEMM from the device's skinny-GEMM rows; ``inf`` if unmeasured.

    ``s = min(m, k, n)``; role ``reduce`` when ``k`` is strictly the smallest, else ``out``;
    ``L = sqrt`` of the product of the other two. The role's rows at each measured ``L`` are
    interpolated log–log in ``s`` (clamped below the smallest measured ``s``); the results are
    interpolated log–log in ``L`` (clamped). A shape whose small side is above every measured
    ``s`` is not skinny: ``inf`` (the square curve prices it alone).
    """
    tables = _skinny_tables(device.gemm_rates)
    s = min(m, k, n)
    role = "reduce" if k == s and k < min(m, n) else "out"
    by_l = tables.get(role)
    if not by_l or s <= 0:
        return math.inf
    if s > max(math.exp(x) for pts in by_l.values() for x, _ in pts) * (1 + 1e-9):
        return math.inf
    large = math.sqrt(m * k * n / s)
    per_l = sorted((math.log(big), _interp(pts, math.log(s))) for big, pts in by_l.items())
    return math.exp(_interp(per_l, math.log(large)))


_HOPPER_REF = DeviceType("hopper-gemm-efficiency", "gpu", (("bf16", 1.0),), 0.0, 0.0, gemm_rates=tuple(
    (role, small, large, 2.0 * small * large * large / eff) for role, small, large, eff in HOPPER_GEMM_EFFICIENCY))


def gemm_efficiency(device: DeviceType, dtype: str, m: float, k: float, n: float) -> float | None:
    """Fraction of the matrix peak a 16-bit ``(m×k)·(k×n)`` GEMM reaches on a GPU without a calibration.

    From the GEMMs measured by shape on an H200 (``HOPPER_GEMM_EFFICIENCY``, read by :func:`gemm_rate`:
    a side ``s`` below about 512, or a weight gradient summing over few rows, runs well below a
    square GEMM), capped by the square GEMMs' ``HOPPER_SQUARE_GEMM_EFFICIENCY``. An H100 or H200
    (the measured chip) takes the figures as they are; another GPU the measured shape dependence
    relative to the square GEMM, times the modelled large-GEMM ``COMPUTE_EFFICIENCY`` (no
    measurement of its own). ``None`` for other dtypes and devices: the flat per-class figure.
    """
    if device.kind != "gpu" or TRAINING_DTYPE_BYTES.get(dtype, 4) != 2 or min(m, k, n) <= 0:
        return None
    eff = min(HOPPER_SQUARE_GEMM_EFFICIENCY, gemm_rate(_HOPPER_REF, m, k, n))
    if is_hopper(device.name):
        return eff
    return eff / HOPPER_SQUARE_GEMM_EFFICIENCY * COMPUTE_EFFICIENCY[OpKind.CONTRACTION]


def _misaligned(op: Op) -> bool:
    """A contraction whose GEMM has a dimension that is not a multiple of 8 (whole op, before any split)."""
    shape = gemm_shape(op)
    return shape is not None and any(round(d) % 8 for d in shape)


def _pointwise(op: Op) -> bool:
    """A convolution whose kernel covers one point (1x1): cuDNN runs it as a plain GEMM."""
    return op.nest is None or math.prod(d.extent for d in op.nest.dims if d.hint is Hint.KERNEL) == 1


def op_classes(graph: Graph) -> list[int]:
    """Per op of ``graph``, a class number: ops of one class get equal :func:`op_cost` (and equal
    :func:`op_bytes`), whatever their names, so the repeated layers of a model are priced once.

    The class is everything ``op_cost`` reads: the op's kind, target, loop nest, attributes and
    FLOP estimate, its operands' shapes and dtypes, and which operands name the same tensor.
    Memoised per graph.
    """
    memo = PRICES.of(graph)
    hit = memo.get(("op_classes",))
    if hit is not None:
        return hit
    ids: dict = {}
    out = []
    tensors = graph.tensors
    for i, op in enumerate(graph.ops):
        names = op.inputs + op.outputs
        first: dict[str, int] = {}
        key = (op.kind, op.target, op.nest, op.attrs, op.flops_estimate,
               tuple((tensors[t].shape, tensors[t].dtype) for t in names),
               tuple(first.setdefault(t, j) for j, t in enumerate(names)))
        try:
            out.append(ids.setdefault(key, len(ids)))
        except TypeError:  # an unhashable attribute value: a class of its own
            out.append(ids.setdefault(("op", i), len(ids)))
    memo[("op_classes",)] = out
    return out


# Published fused-attention rates of three kernels on an H100 80GB SXM5, FP16, head dim 128, 16 heads,
# batch x sequence = 16k tokens: FlashAttention-3 paper (Shah et al. 2024, arXiv:2407.08608), Figure 5
# (forward with a causal mask) and Figure 6 (backward; the paper shows it without a mask only), TFLOP/s as
# labelled on the bars at sequence lengths 512, 1k, 2k, 4k, 8k, 16k, FLOPs counted as FlashAttention's
# benchmarks count them (the masked half left out; the backward 2.5x the forward). "fa2" is the kernel
# torch's scaled_dot_product_attention ran on Hopper from torch 2.5.1 (cuDNN made opt-in,
# pytorch/pytorch#138522; an H100 SDPA at 329 TFLOP/s where cuDNN gave 631, pytorch/pytorch#142132)
# until the bundled cuDNN passed 9.15 (torch 2.11, check_prefer_cudnn_attention in sdp_utils.cpp), and
# the one torchtitan forces off Blackwell (SDPBackend.FLASH_ATTENTION first, pytorch/torchtitan#1196);
# "cudnn" is what torch 2.11+ runs there (the H200 calibration measured that stack); "fa3" the
# flash-attn package's Hopper kernel.
_ATTENTION_SEQ = (512, 1024, 2048, 4096, 8192, 16384)
_ATTENTION_TFLOPS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "fa2": ((191, 260, 298, 319, 333, 335), (214, 260, 291, 310, 318, 322)),
    "cudnn": ((315, 410, 484, 518, 529, 539), (305, 408, 465, 499, 518, 516)),
    "fa3": ((292, 423, 521, 579, 602, 616), (316, 424, 501, 542, 559, 561)),
}
# FlashAttention (v1)'s forward + backward rates, TFLOP/s at sequence lengths 512..16k (B x S = 16k tokens,
# hidden 2048: 32 heads of 64 or 16 of 128; fp16), as labelled on the "FlashAttention" bars of the
# FlashAttention-2 paper's Figure 4 (A100 80GB SXM4) and Figure 7 (H100 80GB SXM5) (Dao 2023,
# arXiv:2307.08691; the repository's assets/flash2_a100_fwd_bwd_benchmark.png and
# flash2_h100_fwd_bwd_benchmark.png), per (device, causal mask, head dimension). FLOPs counted as
# FlashAttention's benchmarks count them: 4·B·S²·H·d for the forward, halved with a causal mask, and
# 3.5x that for forward + backward. The kernel class is flash-attn 1.x's: its CUDA kernel and its Triton
# port (flash_attn/flash_attn_triton.py, the ``attn_impl: triton`` that llm-foundry vendored and ran on
# ``triton-pre-mlir``), whose docstring says "Triton forward + backward is slightly slower than CUDA
# forward + backward"; the same figure's "FlashAttention Triton" bars (OpenAI's Triton kernel) on the A100
# are 0.91-1.02x the CUDA kernel's with a causal mask. Neither uses Hopper's wgmma/TMA: on an H100 FA1 runs
# at 98-137 TFLOP/s (head dim 128, causal) where FlashAttention-2 of the same figure reaches 163-328.
_FA1_TFLOPS: dict[tuple[str, bool, int], tuple[float, ...]] = {
    ("a100", True, 64): (58, 70, 77, 87, 92, 97), ("a100", True, 128): (55, 62, 69, 76, 80, 83),
    ("a100", False, 64): (91, 92, 104, 108, 110, 110), ("a100", False, 128): (76, 72, 76, 80, 82, 83),
    ("h100", True, 64): (104, 123, 136, 138, 149, 156), ("h100", True, 128): (98, 109, 108, 126, 135, 137),
    ("h100", False, 64): (157, 159, 161, 161, 166, 168), ("h100", False, 128): (127, 127, 128, 131, 137, 139),
}
ATTENTION_KERNELS = (*_ATTENTION_TFLOPS, "fa1")
# The dense 16-bit peaks of the chips those rates were measured on (the catalog's figures, from the same
# datasheets): the H100 SXM5 of the papers and the H200 SXM of the calibration (the H100's compute), and
# the A100 SXM4. A kernel's rate on a part of the same chip with another peak (a cluster spec's
# ``h100-...`` at a lower power limit: the same SMs at a lower clock) is scaled by the peaks' ratio, as
# a GEMM's measured efficiency is (:func:`gemm_efficiency`: efficiency x the device's own peak).
_MEASURED_PEAK = {"h100": 989.5e12, "a100": 312e12}


def _rate_scale(device: DeviceType, dtype: str, family: str) -> float:
    """How much slower a kernel runs on ``device`` than on the chip its published or measured rates
    were taken on (``_MEASURED_PEAK[family]``): that peak over the device's own; 1 on the catalog's parts."""
    own = device.peak_flops(dtype)
    return _MEASURED_PEAK[family] / own if own > 0 else 1.0


def _scaled(rows: tuple[tuple[float, float, float], ...], scale: float) -> tuple[tuple[float, float, float], ...]:
    return rows if scale == 1.0 else tuple((f, fw * scale, bw * scale) for f, fw, bw in rows)


def _fa1_row(device: DeviceType, dtype: str,
             shape: tuple[int, int, bool, float] | None) -> tuple[float, float, float]:
    """One ``(flops, forward_s, backward_s)`` row of an attention op of ``shape`` (sequence, head
    dimension, causal, the IR's FLOPs per (batch, head) pair) at FlashAttention (v1)'s published
    rate (``_FA1_TFLOPS``): log-log between the figure's sequence lengths, flat past its ends (its
    rates level off: +1.5% from 8k to 16k on the H100 at head dimension 128); a head dimension runs in
    the kernel's block of the next of 64 or 128 (the Triton port pads it to a power of two, the CUDA
    kernel has blocks of 32, 64 and 128), its rate scaled by d / that block. The figure gives forward
    + backward only: both are priced at that rate (the forward 1/3.5 of the time, the backward 2.5/3.5,
    as the FLOPs). A device whose peak is not the figure's chip's runs at the rate scaled by the peaks."""
    family = "h100" if is_hopper(device.name) else "a100" if device.name.startswith("a100") else None
    if device.kind != "gpu" or family is None or TRAINING_DTYPE_BYTES.get(dtype, 4) != 2:
        raise ValueError(f"attention_kernel='fa1': its published rates are for 16-bit attention on A100 and H100 "
                         f"GPUs; {device.name} at {dtype} prices its fused attention by its own rows or roofline: "
                         "leave attention_kernel unset")
    if shape is None or not 0 < shape[1] <= 128:
        raise ValueError(f"attention_kernel='fa1' prices an attention over (batch, heads, sequence, head dim) "
                         f"operands with a head dimension of at most 128 (FlashAttention's); got {shape}")
    seq, d, causal, flops = shape
    block = 64 if d <= 64 else 128
    rates = _FA1_TFLOPS[(family, causal, block)]
    loglog = [(math.log(s), math.log(r)) for s, r in zip(_ATTENTION_SEQ, rates, strict=True)]
    rate = math.exp(_interp(loglog, math.log(seq))) * 1e12 * d / block
    published = 4.0 * seq * seq * d / (2 if causal else 1)  # one (batch, head) pair, FlashAttention's count
    scale = _rate_scale(device, dtype, family)
    return flops, published / rate * scale, 2.5 * published / rate * scale


def attention_shape(graph: Graph, op: Op) -> tuple[int, int, bool, float] | None:
    """(sequence, head dimension, causal, FLOPs per (batch, head) pair) of an attention op, read from
    its loop nest (the operands may be views the planner folded in): the parallel sequence dimension,
    the reduced feature dimension, causal when a statement is constrained (``s - t >= 0``)."""
    if op.nest is None:
        return None
    par = [d for d in op.nest.dims if d.role.value == "parallel"]
    seq = next((d.extent for d in par if d.hint is Hint.SEQUENCE), None)
    head = next((d.extent for d in op.nest.dims if d.role.value == "reduction" and d.hint is Hint.FEATURE), None)
    if seq is None or head is None:
        return None
    pairs = math.prod(d.extent for d in par if d.hint not in (Hint.SEQUENCE, Hint.FEATURE))
    causal = any(st.constraints for st in op.nest.statements)
    return int(seq), int(head), causal, op.flops / max(pairs, 1)


def attention_rows(device: DeviceType, dtype: str, kernel: str | None = None,
                   shape: tuple[int, int, bool, float] | None = None) -> tuple[tuple[float, float, float], ...]:
    """Fused-attention ``(flops, forward_s, backward_s)`` rows pricing an attention op on ``device``:
    the device's own (:meth:`~polyparallel.cluster.DeviceType.attention_curve`: its calibration, or
    the H200's on a Hopper GPU) unless ``kernel`` names one of :data:`ATTENTION_KERNELS`, whose
    published rates (the tables above) stand for a recipe run with that kernel. ``flops`` as the IR
    counts them (:func:`attention_flops`), the times at the
    published rates, which count the masked half out. ``fa1`` gives one row, at the rate of the op's
    ``shape`` (:func:`attention_shape`; its figure is indexed by sequence length and head dimension).
    Rates taken on another part (the H200's rows, the papers' H100 SXM5 and A100) are scaled to the
    device's own peak (``_MEASURED_PEAK``: a cluster spec's ``h100-...`` at a lower power limit runs the
    same kernel at its lower clock); the catalog's parts keep them as they are."""
    if kernel is None:
        rows = device.attention_curve(dtype)
        own = dict(device.attention_curves).get(TORCH_TO_SHORT.get(dtype, dtype), ())
        # the H200's measured rows on another Hopper part: at that part's peak
        return rows if own or not rows else _scaled(rows, _rate_scale(device, dtype, "h100"))
    if kernel == "fa1":
        return (_fa1_row(device, dtype, shape),)
    if kernel not in _ATTENTION_TFLOPS:
        raise ValueError(f"attention_kernel={kernel!r}: use one of {', '.join(ATTENTION_KERNELS)}, or none (the "
                         "device's own rows)")
    if device.kind != "gpu" or not is_hopper(device.name) or TRAINING_DTYPE_BYTES.get(dtype, 4) != 2:
        raise ValueError(f"attention_kernel={kernel!r}: its published rates are for 16-bit attention on Hopper GPUs "
                         f"(H100/H200); {device.name} at {dtype} prices its fused attention by its own rows or "
                         "roofline: leave attention_kernel unset")
    fwd, bwd = _ATTENTION_TFLOPS[kernel]
    rows = []
    for s, rf, rb in zip(_ATTENTION_SEQ, fwd, bwd):
        b = 16384 // s
        published = 4.0 * b * 16 * 128 * s * s / 2  # FlashAttention's count: the masked half left out
        rows.append((attention_flops(b, 16, s, 128), published / (rf * 1e12), 2.5 * published / (rb * 1e12)))
    return _scaled(tuple(rows), _rate_scale(device, dtype, "h100"))


def op_cost(graph: Graph, op: Op, device: DeviceType, dtype: str = "fp32", split: float = 1.0,
            flops_scale: float = 1.0, fused: bool | None = None, sharded: bool = False,
            eager: bool = False, own_kernels: frozenset[str] = frozenset(),
            attention_kernel: str | None = None) -> OpCost:
    """Roofline time of ``op`` on ``device`` at compute precision ``dtype``.

    Args:
        split: the op's work (FLOPs and bytes) is divided by ``split`` (TP / SP shards).
        flops_scale: multiplies the FLOPs (e.g. 0 for an op whose work is recomputed elsewhere).
        fused: whether a multi-statement op runs as one kernel; default: everything except
            attention (unfused attention writes its score matrix to memory and reads it back).
        sharded: the op runs on sharded parameters (DTensor): each kernel pays the device's
            ``sharded_op_overhead`` forward and ``κ`` times backward.
        eager: elementwise ops absorbed by ``fuse_elementwise`` (``attrs["fused"]``) run as their
            own kernels, as eager PyTorch runs them: each streams its operands (temporaries
            included) through memory; default: they run inside their producer's kernel.
        own_kernels: the absorbed elementwise ops of these kinds (``"dropout"``) run as their own
            kernels even when the rest is fused (``ParallelConfig.fused_dropout``).
        attention_kernel: a fused attention op is priced by this kernel's published rates
            (:func:`attention_rows`) instead of the device's own rows.
    """
    if split <= 0:
        raise ValueError(f"split must be > 0, got {split}")
    kind = OpKind(op.kind)
    if kind in (OpKind.VIEW, OpKind.CREATE) and op.flops == 0:
        return OpCost(op.name, str(kind), 0.0, 0.0, 0.0, 0.0, "free")
    if fused is None:
        # eager torch runs CPU attention as one fused kernel: priced by its rows where measured
        fused = kind is not OpKind.ATTENTION or (device.kind == "cpu" and bool(device.attention_curve(dtype)))
    if not fused and is_sdpa(op) and op.nest is not None and math_sdpa_upcasts(device, dtype):
        return _math_sdpa(graph, op, device, dtype, split, flops_scale, sharded)
    kb = BACKWARD_FACTOR.get(kind, DEFAULT_BACKWARD_FACTOR)
    curve = device.curve(dtype)
    # a calibrated GPU's measured flash-attention rows price a fused attention op, its conv rows (per
    # kernel class) a convolution: forward and backward each by its own measured rate
    att = attention_rows(device, dtype, attention_kernel, attention_shape(graph, op) if attention_kernel == "fa1"
                         else None) if kind is OpKind.ATTENTION and fused else \
        device.conv_curve(dtype, _pointwise(op)) if kind is OpKind.CONV and device.conv_curves else ()
    stream = streaming_bandwidth(device)
    t = t_b = flops_tot = bytes_tot = 0.0
    bound, worst = "launch", -1.0
    kernels = _kernels(graph, op, dtype, fused)
    targets = op.attr.get("fused", ()) if op.nest is not None else ()
    absorbed = len(targets)
    own = [i for i, t in enumerate(targets) if eager or target_base(t) in own_kernels]
    if own and len(op.nest.statements) > absorbed:
        # the absorbed statements (appended last by fuse_elementwise, in ``targets``' order) that run
        # as kernels of their own (all of them when eager); the base kernel already streams the op's
        # operands, each absorbed one its own reads and write
        tail = _kernels(graph, op, dtype, False)[-absorbed:]
        kernels = kernels + [(0.0, tail[i][1], False) for i in own]
    # a calibrated GPU's measured normalisation rows price a batch / layer norm by its input's size
    nrows = device.streaming_curve(dtype, "batch_norm" if "batch_norm" in op.target else "layer_norm") \
        if kind is OpKind.NORM and device.streaming_rows else ()
    norm_numel = graph.tensors[op.inputs[0]].numel / split if nrows else 0.0
    # a calibrated CPU's skinny-GEMM rows price a one-kernel contraction by its shape, backward by its two GEMMs
    # (eager mode's extra kernels for absorbed elementwise ops carry no FLOPs and are left to the roofline)
    one_kernel = fused or op.nest is None or len(op.nest.statements) == 1
    shape = gemm_shape(op, split) if (device.gemm_rates and kind is OpKind.CONTRACTION and one_kernel
                                      and device.kind == "cpu") else None
    # a 16-bit GEMM with a dimension that is not a multiple of 8 leaves the tensor-core kernels: the
    # calibration measured how much slower (a 50257-token vocabulary head: ~5x)
    slow = device.misaligned_factor if (device.misaligned_factor > 1 and kind is OpKind.CONTRACTION
                                        and TRAINING_DTYPE_BYTES.get(dtype, 4) == 2 and _misaligned(op)) else 1.0
    for j, (f, b, matrix) in enumerate(kernels):
        f, b = f * flops_scale / split, b / split
        t_cb = t_c = None
        if nrows and j == 0:
            # the measured kernel (its memory traffic included) replaces the roofline
            t_c = norm_numel / _curve_rate(tuple((x, fw) for x, fw, _ in nrows), norm_numel)
            t_cb = norm_numel / _curve_rate(tuple((x, bw) for x, _, bw in nrows), norm_numel)
            b = 0.0
        elif att and j == 0:
            rate = _curve_rate(tuple((x, fw) for x, fw, _ in att), f)
            t_cb = f / _curve_rate(tuple((x, bw) for x, _, bw in att), f) if f else 0.0
        elif matrix and curve:
            rate = _curve_rate(curve, f)
            if shape is not None and f:
                gm, gk, gn = shape
                square = rate
                rate = min(square, gemm_rate(device, gm, gk, gn))
                t_cb = kb / 2 * (f / min(square, gemm_rate(device, gm, gn, gk))
                                 + f / min(square, gemm_rate(device, gk, gm, gn)))
        elif matrix:
            eff = COMPUTE_EFFICIENCY.get(kind, DEFAULT_COMPUTE_EFFICIENCY) if fused else \
                COMPUTE_EFFICIENCY[OpKind.CONTRACTION]
            rate = device.peak_flops(dtype) * eff
            gs = gemm_shape(op, split) if kind is OpKind.CONTRACTION and one_kernel and f else None
            if gs is not None and (e := gemm_efficiency(device, dtype, *gs)) is not None:
                # an uncalibrated GPU's GEMM by its shape; backward: the input gradient (m, n, k) and
                # the weight gradient (k, m, n), each at its own shape's efficiency
                gm, gk, gn = gs
                peak = device.peak_flops(dtype)
                rate = peak * e
                t_cb = kb / 2 * (f / (peak * gemm_efficiency(device, dtype, gm, gn, gk))
                                 + f / (peak * gemm_efficiency(device, dtype, gk, gm, gn)))
        else:
            rate = device.peak_flops("fp32") * DEFAULT_COMPUTE_EFFICIENCY
        if t_c is None:
            t_c = f / rate * (slow if matrix else 1.0) if f else 0.0
            t_cb = t_cb * slow if t_cb is not None and matrix else t_cb
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
        t += (1 + absorbed) * device.training_op_overhead
        t_b += (kb + absorbed * BACKWARD_FACTOR.get(OpKind.ELEMENTWISE, DEFAULT_BACKWARD_FACTOR)) \
            * device.training_op_overhead
    return OpCost(op.name, str(kind), flops_tot, bytes_tot, t, t_b, bound)


def is_sdpa(op: Op) -> bool:
    """Whether ``op`` is ``torch.nn.functional.scaled_dot_product_attention``."""
    return OpKind(op.kind) is OpKind.ATTENTION and "scaled_dot_product" in op.target


#: ops autocast runs in the compute dtype (its lower-precision list: matmuls, convolutions, attention)
AUTOCAST_LOW = frozenset({OpKind.CONTRACTION, OpKind.CONV, OpKind.ATTENTION})


def autocast_seconds(graph: Graph, op: Op, device: DeviceType, dtype: str, widths: Mapping[str, float],
                     split: float = 1.0) -> tuple[float, float]:
    """Device seconds ``(forward, backward)`` that eager ``torch.autocast`` adds to ``op`` over pricing
    every tensor at the 16-bit ``dtype``; ``widths``: bytes per element of each tensor as the step
    holds it (fp32 parameters, fp32 where torch promotes: ``activations.sent_widths``).

    * An op of autocast's lower-precision list casts each wider operand it multiplies (the first
      two inputs: activations, and fp32 parameters unless FSDP2 holds them in 16 bits) to ``dtype``:
      a kernel reading the wide and writing the narrow copy, and in the backward one casting its
      gradient back; a fused epilogue's other operands (a residual add, eager: its own kernel) are
      read, and its output written, at their widths.
    * The loss runs in fp32 (autocast's fp32 list): narrower inputs are cast up, and it streams its
      operands at 4 bytes.
    * Any other op streams its activations at their widths (a residual stream that stays fp32, a norm
      of it); its backward the gradients of the same widths, ``κ`` times the forward's extra bytes.
    """
    low = float(TRAINING_DTYPE_BYTES.get(dtype, 4))
    kind = OpKind(op.kind)
    if low >= 4 or kind in (OpKind.VIEW, OpKind.CREATE):
        return 0.0, 0.0
    floats = FLOAT_DTYPES

    def numel(t: str) -> float:
        return graph.tensors[t].numel / split

    stream = streaming_bandwidth(device)
    casts: list[float] = []  # elements cast, each once forward and once backward
    wide = 0.0  # bytes the op's own kernels move beyond the 16-bit price
    if kind in AUTOCAST_LOW:
        for j, t in enumerate(dict.fromkeys(op.inputs)):
            spec = graph.tensors[t]
            w = widths.get(t, 4.0)
            if spec.dtype not in floats or w <= low:
                continue
            if j < 2 or spec.kind is TensorKind.PARAM:
                casts.append(numel(t) * (w + low))
            else:
                wide += numel(t) * (w - low)
        wide += sum(numel(t) * (widths.get(t, low) - low) for t in op.outputs
                    if graph.tensors[t].dtype in floats and widths.get(t, low) > low)
    elif kind is OpKind.LOSS:
        for t in dict.fromkeys(op.inputs + op.outputs):
            if graph.tensors[t].dtype in floats:
                if widths.get(t, 4.0) < 4:
                    casts.append(numel(t) * (widths.get(t, low) + 4))
                wide += numel(t) * (4 - low)
    else:
        wide = sum(numel(t) * (widths.get(t, 4.0) - low) for t in dict.fromkeys(op.inputs + op.outputs)
                   if graph.tensors[t].dtype in floats and widths.get(t, 4.0) > low
                   and graph.tensors[t].kind in (TensorKind.ACTIVATION, TensorKind.INPUT))
    kb = BACKWARD_FACTOR.get(kind, DEFAULT_BACKWARD_FACTOR)
    cast_s = sum(max(b / stream, device.launch_overhead) for b in casts)
    return cast_s + wide / stream, cast_s + kb * wide / stream


def math_sdpa_upcasts(device: DeviceType, dtype: str) -> bool:
    """Whether an unfused ``scaled_dot_product_attention`` runs as torch's math kernel with its 16-bit
    operands upcast to fp32: an accelerator computing in a 16-bit dtype (torch >= 2.5 unless
    ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``; CPUs run a fused kernel)."""
    return TRAINING_DTYPE_BYTES.get(dtype, 4) == 2 and device.kind != "cpu"


def math_sdpa_sizes(op: Op, split: float = 1.0) -> tuple[float, float, float, float, float]:
    """Elements of the math kernel's score matrix, queries, keys, values and output: ``(n, q, k, v, o)``."""
    ext = op.nest.extents
    heads = ext["h"] * ext.get("g", 1)
    rows = ext["b"] * heads * ext["s"] / split
    kv = ext["b"] * ext["h"] * ext["t"] / split
    return rows * ext["t"], rows * ext["d"], kv * ext["d"], kv * ext["e"], rows * ext["e"]


def math_sdpa_saved_bytes(op: Op) -> float:
    """Bytes the upcast math kernel keeps for its backward: the fp32 probabilities, the scaled fp32
    queries and keys, and the fp32 copy of the values (the two matmuls' saved operands)."""
    n, q, k, v, _ = math_sdpa_sizes(op)
    return 4 * (n + q + k + v)


def _math_sdpa(graph: Graph, op: Op, device: DeviceType, dtype: str, split: float, flops_scale: float,
               sharded: bool) -> OpCost:
    """``scaled_dot_product_attention`` on an accelerator without a fused kernel, 16-bit: torch's math
    kernel (``_scaled_dot_product_attention_math`` in ``aten/src/ATen/native/transformers/attention.cpp``),
    kernel by kernel as a dispatch trace of torch 2.13 shows them. Forward: q, k, v cast to fp32; q and
    kᵀ each scaled by √scale; the fp32 ``bmm`` of the scores; a causal or given mask added
    out of place; ``_safe_softmax`` (four kernels); the probabilities cast back to 16 bits
    (returned as the kernel's second output, which SDPA discards); dropout if any; the fp32 ``bmm`` with
    v; the output cast. Backward: the output gradient cast to fp32, the four ``bmm`` s, the softmax
    backward (two fp32 reads, one write), the two scalings and the three casts back. Each kernel is the
    slower of its FLOPs at the fp32 GEMM rate and its bytes at the streaming bandwidth."""
    n, q, k, v, o = math_sdpa_sizes(op, split)
    d, e = op.nest.extents["d"], op.nest.extents["e"]
    c = TRAINING_DTYPE_BYTES.get(dtype, 2) + 4  # a cast reads one width and writes the other
    masked = bool(op.nest.statements[0].constraints) or len(op.inputs) > 3
    drop = float(op.attr.get("dropout_p", 0.0) or 0.0) > 0 or bool(op.attr.get("dropout"))
    qk, pv = 2 * n * d * flops_scale, 2 * n * e * flops_scale
    # _safe_softmax is CompositeExplicitAutograd (native_functions.yaml): softmax, then eq(-inf) (one byte
    # out), all() over the rows, and where(fully masked row, 0, softmax), each its own kernel
    safe_softmax = [(0.0, 8 * n), (0.0, 5 * n), (0.0, n), (0.0, 8 * n)]
    fwd = [(0.0, c * q), (0.0, c * k), (0.0, c * v), (0.0, 8 * q), (0.0, 8 * k), (qk, 4 * (q + k + n)),
           *([(0.0, 8 * n)] if masked else []), *safe_softmax, (0.0, c * n),
           *([(0.0, 9 * n)] if drop else []), (pv, 4 * (n + v + o)), (0.0, c * o)]
    bwd = [(0.0, c * o), (pv, 4 * (o + v + n)), (pv, 4 * (n + o + v)), *([(0.0, 9 * n)] if drop else []),
           (0.0, 12 * n), (qk, 4 * (n + k + q)), (qk, 4 * (n + q + k)), (0.0, 8 * q), (0.0, 8 * k),
           (0.0, c * q), (0.0, c * k), (0.0, c * v)]
    curve = device.curve("fp32")
    stream = streaming_bandwidth(device)
    dispatch = device.sharded_op_overhead if sharded else 0.0

    def run(kernels: list[tuple[float, float]]) -> tuple[float, float]:
        """Seconds of the kernels, and of those bound by their FLOPs."""
        t = t_c = 0.0
        for f, b in kernels:
            rate = (_curve_rate(curve, f) if curve else device.peak_flops("fp32")
                    * COMPUTE_EFFICIENCY[OpKind.CONTRACTION]) if f else 0.0
            k = max(f / rate if f else 0.0, b / stream, device.launch_overhead)
            t += k + dispatch
            t_c += k if f and k == f / rate else 0.0
        return t, t_c

    kb = BACKWARD_FACTOR.get(OpKind.ATTENTION, DEFAULT_BACKWARD_FACTOR)
    (t_f, c_f), (t_b, _) = run(fwd), run(bwd)
    return OpCost(op.name, str(OpKind(op.kind)), qk + pv, sum(b for _, b in fwd), t_f + device.training_op_overhead,
                  t_b + kb * device.training_op_overhead, "compute" if 2 * c_f > t_f else "memory")


def batch_statistics_ops(graph: Graph) -> list[Op]:
    """The ops that normalise with statistics of the batch they see (BatchNorm in training mode):
    under data parallelism the torch backend computes them over every replica's share, with
    collectives of their own. Once per graph: the search asks it of every data-parallel plan."""
    memo = PRICES.of(graph)
    if "batch_statistics" not in memo:
        memo["batch_statistics"] = [op for op in graph.ops if OpKind(op.kind) is OpKind.NORM
                                    and "batch_norm" in op.target and op.attr.get("training", True)]
    return memo["batch_statistics"]


def host_step_fixed(device: DeviceType, dtype: str = "fp32") -> float:
    """Host seconds a training step (per micro-batch) pays once: the loss reduction and the backward
    call that starts the autograd engine (``backward_call``, measured with the per-op classes)."""
    return device.host_table(dtype).get("backward_call", 0.0)


def host_class(op: Op) -> str:
    """The class of eager op whose measured host cost (``DeviceType.host_op_seconds``) prices ``op``."""
    kind = OpKind(op.kind)
    if kind is OpKind.NORM:
        return "batch_norm" if "batch_norm" in op.target else "layer_norm"
    return _HOST_CLASS.get(kind, "elementwise")


_HOST_CLASS = {OpKind.CONTRACTION: "linear", OpKind.CONV: "conv", OpKind.VIEW: "view", OpKind.ATTENTION: "attention",
               OpKind.LOSS: "cross_entropy", OpKind.EMBEDDING: "embedding"}


def host_seconds(graph: Graph, device: DeviceType, dtype: str = "fp32",
                 eager: bool = False) -> list[tuple[float, float]]:
    r"""Host seconds ``(forward, backward)`` per op of one training step on an accelerator.

    Eager PyTorch dispatches every op from the host: forward, autograd and launch. The GPU runs
    ahead of the device only while the host enqueues faster than the kernels run; a step whose
    kernels are shorter than their dispatch waits for the host. ``T_c`` (``host_op_seconds``,
    measured by ``polyparallel calibrate --device cuda`` per class: linear, conv, batch/layer norm,
    view, attention, cross entropy, embedding, elementwise) is one op's forward + backward host
    time; it splits as ``T_c/(1+κ)`` forward and ``κ·T_c/(1+κ)`` backward (``κ`` the op kind's
    backward factor). An op off the gradient path (it reads no parameter and no activation that
    needs a gradient: a batch norm's running-statistics update) pays its forward share only.
    ``eager``: each elementwise op absorbed by fusion is one more eager op of the elementwise class.
    A ``bf16``/``fp16`` step runs under autocast, which casts the weights of matrix ops every step:
    classes measured under autocast (``"bf16/linear"`` ...) are used for it where present.
    Empty calibration: zeros (the host is assumed to keep ahead).
    """
    table = device.host_table(dtype)
    if not table:
        return [(0.0, 0.0)] * len(graph.ops)
    grad: set[str] = {t for t, spec in graph.tensors.items() if spec.kind is TensorKind.PARAM}
    out = []
    for op in graph.ops:
        on_path = any(t in grad for t in op.inputs)
        if on_path:
            grad.update(op.outputs)
        kind = OpKind(op.kind)
        kb = BACKWARD_FACTOR.get(kind, DEFAULT_BACKWARD_FACTOR)
        t = table.get(host_class(op), table.get("elementwise", 0.0))
        fwd, bwd = t / (1 + kb), (t * kb / (1 + kb) if on_path else 0.0)
        if eager and op.attr.get("fused"):
            te = table.get("elementwise", 0.0)
            ke = BACKWARD_FACTOR.get(OpKind.ELEMENTWISE, DEFAULT_BACKWARD_FACTOR)
            fwd += len(op.attr["fused"]) * te / (1 + ke)
            bwd += len(op.attr["fused"]) * te * ke / (1 + ke) if on_path else 0.0
        out.append((fwd, bwd))
    return out
