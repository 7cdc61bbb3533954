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
from polyparallel.ir import Graph, TensorKind

from .compute import batch_statistics_ops
from .layers import LAYER, chunks, segments
from .memo import PRICES
from .op_profile import profile_for
from .parallel_config import ParallelConfig
from .stage_layout import Group, StageTerms, group_seconds

__all__ = ["DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES", "DataParallel", "cross_rank_norms", "data_parallel",
           "ddp_exposed", "fsdp_collectives", "fsdp_units", "max_segment_params", "stage_segments", "unit_tensors"]


# torch DDP's gradient buckets (torch.nn.parallel.DistributedDataParallel: bucket_cap_mb=25, and
# dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB for the first bucket, so that communication starts early)
DDP_BUCKET_BYTES = 25 * 2**20


DDP_FIRST_BUCKET_BYTES = 2**20


@dataclass(frozen=True)
class DataParallel:
    exposed: float  # per step, after the pipeline
    t_opt: float
    t_dp: float  # before overlap, per step
    events: tuple[tuple[str, float], ...]
    per_microbatch: float = 0.0  # exposed inside every micro-batch (ZeRO-3 gathers), forward + backward


def ddp_exposed(cluster: Cluster, ccache: dict, groups: Sequence, grad_bytes: float, window: float) -> float:
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
                price[b] = group_seconds(cluster, ccache, (("all_reduce", b),), grp, gid)
            p_b = price[b]
            for _ in range(count):
                produced += b
                ready = window * produced / grad_bytes
                done = (done if done > ready else ready) + p_b
        worst = max(worst, done - window)
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


def data_parallel(cluster: Cluster, ccache: dict, terms: StageTerms, s: int, cfg: ParallelConfig, gb: int,
                   omega: float, v: int, buckets: bool = False, units: Sequence[tuple[float, float]] = (),
                   per_tensor: tuple[Sequence[int], float] | None = None,
                   ) -> tuple[tuple[tuple[str, float], ...], float, float, float, float]:
    """Stage ``s``'s data-parallel traffic (module docstring): ``(events, seconds before overlap,
    exposed seconds per step, exposed seconds per micro-batch forward, and backward)``.
    ``buckets``: ZeRO-0's all-reduce is exposed as torch DDP's buckets leave it (:func:`ddp_exposed`)
    instead of by ``ω``. ``units``: the FSDP2 units of a stage without pipeline parallelism
    (:func:`fsdp_units`), which ZeRO-1/2/3 are priced by (:func:`_fsdp_exposed`).

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
                    price[x] = (group_seconds(cluster, ccache, (("all_gather", x * gb),), grp, gid),
                                group_seconds(cluster, ccache, (("reduce_scatter", x * rb),), grp, gid))
            ag = [price[x][0] for x in terms.seg_params[s]]
            rs = [price[x][1] for x in terms.seg_params[s]]
            f = (ag[0] if ag else 0.0) + sum(max(0.0, ag[i] - omega * seg_fwd[i - 1]) for i in range(1, len(ag)))
            b = max(0.0, sum(ag) + sum(rs) - omega * terms.bwd[s])
            per_mb = max(per_mb, 2 * sum(ag) + sum(rs))
            ef, eb = max(ef, f), max(eb, b)
        hit = terms.memo[key] = (per_mb, ef, eb)
    per_mb, ef, eb = hit
    return (("all_gather", params * gb), ("reduce_scatter", params * rb)), m * per_mb, 0.0, ef, eb


def _dp_flat(cluster: Cluster, ccache: dict, groups: Sequence[Group], params: float, bwd: float, z: int, m: int,
             gb: int, omega: float, v: int, buckets: bool, grad_reduce: str = "reduce_scatter",
             ) -> tuple[tuple[tuple[str, float], ...], float, float, float, float]:
    """:func:`data_parallel` without FSDP2 units: ZeRO-0 (DDP), or ZeRO-1/2 inside pipeline stages
    (and ZeRO-1 whose gradients are all-reduced, ``grad_reduce="all_reduce"``)."""
    rb = max(gb, 4)
    if z == 0:
        events: tuple[tuple[str, float], ...] = (("all_reduce", params * rb),)
        t_dp = max(group_seconds(cluster, ccache, events, grp, gid) for grp, gid in groups)
        if buckets and params:
            return events, t_dp, ddp_exposed(cluster, ccache, groups, params * rb, bwd / v), 0.0, 0.0
        return events, t_dp, max(0.0, t_dp - omega * bwd / v), 0.0, 0.0
    # ZeRO-2 shards the gradients, so every micro-batch's are reduce-scattered as they come
    n_rs = m if z == 2 else 1
    events = ((grad_reduce, params * rb), ("all_gather", params * gb))
    t_dp = max(n_rs * group_seconds(cluster, ccache, events[:1], grp, gid)
               + group_seconds(cluster, ccache, events[1:], grp, gid) for grp, gid in groups)
    # ZeRO-1 overlaps the last micro-batch's backward (of its last chunk, interleaved); ZeRO-2
    # each micro-batch's reduce-scatter with that micro-batch's whole backward
    hide = omega * (m * bwd if z == 2 else bwd / v)
    return events, t_dp, max(0.0, t_dp - hide), 0.0, 0.0


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
    chunk_of_op = chunks(graph, cfg.pp * (cfg.chunks if cfg.schedule == "interleaved" else 1), cfg.partition)
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
                        bwd: float) -> tuple[tuple[tuple[str, float], ...], float, float, float, float]:
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
        b = sum(ag[1:]) + max(0.0, sum(rs[1:]) - omega * bwd) + rs[0]
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
                  cfg: ParallelConfig, gb: int, rb: int, omega: float, bwd: float,
                  ) -> tuple[tuple[tuple[str, float], ...], float, float, float, float]:
    """FSDP2 with a unit per numbered layer (:func:`fsdp_units`), as :func:`data_parallel` returns it.

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
        ag = [group_seconds(cluster, ccache, (("all_gather", w * gb),), grp, gid) if w else 0.0 for w, _ in units]
        rs = [group_seconds(cluster, ccache, (("reduce_scatter", w * rb),), grp, gid) if w else 0.0 for w, _ in units]
        f = ag[0] + sum(max(0.0, a - omega * c) for a, (_, c) in zip(ag[1:], units[1:]))
        b = max(0.0, sum(rs[1:]) + (sum(ag[1:]) if z == 3 else 0.0) - omega * bwd) + rs[0]
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


def max_segment_params(graph: Graph) -> int:
    """Parameters of the largest layer (ZeRO-3 gathers one layer at a time)."""
    cache = PRICES.of(graph)
    if ("max_seg_params",) not in cache:
        cache[("max_seg_params",)] = max((sum(graph.tensors[t].numel for i in sg for t in graph.ops[i].inputs
                                              if graph.tensors[t].kind is TensorKind.PARAM)
                                          for sg in segments(graph)), default=0)
    return cache[("max_seg_params",)]
