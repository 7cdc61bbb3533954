"""Data-parallel gradient reduction and sharded weights: DDP's buckets, FSDP2's units, ZeRO 1-3.

What each ZeRO stage moves per step and how much of it the backward (or the previous layer's
compute) hides is written out in :mod:`.step`'s docstring ("Data-parallel gradients");
:func:`data_parallel` returns it per stage: the collectives, their seconds before overlap, and
what stays exposed per step and per micro-batch. :func:`fsdp_units` and :func:`fsdp_collectives`
list the units and collectives as the torch backend's FSDP2 issues them (``tests/test_fsdp_as_priced.py``
checks them against a traced run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from polyparallel.cluster import Cluster, DeviceType
from polyparallel.ir import TRAINING_DTYPE_BYTES, Graph, TensorKind

from .compute import batch_statistics_ops, streaming_bandwidth
from .expert_parallel import ExpertParallel
from .layers import LAYER, chunks, segments
from .memo import PRICES
from .op_profile import profile_for
from .parallel_config import ParallelConfig
from .stage_layout import Group, StageTerms, group_seconds

__all__ = ["DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES", "NCCL_CHANNELS", "DataParallel", "cross_rank_norms",
           "data_parallel", "ddp_exposed", "fsdp_collectives", "fsdp_copy_seconds", "fsdp_units", "max_segment_params",
           "overlap_slowdown", "overlapped", "stage_data_parallel", "stage_segments", "unit_tensors"]


# torch DDP's gradient buckets (torch.nn.parallel.DistributedDataParallel: bucket_cap_mb=25, and
# dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB for the first bucket, so that communication starts early)
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20

# NCCL runs every channel of a collective as one thread block that holds an SM for the collective's
# whole duration; on NVSwitch nodes it opens 24 channels for all-reduce, all-gather and
# reduce-scatter (HGX A100: "Channel 23/24" in NCCL's log, NVIDIA/nccl-tests#100; H100: the
# all-gather kernel of an FSDP-style prefetch launches 24 blocks, NVIDIA developer forum thread
# 337991, "Compute-Communication Overlap Causes Severe GEMM Performance Degradation").
NCCL_CHANNELS = 24


def overlap_slowdown(device: DeviceType) -> float:
    """σ: how much longer compute takes while a collective runs beside it on the same GPU.

    The collective's ``c`` channels (:data:`NCCL_CHANNELS`) hold ``c`` of the device's ``S`` SMs,
    so a kernel that fills the GPU runs on ``S − c`` of them: ``σ = c / (S − c)`` (A100: 0.29;
    H100/H200: 0.22). Lee et al., "Characterizing Compute-Communication Overlap in GPU-Accelerated
    Distributed Deep Learning" (arXiv:2507.03114, A100 and H100, GPT and Llama under FSDP-style
    overlap) measured the overlapped compute 18.9% slower on average, up to 40%. 0 for a device
    without an SM count (CPUs: gloo's overlap is priced by ``grad_overlap`` there).
    """
    if device.kind == "cpu" or device.sms <= NCCL_CHANNELS:
        return 0.0
    return NCCL_CHANNELS / (device.sms - NCCL_CHANNELS)


def overlapped(comm: float, window: float, sigma: float) -> float:
    """Exposed seconds of ``comm`` seconds of collectives run beside ``window`` seconds of compute:
    what does not fit in the window, plus the compute's slowdown ``σ`` over the time both run
    (:func:`overlap_slowdown`): ``max(0, comm − window) + σ·min(comm, window)``."""
    return max(0.0, comm - window) + sigma * min(comm, window)


@dataclass(frozen=True)
class DataParallel:
    exposed: float  # per step, after the pipeline
    t_opt: float
    t_dp: float  # before overlap, per step
    events: tuple[tuple[str, float], ...]
    per_microbatch: float = 0.0  # exposed inside every micro-batch (ZeRO-3 gathers), forward + backward


def ddp_exposed(cluster: Cluster, ccache: dict, groups: Sequence, grad_bytes: float, window: float,
                sigma: float = 0.0) -> float:
    """Seconds torch DDP's bucketed all-reduce runs past the backward ``window`` that produces the gradients.

    DDP reduces ``grad_bytes`` in buckets, in the order the backward produces them: a first bucket of
    ``DDP_FIRST_BUCKET_BYTES``, then ``DDP_BUCKET_BYTES`` each (torch's defaults). A bucket is ready once
    the backward has produced its last gradient (gradients come out at an even rate over ``window``) and
    its all-reduce starts when it is ready and the previous one has finished (one communication
    stream): ``f_i = max(r_i, f_{i-1}) + AR(b_i)``. Exposed: ``max(0, f_last − window)`` — the last
    bucket never overlaps, and nothing is reduced before the first bucket fills — plus ``σ`` times
    the seconds the all-reduces run inside the window (:func:`overlap_slowdown`).
    """
    key = ("ddp_exposed", tuple(gid for _, gid in groups), grad_bytes, window, sigma)
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
        done = produced = inside = 0.0
        for b, count in runs:
            if not count:
                continue
            if b not in price:
                price[b] = group_seconds(cluster, ccache, (("all_reduce", b),), grp, gid)
            p_b = price[b]
            for _ in range(count):
                produced += b
                ready = window * produced / grad_bytes
                start = done if done > ready else ready
                done = start + p_b
                if start < window:
                    inside += (done if done < window else window) - start
        worst = max(worst, done - window + sigma * inside)
    ccache[key] = out = max(0.0, worst)
    return out


def cross_rank_norms(graph: Graph, cluster: Cluster, ccache: dict, group: tuple[Sequence[int], int],
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
        t += group_seconds(cluster, ccache, (("all_reduce", 8.0 * (c + 1)), ("all_reduce", 8.0 * c)), grp, gid)
    f, b = t, t
    prof = profile_for(dt, graph, cfg.dtype)
    extra = prof.wrapper(cfg.world, "cross_rank_norm/op") if prof is not None else None
    if extra is not None:
        f, b = f + len(ops) * extra[0], b + len(ops) * extra[1]
    return f, b


def stage_data_parallel(graph: Graph, cluster: Cluster, ccache: dict, cfg: ParallelConfig, terms: StageTerms, s: int,
                        v: int, units: Sequence[tuple[float, float]], moe: ExpertParallel | None, copies: bool = True,
                        ) -> tuple[tuple[tuple[str, float], ...], float, float, float, float]:
    """Stage ``s``'s gradient reduction and sharded weights as a step pays them, in
    :func:`data_parallel`'s form: its traffic (``terms``: the stage's weights less the experts'),
    with ``ω`` = ``grad_overlap`` (1 on accelerators, whose collectives run on their own
    engines/streams; 0 on CPU processes, where gloo's threads compete with the compute for the same
    cores), plus BatchNorm's statistics over the replicas (:func:`cross_rank_norms`) and the experts'
    own gradient reduction (``moe``), which joins the reduction and its overlap."""
    dt = terms.types[s]
    omega = cfg.grad_overlap if cfg.grad_overlap is not None else (0.0 if dt.kind == "cpu" else 1.0)
    # an accelerator's DDP all-reduce is priced by its buckets unless an overlap is given
    buckets = cfg.grad_overlap is None and dt.kind != "cpu"
    # DeepSpeed's ZeRO-3 of 2021 gathers parameter tensor by parameter tensor (ParallelConfig.zero3_gather)
    per_tensor = (unit_tensors(graph, cfg, s), dt.launch_overhead) if (
        units and cfg.zero_stage == 3 and cfg.zero3_gather == "parameter") else None
    events, t_dp, exposed, ef, eb = data_parallel(cluster, ccache, terms, s, cfg, TRAINING_DTYPE_BYTES[cfg.dtype],
                                                  omega, v, buckets, units, per_tensor, copies=copies)
    if len(terms.dp_groups[s][0][0]) > 1 and cfg.pp == 1:
        nf, nb = cross_rank_norms(graph, cluster, ccache, terms.dp_groups[s][0], dt, cfg)
        ef, eb = ef + nf, eb + nb
    if moe is not None and moe.grad_t[s]:
        hide = omega * (cfg.microbatches * terms.bwd[s] if cfg.zero_stage == 2 else terms.bwd[s] / v)
        events, t_dp = events + moe.grad_events[s], t_dp + moe.grad_t[s]
        exposed = overlapped(t_dp, hide, overlap_slowdown(dt))
    return events, t_dp, exposed, ef, eb


def data_parallel(cluster: Cluster, ccache: dict, terms: StageTerms, s: int, cfg: ParallelConfig, gb: int,
                  omega: float, v: int, buckets: bool = False, units: Sequence[tuple[float, float]] = (),
                  per_tensor: tuple[Sequence[int], float] | None = None, copies: bool = True,
                  ) -> tuple[tuple[tuple[str, float], ...], float, float, float, float]:
    """Stage ``s``'s data-parallel traffic (module docstring): ``(events, seconds before overlap,
    exposed seconds per step, exposed seconds per micro-batch forward, and backward)``.
    ``buckets``: ZeRO-0's all-reduce is exposed as torch DDP's buckets leave it (:func:`ddp_exposed`)
    instead of by ``ω``. ``units``: the FSDP2 units of a stage without pipeline parallelism
    (:func:`fsdp_units`), which ZeRO-1/2/3 are priced by (:func:`_fsdp_exposed`), with the copies
    into and out of the collectives' buffers unless ``copies`` is False (a profiled device measured
    them). Every collective that runs beside compute slows it by ``σ`` (:func:`overlapped`).

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
    sigma = overlap_slowdown(terms.types[s])
    if z == 0 or (z in (1, 2) and not (cfg.pp == 1 and units)):
        # a function of the group's price classes and a few numbers: the stages and plans sharing them
        # (the repeated layers' stages, plans differing in the schedule or, below ZeRO-2, in m) share it
        key = ("data_parallel", z, m if z == 2 else 0, tuple(gid for _, gid in groups), params, terms.bwd[s], gb,
               omega, v, buckets, cfg.grad_reduce, sigma)
        hit = ccache.get(key)
        if hit is None:
            hit = ccache[key] = _dp_flat(cluster, ccache, groups, params, terms.bwd[s], z, m, gb, omega, v, buckets,
                                         cfg.grad_reduce, sigma)
        return hit
    if cfg.pp == 1 and units:
        if per_tensor is not None:
            return _per_tensor_exposed(cluster, ccache, groups, units, per_tensor, cfg, gb, rb, omega, terms.bwd[s],
                                       sigma)
        out = _fsdp_exposed(cluster, ccache, groups, units, cfg, gb, rb, omega, terms.bwd[s], sigma)
        if not copies:
            return out
        events, t_dp, exposed, ef, eb = out
        cf, cb, cstep = fsdp_copy_seconds(units, cfg, gb, rb, terms.types[s])
        return events, t_dp, exposed + cstep, ef + cf, eb + cb
    # ZeRO-3: per micro-batch, each layer's weights are gathered before its forward (the next
    # layer's gather runs during this layer's compute), gathered again for its backward, and its
    # gradients reduce-scattered; the backward's two share the link against the backward compute
    key = ("zero3", s, gb, omega, sigma)
    hit = terms.memo.get(key)  # independent of m: the plans of one stage layout share it
    if hit is None:
        seg_fwd = terms.seg_fwd[s]
        per_mb = ef = eb = 0.0
        for grp, gid in groups:
            price: dict[float, tuple[float, float]] = {}  # the repeated layers gather the same bytes
            for x in terms.seg_params[s]:
                if x not in price:
                    price[x] = (group_seconds(cluster, ccache, (("all_gather", x * gb),), grp, gid),
                                group_seconds(cluster, ccache, (("reduce_scatter", x * rb),), grp, gid))
            ag = [price[x][0] for x in terms.seg_params[s]]
            rs = [price[x][1] for x in terms.seg_params[s]]
            f = (ag[0] if ag else 0.0) + sum(overlapped(ag[i], omega * seg_fwd[i - 1], sigma)
                                             for i in range(1, len(ag)))
            b = overlapped(sum(ag) + sum(rs), omega * terms.bwd[s], sigma)
            per_mb = max(per_mb, 2 * sum(ag) + sum(rs))
            ef, eb = max(ef, f), max(eb, b)
        hit = terms.memo[key] = (per_mb, ef, eb)
    per_mb, ef, eb = hit
    return (("all_gather", params * gb), ("reduce_scatter", params * rb)), m * per_mb, 0.0, ef, eb


