"""Where a plan's stages and groups sit on the cluster, and what one group's collectives cost.

:func:`stage_layouts` gives every pipeline stage's devices and its tensor-, sequence- and
data-parallel groups (ranks laid out tensor-parallel fastest, then sequence, data, pipeline:
Megatron's order), each group with a *price class* (which nodes it spans and how many groups of its
kind share them), so a collective is priced once per class (:func:`group_seconds`).
:class:`StageTerms` holds the per-stage sums per micro-batch the step model and the data- and
expert-parallel terms read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from polyparallel.cluster import Cluster, DeviceType

from .comm import collective_time, p2p_time
from .memo import PRICES
from .parallel_config import ParallelConfig

__all__ = ["Group", "StageLayout", "StageTerms", "group_seconds", "p2p_seconds", "reduce_over", "span",
           "stage_layouts"]


@dataclass(frozen=True)
class StageTerms:
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
    dp_groups: tuple[tuple[Group, ...], ...]  # distinct (by nodes) dp groups of each stage
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # per-plan parts that repeat
    param_tensors: tuple[int, ...] = ()  # distinct parameter tensors of each stage
    tp_param_tensors: tuple[int, ...] = ()  # of those, the ones split over tp (DTensors in torch)
    p2p_block: tuple[float, ...] = ()  # per micro-batch, in each of forward and backward: synchronous p2p
    tied: tuple[tuple[tuple[tuple[int, ...], float], ...], ...] = ()  # per stage: _StageBase.tied


# (device ids, price class: the id of their sorted node ids and the groups running alongside on a node)
Group = tuple[tuple[int, ...], int]


@dataclass(frozen=True)
class StageLayout:
    devices: tuple[int, ...]
    span: str
    types: tuple[DeviceType, ...]  # in order of first appearance
    tp_groups: tuple[Group, ...]  # distinct by the nodes they span: each distinct group priced once
    sp_groups: tuple[Group, ...]
    dp_groups: tuple[Group, ...]
    p2p_pairs: tuple[tuple[int, int], ...]  # (device of this stage, its peer on the next), distinct by nodes


def stage_layouts(cluster: Cluster, cfg: ParallelConfig, devs: tuple[int, ...]) -> tuple[StageLayout, ...]:
    """Devices, groups and p2p pairs of every stage (kept on the cluster: it is graph-independent).

    Ranks are ``((s·dp + d)·sp + q)·tp + t``, so the device array reshaped to ``(pp, dp, sp, tp)``
    gives tensor-parallel groups along the last axis, sequence-parallel along the third, and the
    data-parallel (× sequence) group of ``t`` as the ``(dp, sp)`` slab at ``t``.
    """
    key = (devs, cfg.dp, cfg.tp, cfg.pp, cfg.seq)
    cache = PRICES.of(cluster).setdefault("layouts", {})
    if key in cache:
        return cache[key]
    ids: dict[tuple[tuple[int, ...], int], int] = PRICES.of(cluster).setdefault("group_ids", {})
    conc_of: dict[int, int] = PRICES.of(cluster).setdefault("group_concurrency", {})
    D = np.asarray(devs, dtype=np.int64).reshape(cfg.pp, cfg.dp, cfg.seq, cfg.tp)
    N = np.asarray([d.node for d in cluster.devices], dtype=np.int64)[D]

    def distinct(dg: np.ndarray, ng: np.ndarray) -> tuple[Group, ...]:
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
        out.append(StageLayout(
            devices=flat, span=span(flat), types=tuple(types.values()),
            tp_groups=distinct(ds.reshape(-1, cfg.tp), ns.reshape(-1, cfg.tp)),
            sp_groups=distinct(ds.transpose(0, 2, 1).reshape(-1, cfg.seq), ns.transpose(0, 2, 1).reshape(-1, cfg.seq)),
            dp_groups=distinct(ds.transpose(2, 0, 1).reshape(cfg.tp, -1), ns.transpose(2, 0, 1).reshape(cfg.tp, -1)),
            p2p_pairs=tuple(pairs.values())))
    cache[key] = tuple(out)
    return cache[key]


def group_seconds(cluster: Cluster, ccache: dict, events: Sequence[tuple[str, float]], grp: Sequence[int],
           gid: int) -> float:
    """Seconds of a list of collectives over one group, each distinct one priced once per cluster.

    ``gid`` names the group's price class (:func:`stage_layouts`): nodes are homogeneous (one device
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


def reduce_over(cluster: Cluster, ccache: dict, group: tuple[int, ...], nbytes: float, concurrent: int = 1) -> float:
    """Seconds of one all-reduce of ``nbytes`` over the devices ``group`` (a group the layout does
    not name: the whole world, the stages sharing a weight), ``concurrent`` such groups sharing a node."""
    key = ("all_reduce over", group, nbytes, concurrent)
    t = ccache.get(key)
    if t is None:
        t = ccache[key] = collective_time(cluster, "all_reduce", nbytes, group, concurrent=concurrent).seconds
    return t


def p2p_seconds(cluster: Cluster, ccache: dict, a: int, b: int, nbytes: float) -> float:
    key = ("p2p", cluster.device(a).node, cluster.device(b).node, a == b, nbytes)
    t = ccache.get(key)
    if t is None:
        t = ccache[key] = p2p_time(cluster, a, b, nbytes)
    return t


def span(ids: Sequence[int]) -> str:
    ids = sorted(ids)
    if ids and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ",".join(map(str, ids[:8])) + ("..." if len(ids) > 8 else "")

