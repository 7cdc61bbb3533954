"""Step time of a whole parallel configuration: compute + exposed communication + bubbles.

Input: a :class:`~polyparallel.ir.Graph` holding the forward pass of **one micro-batch of one
data-parallel replica**, a :class:`~polyparallel.cluster.Cluster`, and a
:class:`ParallelConfig` (degrees ``dp·tp·pp·sp`` = world size, ``m`` micro-batches, schedule,
ZeRO stage, recomputation). One optimizer step processes ``dp · m`` micro-batches.

**Placement.** Ranks are laid out tensor-parallel fastest, then sequence, data, pipeline
(Megatron's order): rank ``((s_pp·dp + i_dp)·sp + i_sp)·tp + i_tp`` runs on device
``devices[rank]`` (the first ``world`` devices of the cluster unless given). The op list is
cut into ``pp·v`` contiguous chunks at layer boundaries (ops grouped by their module
``layers.<i>``), balancing forward FLOPs (bisection on the bottleneck), or with equal layer
counts (``partition="layers"``, what Megatron-LM and DeepSpeed do); chunk ``g`` runs on
stage ``g mod pp``.

**Tensor parallelism** (Megatron-LM, Shoeybi et al. 2019), propagated over the IR without a
per-op placement model: each tensor is *full* or *split* over the ``tp`` group. A
contraction/conv with a parameter reading a full input is column-parallel (output split,
backward all-reduce of its input gradient, once per input tensor); reading a split input it
is row-parallel (output full, forward all-reduce of the output). A parameterised embedding is
vocabulary-parallel (forward all-reduce). Any other op on a split input stays split (heads,
activation functions); a loss on split logits needs three per-row scalars all-reduced. Split
ops do ``1/tp`` of the work. With Megatron sequence parallelism (``sequence_parallel``),
each all-reduce becomes reduce-scatter + all-gather (same volume) and the remaining ops run
on ``1/tp`` of the sequence. (The polyhedral placements of ``polyparallel.poly`` will
replace this propagation with exact per-op communication.)

**Sequence parallelism** ``sp`` (DeepSpeed-Ulysses): every op does ``1/sp`` of the work;
each attention op all-to-alls its three inputs and its output, forward and backward, over the
``sp`` group; parameters are replicated over ``sp`` and their gradients reduced with ``dp``.

**Per micro-batch and stage**: ``F_s = Σ_{ops} t_fwd + Σ t_tp,fwd + Σ t_sp,fwd`` and
``B_s = Σ t_bwd + Σ t_tp,bwd + Σ t_sp,bwd + R_s`` where ``R_s`` is the recomputed forward
(all of ``F_s``'s compute for full recomputation, the attention ops for selective), each on
the slowest device type of the stage. The pipeline schedule is simulated
(:mod:`.pipeline`) with the boundary p2p times (activations scattered over ``tp``).

**Data-parallel gradients**: an all-reduce of the stage's gradient bytes over the ``dp·sp``
group (ZeRO-1/2: reduce-scatter + all-gather, same volume; ZeRO-3 adds two parameter
all-gathers per micro-batch). Gradient buckets are reduced while the backward pass of the
last micro-batch runs, so the exposed part is

    T_dp,exposed = max(0, T_dp − ω · B_s),    ω ∈ [0, 1] = ``grad_overlap``,

with ``ω = 1`` on accelerators (communication runs on its own engines/streams) and ``ω = 0``
on CPU processes, where gloo's threads compete with the compute for the same cores.

**Step**: ``T_s = makespan + T_dp,exposed + T_opt`` per stage (``T_opt`` streams the
optimizer state once); ``T = max_s T_s``; every stage's breakdown (compute, tensor-parallel,
sequence-parallel, p2p, bubble, data-parallel, optimizer, idle) sums to ``T``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from polyparallel.cluster import Cluster, DeviceType
from polyparallel.ir import DTYPE_BYTES, Graph, Op, OpKind, TensorKind

from .comm import collective_time, p2p_time
from .compute import op_cost
from .memory import MemoryReport, device_memory
from .pipeline import SCHEDULES, PipelineResult, simulate

__all__ = ["ParallelConfig", "StageBreakdown", "StepEstimate", "chunk_of_ops", "estimate_step", "layer_segments"]

RECOMPUTE = ("none", "selective", "full")
_SHORT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel degrees and training options priced by :func:`estimate_step`.

    Args:
        dp / tp / pp / sp: data, tensor, pipeline and sequence (Ulysses) parallel degrees.
        microbatches: micro-batches per step per pipeline (gradient accumulation without pp).
        schedule: ``gpipe``, ``1f1b`` or ``interleaved``; ``chunks``: model chunks per stage
            (interleaved only).
        zero_stage: 0 (plain DP), 1 (optimizer), 2 (+gradients), 3 (+weights, FSDP).
        recompute: ``none``, ``selective`` (attention scores) or ``full`` (per layer).
        sequence_parallel: Megatron sequence parallelism alongside ``tp``.
        dtype: compute precision (``fp32``, ``bf16``, ``fp16``); weights and gradients use it.
        optimizer: ``adam``, ``adamw``, ``sgd``, ``sgd_momentum``, ``lion``, ``lamb``.
        grad_overlap: ω of the module docstring; ``None`` picks 1 on accelerators, 0 on CPUs.
        fused_attention: attention keeps only softmax statistics (flash attention).
        devices: device ids in rank order (default: the cluster's first ``world`` devices).
        partition: how layers are cut into pipeline chunks: ``flops`` (balance forward FLOPs) or
            ``layers`` (equal layer counts, embedding/head on the end stages: Megatron/DeepSpeed).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    zero_stage: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    dtype: str = "fp32"
    optimizer: str = "adam"
    grad_overlap: float | None = None
    fused_attention: bool = False
    devices: tuple[int, ...] | None = None
    partition: str = "flops"

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.sp

    def validate(self, cluster: Cluster | None = None) -> None:
        """Raise ``ValueError`` naming the bad field and the fix."""
        for name in ("dp", "tp", "pp", "sp", "microbatches", "chunks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ParallelConfig.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"ParallelConfig.schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        if self.chunks > 1 and self.schedule != "interleaved":
            raise ValueError("ParallelConfig.chunks > 1 needs schedule='interleaved'")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ParallelConfig.zero_stage must be 0..3, got {self.zero_stage}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"ParallelConfig.recompute {self.recompute!r}: use one of {', '.join(RECOMPUTE)}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("ParallelConfig.sequence_parallel needs tp > 1")
        if self.dtype not in _SHORT_BYTES:
            raise ValueError(f"ParallelConfig.dtype {self.dtype!r}: use one of {', '.join(_SHORT_BYTES)}")
        if self.partition not in ("flops", "layers"):
            raise ValueError(f"ParallelConfig.partition {self.partition!r}: use 'flops' or 'layers'")
        if self.grad_overlap is not None and not 0 <= self.grad_overlap <= 1:
            raise ValueError(f"ParallelConfig.grad_overlap must be in [0, 1], got {self.grad_overlap}")
        if cluster is not None:
            devs = self.devices if self.devices is not None else tuple(range(self.world))
            if len(devs) != self.world:
                raise ValueError(f"ParallelConfig.devices lists {len(devs)} devices for a world of {self.world}")
            if self.world > cluster.num_devices or any(not 0 <= d < cluster.num_devices for d in devs):
                raise ValueError(f"the configuration needs {self.world} devices (dp {self.dp} x tp {self.tp} x pp "
                                 f"{self.pp} x sp {self.sp}); cluster {cluster.name!r} has {cluster.num_devices}")

    def rank(self, pp: int, dp: int, sp: int, tp: int) -> int:
        return ((pp * self.dp + dp) * self.sp + sp) * self.tp + tp

    def __str__(self) -> str:
        extra = [f"m={self.microbatches}", self.schedule + (f"x{self.chunks}" if self.chunks > 1 else "")]
        if self.zero_stage:
            extra.append(f"zero{self.zero_stage}")
        if self.recompute != "none":
            extra.append(f"rc={self.recompute}")
        if self.sequence_parallel:
            extra.append("seqpar")
        return f"dp{self.dp} tp{self.tp} pp{self.pp} sp{self.sp} " + " ".join(extra)


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


# --------------------------------------------------------------------------------------------
# layers and chunks
# --------------------------------------------------------------------------------------------

_LAYER = re.compile(r"^(.*?\b(?:layers?|h|blocks?|layer)\.\d+)(?:\.|$)")


def layer_segments(graph: Graph) -> list[list[int]]:
    """Consecutive op indices grouped into layers by module path (``...layers.<i>...``).

    Ops outside any numbered layer join the neighbouring run of such ops; a graph without
    numbered modules falls back to ``⌈√n⌉`` equal runs (Chen et al.'s √n checkpointing).
    """
    keys = []
    for op in graph.ops:
        m = _LAYER.match(op.module or "")
        keys.append(m.group(1) if m else (op.module.split(".")[0] if op.module else ""))
    if not any(_LAYER.match(op.module or "") for op in graph.ops):
        n = len(graph.ops)
        size = max(1, math.ceil(math.sqrt(n)))
        return [list(range(i, min(n, i + size))) for i in range(0, n, size)]
    segs: list[list[int]] = []
    for i, k in enumerate(keys):
        if segs and keys[segs[-1][0]] == k:
            segs[-1].append(i)
        else:
            segs.append([i])
    return segs


def chunk_of_ops(graph: Graph, cfg: ParallelConfig) -> list[int]:
    """The pipeline chunk (``0 .. pp·v − 1``; chunk ``g`` runs on stage ``g mod pp``) of every op,
    cut at layer boundaries as ``cfg.partition`` says — the one place that decides it."""
    v = cfg.chunks if cfg.schedule == "interleaved" else 1
    segs = layer_segments(graph)
    if cfg.partition == "layers":
        starts = _uniform_layers(graph, segs, cfg.pp * v)
    else:
        starts = _partition([float(sum(graph.ops[i].flops for i in s)) + 1.0 for s in segs], cfg.pp * v)
    out = [0] * len(graph.ops)
    for g, (a, b) in enumerate(zip(starts, [*starts[1:], len(segs)])):
        for sg in segs[a:b]:
            for i in sg:
                out[i] = g
    return out


def _partition(weights: Sequence[float], k: int) -> list[int]:
    """Cut a sequence into ``k`` contiguous non-empty parts minimising the largest sum; returns starts."""
    n = len(weights)
    if k > n:
        raise ValueError(f"cannot cut {n} layers into {k} pipeline chunks: use fewer stages/chunks")

    def cuts(limit: float) -> list[int] | None:
        starts, acc = [0], 0.0
        for i, w in enumerate(weights):
            if acc + w > limit and acc > 0:
                starts.append(i)
                acc = 0.0
            acc += w
        return starts if len(starts) <= k else None

    lo, hi = max(weights), sum(weights)
    for _ in range(60):
        mid = (lo + hi) / 2
        if cuts(mid) is None:
            lo = mid
        else:
            hi = mid
    starts = cuts(hi) or [0]
    # every chunk must be non-empty: split the largest parts until there are k
    while len(starts) < k:
        bounds = [*starts, n]
        sizes = [(bounds[j + 1] - bounds[j], j) for j in range(len(starts))]
        size, j = max(sizes)
        starts.insert(j + 1, bounds[j] + size // 2)
    return starts


def _uniform_layers(graph: Graph, segs: list[list[int]], k: int) -> list[int]:
    """Megatron / DeepSpeed ``uniform`` partition: equal numbers of numbered layers per chunk (the
    first ``L mod k`` chunks take one more); embedding and head stay on the first and last chunk."""
    layer_idx = [j for j, sg in enumerate(segs) if _LAYER.match(graph.ops[sg[0]].module or "")]
    n = len(layer_idx)
    if k > n:
        raise ValueError(f"cannot cut {n} layers into {k} pipeline chunks: use fewer stages/chunks")
    starts, pos = [0], 0
    for g in range(k - 1):
        pos += n // k + (1 if g < n % k else 0)
        starts.append(layer_idx[pos])
    return starts


# --------------------------------------------------------------------------------------------
# tensor / sequence parallel propagation
# --------------------------------------------------------------------------------------------

@dataclass
class _OpPlan:
    split: float = 1.0
    tp_fwd: list[tuple[str, float]] = field(default_factory=list)  # (collective, bytes)
    tp_bwd: list[tuple[str, float]] = field(default_factory=list)
    sp_fwd: list[tuple[str, float]] = field(default_factory=list)
    sp_bwd: list[tuple[str, float]] = field(default_factory=list)
    param_split: float = 1.0


def _tensor_bytes(graph: Graph, name: str, dtype: str) -> float:
    t = graph.tensors[name]
    w = _SHORT_BYTES[dtype] if t.dtype in ("float32", "float16", "bfloat16", "float64") else DTYPE_BYTES.get(t.dtype, 4)
    return t.numel * w


def _plan_ops(graph: Graph, cfg: ParallelConfig) -> list[_OpPlan]:
    tp, sp = cfg.tp, cfg.sp
    split_state: dict[str, bool] = {}
    grad_ar_done: set[str] = set()
    plans: list[_OpPlan] = []
    ar = ("reduce_scatter", "all_gather") if cfg.sequence_parallel else ("all_reduce",)
    for op in graph.ops:
        pl = _OpPlan()
        acts = [t for t in op.inputs if graph.tensors[t].kind is not TensorKind.PARAM]
        has_param = any(graph.tensors[t].kind is TensorKind.PARAM for t in op.inputs)
        any_split = any(split_state.get(t, False) for t in acts)
        out_split = False
        if tp > 1:
            kind = OpKind(op.kind)
            if kind in (OpKind.CONTRACTION, OpKind.CONV) and has_param:
                pl.split = pl.param_split = tp
                if any_split:  # row-parallel: partial sums reduced in the forward pass
                    for t in op.outputs:
                        pl.tp_fwd += [(c, _tensor_bytes(graph, t, cfg.dtype)) for c in ar]
                else:  # column-parallel: the input gradient is reduced in the backward pass
                    out_split = True
                    for t in acts:  # graph inputs need no gradient
                        if t not in grad_ar_done and graph.tensors[t].kind is not TensorKind.INPUT:
                            grad_ar_done.add(t)
                            pl.tp_bwd += [(c, _tensor_bytes(graph, t, cfg.dtype)) for c in ar]
            elif kind is OpKind.EMBEDDING and has_param:
                pl.split = pl.param_split = tp
                for t in op.outputs:
                    pl.tp_fwd += [(c, _tensor_bytes(graph, t, cfg.dtype)) for c in ar]
            elif any_split and kind is OpKind.LOSS:
                pl.split = tp
                rows = graph.tensors[acts[0]].numel / max(1, graph.tensors[acts[0]].shape[-1])
                pl.tp_fwd.append(("all_reduce", 3 * rows * 4))
            elif any_split and kind is not OpKind.OPAQUE:
                pl.split = tp
                out_split = True
            elif any_split:  # an op we cannot split: gather its inputs
                for t in acts:
                    if split_state.get(t, False):
                        pl.tp_fwd.append(("all_gather", _tensor_bytes(graph, t, cfg.dtype)))
            elif cfg.sequence_parallel:
                pl.split = tp  # norms, dropout, residuals on 1/tp of the sequence
        for t in op.outputs:
            split_state[t] = out_split
        if sp > 1:
            pl.split *= sp
            if OpKind(op.kind) is OpKind.ATTENTION:
                for t in list(acts) + list(op.outputs):
                    b = _tensor_bytes(graph, t, cfg.dtype) / (sp * (tp if any_split else 1))
                    pl.sp_fwd.append(("all_to_all", b))
                    pl.sp_bwd.append(("all_to_all", b))
        plans.append(pl)
    return plans


def _activation_bytes(graph: Graph, op: Op, dtype: str, fused_attention: bool, selective: bool) -> float:
    """Bytes an op stores for its backward: its outputs, plus attention score matrices."""
    if OpKind(op.kind) in (OpKind.VIEW, OpKind.CREATE):
        return 0.0
    total = sum(_tensor_bytes(graph, t, dtype) for t in op.outputs)
    if OpKind(op.kind) is OpKind.ATTENTION and op.nest is not None and not fused_attention and not selective:
        ext = op.nest.extents
        for st in op.nest.statements:
            for w in st.writes:
                if w.operand == "scores":
                    n = math.prod(ext[d] for e in w.index for d in e.dims)
                    total += 2 * n * _SHORT_BYTES[dtype]  # scores and probabilities
    return total


# --------------------------------------------------------------------------------------------
# the estimate
# --------------------------------------------------------------------------------------------

def estimate_step(graph: Graph, cluster: Cluster, cfg: ParallelConfig) -> StepEstimate:
    """Price one training step of ``graph`` on ``cluster`` under ``cfg`` (see the module docstring)."""
    cfg.validate(cluster)
    devs = cfg.devices if cfg.devices is not None else tuple(range(cfg.world))
    p, v, m = cfg.pp, cfg.chunks if cfg.schedule == "interleaved" else 1, cfg.microbatches
    warnings: list[str] = []
    if graph.opaque_ops():
        warnings.append(f"{len(graph.opaque_ops())} opaque op(s) priced from their FLOP estimate, never split")

    segs = layer_segments(graph)
    chunk_of_op = chunk_of_ops(graph, cfg)
    plans = _plan_ops(graph, cfg)

    def stage_devices(s: int) -> list[int]:
        return [devs[cfg.rank(s, d, q, t)] for d in range(cfg.dp) for q in range(cfg.sp) for t in range(cfg.tp)]

    def group(s: int, d: int, q: int, t: int, axis: str) -> list[int]:
        if axis == "tp":
            return [devs[cfg.rank(s, d, q, x)] for x in range(cfg.tp)]
        if axis == "sp":
            return [devs[cfg.rank(s, d, x, t)] for x in range(cfg.sp)]
        return [devs[cfg.rank(s, x, y, t)] for x in range(cfg.dp) for y in range(cfg.sp)]  # dp (x sp)

    def group_key(grp: list[int]) -> tuple[int, ...]:
        # nodes are homogeneous (one device type, one intra-node link), so a collective's time
        # depends on how many members sit on which node, not on which devices they are
        return tuple(sorted(cluster.device(d).node for d in grp))

    def price_collectives(events: list[tuple[str, float]], grp: list[int], cache: dict) -> float:
        tot = 0.0
        gk = group_key(grp)
        for kind, nbytes in events:
            key = (kind, nbytes, gk)
            if key not in cache:
                cache[key] = collective_time(cluster, kind, nbytes, grp).seconds
            tot += cache[key]
        return tot

    # collective prices depend only on the cluster: keep them across the search's many calls
    ccache: dict = cluster.__dict__.setdefault("_collective_cache", {})
    # op prices depend only on the op, device type, dtype and split: the search prices many
    # configurations of one graph, so they are kept on the graph (dropped when it changes)
    op_costs: dict = graph.__dict__.setdefault("_op_cost_cache", {})
    fwd = [0.0] * p
    bwd = [0.0] * p
    comp = [0.0] * p
    tp_t = [0.0] * p
    sp_t = [0.0] * p
    stage_types: list[DeviceType] = []
    act_bytes = [0.0] * p
    seg_act_max = [0.0] * p
    params_local = [0.0] * p
    for s in range(p):
        sdevs = stage_devices(s)
        types = {cluster.device(d).type.name: cluster.device(d).type for d in sdevs}
        # The slowest device type of the stage sets its pace (synchronous collectives).
        op_idx = [i for i, g in enumerate(chunk_of_op) if g % p == s]
        best: tuple[float, DeviceType, float, float, float] | None = None
        for dt in types.values():
            f = b = rc = 0.0
            for i in op_idx:
                op = graph.ops[i]
                key = (i, dt.name, cfg.dtype, plans[i].split, cfg.fused_attention)
                c = op_costs.get(key)
                if c is None:
                    c = op_costs[key] = op_cost(graph, op, dt, cfg.dtype, split=plans[i].split,
                                                fused=True if cfg.fused_attention else None)
                f += c.forward
                b += c.backward
                if cfg.recompute == "full" or (cfg.recompute == "selective" and OpKind(op.kind) is OpKind.ATTENTION):
                    rc += c.forward
            if best is None or f + b + rc > best[2] + best[3] + best[4]:
                best = (0.0, dt, f, b, rc)
        assert best is not None
        _, dt, f, b, rc = best
        stage_types.append(dt)
        # every group of the stage runs the same collectives; the slowest one sets the pace
        tgrps = [group(s, d, q, 0, "tp") for d in range(cfg.dp) for q in range(cfg.sp)]
        qgrps = [group(s, d, 0, t, "sp") for d in range(cfg.dp) for t in range(cfg.tp)]

        def slowest(events_of: str, groups: list[list[int]], op_idx: list[int] = op_idx) -> float:
            # identical (kind, bytes) events repeat in every layer: price each distinct one once
            # per group, and each distinct group (by the nodes its members sit on) once
            agg: dict[tuple[str, float], int] = {}
            for i in op_idx:
                for ev in getattr(plans[i], events_of):
                    agg[ev] = agg.get(ev, 0) + 1
            if not agg:
                return 0.0
            distinct = {group_key(grp): grp for grp in groups}
            return max(sum(n * price_collectives([ev], grp, ccache) for ev, n in agg.items())
                       for grp in distinct.values())

        tf, tb = slowest("tp_fwd", tgrps), slowest("tp_bwd", tgrps)
        qf, qb = slowest("sp_fwd", qgrps), slowest("sp_bwd", qgrps)
        # recomputing a forward repeats its tensor/sequence-parallel collectives too
        rc_comm = (tf + qf) if cfg.recompute == "full" else 0.0
        fwd[s] = f + tf + qf
        bwd[s] = b + rc + tb + qb + rc_comm
        comp[s] = f + b + rc
        tp_t[s] = tf + tb + (tf if cfg.recompute == "full" else 0.0)
        sp_t[s] = qf + qb + (qf if cfg.recompute == "full" else 0.0)
        # memory inputs
        seen: set[str] = set()
        for i in op_idx:
            op = graph.ops[i]
            for t in op.inputs:
                if graph.tensors[t].kind is TensorKind.PARAM and t not in seen:
                    seen.add(t)
                    params_local[s] += graph.tensors[t].numel / (plans[i].param_split if cfg.tp > 1 else 1)
        stage_segs = [sg for sg in segs if chunk_of_op[sg[0]] % p == s]
        full_act = 0.0
        for sg in stage_segs:
            a = sum(_activation_bytes(graph, graph.ops[i], cfg.dtype, cfg.fused_attention,
                                      cfg.recompute == "selective") / plans[i].split for i in sg)
            full_act += a
            seg_act_max[s] = max(seg_act_max[s], a)
        if cfg.recompute == "full":
            # keep each layer's input (its first op's activation inputs), recompute the rest
            kept = 0.0
            for sg in stage_segs:
                produced = {t for i in sg for t in graph.ops[i].outputs}
                ins = {t for i in sg for t in graph.ops[i].inputs
                       if graph.tensors[t].kind is not TensorKind.PARAM and t not in produced}
                kept += sum(_tensor_bytes(graph, t, cfg.dtype) for t in ins) / (cfg.tp if cfg.sequence_parallel
                                                                                  else 1) / cfg.sp
            act_bytes[s] = kept
        else:
            act_bytes[s] = full_act
            seg_act_max[s] = 0.0

    # p2p between consecutive chunks: tensors produced at or before chunk g, read after it
    last_use: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for t in op.inputs:
            last_use[t] = max(last_use.get(t, -1), chunk_of_op[i])
    boundary = [0.0] * (p * v)
    for i, op in enumerate(graph.ops):
        for t in op.outputs:
            for g in range(chunk_of_op[i], last_use.get(t, -1)):
                boundary[g] += _tensor_bytes(graph, t, cfg.dtype) / (cfg.tp * cfg.sp)
    p2p = [0.0] * p
    p2p_total = [0.0] * p
    for s in range(p):
        times = []
        for g in range(s, p * v - 1, p):
            pairs = {(cluster.device(a).node, cluster.device(b).node): (a, b)
                     for a, b in ((devs[cfg.rank(s, d, q, t)], devs[cfg.rank((s + 1) % p, d, q, t)])
                                  for d in range(cfg.dp) for q in range(cfg.sp) for t in range(cfg.tp))}
            times.append(max(p2p_time(cluster, a, b, boundary[g]) for a, b in pairs.values()))
        p2p[s] = max(times) if times else 0.0
        p2p_total[s] = 2 * m * sum(times)

    sim = simulate(cfg.schedule, fwd, bwd, m, v, p2p)

    # data-parallel gradient synchronisation and optimizer step
    stages = []
    mems = []
    gb = _SHORT_BYTES[cfg.dtype]
    totals = []
    for s in range(p):
        dt = stage_types[s]
        dgrps = [group(s, 0, 0, t, "dp") for t in range(cfg.tp)]
        dgrp = dgrps[0]
        dp_events: list[tuple[str, float]] = []
        grad_bytes = params_local[s] * gb
        if len(dgrp) > 1:
            if cfg.zero_stage == 0:
                dp_events.append(("all_reduce", grad_bytes))
            else:
                dp_events += [("reduce_scatter", grad_bytes), ("all_gather", params_local[s] * gb)]
            if cfg.zero_stage == 3:
                dp_events += [("all_gather", params_local[s] * gb)] * (2 * m)
        t_dp = max(price_collectives(dp_events, grp, ccache) for grp in dgrps)
        omega = cfg.grad_overlap if cfg.grad_overlap is not None else (0.0 if dt.kind == "cpu" else 1.0)
        hide = omega * (bwd[s] / v) * (m if cfg.zero_stage == 3 else 1)
        exposed = max(0.0, t_dp - hide)
        shard = len(dgrp) if cfg.zero_stage >= 1 else 1
        master = 4 if gb < 4 else 0
        opt_state = 8 if cfg.optimizer in ("adam", "adamw", "lamb") else 4 if cfg.optimizer in (
            "sgd_momentum", "lion") else 0
        opt_bytes = params_local[s] / shard * (gb * 3 + 2 * (master + opt_state))
        t_opt = max(opt_bytes / (dt.memory_bandwidth * 0.8), dt.launch_overhead) if params_local[s] else 0.0
        totals.append(sim.makespan + exposed + t_opt)
        stages.append((s, dt, exposed, t_opt, t_dp, dp_events))
        # memory
        in_flight = sim.in_flight[s] / v
        ws = seg_act_max[s]
        if cfg.zero_stage == 3:
            seg_params = max((sum(graph.tensors[t].numel for i in sg for t in graph.ops[i].inputs
                                  if graph.tensors[t].kind is TensorKind.PARAM) for sg in segs), default=0)
            ws += 2 * seg_params * gb / cfg.tp
        mems.append(device_memory(
            label=f"stage {s} (devices {_span(stage_devices(s))})", device=f"{dt.name} {dt.memory / 1e9:.0f} GB",
            capacity=dt.memory, params=params_local[s], dp=len(dgrp), zero_stage=cfg.zero_stage,
            param_dtype=cfg.dtype, optimizer=cfg.optimizer, activations=act_bytes[s], in_flight=in_flight,
            workspace=ws))
    step = max(totals)
    out = []
    for (s, dt, exposed, t_opt, t_dp, dp_events), tot in zip(stages, totals):
        busy_compute = comp[s] * m
        tpc, spc = tp_t[s] * m, sp_t[s] * m
        waiting = max(0.0, sim.makespan - sim.busy[s])
        p2p_part = min(p2p_total[s], waiting)
        parts = (("compute", busy_compute), ("tensor_parallel", tpc), ("sequence_parallel", spc),
                 ("p2p", p2p_part), ("bubble", waiting - p2p_part), ("data_parallel", exposed),
                 ("optimizer", t_opt), ("idle", step - tot))
        dp_kinds = "+".join(dict.fromkeys(k for k, _ in dp_events)) or "none"
        coll = [("tensor_parallel", tpc), ("sequence_parallel", spc), ("p2p", p2p_total[s]),
                (f"data_parallel {dp_kinds} (before overlap)", t_dp)]
        out.append(StageBreakdown(s, tuple(stage_devices(s)), dt.name, parts, tuple(coll)))
    samples = _batch(graph) * m * cfg.dp
    model_flops = 3.0 * graph.flops() * m * cfg.dp
    return StepEstimate(cfg, step, tuple(out), tuple(mems), sim, samples, model_flops, tuple(warnings))


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