def _dp_flat(cluster: Cluster, ccache: dict, groups: Sequence[Group], params: float, bwd: float, z: int, m: int,
             gb: int, omega: float, v: int, buckets: bool, grad_reduce: str = "reduce_scatter", sigma: float = 0.0,
             ) -> tuple[tuple[tuple[str, float], ...], float, float, float, float]:
    """:func:`data_parallel` without FSDP2 units: ZeRO-0 (DDP), or ZeRO-1/2 inside pipeline stages
    (and ZeRO-1 whose gradients are all-reduced, ``grad_reduce="all_reduce"``)."""
    rb = max(gb, 4)
    if z == 0:
        events: tuple[tuple[str, float], ...] = (("all_reduce", params * rb),)
        t_dp = max(group_seconds(cluster, ccache, events, grp, gid) for grp, gid in groups)
        if buckets and params:
            return events, t_dp, ddp_exposed(cluster, ccache, groups, params * rb, bwd / v, sigma), 0.0, 0.0
        return events, t_dp, overlapped(t_dp, omega * bwd / v, sigma), 0.0, 0.0
    # ZeRO-2 shards the gradients, so every micro-batch's are reduce-scattered as they come
    n_rs = m if z == 2 else 1
    events = ((grad_reduce, params * rb), ("all_gather", params * gb))
    t_dp = max(n_rs * group_seconds(cluster, ccache, events[:1], grp, gid)
               + group_seconds(cluster, ccache, events[1:], grp, gid) for grp, gid in groups)
    # ZeRO-1 overlaps the last micro-batch's backward (of its last chunk, interleaved); ZeRO-2
    # each micro-batch's reduce-scatter with that micro-batch's whole backward
    hide = omega * (m * bwd if z == 2 else bwd / v)
    return events, t_dp, overlapped(t_dp, hide, sigma), 0.0, 0.0


