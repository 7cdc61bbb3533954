"""The runtime values of a cluster: device types (peak FLOP/s per dtype, memory, bandwidth, measured
rates where calibrated), links, devices, nodes and centers."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from polyparallel.cluster.units import format_bandwidth, format_duration

FRAMEWORKS = ("torch", "mindspore", "paddle", "tensorflow")
LEVELS = ("intra_node", "inter_node", "inter_center")

# Which dtype's figure prices an op when the device publishes none for the dtype asked:
# same width first (bf16 <-> fp16: both run on the same 16-bit units), then the 16-bit rate
# for fp32/tf32 (NPUs without an fp32 matrix unit cast to fp16, as MindSpore does on Ascend).
DTYPE_FALLBACK = {
    "fp32": ("tf32", "fp16", "bf16"), "tf32": ("fp32", "fp16", "bf16"),
    "bf16": ("fp16", "fp32"), "fp16": ("bf16", "fp32"),
    "fp8": ("int8", "fp16", "bf16"), "int8": ("fp8", "fp16", "bf16", "fp32"),
}
TORCH_TO_SHORT = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                   "int8": "int8", "uint8": "int8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
                   "float64": "fp32", "tf32": "tf32"}

# GEMM efficiency by shape, for GPUs without a calibration of their own: the fraction of the
# data-sheet bf16 tensor-core peak that cuBLAS reached on an H200 SXM (GH100, 132 SMs, 989.5 TFLOP/s
# dense bf16: the H100 SXM's compute), measured by `polyparallel calibrate --device cuda` on
# 2026-11-30 (torch 2.11.0+cu130; benchmarks/results/calibration_h200-sxm.json, "gemm" and "matmul").
# Rows (role, s, L, efficiency): a GEMM whose smallest side is s and whose other two have geometric
# mean L (role "out": s is an output side; "reduce": s is the summed side). Only L = 8192 and 16384:
# the smaller-L rows ran at the timing floor (~14 us, launch and synchronisation), which the
# roofline's launch term prices. Independent of the published validation rows.
HOPPER_GEMM_EFFICIENCY: tuple[tuple[str, int, int, float], ...] = (
    ("out", 128, 8192, 0.42), ("reduce", 128, 8192, 0.31), ("out", 256, 8192, 0.576),
    ("reduce", 256, 8192, 0.413), ("out", 512, 8192, 0.689), ("reduce", 512, 8192, 0.523),
    ("out", 768, 8192, 0.683), ("reduce", 768, 8192, 0.582), ("out", 1024, 8192, 0.688),
    ("reduce", 1024, 8192, 0.627), ("out", 2048, 8192, 0.679), ("reduce", 2048, 8192, 0.631),
    ("out", 4096, 8192, 0.685), ("reduce", 4096, 8192, 0.655), ("out", 128, 16384, 0.46),
    ("reduce", 128, 16384, 0.317), ("out", 256, 16384, 0.641), ("reduce", 256, 16384, 0.451),
    ("out", 512, 16384, 0.699), ("reduce", 512, 16384, 0.55), ("out", 768, 16384, 0.662),
    ("reduce", 768, 16384, 0.551), ("out", 1024, 16384, 0.686), ("reduce", 1024, 16384, 0.618),
    ("out", 2048, 16384, 0.686), ("reduce", 2048, 16384, 0.651), ("out", 4096, 16384, 0.715),
    ("reduce", 4096, 16384, 0.657),
)
# square n^3 bf16 GEMMs on the same H200: 0.685 (n = 2048), 0.695 (4096), 0.697 (8192)
HOPPER_SQUARE_GEMM_EFFICIENCY = 0.697
# device types whose compute is the measured chip's (the H200 is an H100 with more and faster memory):
# the catalog's, and a cluster spec's own variants of them (a name starting ``h100-`` or ``h200-``)
HOPPER_GEMM_DEVICES = frozenset({"h100-sxm", "h200-sxm"})


def is_hopper(name: str) -> bool:
    """Whether a device type of this name takes the H200's measured GEMM and attention rows."""
    return name in HOPPER_GEMM_DEVICES or name.startswith(("h100-", "h200-"))

