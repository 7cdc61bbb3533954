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
(:func:`expert_parallel`).

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
norms, the loss), at the widths :func:`sent_widths` gives.

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
from dataclasses import dataclass, replace

from polyparallel.cluster import Cluster, DeviceType
from polyparallel.ir import TRAINING_DTYPE_BYTES, Graph, Op, OpKind, TensorKind

from .activations import (
    crossing,
    loss_transient,
    op_policy_kept,
    op_policy_recomputed,
    recomputed_segments,
    segment_activations,
    segment_inputs,
    sent_widths,
)
from .compute import (
    autocast_seconds,
    host_seconds,
    host_step_fixed,
    is_sdpa,
    op_classes,
    op_cost,
    streaming_bandwidth,
)
from .data_parallel import (
    DataParallel,
    cross_rank_norms,
    data_parallel,
    fsdp_units,
    max_segment_params,
    overlap_slowdown,
    overlapped,
    unit_tensors,
)
from .expert_parallel import ExpertParallel, expert_parallel
from .layers import chunk_of_ops, chunk_ranges, chunks, layer_segments, segments
from .megatron_rule import op_plans
from .memo import PRICES
from .memory import MemoryReport, device_memory
from .op_profile import profile_for, profiled_op
from .parallel_config import OpPlan, ParallelConfig, StageBreakdown, StepEstimate
from .pipeline import makespan_bound, peak_in_flight, simulate
from .stage_layout import Group, StageLayout, StageTerms, group_seconds, p2p_seconds, reduce_over, stage_layouts

__all__ = ["OpPlan", "ParallelConfig", "StageBreakdown", "StepBound", "StepEstimate", "chunk_of_ops", "estimate_step",
           "layer_segments", "op_seconds", "optimizer_element_time", "step_lower_bound", "step_memory"]

# kernels per parameter tensor of torch's single-tensor optimizer step (torch/optim/adam.py etc.):
# Adam: step += 1, lerp_, mul_ + addcmul_, sqrt / c + eps, addcdiv_
_OPT_KERNELS = {"adam": 9, "adamw": 10, "lamb": 12, "lion": 5, "sgd": 1, "sgd_momentum": 3}
# fp32 accesses per parameter of torch's multi-tensor (foreach) step, kernel by kernel
# (torch/optim/adam.py _multi_tensor_adam, not capturable): lerp_(m, g) 3, mul_(v) 2,
# addcmul_(v, g, g) 3, sqrt(v) 2, div_ 2, add_(eps) 2, addcdiv_(p, m, .) 4 = 18; AdamW's
# decoupled decay mul_(p) adds 2; SGD add_(p, g) 3, with momentum mul_/add_(buf) + add_(p) 8
_FOREACH_ACCESSES = {"adam": 18, "adamw": 20, "lamb": 24, "lion": 10, "sgd": 3, "sgd_momentum": 8}

















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


def step_memory(graph: Graph, cluster: Cluster, cfg: ParallelConfig) -> tuple[MemoryReport, ...]:
    """``estimate_step(...).memory`` without pricing the step's time: a search needs no time of a
    plan that does not fit (most of the plans it enumerates on a big model)."""
    cfg.validate(cluster)
    v = cfg.chunks if cfg.schedule == "interleaved" else 1
    terms = _stage_terms(graph, cluster, cfg, v)
    moe = _expert(graph, cluster, cfg, terms)
    in_flight = peak_in_flight(cfg.schedule, cfg.pp, cfg.microbatches, v)
    return tuple(_stage_memory(graph, cfg, terms, s, v, in_flight[s], _units(graph, cfg, terms, moe, s),
                               moe.expert_params[s] if moe is not None else 0.0) for s in range(cfg.pp))


# -- the parts of the estimate that do not need the pipeline simulation --------------------------