def fsdp_units(graph: Graph, cfg: ParallelConfig, terms: StageTerms, s: int) -> tuple[tuple[float, float], ...]:
    """Stage ``s``'s FSDP2 units as the torch backend wraps them (``_worker._fully_shard``): the root,
    holding every parameter outside the numbered layers, then one unit per numbered layer, in
    execution order; each as ``(parameter elements, forward seconds from the previous unit's start
    to its own)``, the compute its gather can hide behind (none for the root, gathered first)."""
    layer = [is_layer for _, is_layer in stage_segments(graph, cfg, s)]
    units = [(sum(w for w, is_layer in zip(terms.seg_params[s], layer) if not is_layer), 0.0)]
    since = 0.0
    for w, f, is_layer in zip(terms.seg_params[s], terms.seg_fwd[s], layer):
        if is_layer:
            units.append((w, since))
            since = 0.0
        since += f
    return tuple(units)


def stage_segments(graph: Graph, cfg: ParallelConfig, s: int) -> list[tuple[list[int], bool]]:
    """Stage ``s``'s segments in execution order (the order of ``StageTerms.seg_params[s]``), each
    with whether it is a numbered layer (an FSDP2 unit of its own) or part of the root."""
    chunk_of_op = chunks(graph, cfg.pp * cfg.virtual, cfg.partition)
    return [(sg, bool(LAYER.match(graph.ops[sg[0]].module or ""))) for sg in segments(graph)
            if chunk_of_op[sg[0]] % cfg.pp == s]


