"""The runtime values of a cluster: device types (peak FLOP/s per dtype, memory, bandwidth, measured
rates where calibrated), links, devices, nodes and centers."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from polyparallel.cluster.units import format_bandwidth, format_duration

FRAMEWORKS = ("torch", "mindspore")
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
    """

    name: str
    kind: str
    peak: tuple[tuple[str, float], ...]
    memory: float
    memory_bandwidth: float
    launch_overhead: float = 5e-6
    vendor: str = ""
    source: str = ""
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
        """Measured fused-attention ``(flops, forward_s, backward_s)`` rows for ``dtype`` (may be empty)."""
        return dict(self.attention_curves).get(TORCH_TO_SHORT.get(dtype, dtype), ())

    def conv_curve(self, dtype: str, pointwise: bool) -> tuple[tuple[float, float, float], ...]:
        """Measured convolution ``(flops, forward_s, backward_s)`` rows for ``dtype`` and kernel class
        (``pointwise``: a 1x1 kernel); empty when not calibrated."""
        key = f"{TORCH_TO_SHORT.get(dtype, dtype)}/{'1x1' if pointwise else 'kxk'}"
        return dict(self.conv_curves).get(key, ())

    def host_table(self, dtype: str) -> dict[str, float]:
        """Measured host seconds of one eager op by class for a step at ``dtype``: a class measured
        under that dtype's autocast (``bf16/linear``) where present, else the plain one."""
        prefix = f"{TORCH_TO_SHORT.get(dtype, dtype)}/"
        return {**{k: v for k, v in self.host_op_seconds if "/" not in k},
                **{k.removeprefix(prefix): v for k, v in self.host_op_seconds if k.startswith(prefix)}}

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
