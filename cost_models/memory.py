"""Device memory: model states by optimizer, precision and ZeRO/FSDP stage, plus activations.

For a device holding ``Ψ`` parameters (after tensor and pipeline splitting), data-parallel
degree ``d`` and ZeRO stage ``z``:

    weights    = Ψ · b_w                 / (d if z ≥ 3 else 1)  (+ Ψ · b_w / d, z = 1, 2, no master)
    gradients  = Ψ · b_g                 / (d if z ≥ 2 else 1)
    optimizer  = Ψ · (b_master + s_opt)  / (d if z ≥ 1 else 1)

Under expert parallelism the ``Ψ_e`` expert weights a device holds (``1/ep`` of its stage's) are
counted apart: ZeRO shards their states over the ``d_e = d/ep`` ranks holding the same experts.

with ``b_w``, ``b_g`` the bytes of a weight and a gradient (2 for bf16/fp16, 4 for fp32),
``b_master = 4`` when training in 16 bits keeps fp32 master weights, and ``s_opt`` the
optimizer's state per parameter (Adam: two fp32 moments = 8 bytes; SGD with momentum 4;
plain SGD 0). Mixed-precision Adam without ZeRO is the classic 2 + 2 + 4 + 8 = 16 bytes per
parameter (Rajbhandari et al., ZeRO, 2020). ZeRO stages run as FSDP2 (the torch backend): under
ZeRO-1/2 the weights are gathered for the whole step while the sharded parameters stay allocated
(the master weights in 16 bits, a second ``1/d`` copy otherwise); ZeRO-3/FSDP adds a workspace
(given by the caller, ``step``) for the gathered weights: the root unit's (embeddings, head), held
through every micro-batch, and the largest layer's twice (one in use, one prefetched).

Activations: ``A`` bytes per micro-batch for the device's stage (the tensors autograd saves for
its ops, at their split size: ``activations.kept_tensors``; ``scaled_dot_product_attention`` keeps its
output and log-sum-exp, other attention ops their score matrices unless fused; a pipeline stage
also holds the activations it received) times the peak number of micro-batches alive under the
pipeline schedule (``m`` for GPipe, ``p − s`` for 1F1B stage ``s``, ``p(1 + (p−1)/(p·v))`` for
interleaved stage 0, from the simulation). Full recomputation keeps only each layer's input and
needs one layer's activations as a workspace during its backward; selective recomputation
(Korthikanti et al., 2022) drops what attention keeps beyond its inputs and output (score
matrices, or SDPA's log-sum-exp).

:class:`MemoryReport` says whether the device fits and, if not, *why*: which term is
largest on which device, by how much the total is over, and what would shrink that term.

Examples:
    >>> r = device_memory(label="d0", device="a100", capacity=80e9, params=1e9, dp=1, zero_stage=0,
    ...                   param_dtype="bf16", optimizer="adam", activations=0.0)
    >>> r.total / 1e9
    16.0
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OPTIMIZER_STATE_BYTES", "MemoryReport", "device_memory"]

# fp32 optimizer state per parameter, bytes
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "sgd_momentum": 4, "lion": 4, "sgd": 0}
_WIDTH = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}

_ADVICE = {
    "weights": "more tensor/pipeline parallelism or ZeRO-3/FSDP",
    "gradients": "ZeRO stage 2 (shard gradients over data parallel)",
    "optimizer": "ZeRO stage 1 (shard optimizer state over data parallel)",
    "activations": "activation recomputation, fewer micro-batches in flight (1F1B instead of GPipe), "
                   "a smaller micro-batch or more tensor/sequence parallelism",
    "workspace": "smaller layers per recompute segment or less ZeRO-3 prefetch",
}


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per term on one device (or one pipeline stage's devices) and whether they fit."""

    label: str
    device: str
    capacity: float
    terms: tuple[tuple[str, float], ...]
    in_flight: float = 0.0

    @property
    def total(self) -> float:
        return sum(v for _, v in self.terms)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def term(self, name: str) -> float:
        return dict(self.terms)[name]

    def why(self) -> str:
        gb = 1e9
        parts = ", ".join(f"{k} {v / gb:.2f}" for k, v in self.terms if v)
        if self.fits:
            return f"{self.label} ({self.device}): fits, {self.total / gb:.2f} of {self.capacity / gb:.2f} GB ({parts})"
        name, big = max(self.terms, key=lambda kv: kv[1])
        extra = f" ({self.in_flight:g} micro-batches in flight)" if name == "activations" and self.in_flight else ""
        return (f"{self.label} ({self.device}): does not fit, needs {self.total / gb:.2f} GB of "
                f"{self.capacity / gb:.2f} GB (over by {(self.total - self.capacity) / gb:.2f} GB); largest term "
                f"{name} {big / gb:.2f} GB{extra}; terms: {parts}. To shrink {name}: {_ADVICE[name]}")

    def __str__(self) -> str:
        return self.why()


def device_memory(*, label: str, device: str, capacity: float, params: float, dp: int, zero_stage: int,
                  param_dtype: str, optimizer: str, activations: float, in_flight: float = 1.0,
                  grad_dtype: str | None = None, master_weights: bool | None = None,
                  workspace: float = 0.0, expert_params: float = 0.0, expert_dp: int = 1) -> MemoryReport:
    """Memory of one device; see the module docstring for the formulas.

    Args:
        params: parameters held before ZeRO sharding (after tensor/pipeline splitting).
        activations: bytes stored per micro-batch (already reduced by recomputation).
        in_flight: peak micro-batches whose activations are alive.
        master_weights: fp32 master copy; default: when ``param_dtype`` is 16-bit.
        expert_params / expert_dp: expert weights held besides ``params`` (after the ``ep`` split)
            and the ranks ZeRO shards them over.
    """
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; one of {', '.join(OPTIMIZER_STATE_BYTES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage}")
    bw = _WIDTH[param_dtype]
    bg = _WIDTH[grad_dtype or param_dtype]
    master = (bw < 4) if master_weights is None else master_weights
    opt = (4 if master else 0) + OPTIMIZER_STATE_BYTES[optimizer]

    def states(width: float, from_stage: int) -> float:
        return (params * width / (dp if zero_stage >= from_stage else 1)
                + expert_params * width / (expert_dp if zero_stage >= from_stage else 1))

    # ZeRO-1/2 as FSDP2 runs them compute with gathered weights while the sharded parameters stay
    # allocated: in 16 bits those are the fp32 master weights, otherwise a second copy of 1/d
    shard_copy = states(bw, 1) if zero_stage in (1, 2) and not master else 0.0
    terms = (
        ("weights", states(bw, 3) + shard_copy),
        ("gradients", states(bg, 2)),
        ("optimizer", states(opt, 1)),
        ("activations", activations * in_flight),
        ("workspace", workspace),
    )
    return MemoryReport(label, device, capacity, terms, in_flight)
