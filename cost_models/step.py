"""Step time of a whole parallel configuration: compute + exposed communication + bubbles.

Input: a :class:`~polyparallel.ir.Graph` holding the forward pass of **one micro-batch of one
data-parallel replica**, a :class:`~polyparallel.cluster.Cluster`, and a
:class:`~.parallel_config.ParallelConfig` (degrees ``dp·tp·pp·sp`` = world size, ``m`` micro-batches, schedule,
ZeRO stage, recomputation). One optimizer step processes ``dp · m`` micro-batches.

**Placement.** Ranks are laid out tensor-parallel fastest, then sequence, data, pipeline
(Megatron's order): rank ``((s_pp·dp + i_dp)·sp + i_sp)·tp + i_tp`` runs on device
``devices[rank]`` (the first ``world`` devices of the cluster unless given). The op list is
cut into ``pp·v`` contiguous chunks at layer boundaries (:mod:`.layers`); chunk ``g`` runs on
stage ``g mod pp``.

**Tensor and sequence parallelism**: each op's share of the work and its collectives come from
the config's per-op placements (``op_plans``). The planner always gives them: it ranks each plan
with the placements derived from the polyhedral model and with Megatron's layout as one more
candidate (:mod:`polyparallel.planning.derived`). A config without them (a recipe priced by hand)
is priced with Megatron's rule (:mod:`.megatron_rule`), the layout such recipes mean by ``tp``.
Under DeepSpeed-Ulysses ``sp`` every op does ``1/sp`` of the work; each attention op all-to-alls its
three inputs and its output, forward and backward, over the ``sp`` group; parameters are replicated over ``sp`` and
their gradients reduced with ``dp``.

**Expert parallelism** (``ep``, carved from the ``dp·sp`` ranks): each group of ``ep`` consecutive
data-parallel ranks splits every MoE layer's experts (the loop nests' :attr:`~polyparallel.ir.Hint.EXPERT`
dim); per micro-batch and MoE layer the routed rows are all-to-all dispatched to their experts' ranks
and the outputs combined back, forward and backward, at the volumes the polyhedral model counts
(:func:`expert_all_to_all_elements`); the experts' weights, gradients and optimizer state are ``1/ep``
per rank and their gradients are reduced over the ``dp·sp/ep`` ranks holding the same experts
(:func:`_expert_parallel`).

**Per micro-batch and stage**: ``F_s = Σ_{ops} t_fwd + Σ t_tp,fwd + Σ t_sp,fwd`` and
``B_s = Σ t_bwd + Σ t_tp,bwd + Σ t_sp,bwd + R_s`` where ``R_s`` is the recomputed forward
(all of ``F_s``'s compute for full recomputation, the attention ops for selective), each on
the slowest device type of the stage. The pipeline schedule is simulated
(:mod:`.pipeline`) with the boundary p2p times (activations scattered over ``tp``, sent
asynchronously: a hop delays the receiver). Under ``pipeline_p2p="deepspeed"`` (DeepSpeed's
pipeline engine) the slices go by synchronous send/recv and the receiver all-gathers them over its
tensor-parallel group, so the transfers into and out of a stage lengthen its ``F_s`` and ``B_s``;
CPU stages (gloo) do too, the transfer being host work on the cores the stages compute on (no
all-gather). After the flush every stage all-reduces the micro-batch losses over the world and a
weight several stages use (a tied embedding and output head) has its gradient all-reduced over
them, both exposed.

**Data-parallel gradients**: over the ``dp·sp`` group (the groups of all ``tp`` ranks run at
once and share their nodes' network ports: ``concurrent`` in :mod:`.comm`; likewise for the
tensor- and sequence-parallel groups), with ``G`` the stage's gradient bytes (4 per element
with bf16/fp16 too: the torch backend reduces the fp32 gradients of its fp32 master weights; ``W``,
the weights FSDP all-gathers, move at the compute precision), ``B_s`` its backward seconds per
micro-batch and ``ω ∈ [0, 1]`` = ``grad_overlap`` (1 on accelerators, whose collectives run on
their own engines/streams; 0 on CPU processes, where gloo's threads compete with the compute for
the same cores):

* ZeRO-0: one all-reduce of ``G`` per step, reduced in buckets while the backward of the last
  micro-batch runs: ``T_dp,exposed = max(0, AR(G) − ω · B_s / v)``. On accelerators without a
  given ``grad_overlap`` the overlap is torch DDP's, bucket by bucket (a 1 MiB first bucket, then
  25 MiB ones, each reduced once the backward has produced it and the previous one is done): the
  last bucket is always exposed, and a link slower than the backward exposes the remainder.
* ZeRO-1/2/3 run as FSDP2 (the torch backend, ``_worker._fully_shard``) with one unit per
  numbered layer and a root unit holding the rest (embeddings, final norm, head): every unit's
  weights ``W_u`` are all-gathered as one collective and its gradients reduce-scattered as one
  (:func:`fsdp_collectives` lists them per step). Forward: the root's gather has nothing to hide
  behind; layer ``k``'s is prefetched during the compute since the previous unit began (``c_k``).
  Backward: the layers' reduce-scatters (and ZeRO-3's second gathers) share the link against the
  backward; the root's reduce-scatter comes after it:

      E_fwd = AG(W_root) + Σ_k max(0, AG(W_k) − ω·c_k),
      E_bwd = max(0, Σ_k [RS(W_k) (+ AG(W_k) under ZeRO-3)] − ω·B_s) + RS(W_root).

  ZeRO-1 keeps the weights gathered through all micro-batches and reduces the accumulated
  gradients in the last backward: ``E_fwd + E_bwd`` once per step. ZeRO-2 gathers once per step
  (``E_fwd``) and reduce-scatters every micro-batch's gradients (``E_bwd`` in each backward).
  ZeRO-3 reshards every layer after its forward: ``E_fwd`` and ``E_bwd`` lengthen every
  micro-batch's forward and backward inside the pipeline (hiding all of ZeRO-3's traffic under
  the backward of all micro-batches would make FSDP look nearly free for GPT-3-sized models).
* With pipeline stages (FSDP2 wraps each stage's chunk as one unit there) the older per-step
  formulas remain: ZeRO-1 one reduce-scatter of ``G`` (an all-reduce under ``grad_reduce="all_reduce"``,
  DeepSpeed's BF16_Optimizer, which is priced so without pipeline stages too) + all-gather of ``W`` exposed like ZeRO-0;
  ZeRO-2 ``max(0, m·RS(G) + AG(W) − ω·m·B_s)``; ZeRO-3 per layer ``i``:
  ``E_fwd = AG(W_0) + Σ_{i≥1} max(0, AG(W_i) − ω·c_{i−1})``, ``E_bwd = max(0, Σ_i [AG(W_i) +
  RS(W_i)] − ω·B_s)`` in every micro-batch.

**Step**: ``T_s = makespan + T_dp,exposed + T_opt`` per stage (``T_opt`` streams the
optimizer state once; on a calibrated CPU it is ``N·r(N) + n_t·c_t`` for ``N`` local parameter
elements in ``n_t`` tensors: the measured seconds per element ``r`` at that working set and per
tensor ``c_t``, a sharded (DTensor: FSDP2, tensor-parallel) tensor at its own measured
``c_dt``). With ``m > 1`` micro-batches every micro-batch after the first adds its weight
gradients into ``.grad``: each micro-batch's backward carries ``(m−1)/m · N · a`` (``a``:
``grad_accumulation``, measured per element on calibrated CPUs; on accelerators without it a
streaming pass of ``g + 2·max(g, 4)`` bytes per element, the new gradient at the compute precision
``g`` into an accumulator at the reduction precision; priced as compute). Under
``grad_accumulation="cast_add"`` (DeepSpeed's ``BF16_Optimizer``) every micro-batch, the first
included, casts its 16-bit gradient into a temporary and adds it to an fp32 buffer: ``N · (g + 16)``
bytes streamed per micro-batch.

**Eager mixed precision.** An eager 16-bit step on an accelerator (``fused_elementwise`` ``False``, or
``None``: the torch backend) runs under ``torch.autocast``: each op also pays
:func:`~polyparallel.cost_models.compute.autocast_seconds`, its cast kernels and the operands torch
holds in fp32 (parameters, a residual stream that adds a 16-bit projection to fp32 embeddings, layer
norms, the loss), at the widths :func:`_sent_widths` gives.

**Host-bound accelerators.** Eager PyTorch dispatches every kernel from the host; the device
runs ahead only while the host enqueues faster than the kernels run. On an accelerator with
measured dispatch costs (``polyparallel calibrate --device cuda``: ``host_op_seconds`` per op
class, ``optimizer_host``; a GPU without them takes the host costs measured on the H200 machine,
``EAGER_HOST_OP_SECONDS``), a stage's forward + backward of one micro-batch lasts at least the
host's time for its ops, ``H = Σ_ops h_op + h_backward_call``
(:func:`polyparallel.cost_models.compute.host_seconds`), so ``F + B`` becomes
``max(F + B, H)`` (scaled in proportion), and ``T_opt ≥ h_0 + n_t·h_t``. On the H200 this
decides ResNet-50 at batch 16 and every small model.
``T = max_s T_s``; every stage's breakdown (compute, tensor-parallel,
sequence-parallel, p2p, bubble, data-parallel, optimizer, idle) sums to ``T``.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from polyparallel.cluster import Cluster, DeviceType
from polyparallel.ir import TRAINING_DTYPE_BYTES, Graph, Hint, Op, OpKind, TensorKind, element_bytes

from .comm import collective_time, p2p_time
from .compute import (
    AUTOCAST_LOW,
    autocast_seconds,
    batch_statistics_ops,
    host_seconds,
    host_step_fixed,
    is_sdpa,
    math_sdpa_saved_bytes,
    math_sdpa_upcasts,
    op_classes,
    op_cost,
    streaming_bandwidth,
)
from .layers import LAYER, chunk_of_ops, chunk_ranges, chunks, layer_segments, segments
from .megatron_rule import op_plans, tensor_bytes
from .memo import PRICES
from .memory import MemoryReport, device_memory
from .op_profile import profile_for, profiled_op
from .parallel_config import OpPlan, ParallelConfig, StageBreakdown, StepEstimate
from .pipeline import makespan_bound, peak_in_flight, simulate

__all__ = ["OpPlan", "ParallelConfig", "StageBreakdown", "StepBound", "StepEstimate", "chunk_of_ops", "estimate_step",
           "layer_segments", "op_seconds", "optimizer_element_time", "step_lower_bound"]

# kernels per parameter tensor of torch's single-tensor optimizer step (torch/optim/adam.py etc.):
# Adam: step += 1, lerp_, mul_ + addcmul_, sqrt / c + eps, addcdiv_
_OPT_KERNELS = {"adam": 9, "adamw": 10, "lamb": 12, "lion": 5, "sgd": 1, "sgd_momentum": 3}
# fp32 accesses per parameter of torch's multi-tensor (foreach) step, kernel by kernel
# (torch/optim/adam.py _multi_tensor_adam, not capturable): lerp_(m, g) 3, mul_(v) 2,
# addcmul_(v, g, g) 3, sqrt(v) 2, div_ 2, add_(eps) 2, addcdiv_(p, m, .) 4 = 18; AdamW's
# decoupled decay mul_(p) adds 2; SGD add_(p, g) 3, with momentum mul_/add_(buf) + add_(p) 8
_FOREACH_ACCESSES = {"adam": 18, "adamw": 20, "lamb": 24, "lion": 10, "sgd": 3, "sgd_momentum": 8}


# what an absorbed elementwise op's backward keeps (torch's derivatives.yaml): nothing, its output,
# or (the default: gelu, silu, mul, div, pow, sin, ...) its input
_SAVES_NOTHING = frozenset({"add", "sub", "rsub", "neg", "to", "_to_copy", "clone", "contiguous", "alias", "type_as",
                            "mul.Scalar", "div.Scalar", "add.Scalar", "sub.Scalar"})
# torch DDP's gradient buckets (torch.nn.parallel.DistributedDataParallel: bucket_cap_mb=25, and
# dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB for the first bucket, so that communication starts early)
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20

_SAVES_OUTPUT = frozenset({"relu", "sigmoid", "tanh", "exp", "rsqrt", "sqrt", "reciprocal"})


def _saves(target: str) -> str:
    """``nothing``, ``output`` or ``input``: what the backward of the elementwise op ``target`` keeps."""
    parts = target.split(".")
    base = parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0]
    overload = f"{base}.{parts[2]}" if parts[0] == "aten" and len(parts) > 2 else base
    if base in _SAVES_NOTHING or overload in _SAVES_NOTHING:
        return "nothing"
    return "output" if base in _SAVES_OUTPUT else "input"


def _fused_temporaries(op: Op) -> int:
    """Intermediate values of a fused elementwise chain (``attrs["fused"]``: the producer's output
    ``v_0``, then each absorbed op's) that eager torch keeps for the backward: ``v_{i-1}`` when the
    ``i``-th absorbed op saves its input, ``v_i`` when it saves its output (the last, the op's
    output, is counted with the outputs). GPT's ``gelu(fc(x))`` keeps the pre-activation; LLaMA's
    ``silu(gate(x)) * up`` the gate's output and the silu's."""
    kept: set[int] = set()
    chain = op.attr.get("fused", ())
    for i, target in enumerate(chain, start=1):
        how = "nothing" if _base(target) in _NO_GRAD else _saves(target)
        if how == "input":
            kept.add(i - 1)
        elif how == "output" and i < len(chain):
            kept.add(i)
    return len(kept)


_NO_GRAD = frozenset({"eq", "ne", "le", "lt", "ge", "gt", "__and__", "__or__", "__xor__", "logical_and", "logical_or",
                      "logical_not", "bitwise_and", "bitwise_or", "bitwise_not", "isnan", "isinf", "sign"})
_FLOATS = ("float32", "float16", "bfloat16", "float64")
_BINARY_SAVERS = frozenset({"mul", "div", "where", "maximum", "minimum", "pow", "atan2"})


def _base(target: str) -> str:
    parts = target.split(".")
    return parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0]


def _kept_tensors(graph: Graph) -> tuple[frozenset[str], dict[str, int]]:
    """The activations eager torch keeps alive for the backward: autograd's saved tensors.

    A tensor is kept when an op recorded by autograd (one with an input that requires grad) saves
    it: contractions, convolutions, norms and attention save their activation inputs (a Linear its
    input, a matmul both operands); an elementwise op its input (gelu, silu, pow, ...; ``mul`` each
    operand when the other requires grad), its output (relu, exp, rsqrt, ...) or nothing (add, sub,
    casts, comparisons); softmax its output; the loss its logits (its log-softmax, the same size);
    reductions (mean, sum), concatenations, splits and index gathers none of their float inputs.
    A kept view keeps the tensor it views. An op's fused elementwise chain saves what its ops save
    (:func:`_fused_temporaries`); its extra inputs are kept when the chain multiplies by them.
    Returns the kept tensors and, per op recorded by autograd, its kept fused temporaries."""
    cache = PRICES.of(graph)
    if ("kept",) in cache:
        return cache[("kept",)]
    grad = {n for n, t in graph.tensors.items() if t.kind is TensorKind.PARAM}
    temps: dict[str, int] = {}
    producer = {t: op for op in graph.ops for t in op.outputs}
    kept: set[str] = set()

    def keep(t: str) -> None:
        while True:
            p = producer.get(t)
            if p is not None and OpKind(p.kind) is OpKind.VIEW and p.inputs:
                t = p.inputs[0]  # a view's storage is its input's
                continue
            kept.add(t)
            return

    for op in graph.ops:
        acts = [t for t in op.inputs if graph.tensors[t].kind is not TensorKind.PARAM]
        floats = [t for t in acts if graph.tensors[t].dtype in _FLOATS]
        if not any(t in grad for t in op.inputs):
            continue  # autograd records nothing
        kind, base = OpKind(op.kind), _base(op.target)
        chain = op.attr.get("fused", ())
        if base not in _NO_GRAD:
            grad.update(t for t in op.outputs if graph.tensors[t].dtype in _FLOATS)
        main = acts
        temps[op.name] = _fused_temporaries(op)
        if chain and kind in (OpKind.CONTRACTION, OpKind.CONV, OpKind.ELEMENTWISE):
            # the fused op's own inputs come first, those of the absorbed ops after them
            if kind is OpKind.ELEMENTWISE:
                n_main = 2 if base in _BINARY_SAVERS or base in ("add", "sub", "rsub") else 1
            else:
                n_main = 1 if any(graph.tensors[t].kind is TensorKind.PARAM for t in op.inputs) else 2
            main = [t for t in acts if t in floats[:n_main] or t not in floats]
            if any(_base(c) in _BINARY_SAVERS for c in chain):
                for t in floats[n_main:]:
                    keep(t)
        if kind is OpKind.ATTENTION:
            for t in floats:
                keep(t)  # q, k, v (a boolean mask is not kept: torch's kernels take it as is)
        elif kind in (OpKind.CONTRACTION, OpKind.CONV, OpKind.NORM, OpKind.LOSS, OpKind.OPAQUE):
            for t in main:
                keep(t)
        elif kind is OpKind.EMBEDDING or kind is OpKind.GATHER:
            for t in acts:
                if t not in floats:
                    keep(t)  # the indices
        elif kind is OpKind.POOL and "max" in base:
            for t in main:
                keep(t)
        elif kind is OpKind.ELEMENTWISE and base not in _NO_GRAD:
            how = _saves(op.target)
            if how == "input":
                for t in main:
                    if t in floats and (base not in _BINARY_SAVERS or any(o in grad for o in main if o != t)):
                        keep(t)
            elif how == "output" and not chain:
                kept.update(op.outputs)
        elif kind is OpKind.SOFTMAX or (kind is OpKind.REDUCE and "softmax" in base):
            kept.update(op.outputs)
        elif kind is OpKind.REDUCE and base in ("amax", "max", "min", "amin", "prod", "var", "std", "norm"):
            for t in main:
                keep(t)
        if chain and _saves(chain[-1]) == "output":
            kept.update(op.outputs)
    cache[("kept",)] = (frozenset(kept), temps)
    return cache[("kept",)]


def _activation_bytes(graph: Graph, op: Op, dtype: str, fused_attention: bool | None, selective: bool,
                      math_sdpa: bool = False) -> float:
    """Bytes an op stores for its backward: its outputs, the temporaries of its fused elementwise
    chain that eager torch keeps, and for attention what its kernel keeps.

    ``scaled_dot_product_attention`` runs as torch's fused kernels (flash / memory-efficient, on
    CPU the flash kernel), which keep the output and the softmax's log-sum-exp (``B·H·S`` fp32), never
    the ``S×S`` scores (its inputs q, k, v are their producers' outputs, counted there); under
    selective recomputation the checkpoint drops the log-sum-exp too. ``math_sdpa``: it runs as
    torch's upcast math kernel instead (an accelerator, 16 bits, no fused kernel), which keeps fp32
    probabilities and fp32 copies of q, k and v (:func:`math_sdpa_saved_bytes`; measured on an H200,
    GPT-1.7B at batch 4 x 2048: 85.7 GB against 43.9 with flash attention). Any other attention op keeps
    its scores and probabilities unless ``fused_attention`` says it runs as a fused kernel, and
    selective recomputation drops them (Korthikanti et al., 2022)."""
    if OpKind(op.kind) in (OpKind.VIEW, OpKind.CREATE):
        return 0.0
    kept, temps = _kept_tensors(graph)
    total = sum(tensor_bytes(graph, t, dtype) for t in op.outputs if t in kept)
    if op.outputs:
        total += temps.get(op.name, 0) * tensor_bytes(graph, op.outputs[0], dtype)
    if is_sdpa(op) and math_sdpa and op.nest is not None:
        if not selective:
            total += math_sdpa_saved_bytes(op)
    elif is_sdpa(op):
        if not selective and op.outputs:
            out = graph.tensors[op.outputs[0]]
            total += out.numel / max(out.shape[-1], 1) * 4 if out.shape else 0.0
    elif OpKind(op.kind) is OpKind.ATTENTION and op.nest is not None and not fused_attention and not selective:
        ext = op.nest.extents
        for st in op.nest.statements:
            for w in st.writes:
                if w.operand == "scores":
                    n = math.prod(ext[d] for e in w.index for d in e.dims)
                    total += 2 * n * TRAINING_DTYPE_BYTES[dtype]  # scores and probabilities
    return total


# --------------------------------------------------------------------------------------------
# the estimate
# --------------------------------------------------------------------------------------------

def estimate_step(graph: Graph, cluster: Cluster, cfg: ParallelConfig) -> StepEstimate:
    """Price one training step of ``graph`` on ``cluster`` under ``cfg`` (see the module docstring)."""
    cfg.validate(cluster)
    pre = _prepare(graph, cluster, cfg)
    terms, m = pre.terms, cfg.microbatches
    sim = simulate(cfg.schedule, pre.fwd, pre.bwd, m, pre.chunks, terms.p2p)
    totals = [sim.makespan + x.exposed + x.t_opt for x in pre.dp]
    step = max(totals)
    out = []
    for s, (x, tot) in enumerate(zip(pre.dp, totals)):
        busy_compute = (terms.comp[s] + pre.accumulation[s]) * m
        tpc, spc = terms.tp_t[s] * m, terms.sp_t[s] * m
        waiting = max(0.0, sim.makespan - sim.busy[s])
        # asynchronous transfers show as the waiting they cause; synchronous ones are busy time
        blocking = 2 * m * terms.p2p_block[s]
        p2p_total = 2 * m * terms.p2p_sum[s] + blocking
        p2p_part = min(p2p_total - blocking, waiting)
        parts = (("compute", busy_compute), ("tensor_parallel", tpc), ("sequence_parallel", spc),
                 ("p2p", blocking + p2p_part), ("bubble", waiting - p2p_part),
                 ("data_parallel", x.exposed + m * x.per_microbatch),
                 ("optimizer", x.t_opt), ("idle", step - tot))
        if pre.expert:
            parts = (*parts[:3], ("expert_parallel", 2 * m * pre.expert[s]), *parts[3:])
        dp_kinds = "+".join(dict.fromkeys(k for k, _ in x.events)) or "none"
        coll = [("tensor_parallel", tpc), ("sequence_parallel", spc), ("p2p", p2p_total),
                *([("expert_parallel all_to_all", 2 * m * pre.expert[s])] if pre.expert else []),
                (f"data_parallel {dp_kinds} (before overlap)", x.t_dp)]
        out.append(StageBreakdown(s, terms.devices[s], terms.types[s].name, parts, tuple(coll)))
    cache = PRICES.of(graph)
    totals_key = ("totals",)
    if totals_key not in cache:
        n_opaque = len(graph.opaque_ops())
        cache[totals_key] = (_batch(graph), graph.flops(), n_opaque)
    batch, flops, n_opaque = cache[totals_key]
    warnings = (f"{n_opaque} opaque op(s) priced from their FLOP estimate, never split",) if n_opaque else ()
    samples = batch * m * cfg.dp
    model_flops = 3.0 * flops * m * cfg.dp
    return StepEstimate(cfg, step, tuple(out), pre.memory, sim, samples, model_flops, warnings)


@dataclass(frozen=True)
class StepBound:
    """A lower bound on a configuration's step time, and its exact memory, without simulating the pipeline.

    ``lower_bound ≤ estimate_step(...).step_time`` always (see :func:`step_lower_bound`), and
    ``memory`` equals ``estimate_step(...).memory``.
    """

    config: ParallelConfig
    lower_bound: float
    memory: tuple[MemoryReport, ...]

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.memory)


def step_lower_bound(graph: Graph, cluster: Cluster, cfg: ParallelConfig) -> StepBound:
    r"""A cheap admissible lower bound on the step time of ``cfg`` (for branch and bound).

    The step time is ``T = makespan + max_s (exposed_s + T_opt,s)`` (module docstring), and
    every term but the makespan is computed here exactly; the makespan is bounded below by
    :func:`~.pipeline.makespan_bound` (each stage's own busy time plus the forward and
    backward fill of the stages before it), which equals the simulated makespan for equal
    stages without point-to-point cost. Memory does not depend on timing, so it is exact.
    """
    cfg.validate(cluster)
    pre = _prepare(graph, cluster, cfg)
    mk = makespan_bound(pre.fwd, pre.bwd, cfg.microbatches, pre.chunks, pre.terms.p2p)
    return StepBound(cfg, mk + max(x.exposed + x.t_opt for x in pre.dp), pre.memory)


# -- the parts of the estimate that do not need the pipeline simulation --------------------------

@dataclass(frozen=True)
class _StageTerms:
    """Per stage and micro-batch, what does not depend on ``m``, the schedule order, ZeRO or the optimizer."""

    devices: tuple[tuple[int, ...], ...]
    types: tuple[DeviceType, ...]
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    comp: tuple[float, ...]
    tp_t: tuple[float, ...]
    sp_t: tuple[float, ...]
    act: tuple[float, ...]
    seg_act_max: tuple[float, ...]
    params: tuple[float, ...]
    p2p: tuple[float, ...]
    p2p_sum: tuple[float, ...]
    spans: tuple[str, ...]
    seg_params: tuple[tuple[float, ...], ...]  # per stage, parameters first used in each of its layers
    seg_fwd: tuple[tuple[float, ...], ...]  # per stage, forward seconds of each of its layers
    dp_groups: tuple[tuple[_Group, ...], ...]  # distinct (by nodes) dp groups of each stage
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # per-plan parts that repeat
    param_tensors: tuple[int, ...] = ()  # distinct parameter tensors of each stage
    tp_param_tensors: tuple[int, ...] = ()  # of those, the ones split over tp (DTensors in torch)
    p2p_block: tuple[float, ...] = ()  # per micro-batch, in each of forward and backward: synchronous p2p
    tied: tuple[tuple[tuple[tuple[int, ...], float], ...], ...] = ()  # per stage: _StageBase.tied


@dataclass(frozen=True)
class _DataParallel:
    exposed: float  # per step, after the pipeline
    t_opt: float
    t_dp: float  # before overlap, per step
    events: tuple[tuple[str, float], ...]
    per_microbatch: float = 0.0  # exposed inside every micro-batch (ZeRO-3 gathers), forward + backward


@dataclass(frozen=True)
class _Prepared:
    terms: _StageTerms
    chunks: int
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    dp: tuple[_DataParallel, ...]
    memory: tuple[MemoryReport, ...]
    accumulation: tuple[float, ...] = ()  # per stage and micro-batch, inside the backward
    expert: tuple[float, ...] = ()  # per stage and micro-batch, expert-parallel all-to-alls (forward = backward)


def _prepare(graph: Graph, cluster: Cluster, cfg: ParallelConfig) -> _Prepared:
    p, v, m = cfg.pp, cfg.chunks if cfg.schedule == "interleaved" else 1, cfg.microbatches
    terms = _stage_terms(graph, cluster, cfg, v)
    ccache: dict = PRICES.of(cluster).setdefault("collectives", {})
    in_flight = peak_in_flight(cfg.schedule, p, m, v)
    gb = TRAINING_DTYPE_BYTES[cfg.dtype]
    dps, mems, accum = [], [], []
    fwd, bwd = list(terms.fwd), list(terms.bwd)
    moe = _expert_parallel(graph, cluster, cfg, terms, ccache, gb) if cfg.ep > 1 else None
    # the data-parallel group reduces the stage's other weights; the experts' own reduction is added
    dterms = terms if moe is None else replace(
        terms, params=tuple(x - e for x, e in zip(terms.params, moe.expert_params)), memo={})
    for s in range(p):
        dt = terms.types[s]
        dgrp_size = len(terms.dp_groups[s][0][0])
        params = terms.params[s]
        omega = cfg.grad_overlap if cfg.grad_overlap is not None else (0.0 if dt.kind == "cpu" else 1.0)
        # an accelerator's DDP all-reduce is priced by its buckets unless an overlap is given
        buckets = cfg.grad_overlap is None and dt.kind != "cpu"
        units = _fsdp_units(graph, cfg, dterms, s) if (cfg.zero_stage >= 1 and cfg.pp == 1 and moe is None
                                                       and cfg.grad_reduce == "reduce_scatter") else ()
        # DeepSpeed's ZeRO-3 of 2021 gathers parameter tensor by parameter tensor (ParallelConfig.zero3_gather)
        per_tensor = (_unit_tensors(graph, cfg, s), dt.launch_overhead) if (
            units and cfg.zero_stage == 3 and cfg.zero3_gather == "parameter") else None
        events, t_dp, exposed, ef, eb = _data_parallel(cluster, ccache, dterms, s, cfg, gb, omega, v, buckets, units,
                                                       per_tensor)
        if dgrp_size > 1 and cfg.pp == 1:
            nf, nb = _cross_rank_norms(graph, cluster, ccache, terms.dp_groups[s][0], dt, cfg)
            ef, eb = ef + nf, eb + nb
        fwd[s] += ef
        bwd[s] += eb
        # a profiled CPU measured what FSDP2 itself (hooks, copies, the DTensor optimizer) adds to a step
        prof = profile_for(dt, graph, cfg.dtype)
        fsdp = prof.wrapper(cfg.world, f"zero{min(3, max(2, cfg.zero_stage))}/{cfg.optimizer}") if (
            units and dgrp_size > 1 and prof is not None) else None
        if fsdp is not None:
            fwd[s] += fsdp[0]
            bwd[s] += fsdp[1]
        shard = dgrp_size if cfg.zero_stage >= 1 else 1
        # parameter elements this rank updates: with expert parallelism it holds 1/ep of the
        # experts, whose ZeRO shards span the dp·sp/ep ranks holding the same experts
        experts = moe.expert_params[s] if moe is not None else 0.0
        local = (params - experts) / shard + experts / cfg.ep / max(1, shard // cfg.ep)
        if moe is not None:
            fwd[s] += moe.a2a[s]
            bwd[s] += moe.a2a[s]
            if moe.grad_t[s]:
                hide = omega * (m * terms.bwd[s] if cfg.zero_stage == 2 else terms.bwd[s] / v)
                events, t_dp = events + moe.grad_events[s], t_dp + moe.grad_t[s]
                exposed = max(0.0, t_dp - hide)
        if cfg.pp > 1:
            # a pipeline combines its micro-batches' losses and target counts with one all-reduce over
            # the whole world after the flush (the torch backend's weigh_microbatches)
            exposed += _reduce_over(cluster, ccache, tuple(d for ds in terms.devices for d in ds), 32.0)
        elif dgrp_size > 1:
            # the step's loss and its target count are all-reduced over the replicas between the
            # forward and the backward, on every rank's critical path (the torch backend's
            # weigh_replicas; Megatron-LM all-reduces the loss every step for its log)
            exposed += _price(cluster, ccache, (("all_reduce", 32.0),), *terms.dp_groups[s][0])
        for holders, numel in terms.tied[s] if terms.tied else ():
            # a weight several stages use (a tied embedding and output head) gets its gradient
            # summed over them after the flush, before the optimizer: Megatron-LM's
            # _allreduce_word_embedding_grads, DeepSpeed's _exec_reduce_tied_grads, the torch
            # backend's tie groups; every replica's group at once, those on one node sharing its ports
            first = terms.devices[s][0]
            on_node = sum(cluster.device(d).node == cluster.device(first).node for d in terms.devices[s])
            exposed += _reduce_over(cluster, ccache, tuple(terms.devices[h][0] for h in holders),
                                    numel * max(gb, 4), on_node)
        master = 4 if gb < 4 else 0
        opt_state = 8 if cfg.optimizer in ("adam", "adamw", "lamb") else 4 if cfg.optimizer in (
            "sgd_momentum", "lion") else 0
        opt_bytes = local * (gb * 3 + 2 * (master + opt_state))
        if not cfg.fused_optimizer or dt.kind == "cpu":
            # torch's unfused step: the same kernels foreach runs (one tensor at a time on a CPU,
            # where the torch backend never asks for the fused kernel), each a pass over fp32 state
            opt_bytes = local * 4 * _FOREACH_ACCESSES.get(cfg.optimizer, 18)
        t_opt = max(opt_bytes / streaming_bandwidth(dt), dt.launch_overhead) if params else 0.0
        rates = dict(dt.optimizer_element_rates).get(cfg.optimizer)
        if rates and params:
            # measured per element at the stage's own working set (in cache or in memory), not streamed
            t_opt = local * optimizer_element_time(rates, local)
        sharded_extra = 0.0
        if dt.kind == "cpu" and terms.param_tensors:
            # torch's CPU optimizers update tensor by tensor (no multi-tensor kernels there): each
            # parameter tensor costs ~k kernels at least at the kernel floor, plus DTensor's dispatch
            # per kernel for sharded ones (FSDP2 shards all of them, tensor parallelism its own).
            # Where calibration measured the step per tensor (on tensors too small for their kernels
            # to take time: the host's loop and dispatch), that host work runs in series with the
            # streaming on the one thread, so it adds to it
            k = _OPT_KERNELS.get(cfg.optimizer, 9)
            per_tensor = dict(dt.optimizer_tensor_overhead).get(cfg.optimizer)
            dtensors = terms.param_tensors[s] if cfg.zero_stage >= 1 and dgrp_size > 1 else terms.tp_param_tensors[s]
            n_t, dispatch = terms.param_tensors[s], k * dtensors * dt.sharded_op_overhead
            per_dtensor = dict(dt.optimizer_dtensor_overhead).get(cfg.optimizer)
            if per_tensor is None:
                t_opt = max(t_opt, k * n_t * dt.launch_overhead + dispatch)
            elif per_dtensor is not None:
                # measured per sharded tensor too: the whole host cost of a DTensor's update
                t_opt += (n_t - dtensors) * per_tensor + dtensors * per_dtensor
                sharded_extra = dtensors * (per_dtensor - per_tensor)
            else:
                t_opt += n_t * per_tensor + dispatch
                sharded_extra = dispatch
        ratio = prof.optimizer_ratio(cfg.world, cfg.optimizer) if prof is not None else None
        if ratio is not None:
            # the model's plain step as measured against its price (op_profile.py); what DTensors
            # add on top stays as the calibration measured it
            t_opt = ratio * (t_opt - sharded_extra) + (fsdp[2] if fsdp is not None else sharded_extra)
        host = dict((k, (a, b)) for k, a, b in dt.optimizer_host).get(
            f"{cfg.optimizer}/{'fused' if cfg.fused_optimizer else 'foreach'}")
        if host and terms.param_tensors and dt.kind != "cpu":
            # an accelerator's optimizer step is dispatched by the host (measured: a fixed part and a
            # part per tensor); the device cannot finish it sooner than the host enqueues it
            t_opt = max(t_opt, host[0] + host[1] * terms.param_tensors[s])
        # autograd adds every micro-batch's weight gradient after the first into .grad: on average
        # (m-1)/m of the stage's local gradient elements per micro-batch (calibrated CPUs measure it)
        held = params - experts * (1 - 1 / cfg.ep)
        if cfg.grad_accumulation == "cast_add":
            # DeepSpeed's BF16_Optimizer, after every micro-batch's backward: the fresh 16-bit
            # gradient read and cast into a temporary fp32 tensor (gb + 4 bytes), which is added to
            # the fp32 buffer (both read, the buffer written: 3 x 4), the first micro-batch's included
            acc = (gb + 16) / streaming_bandwidth(dt) * (local if cfg.zero_stage >= 2 else held)
        else:
            rate = dt.grad_accumulation
            if not rate and dt.kind != "cpu":
                # uncalibrated accelerators: one streaming pass reading the new gradient at the compute
                # precision and reading and writing the accumulator at the reduction precision (torch's
                # AccumulateGrad on fp32 .grad; Megatron-LM's main_grad hook, megatron/model/distributed.py;
                # Llama 3's "FP32 gradient accumulation")
                rate = (gb + 2 * max(gb, 4)) / streaming_bandwidth(dt)
            acc = rate * (m - 1) / m * (local if cfg.zero_stage >= 2 else held)
        bwd[s] += acc
        accum.append(acc)
        dps.append(_DataParallel(exposed, t_opt, t_dp, events, ef + eb))
        ws = terms.seg_act_max[s] + _loss_transient(graph, cfg, v, _eager(cfg, dt)).get(s, 0.0)
        if cfg.zero_stage == 3 and units:
            # FSDP2 keeps the root's weights gathered through each micro-batch, a layer's while it
            # runs and the next one's, prefetched
            ws += (units[0][0] + 2 * max((w for w, _ in units[1:]), default=0.0)) * gb
        elif cfg.zero_stage == 3:
            ws += 2 * _max_segment_params(graph) * gb / cfg.tp
        mems.append(device_memory(
            label=f"stage {s} (devices {terms.spans[s]})", device=f"{dt.name} {dt.memory / 1e9:.0f} GB",
            capacity=dt.memory, params=params - experts, dp=dgrp_size, zero_stage=cfg.zero_stage,
            param_dtype=cfg.dtype, optimizer=cfg.optimizer, activations=terms.act[s], in_flight=in_flight[s] / v,
            workspace=ws, expert_params=experts / cfg.ep, expert_dp=max(1, dgrp_size // cfg.ep)))
    return _Prepared(terms, v, tuple(fwd), tuple(bwd), tuple(dps), tuple(mems), tuple(accum),
                     moe.a2a if moe is not None else ())


def _eager(cfg: ParallelConfig, device: DeviceType) -> bool:
    """Whether ``cfg`` runs as eager PyTorch on ``device`` (``ParallelConfig.fused_elementwise``)."""
    return cfg.fused_elementwise is False or (cfg.fused_elementwise is None and device.kind != "cpu")


def _low_params(cfg: ParallelConfig) -> bool:
    """Whether FSDP2 holds the parameters in the compute dtype (its ``MixedPrecisionPolicy``): ZeRO over
    more than one data/sequence-parallel rank; otherwise a 16-bit step keeps fp32 parameters."""
    return cfg.zero_stage >= 1 and cfg.dp * cfg.sp > 1


def _loss_transient(graph: Graph, cfg: ParallelConfig, v: int, eager: bool) -> dict[int, float]:
    """Bytes an eager cross-entropy adds at the start of the backward pass, per pipeline stage.

    Eager PyTorch computes the loss in fp32 (autocast upcasts it): ``log_softmax`` of the ``N``
    logits is saved for the backward (``4N`` bytes), whose start allocates the gradient of the
    log-probabilities and of the logits (``4N`` each) while they are still held, a peak of ``12N``
    bytes where the activations count the logits once at the compute precision. A fused loss
    kernel (``fused_elementwise``: Megatron's vocabulary-parallel cross entropy) keeps none of it.
    ``N`` is the op's local share of its input (a vocabulary-parallel split divides it).
    """
    if not eager:
        return {}
    key = ("loss_ws", cfg.pp, v, cfg.partition, cfg.dtype, cfg.tp, cfg.sp, cfg.sequence_parallel, cfg.op_plans)
    cache = PRICES.of(graph)
    if key not in cache:
        chunk_of_op = chunks(graph, cfg.pp * v, cfg.partition)
        plans = op_plans(graph, cfg)
        out: dict[int, float] = {}
        for i, op in enumerate(graph.ops):
            if OpKind(op.kind) is not OpKind.LOSS or not op.inputs:
                continue
            spec = graph.tensors[op.inputs[0]]
            if spec.dtype not in ("float32", "float16", "bfloat16"):
                continue
            n = spec.numel / plans[i].split
            extra = 12 * n - tensor_bytes(graph, op.inputs[0], cfg.dtype) / plans[i].split
            stage = chunk_of_op[i] % cfg.pp
            out[stage] = out.get(stage, 0.0) + max(extra, 0.0)
        cache[key] = out
    return cache[key]


def optimizer_element_time(rates: Sequence[tuple[float, float]], elements: float) -> float:
    """Seconds per parameter element of an optimizer step over ``elements`` elements.

    ``rates``: measured ``(elements, seconds per element)`` rows (``polyparallel calibrate``, by
    working-set size: in cache, in memory), interpolated linearly in ``log elements`` and
    clamped at both ends.
    """
    import numpy as np

    pts = sorted((math.log(e), r) for e, r in rates)
    return float(np.interp(math.log(max(elements, 1.0)), [x for x, _ in pts], [r for _, r in pts]))


def _ddp_exposed(cluster: Cluster, ccache: dict, groups: Sequence, grad_bytes: float, window: float) -> float:
    """Seconds torch DDP's bucketed all-reduce runs past the backward ``window`` that produces the gradients.

    DDP reduces ``grad_bytes`` in buckets, in the order the backward produces them: a first bucket of
    ``DDP_FIRST_BUCKET_BYTES``, then ``DDP_BUCKET_BYTES`` each (torch's defaults). A bucket is ready once
    the backward has produced its last gradient (gradients come out at an even rate over ``window``) and
    its all-reduce starts when it is ready and the previous one has finished (one communication
    stream): ``f_i = max(r_i, f_{i-1}) + AR(b_i)``. Exposed: ``max(0, f_last − window)`` — the last
    bucket never overlaps, and nothing is reduced before the first bucket fills.
    """
    key = ("ddp_exposed", tuple(gid for _, gid in groups), grad_bytes, window)
    hit = ccache.get(key)  # plans differing in m, the schedule or memory knobs share it
    if hit is not None:
        return hit
    first = min(DDP_FIRST_BUCKET_BYTES, grad_bytes)
    full, tail = divmod(grad_bytes - first, DDP_BUCKET_BYTES)
    # the buckets: `first`, `full` of DDP_BUCKET_BYTES, then `tail` (a big model has ~10^4 of them;
    # the loop below is the recurrence above, operation for operation, with its prices hoisted)
    runs = [(first, 1), (DDP_BUCKET_BYTES, int(full))] + ([(tail, 1)] if tail > 0 else [])
    worst = 0.0
    for grp, gid in groups:
        price: dict[float, float] = {}
        done = produced = 0.0
        for b, count in runs:
            if not count:
                continue
            if b not in price:
                price[b] = _price(cluster, ccache, (("all_reduce", b),), grp, gid)
            p_b = price[b]
            for _ in range(count):
                produced += b
                ready = window * produced / grad_bytes
                done = (done if done > ready else ready) + p_b
        worst = max(worst, done - window)
    ccache[key] = out = max(0.0, worst)
    return out


def _cross_rank_norms(graph: Graph, cluster: Cluster, ccache: dict, group: tuple[Sequence[int], int],
                      dt: DeviceType, cfg: ParallelConfig) -> tuple[float, float]:
    """Forward and backward seconds per micro-batch that BatchNorm over the replicas adds
    (``backends/torch/_batchnorm.py``): per op, in the forward an all-reduce of the per-channel sums
    and the count (``8(C+1)`` bytes, float64), then of the squared deviations (``8C``), each
    waited for before the next op; the backward all-reduces both gradients alike. A profiled
    device adds what computing the statistics op by op costs over the fused kernel (measured)."""
    ops = batch_statistics_ops(graph)
    if not ops:
        return 0.0, 0.0
    grp, gid = group
    t = 0.0
    for op in ops:
        c = graph.tensors[op.inputs[0]].shape[1]
        t += _price(cluster, ccache, (("all_reduce", 8.0 * (c + 1)), ("all_reduce", 8.0 * c)), grp, gid)
    f, b = t, t
    prof = profile_for(dt, graph, cfg.dtype)
    extra = prof.wrapper(cfg.world, "cross_rank_norm/op") if prof is not None else None
    if extra is not None:
        f, b = f + len(ops) * extra[0], b + len(ops) * extra[1]
    return f, b


def _data_parallel(cluster: Cluster, ccache: dict, terms: _StageTerms, s: int, cfg: ParallelConfig, gb: int,
                   omega: float, v: int, buckets: bool = False, units: Sequence[tuple[float, float]] = (),
                   per_tensor: tuple[Sequence[int], float] | None = None,
                   ) -> tuple[tuple[tuple[str, float], ...], float, float, float, float]:
    """Stage ``s``'s data-parallel traffic (module docstring): ``(events, seconds before overlap,
    exposed seconds per step, exposed seconds per micro-batch forward, and backward)``.
    ``buckets``: ZeRO-0's all-reduce is exposed as torch DDP's buckets leave it (:func:`_ddp_exposed`)
    instead of by ``ω``. ``units``: the FSDP2 units of a stage without pipeline parallelism
    (:func:`_fsdp_units`), which ZeRO-1/2/3 are priced by (:func:`_fsdp_exposed`).

    Weights move at ``gb`` bytes per element (the compute precision: FSDP2's
    ``MixedPrecisionPolicy(param_dtype=...)`` all-gathers them in it), gradients are reduced at
    ``rb = max(gb, 4)``: with bf16/fp16 the torch backend keeps fp32 master weights, so DDP
    all-reduces their fp32 gradients and FSDP2 reduce-scatters with ``reduce_dtype=float32``."""
    rb = max(gb, 4)
    groups = terms.dp_groups[s]
    if len(groups[0][0]) == 1:
        return (), 0.0, 0.0, 0.0, 0.0
    m, z = cfg.microbatches, cfg.zero_stage
    params = terms.params[s]
    if z == 0 or (z in (1, 2) and not (cfg.pp == 1 and units)):
        # a function of the group's price classes and a few numbers: the stages and plans sharing them
        # (the repeated layers' stages, plans differing in the schedule or, below ZeRO-2, in m) share it
        key = ("data_parallel", z, m if z == 2 else 0, tuple(gid for _, gid in groups), params, terms.bwd[s], gb,
               omega, v, buckets, cfg.grad_reduce)
        hit = ccache.get(key)
        if hit is None:
            hit = ccache[key] = _dp_flat(cluster, ccache, groups, params, terms.bwd[s], z, m, gb, omega, v, buckets,
                                         cfg.grad_reduce)
        return hit
    if cfg.pp == 1 and units:
        if per_tensor is not None:
            return _per_tensor_exposed(cluster, ccache, groups, units, per_tensor, cfg, gb, rb, omega, terms.bwd[s])
        return _fsdp_exposed(cluster, ccache, groups, units, cfg, gb, rb, omega, terms.bwd[s])
    # ZeRO-3: per micro-batch, each layer's weights are gathered before its forward (the next
    # layer's gather runs during this layer's compute), gathered again for its backward, and its
    # gradients reduce-scattered; the backward's two share the link against the backward compute
    key = ("zero3", s, gb, omega)
    hit = terms.memo.get(key)  # independent of m: the plans of one stage layout share it
    if hit is None:
        seg_fwd = terms.seg_fwd[s]
        per_mb = ef = eb = 0.0
        for grp, gid in groups:
            price: dict[float, tuple[float, float]] = {}  # the repeated layers gather the same bytes
            for x in terms.seg_params[s]:
                if x not in price:
                    price[x] = (_price(cluster, ccache, (("all_gather", x * gb),), grp, gid),
                                _price(cluster, ccache, (("reduce_scatter", x * rb),), grp, gid))
            ag = [price[x][0] for x in terms.seg_params[s]]
            rs = [price[x][1] for x in terms.seg_params[s]]
            f = (ag[0] if ag else 0.0) + sum(max(0.0, ag[i] - omega * seg_fwd[i - 1]) for i in range(1, len(ag)))
            b = max(0.0, sum(ag) + sum(rs) - omega * terms.bwd[s])
            per_mb = max(per_mb, 2 * sum(ag) + sum(rs))
            ef, eb = max(ef, f), max(eb, b)
        hit = terms.memo[key] = (per_mb, ef, eb)
    per_mb, ef, eb = hit
    return (("all_gather", params * gb), ("reduce_scatter", params * rb)), m * per_mb, 0.0, ef, eb


def _dp_flat(cluster: Cluster, ccache: dict, groups: Sequence[_Group], params: float, bwd: float, z: int, m: int,
             gb: int, omega: float, v: int, buckets: bool, grad_reduce: str = "reduce_scatter",
             ) -> tuple[tuple[tuple[str, float], ...], float, float, float, float]:
    """:func:`_data_parallel` without FSDP2 units: ZeRO-0 (DDP), or ZeRO-1/2 inside pipeline stages
    (and ZeRO-1 whose gradients are all-reduced, ``grad_reduce="all_reduce"``)."""
    rb = max(gb, 4)
    if z == 0:
        events: tuple[tuple[str, float], ...] = (("all_reduce", params * rb),)
        t_dp = max(_price(cluster, ccache, events, grp, gid) for grp, gid in groups)
        if buckets and params:
            return events, t_dp, _ddp_exposed(cluster, ccache, groups, params * rb, bwd / v), 0.0, 0.0
        return events, t_dp, max(0.0, t_dp - omega * bwd / v), 0.0, 0.0
    # ZeRO-2 shards the gradients, so every micro-batch's are reduce-scattered as they come
    n_rs = m if z == 2 else 1
    events = ((grad_reduce, params * rb), ("all_gather", params * gb))
    t_dp = max(n_rs * _price(cluster, ccache, events[:1], grp, gid) + _price(cluster, ccache, events[1:], grp, gid)
               for grp, gid in groups)
    # ZeRO-1 overlaps the last micro-batch's backward (of its last chunk, interleaved); ZeRO-2
    # each micro-batch's reduce-scatter with that micro-batch's whole backward
    hide = omega * (m * bwd if z == 2 else bwd / v)
    return events, t_dp, max(0.0, t_dp - hide), 0.0, 0.0


def _fsdp_units(graph: Graph, cfg: ParallelConfig, terms: _StageTerms, s: int) -> tuple[tuple[float, float], ...]:
    """Stage ``s``'s FSDP2 units as the torch backend wraps them (``_worker._fully_shard``): the root,
    holding every parameter outside the numbered layers, then one unit per numbered layer, in
    execution order; each as ``(parameter elements, forward seconds from the previous unit's start
    to its own)``, the compute its gather can hide behind (none for the root, gathered first)."""
    layer = [is_layer for _, is_layer in _stage_segments(graph, cfg, s)]
    units = [(sum(w for w, is_layer in zip(terms.seg_params[s], layer) if not is_layer), 0.0)]
    since = 0.0
    for w, f, is_layer in zip(terms.seg_params[s], terms.seg_fwd[s], layer):
        if is_layer:
            units.append((w, since))
            since = 0.0
        since += f
    return tuple(units)


def _stage_segments(graph: Graph, cfg: ParallelConfig, s: int) -> list[tuple[list[int], bool]]:
    """Stage ``s``'s segments in execution order (the order of ``_StageTerms.seg_params[s]``), each
    with whether it is a numbered layer (an FSDP2 unit of its own) or part of the root."""
    chunk_of_op = chunks(graph, cfg.pp * (cfg.chunks if cfg.schedule == "interleaved" else 1), cfg.partition)
    return [(sg, bool(LAYER.match(graph.ops[sg[0]].module or ""))) for sg in segments(graph)
            if chunk_of_op[sg[0]] % cfg.pp == s]


def _unit_tensors(graph: Graph, cfg: ParallelConfig, s: int) -> tuple[int, ...]:
    """The distinct parameter tensors of each of stage ``s``'s FSDP2 units (:func:`_fsdp_units`'
    order: the root's, then one count per numbered layer)."""
    root: set[str] = set()
    layers: list[int] = []
    for sg, is_layer in _stage_segments(graph, cfg, s):
        names = {t for i in sg for t in graph.ops[i].inputs if graph.tensors[t].kind is TensorKind.PARAM}
        if is_layer:
            layers.append(len(names))
        else:
            root |= names
    return (len(root), *layers)


def _per_tensor_exposed(cluster: Cluster, ccache: dict, groups: Sequence[_Group], units: Sequence[tuple[float, float]],
                        per_tensor: tuple[Sequence[int], float], cfg: ParallelConfig, gb: int, rb: int, omega: float,
                        bwd: float) -> tuple[tuple[tuple[str, float], ...], float, float, float, float]:
    """ZeRO-3 gathering tensor by tensor (``zero3_gather="parameter"``), as :func:`_data_parallel`
    returns it: a unit of ``w`` elements in ``n`` tensors costs ``n`` all-gathers of ``w/n`` elements
    and ``n·p`` copy kernels (one per rank's view) at ``launch`` seconds each, exposed in full in the
    forward and again before the backward (the host waits for the device before each); the
    reduce-scatters are FSDP2's (:func:`_fsdp_exposed`)."""
    tensors, launch = per_tensor
    m = cfg.microbatches
    ef = eb = t_dp = 0.0
    for grp, gid in groups:
        p = len(grp)
        ag = [n * (_price(cluster, ccache, (("all_gather", w / n * gb),), grp, gid) + p * launch) if w and n else 0.0
              for (w, _), n in zip(units, tensors)]
        rs = [_price(cluster, ccache, (("reduce_scatter", w * rb),), grp, gid) if w else 0.0 for w, _ in units]
        f = sum(ag)
        b = sum(ag[1:]) + max(0.0, sum(rs[1:]) - omega * bwd) + rs[0]
        ef, eb = max(ef, f), max(eb, b)
        t_dp = max(t_dp, m * (sum(ag) + sum(ag[1:]) + sum(rs)))
    params = sum(w for w, _ in units)
    return (("all_gather", params * gb), ("reduce_scatter", params * rb)), t_dp, 0.0, ef, eb


def fsdp_collectives(units: Sequence[tuple[float, float]], zero_stage: int, microbatches: int, gb: int
                     ) -> list[tuple[str, float]]:
    """The collectives one optimizer step of FSDP2 issues per rank, as :func:`_fsdp_exposed` prices
    them: ``(kind, bytes)`` over the units (:func:`_fsdp_units`), root first. ZeRO-1/2 gather every
    unit once per step (its weights stay gathered through all the micro-batches); ZeRO-3 gathers the
    root once per micro-batch (FSDP2 does not reshard it after the forward) and every layer twice
    (forward, and again for its backward). ZeRO-1 reduce-scatters each unit's gradients once per
    step (accumulated unsharded), ZeRO-2/3 once per micro-batch."""
    rb = max(gb, 4)
    ag = [("all_gather", w * gb) for w, _ in units if w]  # a unit without parameters issues nothing
    rs = [("reduce_scatter", w * rb) for w, _ in units if w]
    if zero_stage == 3:
        return (ag + [("all_gather", w * gb) for w, _ in units[1:] if w] + rs) * microbatches
    return ag + rs * (microbatches if zero_stage == 2 else 1)


def _fsdp_exposed(cluster: Cluster, ccache: dict, groups: Sequence[_Group], units: Sequence[tuple[float, float]],
                  cfg: ParallelConfig, gb: int, rb: int, omega: float, bwd: float,
                  ) -> tuple[tuple[tuple[str, float], ...], float, float, float, float]:
    """FSDP2 with a unit per numbered layer (:func:`_fsdp_units`), as :func:`_data_parallel` returns it.

    Forward: the root's gather has nothing to hide behind; layer ``k``'s is prefetched during the
    compute since the previous unit started (``c_k``): ``E_fwd = AG(W_root) + Σ_k max(0, AG(W_k) −
    ω·c_k)``. Backward: the layers' reduce-scatters (and, under ZeRO-3, their second gathers) share
    the link against the backward; the root's reduce-scatter runs after it, exposed: ``E_bwd =
    max(0, Σ_k [RS(W_k) (+ AG(W_k))] − ω·B) + RS(W_root)``. ZeRO-3 pays both in every micro-batch;
    ZeRO-1/2 gather once per step (``E_fwd`` after the pipeline, with the step), ZeRO-2 reduces in
    every micro-batch's backward, ZeRO-1 in the last one's only."""
    z, m = cfg.zero_stage, cfg.microbatches
    ef = eb = t_dp = 0.0
    for grp, gid in groups:
        ag = [_price(cluster, ccache, (("all_gather", w * gb),), grp, gid) if w else 0.0 for w, _ in units]
        rs = [_price(cluster, ccache, (("reduce_scatter", w * rb),), grp, gid) if w else 0.0 for w, _ in units]
        f = ag[0] + sum(max(0.0, a - omega * c) for a, (_, c) in zip(ag[1:], units[1:]))
        b = max(0.0, sum(rs[1:]) + (sum(ag[1:]) if z == 3 else 0.0) - omega * bwd) + rs[0]
        ef, eb = max(ef, f), max(eb, b)
        t_dp = max(t_dp, sum(_price(cluster, ccache, (e,), grp, gid)
                             for e in fsdp_collectives(units, z, m, gb)))
    params = sum(w for w, _ in units)
    events = (("all_gather", params * gb), ("reduce_scatter", params * rb))
    if z == 3:
        return events, t_dp, 0.0, ef, eb
    if z == 2:
        return events, t_dp, ef, 0.0, eb
    return events, t_dp, ef + eb, 0.0, 0.0


def _price(cluster: Cluster, ccache: dict, events: Sequence[tuple[str, float]], grp: Sequence[int],
           gid: int) -> float:
    """Seconds of a list of collectives over one group, each distinct one priced once per cluster.

    ``gid`` names the group's price class (:func:`_layout`): nodes are homogeneous (one device
    type, one intra-node link), so a collective's time depends on how many members sit on which
    node and how many groups of its kind share those nodes' ports, not on which devices they are.
    """
    tot = 0.0
    for kind, nbytes in events:
        key = (kind, nbytes, gid)
        t = ccache.get(key)
        if t is None:
            conc = PRICES.of(cluster)["group_concurrency"][gid]
            t = ccache[key] = collective_time(cluster, kind, nbytes, grp, concurrent=conc).seconds
        tot += t
    return tot


def _reduce_over(cluster: Cluster, ccache: dict, group: tuple[int, ...], nbytes: float, concurrent: int = 1) -> float:
    """Seconds of one all-reduce of ``nbytes`` over the devices ``group`` (a group the layout does
    not name: the whole world, the stages sharing a weight), ``concurrent`` such groups sharing a node."""
    key = ("all_reduce over", group, nbytes, concurrent)
    t = ccache.get(key)
    if t is None:
        t = ccache[key] = collective_time(cluster, "all_reduce", nbytes, group, concurrent=concurrent).seconds
    return t


def _max_segment_params(graph: Graph) -> int:
    """Parameters of the largest layer (ZeRO-3 gathers one layer at a time)."""
    cache = PRICES.of(graph)
    if ("max_seg_params",) not in cache:
        cache[("max_seg_params",)] = max((sum(graph.tensors[t].numel for i in sg for t in graph.ops[i].inputs
                                              if graph.tensors[t].kind is TensorKind.PARAM)
                                          for sg in segments(graph)), default=0)
    return cache[("max_seg_params",)]


def _stage_terms(graph: Graph, cluster: Cluster, cfg: ParallelConfig, v: int) -> _StageTerms:
    """Memoised per graph and cluster: the search prices many configurations sharing these.

    Two levels: the per-stage sums that do not depend on recomputation (:func:`_stage_base`,
    shared by the three recomputation choices), then the cheap step that applies one.
    """
    devs = cfg.devices if cfg.devices is not None else tuple(range(cfg.world))
    key = ("stages", id(cluster), devs, cfg.dp, cfg.tp, cfg.pp, cfg.sp, v, cfg.partition, cfg.sequence_parallel,
           cfg.dtype, cfg.fused_attention, cfg.op_plans, cfg.zero_stage >= 1, cfg.pipeline_p2p, cfg.fused_elementwise,
           cfg.fused_dropout)
    cache = PRICES.of(graph)
    hit = cache.get((*key, cfg.recompute))
    if hit is not None and hit[0] is cluster:  # the cluster is held, so its id is not reused
        return hit[1]
    base = cache.get(key)
    if base is None or base[0] is not cluster:
        base = cache[key] = (cluster, _stage_base(graph, cluster, cfg, v, devs))
    terms = _apply_recompute(graph, cfg, base[1])
    cache[(*key, cfg.recompute)] = (cluster, terms)
    return terms


@dataclass(frozen=True)
class _StageBase:
    """One stage's sums per micro-batch before a recomputation choice."""

    layout: _StageLayout
    # (type, forward, backward, attention forward, forward of each layer)
    by_type: tuple[tuple[DeviceType, float, float, float, tuple[float, ...]], ...]
    tf: float  # tensor-parallel collectives, forward and backward
    tb: float
    qf: float  # sequence-parallel collectives
    qb: float
    params: float
    param_tensors: int
    tp_param_tensors: int
    segs: tuple[int, ...]  # the stage's layer segments
    seg_params: tuple[float, ...]  # parameters first used in each of them
    p2p: float
    p2p_sum: float
    p2p_block: float  # synchronous transfers (DeepSpeed's engine) per micro-batch, forward and backward alike
    # boundary activations the stage holds per micro-batch beyond its ops' own: (without full
    # recomputation: what it received; with it: what its checkpointed layers sent, and what it
    # received from ops that keep theirs; the rest is counted as the inputs of its layers)
    held: tuple[float, float] = (0.0, 0.0)
    # parameters this stage shares with other stages (a tied embedding and output head): per set of
    # stages holding them, their local elements, whose gradients are all-reduced over those stages
    tied: tuple[tuple[tuple[int, ...], float], ...] = ()


def _apply_recompute(graph: Graph, cfg: ParallelConfig, base: tuple[_StageBase, ...]) -> _StageTerms:
    plans = op_plans(graph, cfg)
    full = cfg.recompute == "full"
    out: dict[str, list] = {k: [] for k in _StageTerms.__dataclass_fields__ if k != "memo"}
    for st in base:
        # The slowest device type of the stage sets its pace (synchronous collectives).
        best: tuple[DeviceType, float, float, float, tuple[float, ...]] | None = None
        for dt, f, b, att, seg_f in st.by_type:
            rc = f if full else att if cfg.recompute == "selective" else 0.0
            if best is None or f + b + rc > best[1] + best[2] + best[3]:
                best = (dt, f, b, rc, seg_f)
        assert best is not None
        dt, f, b, rc, seg_f = best
        seg_act = _segment_activations(graph, cfg, plans, dt)
        tf, tb, qf, qb = st.tf, st.tb, st.qf, st.qb
        # recomputing a forward repeats its tensor/sequence-parallel collectives too
        rc_comm = (tf + qf) if full else 0.0
        out["devices"].append(st.layout.devices)
        out["spans"].append(st.layout.span)
        out["types"].append(dt)
        out["fwd"].append(f + tf + qf + st.p2p_block)
        out["bwd"].append(b + rc + tb + qb + rc_comm + st.p2p_block)
        out["comp"].append(f + b + rc)
        out["tp_t"].append(tf + tb + (tf if full else 0.0))
        out["sp_t"].append(qf + qb + (qf if full else 0.0))
        out["params"].append(st.params)
        out["seg_params"].append(st.seg_params)
        out["seg_fwd"].append(seg_f)
        out["param_tensors"].append(st.param_tensors)
        out["tp_param_tensors"].append(st.tp_param_tensors)
        full_act = seg_max = 0.0
        rec = _recomputed_segments(graph) if full else ()
        for j in st.segs:
            full_act += seg_act[j]
            if full and rec[j]:
                seg_max = max(seg_max, seg_act[j])
        if full:
            # keep each layer's input (its first op's activation inputs), recompute the rest; ops
            # outside the numbered layers (embeddings, final norm, head, loss) keep theirs, as
            # Megatron-LM and torch's checkpointing of the blocks do
            kept = 0.0
            seg_in = _segment_inputs(graph, cfg.dtype)
            for j in st.segs:
                kept += seg_in[j] / (cfg.tp if cfg.sequence_parallel else 1) / cfg.sp + (0.0 if rec[j] else seg_act[j])
            out["act"].append(kept + st.held[1])
            out["seg_act_max"].append(seg_max)
        else:
            out["act"].append(full_act + st.held[0])
            out["seg_act_max"].append(0.0)
        out["dp_groups"].append(st.layout.dp_groups)
        out["p2p"].append(st.p2p)
        out["p2p_sum"].append(st.p2p_sum)
        out["p2p_block"].append(st.p2p_block)
        out["tied"].append(st.tied)
    return _StageTerms(**{k: tuple(x) for k, x in out.items()})


def op_seconds(graph: Graph, op: Op, dt: DeviceType, cfg: ParallelConfig, split: float = 1.0,
               sharded: bool = False, op_class: int | None = None) -> tuple[float, float]:
    """Device seconds ``(forward, backward)`` of one op on ``dt`` as ``cfg`` runs it, before any
    measured profile: the kernels :func:`~polyparallel.cost_models.compute.op_cost` prices (SDPA as
    a fused kernel on accelerators unless ``fused_attention`` is ``False``, every elementwise op its
    own kernel when eager) plus, for an eager 16-bit step on an accelerator, what ``torch.autocast``
    adds. The step model and the placement solver both price ops with it. ``op_class``
    (:func:`~polyparallel.cost_models.compute.op_classes`) memoises the result per graph."""
    eager = _eager(cfg, dt)
    low_params = _low_params(cfg)
    autocast = eager and TRAINING_DTYPE_BYTES.get(cfg.dtype, 4) < 4 and dt.kind != "cpu"
    memo = PRICES.of(graph)
    key = ("op_seconds", op_class if op_class is not None else op.name, dt.cache_key, cfg.dtype, split,
           cfg.fused_attention, sharded, eager, autocast and low_params, cfg.fused_dropout)
    hit = memo.get(key)
    if hit is not None:
        return hit
    # fused_attention None: torch runs SDPA as a fused kernel on accelerators (CPUs: by their
    # measured attention rows, op_cost's own choice)
    fused = True if cfg.fused_attention or (cfg.fused_attention is None and is_sdpa(op) and dt.kind != "cpu") \
        else None
    c = op_cost(graph, op, dt, cfg.dtype, split=split, fused=fused, sharded=sharded, eager=eager,
                own_kernels=frozenset() if cfg.fused_dropout else frozenset({"dropout"}))
    out = (c.forward, c.backward)
    if autocast:
        extra = autocast_seconds(graph, op, dt, cfg.dtype, _sent_widths(graph, cfg.dtype, low_params), split)
        out = (out[0] + extra[0], out[1] + extra[1])
    memo[key] = out
    return out


def _op_vectors(graph: Graph, dt: DeviceType, cfg: ParallelConfig,
                plans: list[OpPlan]) -> tuple[list[float], list[float], list[float]]:
    """Forward, backward and attention-forward seconds of every op on one device type."""
    # a profiled device (op_profile.py) prices the model's ops as measured with `world` processes
    world = cfg.world if dt.op_profile is not None else 0
    key = ("opvec", dt.cache_key, cfg.dtype, cfg.tp, cfg.sp, cfg.sequence_parallel, cfg.fused_attention, cfg.op_plans,
           _eager(cfg, dt), world, _low_params(cfg), cfg.fused_dropout)
    op_costs = PRICES.of(graph)
    hit = op_costs.get(key)
    if hit is not None:
        return hit
    fw, bw, att = [], [], []
    classes = op_classes(graph)
    for i, op in enumerate(graph.ops):
        # tensor-parallel parameters are DTensors: their ops pay the host's dispatch (compute.py)
        sharded = plans[i].param_split > 1
        measured = profiled_op(graph, op, dt, world, plans[i].split, sharded, cfg.dtype) if world else None
        if measured is None:
            measured = op_seconds(graph, op, dt, cfg, plans[i].split, sharded, classes[i])
        fw.append(measured[0])
        bw.append(measured[1])
        att.append(measured[0] if OpKind(op.kind) is OpKind.ATTENTION else 0.0)
    op_costs[key] = (fw, bw, att)
    return fw, bw, att


def _host_vector(graph: Graph, dt: DeviceType, cfg: ParallelConfig) -> list[tuple[float, float]]:
    """Host seconds (forward, backward) of every op on an accelerator with measured dispatch costs."""
    key = ("host", dt.cache_key, cfg.dtype, cfg.fused_elementwise)
    cache = PRICES.of(graph)
    if key not in cache:
        cache[key] = host_seconds(graph, dt, cfg.dtype, eager=_eager(cfg, dt))
    return cache[key]


def _per_plan(graph: Graph, cfg: ParallelConfig, plans: list[OpPlan]) -> tuple[list[int], list[tuple], list[int],
                                                                                 list[tuple[int, str, float, int]]]:
    """Ops with tensor/sequence-parallel collectives, and parameter uses ``(op, tensor, local numel,
    numel)``, in op order."""
    key = ("per_plan", cfg.tp, cfg.sp, cfg.sequence_parallel, cfg.dtype, cfg.op_plans)
    cache = PRICES.of(graph)
    hit = cache.get(key)
    if hit is not None:
        return hit
    ev_idx, ev = [], []
    for i, pl in enumerate(plans):
        if pl.tp_fwd or pl.tp_bwd or pl.sp_fwd or pl.sp_bwd:
            ev_idx.append(i)
            ev.append((pl.tp_fwd, pl.tp_bwd, pl.sp_fwd, pl.sp_bwd))
    uses = []
    for i, op in enumerate(graph.ops):
        for t in op.inputs:
            if graph.tensors[t].kind is TensorKind.PARAM:
                whole = graph.tensors[t].numel
                uses.append((i, t, whole / (plans[i].param_split if cfg.tp > 1 else 1), whole))
    out = (ev_idx, ev, [u[0] for u in uses], uses)
    cache[key] = out
    return out


def _segment_activations(graph: Graph, cfg: ParallelConfig, plans: list[OpPlan], device: DeviceType) -> list[float]:
    selective = cfg.recompute == "selective"
    math_sdpa = cfg.fused_attention is False and math_sdpa_upcasts(device, cfg.dtype)
    key = ("seg_act", cfg.tp, cfg.sp, cfg.sequence_parallel, cfg.dtype, cfg.fused_attention, selective,
           cfg.op_plans, math_sdpa)
    cache = PRICES.of(graph)
    if key not in cache:
        op_key = ("op_act", cfg.dtype, cfg.fused_attention, selective, math_sdpa)
        if op_key not in cache:
            cache[op_key] = [_activation_bytes(graph, op, cfg.dtype, cfg.fused_attention, selective, math_sdpa)
                             for op in graph.ops]
        act = cache[op_key]
        cache[key] = [sum(act[i] / plans[i].split for i in sg) for sg in segments(graph)]
    return cache[key]


def _recomputed_segments(graph: Graph) -> list[bool]:
    """Which layer segments full recomputation checkpoints: the numbered layers, or every run of
    ``√n`` ops in a graph without numbered layers."""
    cache = PRICES.of(graph)
    if ("recomputed",) not in cache:
        segs = segments(graph)
        layer = [bool(LAYER.match(graph.ops[sg[0]].module or "")) for sg in segs]
        cache[("recomputed",)] = layer if any(layer) else [True] * len(segs)
    return cache[("recomputed",)]


def _segment_inputs(graph: Graph, dtype: str) -> list[float]:
    """Bytes full recomputation keeps per layer segment besides the activations it does not recompute.

    A recomputed segment keeps its inputs (each layer's input); a segment it does not recompute
    also keeps the inputs it reads from recomputed ones (the head's input after the last layer),
    which its own ops save for their backward. Tensors written by ops that are not recomputed are
    counted with those ops' activations, once."""
    key = ("seg_in", dtype)
    cache = PRICES.of(graph)
    if key not in cache:
        segs, rec = segments(graph), _recomputed_segments(graph)
        by_rec = {t: rec[j] for j, sg in enumerate(segs) for i in sg for t in graph.ops[i].outputs}
        out = []
        for j, sg in enumerate(segs):
            produced = {t for i in sg for t in graph.ops[i].outputs}
            ins = {t for i in sg for t in graph.ops[i].inputs
                   if graph.tensors[t].kind is not TensorKind.PARAM and t not in produced
                   and by_rec.get(t, rec[j])}
            out.append(sum(tensor_bytes(graph, t, dtype) for t in ins))
        cache[key] = out
    return cache[key]


def _sent_widths(graph: Graph, dtype: str, low_params: bool) -> dict[str, float]:
    """Bytes per element of every tensor as the torch backend holds it in training at ``dtype``.

    fp32: every float tensor 4. bf16/fp16 run under autocast with fp32 parameters (or, where
    FSDP2 shards them with ``MixedPrecisionPolicy``, ``low_params``, parameters cast to ``dtype``):
    contractions, convolutions and attention compute in ``dtype`` (autocast's lower-precision list,
    :data:`~polyparallel.cost_models.compute.AUTOCAST_LOW`), the loss and
    layer/group norms in fp32 (its fp32 list), batch norm in its input's dtype (cuDNN's), a cast to
    its dtype, and every other op promotes its float inputs as torch does. So a
    residual stream that adds a bf16 projection to fp32 embeddings stays fp32 (what a pipeline
    stage sends), unless FSDP2 made the embeddings bf16."""
    from polyparallel.ir import DTYPE_BYTES, FLOAT_DTYPES, element_bytes

    key = ("widths", dtype, low_params)
    cache = PRICES.of(graph)
    if key in cache:
        return cache[key]
    low = float(TRAINING_DTYPE_BYTES.get(dtype, 4))
    width: dict[str, float] = {}
    floats = FLOAT_DTYPES
    for name, t in graph.tensors.items():
        if t.dtype not in floats:
            width[name] = float(DTYPE_BYTES.get(t.dtype, 4))
        elif low < 4 and t.kind is TensorKind.PARAM and low_params:
            width[name] = low
        elif t.kind is not TensorKind.ACTIVATION:
            width[name] = 4.0 if low < 4 else float(element_bytes(t.dtype, dtype))
    for op in graph.ops:
        ins = [width.get(t, 4.0) for t in op.inputs if graph.tensors[t].dtype in floats]
        kind = OpKind(op.kind)
        cast = op.attr.get("dtype")
        if low >= 4:
            w = low
        elif kind in AUTOCAST_LOW:
            others = [width.get(t, 4.0) for t in op.inputs[2:] if graph.tensors[t].dtype in floats
                      and graph.tensors[t].kind is not TensorKind.PARAM]
            # a fused epilogue (the residual add) promotes to its other inputs' width
            w = max([low, *others]) if op.attr.get("fused") else low
        elif kind is OpKind.LOSS:
            w = 4.0
        elif kind is OpKind.NORM and "batch_norm" in op.target:
            # cuDNN's batch norm returns its input's dtype whatever its fp32 affine parameters and statistics
            w = max([width.get(t, 4.0) for t in op.inputs if graph.tensors[t].dtype in floats
                     and graph.tensors[t].kind in (TensorKind.ACTIVATION, TensorKind.INPUT)], default=4.0)
        elif kind is OpKind.NORM and ("layer_norm" in op.target or "group_norm" in op.target):
            w = 4.0  # autocast's fp32 list
        elif isinstance(cast, str) and cast.startswith("torch."):
            w = {"torch.float32": 4.0, "torch.bfloat16": 2.0, "torch.float16": 2.0}.get(cast, max(ins, default=4.0))
        else:
            w = max(ins, default=4.0)
        for t in op.outputs:
            if graph.tensors[t].dtype in floats:
                width[t] = w
            else:
                width.setdefault(t, float(DTYPE_BYTES.get(graph.tensors[t].dtype, 4)))
    cache[key] = width
    return width


def _crossing(graph: Graph, dtype: str, low_params: bool = False) -> list[tuple[int, int, float]]:
    """(producer op, last consumer op, bytes) of every tensor read after the op that writes it, in op
    order; the bytes as the executor holds and sends it (:func:`_sent_widths`)."""
    key = ("crossing", dtype, low_params)
    cache = PRICES.of(graph)
    if key not in cache:
        last: dict[str, int] = {}
        for i, op in enumerate(graph.ops):
            for t in op.inputs:
                last[t] = i
        width = _sent_widths(graph, dtype, low_params)
        cache[key] = [(i, last[t], graph.tensors[t].numel * width[t]) for i, op in enumerate(graph.ops)
                      for t in op.outputs if last.get(t, -1) > i]
    return cache[key]


def _stage_base(graph: Graph, cluster: Cluster, cfg: ParallelConfig, v: int,
                devs: tuple[int, ...]) -> tuple[_StageBase, ...]:
    p = cfg.pp
    segs = segments(graph)
    chunk_of_op = chunks(graph, p * v, cfg.partition)
    plans = op_plans(graph, cfg)
    ev_idx, ev, use_idx, uses = _per_plan(graph, cfg, plans)
    gmemo = PRICES.of(graph)
    ccache: dict = PRICES.of(cluster).setdefault("collectives", {})
    n = len(graph.ops)
    ranges = chunk_ranges(graph, p * v, cfg.partition)
    layout = _layout(cluster, cfg, devs)
    stage_of_seg = [chunk_of_op[sg[0]] % p for sg in segs]
    seg_of_op = gmemo.get(("seg_of_op",))
    if seg_of_op is None:
        seg_of_op = gmemo[("seg_of_op",)] = [0] * n
        for j, sg in enumerate(segs):
            for i in sg:
                seg_of_op[i] = j
    # p2p between consecutive chunks: tensors produced at or before chunk g, read after it, in the
    # dtype the executor sends (fp32 residual streams under autocast, the compute precision where
    # FSDP2 casts the parameters); of those, the bytes made by layers full recomputation checkpoints
    # (the same for every plan of one cut, dtype and tp·sp: memoised per graph)
    low_params = _low_params(cfg)
    bkey = ("boundary", p * v, cfg.partition, cfg.dtype, low_params, cfg.tp * cfg.sp)
    hit = gmemo.get(bkey)
    if hit is None:
        boundary = [0.0] * (p * v)
        from_rec = [0.0] * (p * v)
        rec = _recomputed_segments(graph)
        cross = _crossing(graph, cfg.dtype, low_params)
        active: list[tuple[int, int, float]] = []
        k = 0
        for g in range(p * v - 1):
            cut = next((ranges[h][0] for h in range(g + 1, p * v) if ranges[h][1] > ranges[h][0]), n)
            while k < len(cross) and cross[k][0] < cut:
                active.append(cross[k])
                k += 1
            active = [x for x in active if x[1] >= cut]
            for i, _, nb in active:
                boundary[g] += nb / (cfg.tp * cfg.sp)
                from_rec[g] += nb / (cfg.tp * cfg.sp) if rec[seg_of_op[i]] else 0.0
        hit = gmemo[bkey] = (tuple(boundary), tuple(from_rec))
    boundary, from_rec = hit
    # DeepSpeed's engine (pipe_partitioned / grad_partitioned, its defaults under tensor parallelism):
    # each tensor-parallel rank sends its 1/tp slice, blocking the stream on both ends, and the
    # receiver rebuilds the tensor with an all-gather over its tensor-parallel group (PartitionedTensor.full).
    # CPU stages (gloo) block both ends too: a transfer is host work on the threads and cores the
    # stages compute on. Measured for the executor benchmark's GPT on 2 ranks (torch's pipelining
    # schedules): per micro-batch and stage ~1 ms of posting, waiting and unpacking around each
    # 65 KB transfer, while the receiver's wait ended 0.02-0.3 ms after the sender posted
    deepspeed = cfg.pipeline_p2p == "deepspeed"
    host_p2p = all(t.kind == "cpu" for lay in layout for t in lay.types)
    sync_hop = [(max(_p2p(cluster, ccache, a, b, boundary[g]) for a, b in layout[g % p].p2p_pairs),
                 max(_price(cluster, ccache, [("all_gather", boundary[g] * cfg.tp)], grp, gid)
                     for grp, gid in layout[(g + 1) % p].tp_groups) if cfg.tp > 1 and deepspeed else 0.0)
                for g in range(p * v - 1)] if deepspeed or host_p2p else []
    out = []
    held_params: list[dict[str, float]] = []
    for s in range(p):
        lay = layout[s]
        rng = [ranges[g] for g in range(s, p * v, p)]
        stage_segs = tuple(j for j in range(len(segs)) if stage_of_seg[j] == s)
        by_type = []
        for dt in lay.types:
            fw, bw, att = _op_vectors(graph, dt, cfg, plans)
            f = b = a_f = 0.0
            for a, z in rng:
                f = sum(fw[a:z], f)
                b = sum(bw[a:z], b)
                a_f = sum(att[a:z], a_f)
            if dt.host_table(cfg.dtype):
                # an accelerator's host enqueues the micro-batch's kernels; when that takes longer
                # than the kernels run, the device waits: forward + backward last the host's time
                host = _host_vector(graph, dt, cfg)
                h = sum(x + y for a, z in rng for x, y in host[a:z]) + host_step_fixed(dt, cfg.dtype)
                if h > f + b > 0:
                    f, b = f * h / (f + b), b * h / (f + b)
            by_type.append((dt, f, b, a_f, tuple(sum(fw[i] for i in segs[j]) for j in stage_segs)))
        # every group of the stage runs the same collectives; the slowest one sets the pace
        # (the events and their prices depend on the plans and the stage's op ranges, not on dp, m or
        # the memory knobs: memoised per graph for the plans sharing them)
        stage_key = ("stage_ev", cfg.tp, cfg.sp, cfg.sequence_parallel, cfg.dtype, cfg.op_plans, tuple(rng))
        stage_memo = gmemo.get(stage_key)
        if stage_memo is None:
            stage_memo = gmemo[stage_key] = ([], {})
            stage_ev = [e for a, z in rng for e in ev[bisect_left(ev_idx, a): bisect_left(ev_idx, z)]]
            for which in range(4):
                agg: dict[tuple[str, float], int] = {}
                for e in stage_ev:
                    for x in e[which]:
                        agg[x] = agg.get(x, 0) + 1
                stage_memo[0].append(agg)

        def slowest(which: int, groups: tuple[_Group, ...], stage_memo: tuple = stage_memo) -> float:
            # identical (kind, bytes) events repeat in every layer: price each distinct one once
            # per group, and each distinct group (by the nodes its members sit on) once
            agg = stage_memo[0][which]
            if not agg:
                return 0.0
            key = (which, id(cluster), tuple(gid for _, gid in groups))
            hit = stage_memo[1].get(key)
            if hit is not None and hit[0] is cluster:  # the cluster is held, so its id is not reused
                return hit[1]
            t = max(sum(k * _price(cluster, ccache, [x], grp, gid) for x, k in agg.items()) for grp, gid in groups)
            stage_memo[1][key] = (cluster, t)
            return t

        # memory inputs
        seen: dict[str, float] = {}
        params = 0.0
        split_tensors = 0
        seg_params = dict.fromkeys(stage_segs, 0.0)
        for a, z in rng:
            for i, t, numel, whole in uses[bisect_left(use_idx, a): bisect_left(use_idx, z)]:
                if t not in seen:
                    seen[t] = numel
                    params += numel
                    split_tensors += numel < whole
                    seg_params[seg_of_op[i]] += numel
        times = [max(_p2p(cluster, ccache, a, b, boundary[g]) for a, b in lay.p2p_pairs)
                 for g in range(s, p * v - 1, p)]
        block = 0.0
        if sync_hop:
            # per micro-batch the forward receives and gathers boundary g − 1 and sends boundary g; the
            # backward receives and gathers g's gradient and sends g − 1's: half the gathers in each
            ends = [sync_hop[g - 1] for g in range(s, p * v, p) if g > 0] + [
                sync_hop[g] for g in range(s, p * v - 1, p)]
            block = sum(x + ag / 2 for x, ag in ends)
            times = []
        # a stage holds, until their gradients pass, what it received (its own buffers) and what it sent
        recv = [g - 1 for g in range(s, p * v, p) if g > 0]
        sent = [g for g in range(s, p * v - 1, p)]
        held = (sum(boundary[g] for g in recv),
                sum(from_rec[g] for g in sent) + sum(boundary[g] - from_rec[g] for g in recv))
        out.append(_StageBase(
            layout=lay, by_type=tuple(by_type), tf=slowest(0, lay.tp_groups), tb=slowest(1, lay.tp_groups),
            qf=slowest(2, lay.sp_groups), qb=slowest(3, lay.sp_groups), params=params, param_tensors=len(seen),
            tp_param_tensors=split_tensors, segs=stage_segs, seg_params=tuple(seg_params.values()),
            p2p=max(times) if times else 0.0, p2p_sum=sum(times), p2p_block=block, held=held))
        held_params.append(seen)
    return tuple(replace(b, tied=_tied(held_params, s)) for s, b in enumerate(out)) if p > 1 else tuple(out)


def _tied(held: list[dict[str, float]], s: int) -> tuple[tuple[tuple[int, ...], float], ...]:
    """The parameters stage ``s`` shares with other stages, as ``(stages holding them, local
    elements)`` per set of holders."""
    by: dict[tuple[int, ...], float] = {}
    for t, numel in held[s].items():
        holders = tuple(o for o, h in enumerate(held) if t in h)
        if len(holders) > 1:
            by[holders] = by.get(holders, 0.0) + numel
    return tuple(sorted(by.items()))


# -- expert parallelism ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _ExpertParallel:
    """Per stage: the expert weights it holds before the ``ep`` split, the seconds of its MoE
    layers' all-to-alls per micro-batch (forward and backward alike), and the experts' gradient
    reduction over the ranks holding the same experts (events, seconds per step)."""

    expert_params: tuple[float, ...]
    a2a: tuple[float, ...]
    grad_events: tuple[tuple[tuple[str, float], ...], ...]
    grad_t: tuple[float, ...]


def _moe_layers(graph: Graph) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """The MoE layers as ``(first, last)`` expert-matmul op indices (one layer per module: the
    first's input is dispatched, the last's output combined), and the expert weight tensors
    (parameters reaching an expert matmul's weight operand through views and casts)."""
    cache = PRICES.of(graph)
    hit = cache.get(("moe",))
    if hit is not None:
        return hit
    by_module: dict[str, list[int]] = {}
    weights: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        if op.nest is None or not any(d.hint is Hint.EXPERT for d in op.nest.dims) or len(op.inputs) < 2:
            continue
        by_module.setdefault(op.module or op.name, []).append(i)
        t = op.inputs[1]
        while graph.tensors[t].kind is not TensorKind.PARAM:
            prod = graph.producer(t)
            if prod is None or OpKind(prod.kind) not in (OpKind.VIEW, OpKind.ELEMENTWISE) or not prod.inputs:
                break
            t = prod.inputs[0]
        if graph.tensors[t].kind is TensorKind.PARAM:
            weights[t] = i
    out = ([(ix[0], ix[-1]) for ix in by_module.values()], weights)
    cache[("moe",)] = out
    return out


def expert_all_to_all_elements(rows: int, hidden_in: int, hidden_out: int, experts: int, ep: int) -> tuple[int, int]:
    """Elements one device receives in a MoE layer's dispatch and in its combine over ``ep`` ranks
    holding ``rows`` routed rows each, from the polyhedral model: the expert matmul of the
    ``ep`` ranks' rows side by side (:func:`polyparallel.ops.grouped_mm` with ``sources = ep``)
    placed ``e:ep``; the dispatch is the footprint of its input minus the rank's own rows, the
    combine its output block back to the rows' ranks. Rows that do not divide over the experts
    are padded up (a bound)."""
    from polyparallel import ops
    from polyparallel.ir import Graph as _Graph
    from polyparallel.ir import Op as _Op
    from polyparallel.ir import TensorSpec
    from polyparallel.poly import DeviceMesh, Placement, TensorLayout, operand_need, output_layout, reshard

    rows = -(-rows // experts) * experts
    n = ep * rows
    g = _Graph("moe_layer")
    for name, shape, kind in (("x", (n, hidden_in), TensorKind.ACTIVATION),
                              ("w", (experts, hidden_in, hidden_out), TensorKind.PARAM),
                              ("y", (n, hidden_out), TensorKind.ACTIVATION)):
        g.add_tensor(TensorSpec(name, shape, kind=kind))
    op = g.add_op(_Op("experts", OpKind.CONTRACTION, "grouped_mm", ("x", "w"), ("y",),
                      ops.grouped_mm((n, hidden_in), (experts, hidden_in, hidden_out), sources=ep)))
    mesh, placed = DeviceMesh.of(ep=ep), Placement.parse("e:ep")
    dispatch = reshard(TensorLayout.sharded((n, hidden_in), ep=0), operand_need(g, op, placed, mesh, "in0"), mesh)
    combine = reshard(output_layout(g, op, placed, mesh), TensorLayout.sharded((n, hidden_out), ep=0), mesh)
    return dispatch.elements, combine.elements


def _expert_parallel(graph: Graph, cluster: Cluster, cfg: ParallelConfig, terms: _StageTerms, ccache: dict,
                     gb: int) -> _ExpertParallel:
    """Expert parallelism's terms per stage (``cfg.ep`` ranks of each data-parallel group, consecutive).

    Forward, per micro-batch and MoE layer: the dispatch of the routed rows to the experts'
    ranks and the combine of the experts' outputs back, each an all-to-all over the ``ep``
    group of the bytes :func:`expert_all_to_all_elements` counts (a rank's rows: its
    ``T = tokens·top_k`` rows divided over ``sp``, and over ``tp`` under Megatron sequence
    parallelism); the backward moves the gradients of both the same way. The balanced routing of
    the loop nest makes every expert's work ``1/E`` of the rows, so the compute per rank is
    unchanged. Gradients of the expert weights (``1/ep`` of the stage's per rank) are reduced
    over the ``dp·sp/ep`` ranks holding the same experts (every ``ep``-th member of the data-parallel
    group): all-reduce under ZeRO-0, reduce-scatter + all-gather under ZeRO-1/2.
    """
    p, ep, v = cfg.pp, cfg.ep, cfg.chunks if cfg.schedule == "interleaved" else 1
    layers, weights = _moe_layers(graph)
    chunk_of_op = chunks(graph, p * v, cfg.partition)
    plans = op_plans(graph, cfg)
    expert = [0.0] * p
    counted: set[tuple[int, str]] = set()
    for i, t, numel, _ in _per_plan(graph, cfg, plans)[3]:
        s = chunk_of_op[i] % p
        if t in weights and (s, t) not in counted:
            counted.add((s, t))
            expert[s] += numel
    rows_div = cfg.sp * (cfg.tp if cfg.sequence_parallel else 1)
    conc_of = PRICES.of(cluster)["group_concurrency"]
    nodes = [d.node for d in cluster.devices]

    def subgroups_time(grp: tuple[int, ...], gid: int, subs: list[tuple[int, ...]],
                       events: Sequence[tuple[str, float]]) -> float:
        # the subgroups of every data-parallel group run at once: those with a member on a node
        # share its ports with each other and with the other tensor-parallel ranks' groups
        on_node: dict[int, int] = {}
        for sub in subs:
            for nd in {nodes[d] for d in sub}:
                on_node[nd] = on_node.get(nd, 0) + 1
        worst = 0.0
        for sub in subs:
            conc = conc_of[gid] * max(on_node[nodes[d]] for d in sub)
            tot = 0.0
            for kind, nbytes in events:
                key = ("ep", kind, nbytes, tuple(sorted(nodes[d] for d in sub)), conc)
                if key not in ccache:
                    ccache[key] = collective_time(cluster, kind, nbytes, sub, concurrent=conc).seconds
                tot += ccache[key]
            worst = max(worst, tot)
        return worst

    a2a, grad_events, grad_t = [0.0] * p, [], []
    for s in range(p):
        events = []
        for first, last in layers:
            if chunk_of_op[first] % p != s:
                continue
            x, w = (graph.tensors[t] for t in graph.ops[first].inputs[:2])
            y = graph.tensors[graph.ops[last].outputs[0]]
            key = ("moe_a2a", ep, x.shape, w.shape, y.shape, rows_div)
            if key not in PRICES.of(graph):
                PRICES.of(graph)[key] = expert_all_to_all_elements(
                    max(1, x.shape[0] // rows_div), x.shape[1], y.shape[1], w.shape[0], ep)
            d_el, c_el = PRICES.of(graph)[key]
            for el, spec in ((d_el, x), (c_el, y)):
                events.append(("all_to_all", el * element_bytes(spec.dtype, cfg.dtype) * ep / (ep - 1)))
        groups = terms.dp_groups[s]
        a2a[s] = max(subgroups_time(grp, gid, [grp[i:i + ep] for i in range(0, len(grp), ep)], events)
                     for grp, gid in groups) if events else 0.0
        held = expert[s] / ep
        ev: tuple[tuple[str, float], ...] = ()
        if len(groups[0][0]) > ep and held:
            rb = max(gb, 4)
            ev = ((("all_reduce", held * rb),) if cfg.zero_stage == 0 else
                  (("reduce_scatter", held * rb),) * (cfg.microbatches if cfg.zero_stage == 2 else 1)
                  + (("all_gather", held * gb),))
        grad_events.append(ev)
        grad_t.append(max(subgroups_time(grp, gid, [grp[j::ep] for j in range(ep)], ev) for grp, gid in groups)
                      if ev else 0.0)
    return _ExpertParallel(tuple(expert), tuple(a2a), tuple(grad_events), tuple(grad_t))


# (device ids, price class: the id of their sorted node ids and the groups running alongside on a node)
_Group = tuple[tuple[int, ...], int]


@dataclass(frozen=True)
class _StageLayout:
    devices: tuple[int, ...]
    span: str
    types: tuple[DeviceType, ...]  # in order of first appearance
    tp_groups: tuple[_Group, ...]  # distinct by the nodes they span: each distinct group priced once
    sp_groups: tuple[_Group, ...]
    dp_groups: tuple[_Group, ...]
    p2p_pairs: tuple[tuple[int, int], ...]  # (device of this stage, its peer on the next), distinct by nodes


def _layout(cluster: Cluster, cfg: ParallelConfig, devs: tuple[int, ...]) -> tuple[_StageLayout, ...]:
    """Devices, groups and p2p pairs of every stage (kept on the cluster: it is graph-independent).

    Ranks are ``((s·dp + d)·sp + q)·tp + t``, so the device array reshaped to ``(pp, dp, sp, tp)``
    gives tensor-parallel groups along the last axis, sequence-parallel along the third, and the
    data-parallel (× sequence) group of ``t`` as the ``(dp, sp)`` slab at ``t``.
    """
    import numpy as np

    key = (devs, cfg.dp, cfg.tp, cfg.pp, cfg.sp)
    cache = PRICES.of(cluster).setdefault("layouts", {})
    if key in cache:
        return cache[key]
    ids: dict[tuple[tuple[int, ...], int], int] = PRICES.of(cluster).setdefault("group_ids", {})
    conc_of: dict[int, int] = PRICES.of(cluster).setdefault("group_concurrency", {})
    D = np.asarray(devs, dtype=np.int64).reshape(cfg.pp, cfg.dp, cfg.sp, cfg.tp)
    N = np.asarray([d.node for d in cluster.devices], dtype=np.int64)[D]

    def distinct(dg: np.ndarray, ng: np.ndarray) -> tuple[_Group, ...]:
        # groups of one kind run their collectives at the same time: those sharing a node
        # share its network ports (comm.collective_time's ``concurrent``)
        rows = np.sort(ng, axis=1).tolist()
        per_node: dict[int, int] = {}
        for row in rows:
            for nd in set(row):
                per_node[nd] = per_node.get(nd, 0) + 1
        first: dict[tuple[int, ...], int] = {}
        for i, row in enumerate(map(tuple, rows)):
            first.setdefault(row, i)
        out = []
        for row, i in first.items():
            conc = max(per_node[nd] for nd in row)
            out.append((tuple(dg[i].tolist()), ids.setdefault((row, conc), len(ids))))
            conc_of[out[-1][1]] = conc
        return tuple(out)

    out = []
    for s in range(cfg.pp):
        ds, ns = D[s], N[s]
        flat = tuple(ds.ravel().tolist())
        nodes = ns.ravel().tolist()
        first_idx: dict[int, int] = {}
        for i, nd in enumerate(nodes):
            first_idx.setdefault(nd, i)
        types = {cluster.device(flat[i]).type.name: cluster.device(flat[i]).type for i in first_idx.values()}
        nxt = (s + 1) % cfg.pp
        peers = D[nxt].ravel().tolist()
        pairs: dict[tuple[int, int], tuple[int, int]] = {}
        for a, b, na, nb in zip(flat, peers, nodes, N[nxt].ravel().tolist()):
            pairs.setdefault((na, nb), (a, b))
        out.append(_StageLayout(
            devices=flat, span=_span(flat), types=tuple(types.values()),
            tp_groups=distinct(ds.reshape(-1, cfg.tp), ns.reshape(-1, cfg.tp)),
            sp_groups=distinct(ds.transpose(0, 2, 1).reshape(-1, cfg.sp), ns.transpose(0, 2, 1).reshape(-1, cfg.sp)),
            dp_groups=distinct(ds.transpose(2, 0, 1).reshape(cfg.tp, -1), ns.transpose(2, 0, 1).reshape(cfg.tp, -1)),
            p2p_pairs=tuple(pairs.values())))
    cache[key] = tuple(out)
    return cache[key]


def _p2p(cluster: Cluster, ccache: dict, a: int, b: int, nbytes: float) -> float:
    key = ("p2p", cluster.device(a).node, cluster.device(b).node, a == b, nbytes)
    t = ccache.get(key)
    if t is None:
        t = ccache[key] = p2p_time(cluster, a, b, nbytes)
    return t


def _batch(graph: Graph) -> int:
    for name in graph.inputs:
        t = graph.tensors[name]
        if t.shape:
            return t.shape[0]
    return 1


def _span(ids: Sequence[int]) -> str:
    ids = sorted(ids)
    if ids and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ",".join(map(str, ids[:8])) + ("..." if len(ids) > 8 else "")
