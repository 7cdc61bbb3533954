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
their gradients reduced with ``dp``. Context parallelism ``cp`` (ring attention) splits the work the same way; its
``K, V`` transfers (:mod:`.megatron_rule`) are charged for what the attention's compute does not hide
(:func:`_ring_exposed`).

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
asynchronously: a hop delays the receiver; :mod:`.pipeline_boundary`). Under ``pipeline_p2p="deepspeed"`` (DeepSpeed's
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

**Step**: ``T_s = makespan + T_dp,exposed + T_opt`` per stage (:mod:`.optimizer`; ``T_opt`` streams the
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

from bisect import bisect_left
from dataclasses import dataclass, replace

from polyparallel.cluster import Cluster, DeviceType
from polyparallel.ir import TRAINING_DTYPE_BYTES, Graph, Op, OpKind, TensorKind

from .activations import (
    loss_transient,
    op_policy_kept,
    op_policy_recomputed,
    recomputed_segments,
    segment_activations,
    segment_inputs,
    sent_widths,
)
from .compute import autocast_seconds, host_seconds, host_step_fixed, is_sdpa, op_classes, op_cost
from .data_parallel import DataParallel, fsdp_units, max_segment_params, stage_data_parallel
from .expert_parallel import ExpertParallel, expert_parallel
from .layers import chunk_of_ops, chunk_ranges, chunks, layer_segments, segment_of_op, segments
from .megatron_rule import op_plans
from .memo import PRICES
from .memory import MemoryReport, device_memory
from .op_profile import profile_for, profiled_op
from .optimizer import accumulation_seconds, optimizer_seconds
from .parallel_config import OpPlan, ParallelConfig, StageBreakdown, StepEstimate
from .pipeline import makespan_bound, peak_in_flight, simulate
from .pipeline_boundary import boundary_bytes, flush_reductions, stage_p2p, sync_hops, tied_params
from .stage_layout import Group, StageLayout, StageTerms, group_seconds, stage_layouts

__all__ = ["OpPlan", "ParallelConfig", "StageBreakdown", "StepBound", "StepEstimate", "chunk_of_ops", "estimate_step",
           "layer_segments", "op_seconds", "step_lower_bound", "step_memory"]


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
    v = cfg.virtual
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
    p, v, m = cfg.pp, cfg.virtual, cfg.microbatches
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
        units = _units(graph, cfg, dterms, moe, s)
        # a profiled CPU measured what FSDP2 itself (hooks, copies, the DTensor optimizer) adds to a step
        prof = profile_for(dt, graph, cfg.dtype)
        fsdp = prof.wrapper(cfg.world, f"zero{min(3, max(2, cfg.zero_stage))}/{cfg.optimizer}") if (
            units and dgrp_size > 1 and prof is not None) else None
        events, t_dp, exposed, ef, eb = stage_data_parallel(graph, cluster, ccache, cfg, dterms, s, v, units, moe,
                                                            copies=fsdp is None)
        fwd[s] += ef
        bwd[s] += eb
        if fsdp is not None:
            fwd[s] += fsdp[0]
            bwd[s] += fsdp[1]
        if moe is not None:
            fwd[s] += moe.a2a[s]
            bwd[s] += moe.a2a[s]
        for t in flush_reductions(cluster, ccache, cfg, terms, s, gb):
            exposed += t
        # parameter elements this rank updates: with expert parallelism it holds 1/ep of the
        # experts, whose ZeRO shards span the dp·sp/ep ranks holding the same experts
        shard = dgrp_size if cfg.zero_stage >= 1 else 1
        experts = moe.expert_params[s] if moe is not None else 0.0
        local = (terms.params[s] - experts) / shard + experts / cfg.ep / max(1, shard // cfg.ep)
        t_opt = optimizer_seconds(cfg, terms, s, local, dgrp_size, prof, fsdp)
        acc = accumulation_seconds(cfg, terms, s, local, terms.params[s] - experts * (1 - 1 / cfg.ep))
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


def _eager(cfg: ParallelConfig, device: DeviceType) -> bool:
    """Whether ``cfg`` runs as eager PyTorch on ``device`` (``ParallelConfig.fused_elementwise``; unset,
    eager on accelerators unless the plan compiles its blocks, ``Plan.compile``)."""
    return cfg.fused_elementwise is False or (cfg.fused_elementwise is None and device.kind != "cpu"
                                              and cfg.compile == "none")


def _low_params(cfg: ParallelConfig) -> bool:
    """Whether FSDP2 holds the parameters in the compute dtype (its ``MixedPrecisionPolicy``): ZeRO over
    more than one data/sequence-parallel rank; otherwise a 16-bit step keeps fp32 parameters."""
    return cfg.zero_stage >= 1 and cfg.dp * cfg.seq > 1


def _stage_terms(graph: Graph, cluster: Cluster, cfg: ParallelConfig, v: int) -> StageTerms:
    """Memoised per graph and cluster: the search prices many configurations sharing these.

    Two levels: the per-stage sums that do not depend on recomputation (:func:`_stage_base`,
    shared by the three recomputation choices), then the cheap step that applies one.
    """
    devs = cfg.devices if cfg.devices is not None else tuple(range(cfg.world))
    key = ("stages", id(cluster), devs, cfg.dp, cfg.pp, *cfg.split_key, v, cfg.partition,
           cfg.dtype, cfg.fused_attention, cfg.op_plans, cfg.zero_stage >= 1, cfg.pipeline_p2p, cfg.fused_elementwise,
           cfg.compile,
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


def _ring_exposed(comm: float, attention: float, cp: int, backward: bool = False) -> float:
    """What of ring attention's transfers (``comm`` seconds per micro-batch) the attention's compute
    (``attention`` seconds, forward or backward) does not hide; ``comm`` itself without cp.

    Forward: ``cp - 1`` K/V shifts, each travelling while a block (``attention / cp``) is computed.
    Backward: the same ``cp - 1`` K/V shifts hidden so, and ``cp`` shifts of the dK/dV accumulators,
    each sent after its block is computed and waited for (exposed), as the executor runs them."""
    if cp == 1:
        return comm
    if not backward:
        return max(0.0, comm - attention * (cp - 1) / cp)
    per_shift = comm / (2 * cp - 1)
    return cp * per_shift + max(0.0, (cp - 1) * per_shift - attention * (cp - 1) / cp)


def _apply_recompute(graph: Graph, cfg: ParallelConfig, base: tuple[_StageBase, ...]) -> StageTerms:
    plans = op_plans(graph, cfg)
    # the operator policy checkpoints the same layers as full recomputation, keeping some outputs
    layers = cfg.recompute in ("full", "op")
    out: dict[str, list] = {k: [] for k in StageTerms.__dataclass_fields__ if k != "memo"}
    for st in base:
        # The slowest device type of the stage sets its pace (synchronous collectives).
        best: tuple[DeviceType, float, float, float, tuple[float, ...], float] | None = None
        for dt, f, b, att, opf, seg_f in st.by_type:
            rc = {"full": f, "selective": att, "op": opf}.get(cfg.recompute, 0.0)
            if best is None or f + b + rc > best[1] + best[2] + best[3]:
                best = (dt, f, b, rc, seg_f, att)
        assert best is not None
        dt, f, b, rc, seg_f, att = best
        seg_act = segment_activations(graph, cfg, plans, dt)
        tf, tb, qf, qb = st.tf, st.tb, _ring_exposed(st.qf, att, cfg.cp), \
            _ring_exposed(st.qb, 2 * att, cfg.cp, backward=True)
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
                kept += seg_in[j] / (cfg.tp if cfg.sequence_parallel else 1) / cfg.seq + (
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
    key = ("opvec", dt.cache_key, cfg.dtype, *cfg.split_key, cfg.fused_attention,
           cfg.op_plans, _eager(cfg, dt), world, _low_params(cfg), cfg.fused_dropout, cfg.attention_kernel)
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
        # ring attention (cp) computes a rank's 1/cp of the attention as cp kernels of 1/cp of that,
        # one per K/V block: each priced at its own size (smaller kernels run less efficiently)
        ring = cfg.cp if cfg.cp > 1 and attention[i] else 1
        split = plan.split * ring
        measured = profiled_op(graph, op, dt, world, split, sharded, cfg.dtype) if world else None
        if measured is None:
            k = (classes[i], split, sharded)
            measured = priced.get(k)
            if measured is None:
                measured = priced[k] = op_seconds(graph, op, dt, cfg, split, sharded, classes[i])
        if ring > 1:
            measured = (measured[0] * ring, measured[1] * ring)
        fw.append(measured[0])
        bw.append(measured[1])
        att.append(measured[0] if attention[i] else 0.0)
    opr = [f if again else 0.0 for again, f in zip(recomputed, fw)]
    op_costs[key] = (fw, bw, att, opr)
    return fw, bw, att, opr


def _host_vector(graph: Graph, dt: DeviceType, cfg: ParallelConfig) -> list[tuple[float, float]]:
    """Host seconds (forward, backward) of every op on an accelerator with measured dispatch costs."""
    key = ("host", dt.cache_key, cfg.dtype, _eager(cfg, dt))
    cache = PRICES.of(graph)
    if key not in cache:
        cache[key] = host_seconds(graph, dt, cfg.dtype, eager=_eager(cfg, dt))
    return cache[key]


def per_plan(graph: Graph, cfg: ParallelConfig, plans: list[OpPlan]) -> tuple[list[int], list[tuple], list[int],
                                                                                 list[tuple[int, str, float, int]]]:
    """Ops with tensor/sequence-parallel collectives, and parameter uses ``(op, tensor, local numel,
    numel)``, in op order."""
    key = ("per_plan", *cfg.split_key, cfg.dtype, cfg.op_plans)
    cache = PRICES.of(graph)
    hit = cache.get(key)
    if hit is not None:
        return hit
    ev_idx, ev = [], []
    for i, pl in enumerate(plans):
        if pl.tp_fwd or pl.tp_bwd or pl.sp_fwd or pl.sp_bwd:
            ev_idx.append(i)
            ev.append((pl.tp_fwd, pl.tp_bwd, pl.sp_fwd, pl.sp_bwd))
    # without tensor parallelism the uses are whole whatever the plans: one list for every sp
    ukey = key if cfg.tp > 1 else ("param_uses",)
    if ukey not in cache:
        uses = []
        for i, op in enumerate(graph.ops):
            for t in op.inputs:
                if graph.tensors[t].kind is TensorKind.PARAM:
                    whole = graph.tensors[t].numel
                    uses.append((i, t, whole / (plans[i].param_split if cfg.tp > 1 else 1), whole))
        cache[ukey] = ([u[0] for u in uses], uses)
    out = (ev_idx, ev, *cache[ukey])
    cache[key] = out
    return out


def _stage_base(graph: Graph, cluster: Cluster, cfg: ParallelConfig, v: int,
                devs: tuple[int, ...]) -> tuple[_StageBase, ...]:
    p = cfg.pp
    segs = segments(graph)
    chunk_of_op = chunks(graph, p * v, cfg.partition)
    plans = op_plans(graph, cfg)
    ev_idx, ev, use_idx, uses = per_plan(graph, cfg, plans)
    ccache: dict = PRICES.of(cluster).setdefault("collectives", {})
    ranges = chunk_ranges(graph, p * v, cfg.partition)
    layout = stage_layouts(cluster, cfg, devs)
    stage_of_seg = [chunk_of_op[sg[0]] % p for sg in segs]
    boundaries = boundary_bytes(graph, cfg, v, _low_params(cfg))
    sync_hop = sync_hops(cluster, ccache, cfg, layout, v, boundaries[0])
    out = []
    held_params: list[dict[str, float]] = []
    for s in range(p):
        lay = layout[s]
        rng = [ranges[g] for g in range(s, p * v, p)]
        stage_segs = tuple(j for j in range(len(segs)) if stage_of_seg[j] == s)
        by_type = tuple(_stage_compute(graph, cfg, plans, dt, rng, stage_segs) for dt in lay.types)
        tf, tb, qf, qb = _stage_collectives(graph, cluster, ccache, cfg, lay, rng, ev_idx, ev)
        seen, params, split_tensors, seg_params = _stage_params(graph, rng, stage_segs, use_idx, uses)
        p2p, p2p_sum, block, held = stage_p2p(cluster, ccache, lay, s, p, v, boundaries, sync_hop)
        out.append(_StageBase(
            layout=lay, by_type=by_type, tf=tf, tb=tb, qf=qf, qb=qb, params=params, param_tensors=len(seen),
            tp_param_tensors=split_tensors, segs=stage_segs, seg_params=seg_params,
            p2p=p2p, p2p_sum=p2p_sum, p2p_block=block, held=held))
        held_params.append(seen)
    return tuple(replace(b, tied=t) for b, t in zip(out, tied_params(held_params))) if p > 1 else tuple(out)


def _stage_compute(graph: Graph, cfg: ParallelConfig, plans: list[OpPlan], dt: DeviceType,
                   rng: list[tuple[int, int]], stage_segs: tuple[int, ...]
                   ) -> tuple[DeviceType, float, float, float, float, tuple[float, ...]]:
    """One stage's ops on device type ``dt`` per micro-batch (``rng``: its chunks' op ranges): one
    row of :attr:`_StageBase.by_type`."""
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
    segs = segments(graph)
    return dt, f, b, a_f, o_f, tuple(sum(fw[i] for i in segs[j]) for j in stage_segs)


def _stage_collectives(graph: Graph, cluster: Cluster, ccache: dict, cfg: ParallelConfig, lay: StageLayout,
                       rng: list[tuple[int, int]], ev_idx: list[int], ev: list[tuple]
                       ) -> tuple[float, float, float, float]:
    """One stage's tensor-parallel (forward, backward) and sequence-parallel (forward, backward)
    collective seconds per micro-batch: ``ev`` the plans' events at ops ``ev_idx`` (:func:`per_plan`).

    Every group of the stage runs the same collectives; the slowest one sets the pace. The events
    and their prices depend on the plans and the stage's op ranges, not on dp, m or the memory
    knobs: memoised per graph for the plans sharing them."""
    gmemo = PRICES.of(graph)
    stage_key = ("stage_ev", *cfg.split_key, cfg.dtype, cfg.op_plans, tuple(rng))
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

    def slowest(which: int, groups: tuple[Group, ...]) -> float:
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

    return (slowest(0, lay.tp_groups), slowest(1, lay.tp_groups), slowest(2, lay.sp_groups),
            slowest(3, lay.sp_groups))


def _stage_params(graph: Graph, rng: list[tuple[int, int]], stage_segs: tuple[int, ...], use_idx: list[int],
                  uses: list[tuple[int, str, float, int]]
                  ) -> tuple[dict[str, float], float, int, tuple[float, ...]]:
    """One stage's parameters (``uses``: the plans' parameter uses at ops ``use_idx``,
    :func:`per_plan`): their local elements by name, the total, how many are split over ``tp``, and
    the elements first used in each of the stage's layer segments."""
    seg_of_op = segment_of_op(graph)
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
    return seen, params, split_tensors, tuple(seg_params.values())


def _batch(graph: Graph) -> int:
    for name in graph.inputs:
        t = graph.tensors[name]
        if t.shape:
            return t.shape[0]
    return 1