# Fused causal attention (torch scaled_dot_product_attention, is_causal=True) for GPUs without a
# calibration of their own: (FLOPs of the unmasked half, forward s, backward s) measured on the same
# H200 SXM by `polyparallel calibrate --device cuda` on 2026-11-30 (torch 2.11.0+cu130;
# benchmarks/results/calibration_h200-sxm.json "attention"; shapes B,H,S,d = 4,16,512..2048,64, then
# 4,16,4096,128 and 2,32,8192,128; the backward is the forward + backward's time less the forward's).
# At S = 8192 the bf16 forward runs at 0.58 of the peak and the backward takes 3.1x the forward's time
# (it recomputes the scores and does ~2.5x the forward's matrix FLOPs), where the flat figures assumed
# 0.5 and twice the forward. Taken by the Hopper devices (is_hopper), like the GEMM rows. Independent of the
# published validation rows.
HOPPER_ATTENTION_ROWS: tuple[tuple[str, tuple[tuple[float, float, float], ...]], ...] = (
    ("bf16", (
        (2.1517e+09, 2.22e-05, 0.0001967),
        (8.5983e+09, 3.498e-05, 0.0001562),
        (3.4377e+10, 9.97e-05, 0.0003399),
        (2.7495e+11, 0.0005258, 0.001493),
        (1.0996e+12, 0.001922, 0.005904),
    )),
    ("fp16", (
        (2.1517e+09, 3.484e-05, 0.00016),
        (8.5983e+09, 3.506e-05, 0.0001623),
        (3.4377e+10, 0.0001019, 0.0003385),
        (2.7495e+11, 0.0005467, 0.001701),
        (1.0996e+12, 0.001788, 0.006219),
    )),
)