@dataclass(frozen=True)
class _Prepared:
    terms: StageTerms
    chunks: int
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    dp: tuple[DataParallel, ...]
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
    moe = _expert(graph, cluster, cfg, terms)
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
        units = _units(graph, cfg, dterms, moe, s)
        # DeepSpeed's ZeRO-3 of 2021 gathers parameter tensor by parameter tensor (ParallelConfig.zero3_gather)
        per_tensor = (unit_tensors(graph, cfg, s), dt.launch_overhead) if (
            units and cfg.zero_stage == 3 and cfg.zero3_gather == "parameter") else None
        # a profiled CPU measured what FSDP2 itself (hooks, copies, the DTensor optimizer) adds to a step
        prof = profile_for(dt, graph, cfg.dtype)
        fsdp = prof.wrapper(cfg.world, f"zero{min(3, max(2, cfg.zero_stage))}/{cfg.optimizer}") if (
            units and dgrp_size > 1 and prof is not None) else None
        events, t_dp, exposed, ef, eb = data_parallel(cluster, ccache, dterms, s, cfg, gb, omega, v, buckets, units,
                                                      per_tensor, copies=fsdp is None)
        if dgrp_size > 1 and cfg.pp == 1:
            nf, nb = cross_rank_norms(graph, cluster, ccache, terms.dp_groups[s][0], dt, cfg)
            ef, eb = ef + nf, eb + nb
        fwd[s] += ef
        bwd[s] += eb
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
                exposed = overlapped(t_dp, hide, overlap_slowdown(dt))
        if cfg.pp > 1:
            # a pipeline combines its micro-batches' losses and target counts with one all-reduce over
            # the whole world after the flush (the torch backend's weigh_microbatches)
            exposed += _loss_reduce(cluster, ccache, terms)
        elif dgrp_size > 1:
            # the step's loss and its target count are all-reduced over the replicas between the
            # forward and the backward, on every rank's critical path (the torch backend's
            # weigh_replicas; Megatron-LM all-reduces the loss every step for its log)
            exposed += group_seconds(cluster, ccache, (("all_reduce", 32.0),), *terms.dp_groups[s][0])
        for holders, numel in terms.tied[s] if terms.tied else ():
            # a weight several stages use (a tied embedding and output head) gets its gradient
            # summed over them after the flush, before the optimizer: Megatron-LM's
            # _allreduce_word_embedding_grads, DeepSpeed's _exec_reduce_tied_grads, the torch
            # backend's tie groups; every replica's group at once, those on one node sharing its ports
            exposed += reduce_over(cluster, ccache, tuple(terms.devices[h][0] for h in holders),
                                    numel * max(gb, 4), _on_first_node(cluster, terms, s))
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
        dps.append(DataParallel(exposed, t_opt, t_dp, events, ef + eb))
        mems.append(_stage_memory(graph, cfg, terms, s, v, in_flight[s], units, experts))
    return _Prepared(terms, v, tuple(fwd), tuple(bwd), tuple(dps), tuple(mems), tuple(accum),
                     moe.a2a if moe is not None else ())


def _expert(graph: Graph, cluster: Cluster, cfg: ParallelConfig, terms: StageTerms) -> ExpertParallel | None:
    """The expert-parallel terms of ``cfg`` (None without expert parallelism)."""
    if cfg.ep == 1:
        return None
    ccache: dict = PRICES.of(cluster).setdefault("collectives", {})
    return expert_parallel(graph, cluster, cfg, terms, ccache, TRAINING_DTYPE_BYTES[cfg.dtype],
                           per_plan(graph, cfg, op_plans(graph, cfg))[3])


def _units(graph: Graph, cfg: ParallelConfig, terms: StageTerms, moe: ExpertParallel | None,
           s: int) -> tuple[tuple[float, float], ...]:
    """Stage ``s``'s FSDP2 units where ZeRO-1/2/3 are priced by them (no pipeline, no experts)."""
    if cfg.zero_stage >= 1 and cfg.pp == 1 and moe is None and cfg.grad_reduce == "reduce_scatter":
        return fsdp_units(graph, cfg, terms, s)
    return ()