def unit_tensors(graph: Graph, cfg: ParallelConfig, s: int) -> tuple[int, ...]:
    """The distinct parameter tensors of each of stage ``s``'s FSDP2 units (:func:`fsdp_units`'
    order: the root's, then one count per numbered layer)."""
    root: set[str] = set()
    layers: list[int] = []
    for sg, is_layer in stage_segments(graph, cfg, s):
        names = {t for i in sg for t in graph.ops[i].inputs if graph.tensors[t].kind is TensorKind.PARAM}
        if is_layer:
            layers.append(len(names))
        else:
            root |= names
    return (len(root), *layers)


def _per_tensor_exposed(cluster: Cluster, ccache: dict, groups: Sequence[Group], units: Sequence[tuple[float, float]],
                        per_tensor: tuple[Sequence[int], float], cfg: ParallelConfig, gb: int, rb: int, omega: float,
                        bwd: float, sigma: float = 0.0,
                        ) -> tuple[tuple[tuple[str, float], ...], float, float, float, float]:
    """ZeRO-3 gathering tensor by tensor (``zero3_gather="parameter"``), as :func:`data_parallel`
    returns it: a unit of ``w`` elements in ``n`` tensors costs ``n`` all-gathers of ``w/n`` elements
    and ``n·p`` copy kernels (one per rank's view) at ``launch`` seconds each, exposed in full in the
    forward and again before the backward (the host waits for the device before each); the
    reduce-scatters are FSDP2's (:func:`_fsdp_exposed`)."""
    tensors, launch = per_tensor
    m = cfg.microbatches
    ef = eb = t_dp = 0.0
    for grp, gid in groups:
        p = len(grp)
        ag = [n * (group_seconds(cluster, ccache, (("all_gather", w / n * gb),), grp, gid) + p * launch)
              if w and n else 0.0 for (w, _), n in zip(units, tensors)]
        rs = [group_seconds(cluster, ccache, (("reduce_scatter", w * rb),), grp, gid) if w else 0.0 for w, _ in units]
        f = sum(ag)
        b = sum(ag[1:]) + overlapped(sum(rs[1:]), omega * bwd, sigma) + rs[0]
        ef, eb = max(ef, f), max(eb, b)
        t_dp = max(t_dp, m * (sum(ag) + sum(ag[1:]) + sum(rs)))
    params = sum(w for w, _ in units)
    return (("all_gather", params * gb), ("reduce_scatter", params * rb)), t_dp, 0.0, ef, eb