# Host seconds of one eager PyTorch training op (forward + backward: module call, dispatch, autograd,
# kernel launches), by class, for GPUs without a calibration of their own (the device waits for them
# when its kernels are shorter): measured by `polyparallel calibrate --device cuda` (chains of tiny
# ops, forward and backward) on the H200 machine's host, 2026-11-30, torch 2.11.0+cu130
# (benchmarks/results/calibration_h200-sxm.json "training_ops", "training_ops_bf16", "training_ops_fp16";
# "bf16/..." keys: under autocast, which casts a matrix op's weights every step). A figure of the
# host CPU and the framework, not of the GPU. Independent of the published validation rows.
EAGER_HOST_OP_SECONDS: tuple[tuple[str, float], ...] = (
    ("elementwise", 34.1e-6), ("linear", 132.1e-6), ("conv", 130.8e-6), ("batch_norm", 106.1e-6),
    ("layer_norm", 88.5e-6), ("view", 12.5e-6), ("attention", 122.3e-6), ("cross_entropy", 76.9e-6),
    ("embedding", 53.9e-6), ("backward_call", 111.9e-6),
    ("bf16/elementwise", 33.1e-6), ("bf16/linear", 234.9e-6), ("bf16/conv", 221.1e-6), ("bf16/batch_norm", 119.5e-6),
    ("bf16/layer_norm", 84.8e-6), ("bf16/view", 7.2e-6), ("bf16/attention", 128.0e-6),
    ("bf16/cross_entropy", 76.0e-6), ("bf16/embedding", 63.8e-6), ("bf16/backward_call", 129.5e-6),
    ("fp16/elementwise", 30.7e-6), ("fp16/linear", 215.1e-6), ("fp16/conv", 166.0e-6), ("fp16/batch_norm", 118.1e-6),
    ("fp16/layer_norm", 59.1e-6), ("fp16/view", 10.9e-6), ("fp16/attention", 115.6e-6),
    ("fp16/cross_entropy", 90.4e-6), ("fp16/embedding", 55.3e-6), ("fp16/backward_call", 142.7e-6),
)


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator or CPU process.

    Args:
        name: catalog name (``a100-80gb-sxm``).
        kind: ``gpu``, ``npu`` or ``cpu``.
        peak: peak FLOP/s per dtype (``fp32``, ``bf16``, ``fp16``, ``int8``...), as pairs.
        memory: capacity in bytes.
        memory_bandwidth: bytes/s.
        launch_overhead: seconds: the floor of any kernel.
        source: where the numbers come from.
        sms: streaming multiprocessors (a GPU's compute units; 0: not given). A collective's kernels
            hold some of them while they run, which slows the compute they overlap
            (:func:`polyparallel.cost_models.data_parallel.overlap_slowdown`).
        matmul_curve: measured ``(flops, seconds)`` of matmuls by size (calibrated devices).
        sharded_op_overhead: seconds a sharded-tensor (DTensor) op adds on the host over a plain
            one (calibrated CPU processes); 0 where the host runs ahead of the device.
        matmul_curves: measured ``(flops, seconds)`` curves per dtype (calibrated GPUs, ``polyparallel
            calibrate --device cuda``), as ``(dtype, curve)`` pairs; preferred over ``matmul_curve``.
        attention_curves: measured fused-attention ``(flops, forward_s, backward_s)`` per dtype.
        conv_curves: measured convolution ``(flops, forward_s, backward_s)`` rows per ``dtype/class``
            key, class ``1x1`` (pointwise) or ``kxk`` (a larger kernel) (calibrated GPUs).
        streaming_rows: measured ``(numel, forward_s, backward_s)`` rows of streaming kernels per
            ``dtype/kind`` key (``batch_norm``, ``layer_norm``, ``elementwise``; calibrated GPUs).
        host_op_seconds: measured host seconds of one eager op, forward + backward, by class
            (``linear``, ``conv``, ``batch_norm`` ...; calibrated GPUs): what a step waits for when
            its kernels are shorter than their dispatch; ``dtype/class`` keys: measured under autocast.
        optimizer_host: measured host seconds of an optimizer step as ``(optimizer/mode, fixed,
            per tensor)`` (mode ``foreach`` or ``fused``; calibrated GPUs).
        misaligned_factor: measured slowdown of a 16-bit GEMM with a dimension that is not a
            multiple of 8 against the same GEMM padded (median over the calibrated shapes; 1: none).
        memory_efficiency: measured fraction of ``memory_bandwidth`` a streaming kernel reaches
            (``None``: the compute model's modelled default).
        training_op_overhead: seconds of host work an eager training op pays per kernel forward
            and per backward kernel beyond ``launch_overhead`` (module call, autograd node and
            engine, gradient accumulation; calibrated CPU processes); 0 where the host runs ahead
            of the device.
        optimizer_tensor_overhead: measured seconds per parameter tensor of the framework's
            optimizer step, as ``(optimizer, seconds)`` pairs (calibrated CPU processes: torch
            updates tensor by tensor there); empty: priced from ``launch_overhead``.
        optimizer_element_rates: measured seconds per parameter element of that step by total
            elements, as ``(optimizer, ((elements, seconds), ...))`` pairs (calibrated CPU
            processes); empty: priced by streaming the optimizer state at the memory bandwidth.
        gemm_rates: measured skinny-GEMM seconds as ``(role, small, large, seconds)`` rows (role
            ``out`` or ``reduce``; calibrated CPU processes; see
            :func:`polyparallel.cost_models.compute.gemm_rate`); empty: the square curve alone.
        grad_accumulation: seconds per gradient element autograd adds into an existing gradient
            (every micro-batch after the first; calibrated CPU processes); 0: not priced.
        optimizer_dtensor_overhead: measured seconds per *sharded* (DTensor) parameter tensor of
            the optimizer step, as ``(optimizer, seconds)`` pairs (calibrated CPU processes, FSDP2 and
            tensor parallelism); empty: the plain per-tensor cost plus ``k`` DTensor dispatches.
        op_profile: the measured op prices of one model on this machine
            (:class:`polyparallel.cost_models.op_profile.OpProfile`, ``search(..., profile=True)``);
            they replace the roofline for that model's ops.
    """

    name: str
    kind: str
    peak: tuple[tuple[str, float], ...]
    memory: float
    memory_bandwidth: float
    launch_overhead: float = 5e-6
    vendor: str = ""
    source: str = ""
    sms: int = 0
    matmul_curve: tuple[tuple[float, float], ...] = ()
    sharded_op_overhead: float = 0.0
    matmul_curves: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    attention_curves: tuple[tuple[str, tuple[tuple[float, float, float], ...]], ...] = ()
    memory_efficiency: float | None = None
    conv_curves: tuple[tuple[str, tuple[tuple[float, float, float], ...]], ...] = ()
    streaming_rows: tuple[tuple[str, tuple[tuple[float, float, float], ...]], ...] = ()
    host_op_seconds: tuple[tuple[str, float], ...] = ()
    optimizer_host: tuple[tuple[str, float, float], ...] = ()
    misaligned_factor: float = 1.0
    training_op_overhead: float = 0.0
    optimizer_tensor_overhead: tuple[tuple[str, float], ...] = ()
    optimizer_element_rates: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    gemm_rates: tuple[tuple[str, int, int, float], ...] = ()
    grad_accumulation: float = 0.0
    optimizer_dtensor_overhead: tuple[tuple[str, float], ...] = ()
    op_profile: Any = None

    @cached_property
    def cache_key(self) -> tuple[str, int]:
        """``(name, hash of every figure)``, computed once: prices cached per graph stay apart for
        two types that share a name (``local-cpu:1`` and ``local-cpu:4`` are both ``cpu-process``)."""
        return (self.name, hash(self))

    def curve(self, dtype: str) -> tuple[tuple[float, float], ...]:
        """The measured matmul curve for ``dtype`` (GPU calibrations), else the dtype-less one (CPU)."""
        short = TORCH_TO_SHORT.get(dtype, dtype)
        return dict(self.matmul_curves).get(short, self.matmul_curve)

    def attention_curve(self, dtype: str) -> tuple[tuple[float, float, float], ...]:
        """Measured fused-attention ``(flops, forward_s, backward_s)`` rows for ``dtype`` (may be empty):
        the device's own calibration, else, on an H100/H200, the H200's (``HOPPER_ATTENTION_ROWS``)."""
        short = TORCH_TO_SHORT.get(dtype, dtype)
        own = dict(self.attention_curves).get(short, ())
        if own or self.kind != "gpu" or not is_hopper(self.name):
            return own
        return dict(HOPPER_ATTENTION_ROWS).get(short, ())

    def conv_curve(self, dtype: str, pointwise: bool) -> tuple[tuple[float, float, float], ...]:
        """Measured convolution ``(flops, forward_s, backward_s)`` rows for ``dtype`` and kernel class
        (``pointwise``: a 1x1 kernel); empty when not calibrated."""
        key = f"{TORCH_TO_SHORT.get(dtype, dtype)}/{'1x1' if pointwise else 'kxk'}"
        return dict(self.conv_curves).get(key, ())

    def host_table(self, dtype: str) -> dict[str, float]:
        """Measured host seconds of one eager op by class for a step at ``dtype``: a class measured
        under that dtype's autocast (``bf16/linear``) where present, else the plain one. A GPU
        without any calibration takes ``EAGER_HOST_OP_SECONDS``; a calibration without host rows
        (the host kept ahead where it was measured), and other devices, none."""
        uncalibrated_gpu = self.kind == "gpu" and not self.matmul_curves
        rows = self.host_op_seconds or (EAGER_HOST_OP_SECONDS if uncalibrated_gpu else ())
        prefix = f"{TORCH_TO_SHORT.get(dtype, dtype)}/"
        return {**{k: v for k, v in rows if "/" not in k},
                **{k.removeprefix(prefix): v for k, v in rows if k.startswith(prefix)}}

    def streaming_curve(self, dtype: str, kind: str) -> tuple[tuple[float, float, float], ...]:
        """Measured ``(numel, forward_s, backward_s)`` rows of a streaming kernel (``batch_norm``,
        ``layer_norm``, ``elementwise``) for ``dtype``; empty when not calibrated."""
        return dict(self.streaming_rows).get(f"{TORCH_TO_SHORT.get(dtype, dtype)}/{kind}", ())

    def peak_flops(self, dtype: str = "fp32") -> float:
        """Peak FLOP/s for a dtype (``fp32``/``bf16``.. or torch names), with documented fallbacks."""
        short = TORCH_TO_SHORT.get(dtype, dtype)
        table = dict(self.peak)
        for d in (short, *DTYPE_FALLBACK.get(short, ())):
            if d in table:
                return table[d]
        return max(table.values())

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Link:
    """A link class: bandwidth per direction (bytes/s), latency (s), ports, efficiency.

    ``bandwidth`` is the usable rate of one direction over all ports: ``min(up, down) * ports
    * efficiency / oversubscription``. ``algorithms``: the collective algorithms the link's
    communication library runs over it (NCCL/HCCL: ring and tree; gloo: ring only, and its
    α–β is fitted with the ring formula).
    """

    kind: str
    up: float
    down: float
    latency: float
    ports: int = 1
    efficiency: float = 1.0
    oversubscription: float = 1.0
    source: str = ""
    algorithms: tuple[str, ...] = ("ring", "tree")

    @property
    def bandwidth(self) -> float:
        return min(self.up, self.down) * self.ports * self.efficiency / self.oversubscription

    @property
    def up_bandwidth(self) -> float:
        return self.up * self.ports * self.efficiency / self.oversubscription

    @property
    def down_bandwidth(self) -> float:
        return self.down * self.ports * self.efficiency / self.oversubscription

    def __str__(self) -> str:
        bw = f"{format_bandwidth(self.up_bandwidth)}" if self.up == self.down else \
            f"up {format_bandwidth(self.up_bandwidth)} / down {format_bandwidth(self.down_bandwidth)}"
        return f"{self.kind} {bw}, {format_duration(self.latency)}"


@dataclass(frozen=True)
class Device:
    """One device of the cluster; ``id`` is its global rank order (centers, nodes, devices)."""

    id: int
    name: str
    type: DeviceType
    center: int
    node: int
    local: int


@dataclass(frozen=True)
class Node:
    name: str
    center: int
    index: int
    device_type: DeviceType
    devices: tuple[int, ...]
    intra: Link
    nic: Link | None


@dataclass(frozen=True)
class Center:
    name: str
    index: int
    city: str
    framework: str
    data_may_leave: bool
    activations_may_leave: bool
    nodes: tuple[int, ...]
    wan: Link | None