def _stage_memory(graph: Graph, cfg: ParallelConfig, terms: StageTerms, s: int, v: int, in_flight: int,
                  units: tuple[tuple[float, float], ...], experts: float) -> MemoryReport:
    """Stage ``s``'s memory per device: ``experts``, the stage's expert parameters before the ``ep`` split."""
    dt = terms.types[s]
    dgrp_size = len(terms.dp_groups[s][0][0])
    gb = TRAINING_DTYPE_BYTES[cfg.dtype]
    ws = terms.seg_act_max[s] + loss_transient(graph, cfg, v, _eager(cfg, dt)).get(s, 0.0)
    if cfg.zero_stage == 3 and units:
        # FSDP2 keeps the root's weights gathered through each micro-batch, a layer's while it
        # runs and the next one's, prefetched
        ws += (units[0][0] + 2 * max((w for w, _ in units[1:]), default=0.0)) * gb
    elif cfg.zero_stage == 3:
        ws += 2 * max_segment_params(graph) * gb / cfg.tp
    return device_memory(
        label=f"stage {s} (devices {terms.spans[s]})", device=f"{dt.name} {dt.memory / 1e9:.0f} GB",
        capacity=dt.memory, params=terms.params[s] - experts, dp=dgrp_size, zero_stage=cfg.zero_stage,
        param_dtype=cfg.dtype, optimizer=cfg.optimizer, activations=terms.act[s], in_flight=in_flight / v,
        workspace=ws, expert_params=experts / cfg.ep, expert_dp=max(1, dgrp_size // cfg.ep))


def _loss_reduce(cluster: Cluster, ccache: dict, terms: StageTerms) -> float:
    """Seconds of the pipeline's loss all-reduce over every device of the plan: the same for each
    stage and for every plan sharing ``terms`` (kept in its memo: the world is 10^3 devices on a
    big cluster, and its tuple is the collective's key)."""
    hit = terms.memo.get("loss_reduce")
    if hit is None:
        hit = terms.memo["loss_reduce"] = reduce_over(cluster, ccache, tuple(d for ds in terms.devices for d in ds),
                                                      32.0)
    return hit


def _on_first_node(cluster: Cluster, terms: StageTerms, s: int) -> int:
    """Devices of stage ``s`` on its first device's node (the replicas' tied-weight groups sharing
    that node's ports), kept in the memo of ``terms``."""
    key = ("on_first_node", s)
    hit = terms.memo.get(key)
    if hit is None:
        first = terms.devices[s][0]
        hit = terms.memo[key] = sum(cluster.device(d).node == cluster.device(first).node for d in terms.devices[s])
    return hit


def _eager(cfg: ParallelConfig, device: DeviceType) -> bool:
    """Whether ``cfg`` runs as eager PyTorch on ``device`` (``ParallelConfig.fused_elementwise``)."""
    return cfg.fused_elementwise is False or (cfg.fused_elementwise is None and device.kind != "cpu")


def _low_params(cfg: ParallelConfig) -> bool:
    """Whether FSDP2 holds the parameters in the compute dtype (its ``MixedPrecisionPolicy``): ZeRO over
    more than one data/sequence-parallel rank; otherwise a 16-bit step keeps fp32 parameters."""
    return cfg.zero_stage >= 1 and cfg.dp * cfg.sp > 1




def optimizer_element_time(rates: Sequence[tuple[float, float]], elements: float) -> float:
    """Seconds per parameter element of an optimizer step over ``elements`` elements.

    ``rates``: measured ``(elements, seconds per element)`` rows (``polyparallel calibrate``, by
    working-set size: in cache, in memory), interpolated linearly in ``log elements`` and
    clamped at both ends.
    """
    import numpy as np

    pts = sorted((math.log(e), r) for e, r in rates)
    return float(np.interp(math.log(max(elements, 1.0)), [x for x, _ in pts], [r for _, r in pts]))




























def _stage_terms(graph: Graph, cluster: Cluster, cfg: ParallelConfig, v: int) -> StageTerms:
    """Memoised per graph and cluster: the search prices many configurations sharing these.

    Two levels: the per-stage sums that do not depend on recomputation (:func:`_stage_base`,
    shared by the three recomputation choices), then the cheap step that applies one.
    """
    devs = cfg.devices if cfg.devices is not None else tuple(range(cfg.world))
    key = ("stages", id(cluster), devs, cfg.dp, cfg.tp, cfg.pp, cfg.sp, v, cfg.partition, cfg.sequence_parallel,
           cfg.dtype, cfg.fused_attention, cfg.op_plans, cfg.zero_stage >= 1, cfg.pipeline_p2p, cfg.fused_elementwise,
           cfg.fused_dropout, cfg.attention_kernel)
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

    layout: StageLayout
    # (type, forward, backward, attention forward, forward of what the operator policy recomputes,
    # forward of each layer)
    by_type: tuple[tuple[DeviceType, float, float, float, float, tuple[float, ...]], ...]
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


def _apply_recompute(graph: Graph, cfg: ParallelConfig, base: tuple[_StageBase, ...]) -> StageTerms:
    plans = op_plans(graph, cfg)
    # the operator policy checkpoints the same layers as full recomputation, keeping some outputs
    layers = cfg.recompute in ("full", "op")
    out: dict[str, list] = {k: [] for k in StageTerms.__dataclass_fields__ if k != "memo"}
    for st in base:
        # The slowest device type of the stage sets its pace (synchronous collectives).
        best: tuple[DeviceType, float, float, float, tuple[float, ...]] | None = None
        for dt, f, b, att, opf, seg_f in st.by_type:
            rc = {"full": f, "selective": att, "op": opf}.get(cfg.recompute, 0.0)
            if best is None or f + b + rc > best[1] + best[2] + best[3]:
                best = (dt, f, b, rc, seg_f)
        assert best is not None
        dt, f, b, rc, seg_f = best
        seg_act = segment_activations(graph, cfg, plans, dt)
        tf, tb, qf, qb = st.tf, st.tb, st.qf, st.qb
        # recomputing a forward repeats its tensor/sequence-parallel collectives too (the operator
        # policy keeps matrix products' outputs, not what their all-reduces and all-gathers return)
        rc_comm = (tf + qf) if layers else 0.0
        out["devices"].append(st.layout.devices)
        out["spans"].append(st.layout.span)
        out["types"].append(dt)
        out["fwd"].append(f + tf + qf + st.p2p_block)
        out["bwd"].append(b + rc + tb + qb + rc_comm + st.p2p_block)
        out["comp"].append(f + b + rc)
        out["tp_t"].append(tf + tb + (tf if layers else 0.0))
        out["sp_t"].append(qf + qb + (qf if layers else 0.0))
        out["params"].append(st.params)
        out["seg_params"].append(st.seg_params)
        out["seg_fwd"].append(seg_f)
        out["param_tensors"].append(st.param_tensors)
        out["tp_param_tensors"].append(st.tp_param_tensors)
        full_act = seg_max = 0.0
        rec = recomputed_segments(graph) if layers else ()
        for j in st.segs:
            full_act += seg_act[j]
            if layers and rec[j]:
                seg_max = max(seg_max, seg_act[j])
        if layers:
            # keep each layer's input (its first op's activation inputs), recompute the rest; ops
            # outside the numbered layers (embeddings, final norm, head, loss) keep theirs, as
            # Megatron-LM and torch's checkpointing of the blocks do; the operator policy also keeps
            # the outputs it saves. While a layer's backward runs its activations are back (seg_max)
            kept = 0.0
            seg_in = segment_inputs(graph, cfg.dtype)
            saved = op_policy_kept(graph, cfg, plans) if cfg.recompute == "op" else [0.0] * len(seg_in)
            for j in st.segs:
                kept += seg_in[j] / (cfg.tp if cfg.sequence_parallel else 1) / cfg.sp + (
                    saved[j] if rec[j] else seg_act[j])
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
    return StageTerms(**{k: tuple(x) for k, x in out.items()})


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
           cfg.fused_attention, sharded, eager, autocast and low_params, cfg.fused_dropout, cfg.attention_kernel)
    hit = memo.get(key)
    if hit is not None:
        return hit
    # fused_attention None: torch runs SDPA as a fused kernel on accelerators (CPUs: by their
    # measured attention rows, op_cost's own choice)
    fused = True if cfg.fused_attention or (cfg.fused_attention is None and is_sdpa(op) and dt.kind != "cpu") \
        else None
    c = op_cost(graph, op, dt, cfg.dtype, split=split, fused=fused, sharded=sharded, eager=eager,
                own_kernels=frozenset() if cfg.fused_dropout else frozenset({"dropout"}),
                attention_kernel=cfg.attention_kernel)
    out = (c.forward, c.backward)
    if autocast:
        extra = autocast_seconds(graph, op, dt, cfg.dtype, sent_widths(graph, cfg.dtype, low_params), split)
        out = (out[0] + extra[0], out[1] + extra[1])
    memo[key] = out
    return out


def _op_vectors(graph: Graph, dt: DeviceType, cfg: ParallelConfig,
                plans: list[OpPlan]) -> tuple[list[float], list[float], list[float], list[float]]:
    """Forward, backward, attention-forward and operator-policy-recomputed forward
    (:func:`~.activations.op_policy_recomputed`) seconds of every op on one device type."""
    # a profiled device (op_profile.py) prices the model's ops as measured with `world` processes
    world = cfg.world if dt.op_profile is not None else 0
    key = ("opvec", dt.cache_key, cfg.dtype, cfg.tp, cfg.sp, cfg.sequence_parallel, cfg.fused_attention, cfg.op_plans,
           _eager(cfg, dt), world, _low_params(cfg), cfg.fused_dropout, cfg.attention_kernel)
    op_costs = PRICES.of(graph)
    hit = op_costs.get(key)
    if hit is not None:
        return hit
    fw, bw, att = [], [], []
    classes = op_classes(graph)
    recomputed = op_policy_recomputed(graph)
    attention = op_costs.get(("attention_ops",))
    if attention is None:
        attention = op_costs[("attention_ops",)] = [OpKind(op.kind) is OpKind.ATTENTION for op in graph.ops]
    # op_seconds prices an op by its class (the repeated layers' ops share one): each class, split
    # and sharding looked up once here
    priced: dict[tuple[int, float, bool], tuple[float, float]] = {}
    for i, op in enumerate(graph.ops):
        # tensor-parallel parameters are DTensors: their ops pay the host's dispatch (compute.py)
        plan = plans[i]
        sharded = plan.param_split > 1
        measured = profiled_op(graph, op, dt, world, plan.split, sharded, cfg.dtype) if world else None
        if measured is None:
            k = (classes[i], plan.split, sharded)
            measured = priced.get(k)
            if measured is None:
                measured = priced[k] = op_seconds(graph, op, dt, cfg, plan.split, sharded, classes[i])
        fw.append(measured[0])
        bw.append(measured[1])
        att.append(measured[0] if attention[i] else 0.0)
    opr = [f if again else 0.0 for again, f in zip(recomputed, fw)]
    op_costs[key] = (fw, bw, att, opr)
    return fw, bw, att, opr


def _host_vector(graph: Graph, dt: DeviceType, cfg: ParallelConfig) -> list[tuple[float, float]]:
    """Host seconds (forward, backward) of every op on an accelerator with measured dispatch costs."""
    key = ("host", dt.cache_key, cfg.dtype, cfg.fused_elementwise)
    cache = PRICES.of(graph)
    if key not in cache:
        cache[key] = host_seconds(graph, dt, cfg.dtype, eager=_eager(cfg, dt))
    return cache[key]


def per_plan(graph: Graph, cfg: ParallelConfig, plans: list[OpPlan]) -> tuple[list[int], list[tuple], list[int],
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












def _stage_base(graph: Graph, cluster: Cluster, cfg: ParallelConfig, v: int,
                devs: tuple[int, ...]) -> tuple[_StageBase, ...]:
    p = cfg.pp
    segs = segments(graph)
    chunk_of_op = chunks(graph, p * v, cfg.partition)
    plans = op_plans(graph, cfg)
    ev_idx, ev, use_idx, uses = per_plan(graph, cfg, plans)
    gmemo = PRICES.of(graph)
    ccache: dict = PRICES.of(cluster).setdefault("collectives", {})
    n = len(graph.ops)
    ranges = chunk_ranges(graph, p * v, cfg.partition)
    layout = stage_layouts(cluster, cfg, devs)
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
        rec = recomputed_segments(graph)
        cross = crossing(graph, cfg.dtype, low_params)
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
    sync_hop = [(max(p2p_seconds(cluster, ccache, a, b, boundary[g]) for a, b in layout[g % p].p2p_pairs),
                 max(group_seconds(cluster, ccache, [("all_gather", boundary[g] * cfg.tp)], grp, gid)
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
            fw, bw, att, opr = _op_vectors(graph, dt, cfg, plans)
            f = b = a_f = o_f = 0.0
            for a, z in rng:
                f = sum(fw[a:z], f)
                b = sum(bw[a:z], b)
                a_f = sum(att[a:z], a_f)
                o_f = sum(opr[a:z], o_f)
            if dt.host_table(cfg.dtype):
                # an accelerator's host enqueues the micro-batch's kernels; when that takes longer
                # than the kernels run, the device waits: forward + backward last the host's time
                host = _host_vector(graph, dt, cfg)
                h = sum(x + y for a, z in rng for x, y in host[a:z]) + host_step_fixed(dt, cfg.dtype)
                if h > f + b > 0:
                    f, b = f * h / (f + b), b * h / (f + b)
            by_type.append((dt, f, b, a_f, o_f, tuple(sum(fw[i] for i in segs[j]) for j in stage_segs)))
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

        def slowest(which: int, groups: tuple[Group, ...], stage_memo: tuple = stage_memo) -> float:
            # identical (kind, bytes) events repeat in every layer: price each distinct one once
            # per group, and each distinct group (by the nodes its members sit on) once
            agg = stage_memo[0][which]
            if not agg:
                return 0.0
            key = (which, id(cluster), tuple(gid for _, gid in groups))
            hit = stage_memo[1].get(key)
            if hit is not None and hit[0] is cluster:  # the cluster is held, so its id is not reused
                return hit[1]
            t = max(sum(k * group_seconds(cluster, ccache, [x], grp, gid) for x, k in agg.items())
                    for grp, gid in groups)
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
        times = [max(p2p_seconds(cluster, ccache, a, b, boundary[g]) for a, b in lay.p2p_pairs)
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
    return tuple(replace(b, tied=t) for b, t in zip(out, _tied(held_params))) if p > 1 else tuple(out)


def _tied(held: list[dict[str, float]]) -> list[tuple[tuple[tuple[int, ...], float], ...]]:
    """Per stage, the parameters it shares with other stages, as ``(stages holding them, local
    elements)`` per set of holders."""
    holders: dict[str, list[int]] = {}
    for o, h in enumerate(held):
        for t in h:
            holders.setdefault(t, []).append(o)
    out = []
    for h in held:
        by: dict[tuple[int, ...], float] = {}
        for t, numel in h.items():
            hs = holders[t]
            if len(hs) > 1:
                key = tuple(hs)
                by[key] = by.get(key, 0.0) + numel
        out.append(tuple(sorted(by.items())))
    return out


















def _batch(graph: Graph) -> int:
    for name in graph.inputs:
        t = graph.tensors[name]
        if t.shape:
            return t.shape[0]
    return 1