def fsdp_collectives(units: Sequence[tuple[float, float]], zero_stage: int, microbatches: int, gb: int
                     ) -> list[tuple[str, float]]:
    """The collectives one optimizer step of FSDP2 issues per rank, as :func:`_fsdp_exposed` prices
    them: ``(kind, bytes)`` over the units (:func:`fsdp_units`), root first. ZeRO-1/2 gather every
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


def _fsdp_exposed(cluster: Cluster, ccache: dict, groups: Sequence[Group], units: Sequence[tuple[float, float]],
                  cfg: ParallelConfig, gb: int, rb: int, omega: float, bwd: float, sigma: float = 0.0,
                  ) -> tuple[tuple[tuple[str, float], ...], float, float, float, float]:
    """FSDP2 with a unit per numbered layer (:func:`fsdp_units`), as :func:`data_parallel` returns it.

    Forward: the root's gather has nothing to hide behind; layer ``k``'s is prefetched during the
    compute since the previous unit started (``c_k``): ``E_fwd = AG(W_root) + Σ_k max(0, AG(W_k) −
    ω·c_k)``. Backward: the layers' reduce-scatters (and, under ZeRO-3, their second gathers) share
    the link against the backward; the root's reduce-scatter runs after it, exposed: ``E_bwd =
    max(0, Σ_k [RS(W_k) (+ AG(W_k))] − ω·B) + RS(W_root)``. Each overlap also slows the compute it
    runs beside (each ``max(0, x − w)`` is :func:`overlapped`: ``σ·min(x, w)`` is added). ZeRO-3 pays
    both in every micro-batch; ZeRO-1/2 gather once per step (``E_fwd`` after the pipeline, with the
    step), ZeRO-2 reduces in every micro-batch's backward, ZeRO-1 in the last one's only."""
    z, m = cfg.zero_stage, cfg.microbatches
    ef = eb = t_dp = 0.0
    for grp, gid in groups:
        ag = [group_seconds(cluster, ccache, (("all_gather", w * gb),), grp, gid) if w else 0.0 for w, _ in units]
        rs = [group_seconds(cluster, ccache, (("reduce_scatter", w * rb),), grp, gid) if w else 0.0 for w, _ in units]
        f = ag[0] + sum(overlapped(a, omega * c, sigma) for a, (_, c) in zip(ag[1:], units[1:]))
        b = overlapped(sum(rs[1:]) + (sum(ag[1:]) if z == 3 else 0.0), omega * bwd, sigma) + rs[0]
        ef, eb = max(ef, f), max(eb, b)
        t_dp = max(t_dp, sum(group_seconds(cluster, ccache, (e,), grp, gid)
                             for e in fsdp_collectives(units, z, m, gb)))
    params = sum(w for w, _ in units)
    events = (("all_gather", params * gb), ("reduce_scatter", params * rb))
    if z == 3:
        return events, t_dp, 0.0, ef, eb
    if z == 2:
        return events, t_dp, ef, 0.0, eb
    return events, t_dp, ef + eb, 0.0, 0.0


def fsdp_copy_seconds(units: Sequence[tuple[float, float]], cfg: ParallelConfig, gb: int, rb: int,
                      device: DeviceType) -> tuple[float, float, float]:
    """Seconds of the copies into and out of the collectives' buffers that run on the compute stream:
    per micro-batch in the forward and in the backward, and once per step (ZeRO-1/2's gather).

    ``zero3_gather="unit"`` (FSDP2, ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``): a
    unit's gather lands in one flat buffer that ``foreach_all_gather_copy_out`` copies into the
    parameters (``split_with_sizes_copy``: ``2·W·gb`` bytes read and written), and its gradients are
    copied into the reduce-scatter's input at the reduction precision before it starts
    (``foreach_reduce_scatter_copy_in``, ``chunk_cat``: ``W·(gb + rb)``). ``"flat"`` (FSDP1's
    ``FlatParameter``: the gathered buffer is the parameters' storage and the gradient one flat
    tensor) copies only to cast the gradient to the reduction precision (``W·(gb + rb)`` when they
    differ). ``"parameter"`` prices its own copies (:func:`_per_tensor_exposed`). ZeRO-3 gathers
    every layer again for its backward; ZeRO-1/2 gather once per step; ZeRO-2/3 reduce every
    micro-batch, ZeRO-1 once per step. Streamed at the device's bandwidth."""
    if cfg.zero3_gather == "parameter":
        return 0.0, 0.0, 0.0
    bw = streaming_bandwidth(device)
    total = sum(w for w, _ in units)
    layers = sum(w for w, _ in units[1:])
    gather = 2 * gb / bw if cfg.zero3_gather == "unit" else 0.0
    reduce = (gb + rb) / bw if cfg.zero3_gather == "unit" or gb != rb else 0.0
    z = cfg.zero_stage
    if z == 3:
        return total * gather, layers * gather + total * reduce, 0.0
    if z == 2:
        return 0.0, total * reduce, total * gather
    return 0.0, 0.0, total * (gather + reduce)


def max_segment_params(graph: Graph) -> int:
    """Parameters of the largest layer (ZeRO-3 gathers one layer at a time)."""
    cache = PRICES.of(graph)
    if ("max_seg_params",) not in cache:
        cache[("max_seg_params",)] = max((sum(graph.tensors[t].numel for i in sg for t in graph.ops[i].inputs
                                              if graph.tensors[t].kind is TensorKind.PARAM)
                                          for sg in segments(graph)), default=0)
    return cache[("max_seg_params",)]
