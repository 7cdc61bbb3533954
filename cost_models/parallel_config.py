"""What the step model prices and what it returns: :class:`ParallelConfig` (degrees, micro-batching,
schedule, memory knobs, precision, optional per-op placements as :class:`OpPlan` s) and
:class:`StepEstimate` (step time, per-stage breakdown, memory)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from polyparallel.cluster import Cluster
from polyparallel.ir import TRAINING_DTYPE_BYTES
from polyparallel.plan import RECOMPUTE, Plan

from .compute import ATTENTION_KERNELS
from .memory import OPTIMIZER_STATE_BYTES, MemoryReport
from .pipeline import PipelineResult

__all__ = ["EXECUTION_FIELDS", "GRAD_ACCUMULATION", "GRAD_REDUCE", "PIPELINE_P2P", "RECOMPUTE", "ZERO3_GATHER",
           "OpPlan", "ParallelConfig", "StageBreakdown", "StepEstimate", "execution_options", "parse_execution"]

PIPELINE_P2P = ("megatron", "deepspeed")
GRAD_REDUCE = ("reduce_scatter", "all_reduce")
GRAD_ACCUMULATION = ("in_place", "cast_add")
ZERO3_GATHER = ("unit", "flat", "parameter")
OPTIMIZERS = tuple(OPTIMIZER_STATE_BYTES)

# How the training framework runs a plan, as distinct from the plan (degrees, micro-batching, schedule,
# memory knobs): which kernels it fuses, whether it overlaps the gradient reduction with the backward,
# how its pipeline exchanges activations and its optimizer reduces and accumulates gradients. Unset,
# each is what the torch backend does; a recipe measured under another framework (Megatron-LM,
# DeepSpeed) sets them to what that framework did (``pp.evaluate(execution=...)``, ``--execution``).
EXECUTION_FIELDS = ("fused_elementwise", "fused_attention", "fused_dropout", "fused_optimizer", "grad_overlap",
                    "optimizer", "pipeline_p2p", "grad_reduce", "grad_accumulation", "zero3_gather", "attention_kernel",
                    "fused_loss")


@dataclass(frozen=True)
class OpPlan:
    """One op's share of the work and its tensor/sequence-parallel collectives, as a placement gives them.

    ``split``: the op's FLOPs and bytes are divided by it; ``tp_fwd`` / ``tp_bwd``: ``(collective
    kind, bytes)`` over the op's tensor-parallel group in the forward / backward pass (its own
    collectives and the reshards of its inputs and their gradients); ``sp_fwd`` / ``sp_bwd`` over
    the sequence-parallel group; ``param_split``: ways its parameters are sharded (memory, and
    DTensor dispatch when > 1).
    """

    split: float = 1.0
    tp_fwd: tuple[tuple[str, float], ...] = ()
    tp_bwd: tuple[tuple[str, float], ...] = ()
    sp_fwd: tuple[tuple[str, float], ...] = ()
    sp_bwd: tuple[tuple[str, float], ...] = ()
    param_split: float = 1.0


@dataclass(frozen=True)
class ParallelConfig(Plan):
    """A :class:`~polyparallel.plan.Plan` (degrees, micro-batching, schedule, memory knobs, precision)
    with the options :func:`estimate_step` prices it under: how the training framework runs it and,
    optionally, per-op placements.

    Args:
        dp ... dtype: the plan (:class:`~polyparallel.plan.Plan`). Priced here: ``ep`` all-to-alls
            the routed tokens to the experts and back and reduces the experts' gradients only over
            the ``dp·sp/ep`` ranks holding the same experts; ``recompute`` ``selective`` recomputes
            the attention scores (Korthikanti et al.), ``op`` checkpoints every layer keeping every
            second matrix product's output and the fused attention's (torchtitan's "selective op"
            policy, :func:`~.activations.op_policy_saved`), ``full`` checkpoints every layer keeping
            its input only; ``dtype`` is also the weights' and gradients' precision.
        optimizer: ``adam``, ``adamw``, ``sgd``, ``sgd_momentum``, ``lion``, ``lamb``.
        grad_overlap: ω of the module docstring; ``None`` picks 1 on accelerators, 0 on CPUs.
        fused_attention: which attention kernels run. ``None`` (default): as eager torch chooses:
            ``scaled_dot_product_attention`` runs a fused kernel (flash / memory-efficient on
            accelerators, torch's flash kernel on CPUs), keeping only softmax statistics; any other
            attention op runs unfused. ``True``: every attention op is fused (flash attention
            throughout). ``False``: nothing is fused; ``scaled_dot_product_attention`` runs torch's
            math kernel (on accelerators, 16-bit attention computed in fp32).
        fused_optimizer: on accelerators the optimizer step is one fused kernel that reads and
            writes every state once (apex/Megatron FusedAdam, ``torch.optim.Adam(fused=True)``, which
            the torch backend uses on CUDA); ``False``: torch's default multi-tensor (foreach) step,
            priced by its passes over fp32 memory (18 accesses per parameter for Adam). CPUs always
            run the unfused step (tensor by tensor, the same kernels).
        fused_elementwise: ``True``: elementwise ops absorbed by ``fuse_elementwise`` run inside their
            producer's kernel and 16-bit plans compute in 16 bits throughout (a compiler, or hand-fused
            kernels and 16-bit weights as in Megatron); ``False``: eager PyTorch, each is its own kernel
            streaming its operands and its own host dispatch, and a 16-bit plan runs under
            ``torch.autocast``; ``None`` (default): what the torch backend runs, eager on accelerators
            (fused where the plan compiles its blocks, ``compile="regional"``), and on CPUs the
            prices their calibration and profiles measured (of eager steps).
        fused_loss: ``True``: an eager step's cross entropy is one fused kernel on 16-bit logits
            (flash-attn's ``CrossEntropyLoss``, llm-foundry's default ``loss_fn: fused_crossentropy``):
            it keeps per-row statistics and allocates one logits-sized gradient, where torch's upcast
            loss holds fp32 log-probabilities and their gradients (:func:`~.activations.loss_transient`;
            its time is still priced as the eager loss's, a few ms at most). ``None``: fused exactly
            when ``fused_elementwise`` fuses (Megatron's in-place vocabulary-parallel loss).
        fused_dropout: ``False``: a dropout absorbed by ``fuse_elementwise`` still runs as its own
            kernel (reads its input, writes its output; the backward likewise) where
            ``fused_elementwise`` fuses the rest: Megatron-LM's attention dropout, a ``torch.nn.Dropout``
            on the probabilities its fused scale-mask-softmax kernel wrote (``megatron/model/transformer.py``
            ``ParallelAttention``). Eager steps run every elementwise op on its own anyway.
        devices: device ids in rank order (default: the cluster's first ``world`` devices).
        partition: how layers are cut into pipeline chunks: ``flops`` (balance forward FLOPs) or
            ``layers`` (equal layer counts, embedding/head on the end stages: Megatron/DeepSpeed).
        pipeline_p2p: how stages exchange boundary activations and their gradients. ``megatron``:
            each tensor-parallel rank sends ``1/tp`` of the tensor and the receivers all-gather it
            over the node's fast links (Megatron-LM's scatter/gather), asynchronously: a transfer
            delays its receiver only. ``deepspeed``: DeepSpeed's pipeline engine
            (``deepspeed/runtime/pipe``): the same slices (``pipe_partitioned``/``grad_partitioned``),
            but sent with synchronous ``p2p.send``/``p2p.recv`` (``async_op`` is refused) issued
            between the compute instructions, "blocking and must be paired" (``schedule.py``), and
            rebuilt by an all-gather on the receiver (``PartitionedTensor.full``): each transfer
            occupies both its sender's and its receiver's stream; per micro-batch a stage receives
            and sends the activation and the gradient.
        grad_reduce: how ZeRO-1 reduces the gradients before each rank updates its shard.
            ``reduce_scatter``: each rank receives only its shard's sum (FSDP2, Megatron's distributed
            optimizer). ``all_reduce``: every rank receives the whole sum, then updates its shard and
            all-gathers the weights: DeepSpeed's ``BF16_Optimizer``, the optimizer its pipeline engine
            runs bf16 ZeRO-1 with (``deepspeed/runtime/pipe/engine.py``: ``_exec_reduce_grads`` ->
            ``_bf16_reduce_grads`` -> ``buffered_allreduce_fallback`` over the optimizer's fp32
            gradients, ``get_grads_for_reduction``), twice a reduce-scatter's traffic. ZeRO-1 only.
        grad_accumulation: how each micro-batch's weight gradients reach the accumulator the
            reduction reads. ``in_place``: added where they are produced, one streaming pass, the
            first micro-batch's taken as it is (torch's ``AccumulateGrad``, Megatron-LM's
            ``main_grad`` hook). ``cast_add``: a 16-bit gradient, fresh every micro-batch, then cast
            into a temporary fp32 tensor and added to a separate fp32 gradient buffer, in every
            micro-batch: DeepSpeed's ``BF16_Optimizer.update_hp_grads``
            (``hp_grad.add_(lp.grad.to(hp_grad.dtype))``), which its pipeline engine calls after each
            backward pass (``_exec_backward_pass``) and which ``grad_reduce="all_reduce"`` reduces.
            16-bit dtypes only.
        zero3_gather: how sharded data parallelism gathers the weights before a layer runs. ``unit``:
            one all-gather per FSDP2 unit (a numbered layer, the root's weights) into one buffer,
            prefetched during the previous unit's compute, then copied out into the parameters on
            the compute stream; the gradients copied into the reduce-scatter's buffer likewise (the
            torch backend). ``flat``: FSDP1's ``FlatParameter`` (torch's ``FullyShardedDataParallel``,
            MosaicML Composer, fairscale): the same units and overlap, but the gathered buffer is the
            parameters' storage and the gradient one flat tensor, so only the cast of the gradient to
            the reduction precision is copied (:func:`~.data_parallel.fsdp_copy_seconds`).
            ``parameter``: DeepSpeed's ZeRO-3 of 2021
            (``deepspeed/runtime/zero/partition_parameters.py``, ``_allgather_param``): every
            parameter tensor by its own ``all_gather`` into a list of one view per rank, which torch
            copies out of the collective's flat buffer one kernel per rank, the host waiting for the
            device first (``torch.cuda.synchronize()``): per tensor the ring's latency and ``p``
            kernel launches, none of it hidden behind compute. Its gradient reduce-scatter is priced
            as FSDP2's; ZeRO-3 without a pipeline only.
        attention_kernel: which fused attention kernel runs: ``None``, the device's own rows (its
            calibration; on a Hopper GPU without one the H200's, torch 2.11's cuDNN kernel), or a
            kernel of :data:`~.compute.ATTENTION_KERNELS` at its published rates (``fa2``: torch's
            SDPA on Hopper from 2.5.1 to 2.10, and torchtitan's choice; ``cudnn``; ``fa3``; ``fa1``:
            FlashAttention v1's CUDA kernel and its Triton port, llm-foundry's ``attn_impl: triton`` of
            2023, at the FlashAttention-2 paper's published A100 and H100 rates by sequence length and
            head dimension, 55-83 and 98-137 TFLOP/s forward + backward causal at head dimension 128).
        op_plans: one :class:`OpPlan` per graph op, from per-op placements (a placement solver);
            ``None`` prices the Megatron rule of the module docstring.
    """

    optimizer: str = "adam"
    grad_overlap: float | None = None
    fused_attention: bool | None = None
    fused_optimizer: bool = True
    fused_elementwise: bool | None = None
    fused_dropout: bool = True
    fused_loss: bool | None = None
    devices: tuple[int, ...] | None = None
    partition: str = "flops"
    pipeline_p2p: str = "megatron"
    grad_reduce: str = "reduce_scatter"
    grad_accumulation: str = "in_place"
    zero3_gather: str = "unit"
    attention_kernel: str | None = None
    op_plans: tuple[OpPlan, ...] | None = field(default=None, repr=False)

    def validate(self, cluster: Cluster | None = None) -> None:
        """Raise ``ValueError`` naming the bad field and the fix."""
        why = self.problems("ParallelConfig.")
        if why:
            raise ValueError(why[0])
        if self.ep > 1 and self.zero_stage == 3:
            raise ValueError("ParallelConfig.ep > 1 with zero_stage 3 is not modelled: use ZeRO 0-2 with expert "
                             "parallelism (the experts are already sharded over ep)")
        if self.partition not in ("flops", "layers"):
            raise ValueError(f"ParallelConfig.partition {self.partition!r}: use 'flops' or 'layers'")
        if self.pipeline_p2p not in PIPELINE_P2P:
            raise ValueError(f"ParallelConfig.pipeline_p2p {self.pipeline_p2p!r}: use one of {', '.join(PIPELINE_P2P)}")
        if self.grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"ParallelConfig.grad_reduce {self.grad_reduce!r}: use one of {', '.join(GRAD_REDUCE)}")
        if self.grad_reduce == "all_reduce" and self.zero_stage != 1:
            raise ValueError("ParallelConfig.grad_reduce='all_reduce' is ZeRO-1's variant: set zero_stage=1 (ZeRO-0 "
                             "all-reduces anyway; ZeRO-2/3 keep only their gradient shard)")
        if self.grad_accumulation not in GRAD_ACCUMULATION:
            raise ValueError(f"ParallelConfig.grad_accumulation {self.grad_accumulation!r}: use one of "
                             f"{', '.join(GRAD_ACCUMULATION)}")
        if self.grad_accumulation == "cast_add" and TRAINING_DTYPE_BYTES[self.dtype] >= 4:
            raise ValueError("ParallelConfig.grad_accumulation='cast_add' casts 16-bit gradients into fp32: set "
                             "dtype='bf16' or 'fp16', or use 'in_place'")
        if self.zero3_gather not in ZERO3_GATHER:
            raise ValueError(f"ParallelConfig.zero3_gather {self.zero3_gather!r}: use one of {', '.join(ZERO3_GATHER)}")
        if self.attention_kernel is not None and self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"ParallelConfig.attention_kernel {self.attention_kernel!r}: use one of "
                             f"{', '.join(ATTENTION_KERNELS)}, or None (the device's own rows)")
        if self.fused_loss not in (None, True, False):
            raise ValueError(f"ParallelConfig.fused_loss must be None, True or False, got {self.fused_loss!r}")
        if self.fused_attention not in (None, True, False):
            raise ValueError(f"ParallelConfig.fused_attention must be None, True or False, got "
                             f"{self.fused_attention!r}")
        if self.grad_overlap is not None and not 0 <= self.grad_overlap <= 1:
            raise ValueError(f"ParallelConfig.grad_overlap must be in [0, 1], got {self.grad_overlap}")
        if cluster is not None:
            devs = self.devices if self.devices is not None else tuple(range(self.world))
            if len(devs) != self.world:
                raise ValueError(f"ParallelConfig.devices lists {len(devs)} devices for a world of {self.world}")
            if self.world > cluster.num_devices or min(devs) < 0 or max(devs) >= cluster.num_devices:
                raise ValueError(f"the configuration needs {self.world} devices (dp {self.dp} x tp {self.tp} x pp "
                                 f"{self.pp} x sp {self.sp} x cp {self.cp}); cluster {cluster.name!r} has "
                                 f"{cluster.num_devices}")

    def __str__(self) -> str:
        extra = [f"m={self.microbatches}", self.schedule + (f"x{self.chunks}" if self.chunks > 1 else "")]
        if self.zero_stage:
            extra.append(f"zero{self.zero_stage}")
        if self.recompute != "none":
            extra.append(f"rc={self.recompute}")
        if self.sequence_parallel:
            extra.append("seqpar")
        if self.op_plans is not None:
            extra.append("placed")
        if self.pipeline_p2p != "megatron" and self.pp > 1:
            extra.append(f"p2p={self.pipeline_p2p}")
        if self.grad_reduce != "reduce_scatter":
            extra.append(f"grads={self.grad_reduce}")
        if self.grad_accumulation != "in_place":
            extra.append(f"accum={self.grad_accumulation}")
        if self.ep > 1:
            extra.insert(0, f"ep{self.ep}")
        return f"dp{self.dp} tp{self.tp} pp{self.pp} sp{self.sp} " + (f"cp{self.cp} " if self.cp > 1 else "") + \
            " ".join(extra)


def execution_options(values: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """``values`` (a subset of :data:`EXECUTION_FIELDS`) checked and as sorted pairs, hashable for a
    frozen record; ``ValueError`` names an unknown field or a bad value and what to give instead.

    >>> execution_options({"grad_overlap": 0, "fused_elementwise": True})
    (('fused_elementwise', True), ('grad_overlap', 0.0))
    """
    if not values:
        return ()
    unknown = sorted(set(values) - set(EXECUTION_FIELDS))
    if unknown:
        raise ValueError(f"unknown execution option(s) {unknown}: use {', '.join(EXECUTION_FIELDS)}")
    out = dict(values)
    if out.get("grad_overlap") is not None:
        if isinstance(out["grad_overlap"], bool) or not isinstance(out["grad_overlap"], int | float):
            raise ValueError(f"execution grad_overlap={out['grad_overlap']!r}: give the overlapped share in [0, 1]")
        out["grad_overlap"] = float(out["grad_overlap"])
    for name in ("fused_elementwise", "fused_attention", "fused_loss"):
        if name in out and out[name] not in (None, True, False):
            raise ValueError(f"execution {name}={out[name]!r}: give true, false or none (the torch backend's choice)")
    for name in ("fused_optimizer", "fused_dropout"):
        if name in out and out[name] not in (True, False):
            raise ValueError(f"execution {name}={out[name]!r}: give true or false")
    for name, allowed in (("pipeline_p2p", PIPELINE_P2P), ("grad_reduce", GRAD_REDUCE),
                          ("grad_accumulation", GRAD_ACCUMULATION), ("optimizer", OPTIMIZERS),
                          ("zero3_gather", ZERO3_GATHER)):
        if name in out and out[name] not in allowed:
            raise ValueError(f"execution {name}={out[name]!r}: give one of {', '.join(allowed)}")
    if out.get("attention_kernel") not in (None, *ATTENTION_KERNELS):
        raise ValueError(f"execution attention_kernel={out['attention_kernel']!r}: give one of "
                         f"{', '.join(ATTENTION_KERNELS)} or none (the device's own rows)")
    # the combined checks (ZeRO-1 for grad_reduce, 16 bits for cast_add, overlap in [0, 1]) are
    # ParallelConfig.validate's, made on each priced plan
    return tuple(sorted(out.items()))


def parse_execution(items: Iterable[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings (the CLI's ``--execution``) as an ``execution`` mapping: ``true`` /
    ``false`` / ``none`` and numbers are read as such, anything else stays a string; checked by
    :func:`execution_options`.

    >>> parse_execution(["grad_overlap=0", "fused_dropout=false", "pipeline_p2p=deepspeed"])
    {'grad_overlap': 0, 'fused_dropout': False, 'pipeline_p2p': 'deepspeed'}
    """
    words = {"true": True, "false": False, "none": None}
    out: dict[str, Any] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--execution {item!r}: give KEY=VALUE, KEY one of {', '.join(EXECUTION_FIELDS)}")
        raw = raw.strip()
        value: Any = words.get(raw.lower(), raw)
        if isinstance(value, str):
            for kind in (int, float):
                try:
                    value = kind(raw)
                    break
                except ValueError:
                    pass
        out[key.strip()] = value
    execution_options(out)
    return out


@dataclass(frozen=True)
class StageBreakdown:
    """Seconds of one pipeline stage per step; ``parts`` sum to the step time."""

    stage: int
    devices: tuple[int, ...]
    device_type: str
    parts: tuple[tuple[str, float], ...]
    collectives: tuple[tuple[str, float], ...]  # per collective kind and purpose, seconds per step

    def part(self, name: str) -> float:
        return dict(self.parts)[name]

    @property
    def total(self) -> float:
        return sum(v for _, v in self.parts)


@dataclass(frozen=True)
class StepEstimate:
    """A priced configuration: step time, per-stage breakdown, memory per stage, throughput."""

    config: ParallelConfig
    step_time: float
    stages: tuple[StageBreakdown, ...]
    memory: tuple[MemoryReport, ...]
    pipeline: PipelineResult
    samples_per_step: int
    model_flops_per_step: float
    warnings: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.memory)

    @property
    def throughput(self) -> float:
        """Samples (graph batch units) per second."""
        return self.samples_per_step / self.step_time

    @property
    def model_flops_per_device(self) -> float:
        """Achieved model FLOP/s per device (3x forward FLOPs, recomputation not counted)."""
        return self.model_flops_per_step / self.step_time / self.config.world

    def breakdown(self) -> dict[str, float]:
        """The critical stage's parts (the stage with the least idle time)."""
        crit = min(self.stages, key=lambda s: s.part("idle"))
        return dict(crit.parts)

    def why_not_fit(self) -> list[str]:
        return [r.why() for r in self.memory if not r.fits]

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": str(self.config), "step_time_s": self.step_time, "throughput": self.throughput,
            "model_flops_per_device": self.model_flops_per_device, "fits": self.fits,
            "breakdown": self.breakdown(),
            "stages": [{"stage": s.stage, "device_type": s.device_type, "parts": dict(s.parts),
                        "collectives": dict(s.collectives)} for s in self.stages],
            "memory": [{"label": r.label, "total": r.total, "capacity": r.capacity, "terms": dict(r.terms),
                        "fits": r.fits} for r in self.memory],
            "warnings": list(self.warnings),
        }
