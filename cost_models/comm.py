"""Communication cost: the α–β model per link class, collectives by algorithm and by level.

A message of ``n`` bytes over a link of latency ``α`` and bandwidth ``B`` takes
``α + n/B``. Collectives over ``p`` ranks, ``n`` the full buffer size:

====================  ================================  ==============================
collective            ring (bandwidth-optimal)          tree / binomial (latency-optimal)
====================  ================================  ==============================
all-reduce            2(p−1)/p · n/B + 2(p−1)·α         2·n/B + 2⌈log₂p⌉·α (pipelined
                                                        double binary tree, as NCCL)
reduce-scatter        (p−1)/p · n/B + (p−1)·α           —
all-gather            (p−1)/p · n/B + (p−1)·α           —
all-to-all            (p−1)/p · n/B + (p−1)·α           (pairwise exchange)
broadcast             n/B + (p−1)·α (pipelined chain)   ⌈log₂p⌉·(n/B + α)
p2p                   n/B + α
halo                  α + n/B_eff (neighbour exchange, below)
shift                 α + n/B_eff (ring shift, below)
====================  ================================  ==============================

A **halo** (neighbour exchange: convolution rows split over a mesh axis) is priced with ``n``
the bytes one device *receives*: each device of the ordered group gets its missing rows from its
neighbours (``min(2, p−1)`` of them, ``n`` split evenly between them), all devices at once. A
device's time is the slowest of its incoming flows, ``α + n_flow/B_flow``; intra-node flows
share the device's own link (``B/k`` for ``k`` such flows), a flow from another node shares that
node's ports with the other boundary flows leaving it (and the ``concurrent`` groups). The step
is the slowest device. It is independent of ``p`` beyond the boundaries it crosses (not an
all-to-all over the group).

A **shift** (ring attention's step: every device of the ordered group sends ``n`` bytes to the
next and receives ``n`` from the previous, cyclically, all at once) is priced like a halo with one
incoming flow per device, the last device's flow to the first included.

NCCL picks the algorithm whose predicted time is smallest for the message size and the
topology; :func:`collective_time` does the same over the candidates that apply: those every
link of the group runs (``Link.algorithms``). gloo runs rings only (its α–β is fitted with the
ring formula by ``polyparallel calibrate``), so a group on a gloo link is priced as a ring at
every size and group size.

**Levels.** A group whose devices span several link levels (devices of one node, nodes of
one center, centers) is priced with the hierarchical decomposition NCCL and HCCL use, when
the group is *regular* (every node holds ``k₀`` of its devices, every center ``k₁`` of its
nodes): for all-reduce,

    T = Σ_{l < L} [RS_l(n_l) + AG_l(n_l)] + AR_L(n_L),    n_l = n / Π_{j<l} k_j,

where level ``l`` runs ``Π_{j<l} k_j`` concurrent flows that share the level's endpoint
bandwidth (a node's ports, a center's WAN uplink), so each flow sees ``B_l / Π_{j<l} k_j``
and the β term of level ``l`` equals that of one flow carrying ``n`` over the whole
endpoint. Reduce-scatter and all-gather walk the levels once for their bandwidth, but NCCL
runs them as rings over all ``p`` ranks (one per NIC rail), so their latency term is
``(p − 1)·max_l α_l`` rather than ``Σ_l (k_l − 1)·α_l`` — at 1536 ranks that is ~8 ms per
collective, which ZeRO-3 pays once per layer. Broadcast runs the outer level first. An
irregular group, and all-to-all (every pair talks), is priced as a flat ring on
its slowest link, with that link's bandwidth shared by the flows crossing it. The result
is the cheaper of the hierarchical and the flat schedule.

**Concurrent groups.** The data-parallel groups of the ``t`` tensor-parallel ranks of a node
reduce at the same time and leave through the same network ports: ``concurrent = t`` groups
share each node's ports (and each center's uplink), so each sees ``1/t`` of them. (With
``tp = 8`` on an 8-GPU node that is one NIC per GPU, rail-aligned, as on a DGX.) Intra-node
links are per device and are not shared.

A WAN backbone declared shared carries all inter-center flows: with ``c`` centers in a ring
each flow gets ``backbone / c``; asymmetric up/down links are used as ``min(up, down)``
for ring steps (each rank sends and receives).

Examples:
    >>> ring_time("all_reduce", 1e9, 8, 100e9, 5e-6)  # doctest: +ELLIPSIS
    0.01757...
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from polyparallel.cluster import Cluster

__all__ = [
    "COLLECTIVES",
    "CollectiveCost",
    "collective_time",
    "p2p_time",
    "ring_time",
    "tree_time",
]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p", "halo", "shift")


@dataclass(frozen=True)
class CollectiveCost:
    """The price of one collective: total seconds, the algorithm chosen, and per-level parts."""

    kind: str
    nbytes: float
    group_size: int
    seconds: float
    algorithm: str
    level: str
    parts: tuple[tuple[str, float], ...] = ()

    def __str__(self) -> str:
        return f"{self.kind}({self.nbytes:.3g} B, p={self.group_size}) {self.algorithm}@{self.level}: " \
               f"{self.seconds * 1e3:.3f} ms"


def _check(kind: str, n: float, p: int) -> None:
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; one of {', '.join(COLLECTIVES)}")
    if p < 1 or n < 0:
        raise ValueError(f"collective {kind} needs p >= 1 and n >= 0, got p={p}, n={n}")


def ring_time(kind: str, n: float, p: int, bandwidth: float, alpha: float) -> float:
    """Ring (pipelined chain for broadcast) time of a collective; see the module table."""
    _check(kind, n, p)
    if p == 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (p - 1) / p * n / bandwidth + 2 * (p - 1) * alpha
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) / p * n / bandwidth + (p - 1) * alpha
    if kind == "broadcast":
        return n / bandwidth + (p - 1) * alpha
    return n / bandwidth + alpha


def tree_time(kind: str, n: float, p: int, bandwidth: float, alpha: float) -> float | None:
    """Tree time, or ``None`` where no tree algorithm applies (reduce-scatter, all-gather...)."""
    _check(kind, n, p)
    if p == 1:
        return 0.0
    depth = math.ceil(math.log2(p))
    if kind == "all_reduce":
        return 2 * n / bandwidth + 2 * depth * alpha
    if kind == "broadcast":
        return depth * (n / bandwidth + alpha)
    return None


def _best(kind: str, n: float, p: int, bw: float, alpha: float, tree: bool = True) -> tuple[float, str]:
    r = ring_time(kind, n, p, bw, alpha)
    t = tree_time(kind, n, p, bw, alpha) if tree else None
    if t is not None and t < r:
        return t, "tree"
    return r, "ring"


def _tree_allowed(cluster: Cluster, group: Sequence[int]) -> bool:
    """Whether every link the group's collective may cross runs tree algorithms (gloo: ring only)."""
    node_ids = {cluster.device(d).node for d in group}
    links = [cluster.nodes[n].intra for n in node_ids]
    if len(node_ids) > 1:
        links += [cluster.nodes[n].nic for n in node_ids]
    centers = {cluster.nodes[n].center for n in node_ids}
    if len(centers) > 1:
        links += [cluster.centers[c].wan for c in centers] + [cluster.backbone]
    return all("tree" in lk.algorithms for lk in links if lk is not None)


def p2p_time(cluster: Cluster, src: int, dst: int, nbytes: float) -> float:
    """Point-to-point transfer time from device ``src`` to ``dst`` (asymmetric links respected)."""
    if src == dst or nbytes == 0:
        return 0.0
    bw, lat = cluster.link(src, dst)
    return lat + nbytes / bw


def _levels(cluster: Cluster, group: Sequence[int], concurrent: int = 1) -> list[tuple[str, int, float, float]] | None:
    """Regular level structure of a group: ``[(level, k, bandwidth_per_endpoint, alpha)]`` inner first.

    ``bandwidth_per_endpoint`` is the bandwidth one endpoint (device / node / center) of the
    level offers to all the group's flows that leave through it (``1/concurrent`` of a node's
    ports or a center's uplink when that many groups run at once).
    """
    by_center: dict[int, dict[int, list[int]]] = {}
    for d in group:
        dev = cluster.device(d)
        by_center.setdefault(dev.center, {}).setdefault(dev.node, []).append(d)
    per_node = {len(v) for nodes in by_center.values() for v in nodes.values()}
    per_center = {len(nodes) for nodes in by_center.values()}
    if len(per_node) != 1 or len(per_center) != 1:
        return None
    k0, k1, k2 = per_node.pop(), per_center.pop(), len(by_center)
    levels: list[tuple[str, int, float, float]] = []
    if k0 > 1:
        nodes = [cluster.nodes[n] for c in by_center.values() for n in c]
        levels.append(("intra_node", k0, min(n.intra.bandwidth for n in nodes), max(n.intra.latency for n in nodes)))
    if k1 > 1:
        node_ids = [n for c in by_center.values() for n in c]
        bw = min(cluster.node_bandwidth(n) for n in node_ids) / concurrent
        lat = max(cluster.nodes[n].nic.latency for n in node_ids if cluster.nodes[n].nic is not None)
        levels.append(("inter_node", k1, bw, lat))
    if k2 > 1:
        cs = list(by_center)
        bw = min(cluster.center_bandwidth(c, flows=k2) for c in cs) / concurrent
        lat = max(cluster.center_latency(a, b) for a in cs for b in cs)
        levels.append(("inter_center", k2, bw, lat))
    return levels


def _flat(cluster: Cluster, kind: str, n: float, group: Sequence[int], concurrent: int = 1,
          tree: bool = True) -> tuple[float, str, str]:
    """Flat ring/tree on the slowest link of the ring, bandwidth shared by the flows crossing it
    (those of ``concurrent`` identical groups too)."""
    p = len(group)
    worst_bw, worst_lat, worst_level = math.inf, 0.0, "intra_node"
    order = ("intra_node", "inter_node", "inter_center")
    # Flows that leave one endpoint share it: count ring edges leaving each node / center.
    # Links depend on the nodes only (nodes are homogeneous): look each pair up once.
    dev = [cluster.device(d) for d in group]
    edges: dict[tuple[int, int, bool], tuple[str, float, float]] = {}
    ring = []
    for i in range(p):
        a, b = group[i], group[(i + 1) % p]
        key = (dev[i].node, dev[(i + 1) % p].node, a == b)
        if key not in edges:
            edges[key] = (cluster.level(a, b), *cluster.link(a, b))
        ring.append((dev[i], edges[key]))
    out_node: dict[int, int] = {}
    out_center: dict[int, int] = {}
    for da, (lvl, _, _) in ring:
        if lvl != "intra_node":
            out_node[da.node] = out_node.get(da.node, 0) + concurrent
        if lvl == "inter_center":
            out_center[da.center] = out_center.get(da.center, 0) + concurrent
    flows_wan = sum(out_center.values())
    for da, (lvl, bw, lat) in ring:
        if lvl == "inter_node":
            bw = min(bw, cluster.node_bandwidth(da.node) / out_node[da.node])
        elif lvl == "inter_center":
            wan = cluster.centers[da.center].wan
            assert wan is not None
            bw = min(bw, cluster.center_bandwidth(da.center, flows=flows_wan) / out_center[da.center])
        worst_bw, worst_lat = min(worst_bw, bw), max(worst_lat, lat)
        if order.index(lvl) > order.index(worst_level):
            worst_level = lvl
    t, algo = _best(kind, n, p, worst_bw, worst_lat, tree)
    return t, algo, worst_level


def collective_time(cluster: Cluster, kind: str, nbytes: float, group: Sequence[int],
                    concurrent: int = 1) -> CollectiveCost:
    """Price a collective of ``nbytes`` (the full buffer) over the device ids in ``group``.

    Returns the cheaper of the flat ring/tree on the slowest link and the hierarchical
    decomposition (regular groups), with the per-level parts of the hierarchical one.
    ``concurrent`` identical groups run at the same time on the same nodes (the data-parallel
    groups of all the tensor-parallel ranks of a node reduce together): they share each node's
    network ports and each center's WAN uplink, so each group sees ``1/concurrent`` of them.
    Intra-node links are per device (NVLink/NVSwitch) and are not shared.
    """
    if concurrent < 1:
        raise ValueError(f"concurrent must be >= 1, got {concurrent}")
    group = list(dict.fromkeys(group))
    p = len(group)
    _check(kind, nbytes, p)
    if p == 1 or nbytes == 0:
        return CollectiveCost(kind, nbytes, p, 0.0, "none", "none")
    if kind == "p2p":
        if p != 2:
            raise ValueError(f"p2p is between two devices, got a group of {p}")
        return CollectiveCost(kind, nbytes, 2, p2p_time(cluster, group[0], group[1], nbytes), "direct",
                              cluster.level(group[0], group[1]))
    if kind in ("halo", "shift"):
        t, level = _halo_time(cluster, nbytes, group, concurrent, cyclic=kind == "shift")
        return CollectiveCost(kind, nbytes, p, t, "neighbour", level)
    tree = _tree_allowed(cluster, group)
    flat_t, flat_algo, flat_level = _flat(cluster, kind, nbytes, group, concurrent, tree)
    best = CollectiveCost(kind, nbytes, p, flat_t, flat_algo, flat_level)
    levels = _levels(cluster, group, concurrent)
    if levels is None or len(levels) < 2 or kind == "all_to_all":
        return best
    parts: list[tuple[str, float]] = []
    # Level i runs flows_i = prod_{j<i} k_j concurrent flows of n_i = n / flows_i bytes that
    # share the level's endpoint bandwidth B_i: each flow sees B_i / flows_i.
    flows = 1
    if kind in ("all_reduce", "reduce_scatter", "all_gather"):
        for i, (name, k, bw, lat) in enumerate(levels):
            n_i, bw_i = nbytes / flows, bw / flows
            if kind == "all_reduce" and i == len(levels) - 1:
                t, algo = _best("all_reduce", n_i, k, bw_i, lat, tree)
                parts.append((f"all_reduce({algo})@{name}", t))
            elif kind == "all_reduce":
                t = ring_time("reduce_scatter", n_i, k, bw_i, lat)
                parts += [(f"reduce_scatter@{name}", t), (f"all_gather@{name}", t)]
            else:
                parts.append((f"{kind}@{name}", ring_time(kind, n_i, k, bw_i, lat)))
            flows *= k
    elif kind == "broadcast":
        for name, k, bw, lat in reversed(levels):
            t, algo = _best("broadcast", nbytes, k, bw, lat, tree)
            parts.append((f"broadcast({algo})@{name}", t))
    hier = sum(t for _, t in parts)
    if kind in ("all_gather", "reduce_scatter"):
        # NCCL runs these as rings over all p ranks (one ring per NIC rail, so the bandwidth is
        # the levels' above): p − 1 steps, each as slow as its slowest hop, not Σ (k_l − 1) steps
        lat_levels = sum((k - 1) * lat for _, k, _, lat in levels)
        ring_lat = (p - 1) * max(lat for _, _, _, lat in levels)
        parts.append(("ring latency over all ranks", ring_lat - lat_levels))
        hier += ring_lat - lat_levels
    if hier < best.seconds:
        return CollectiveCost(kind, nbytes, p, hier, "hierarchical", levels[-1][0], tuple(parts))
    return best


def _halo_time(cluster: Cluster, received: float, group: Sequence[int], concurrent: int = 1,
               cyclic: bool = False) -> tuple[float, str]:
    """Neighbour exchange over the ordered ``group``: every device receives ``received`` bytes from
    its neighbours at once (module docstring); (seconds of the slowest device, slowest level).
    ``cyclic``: a ring shift, each device receiving from its predecessor only (the first from the last)."""
    p = len(group)
    per_flow = received if cyclic else received / min(2, p - 1)
    dev = [cluster.device(d) for d in group]
    # flows leaving each node: one per ordered pair of neighbours on different nodes
    out_node: dict[int, int] = {}
    for i in range(p if cyclic else p - 1):
        a, b = dev[i], dev[(i + 1) % p]
        if a.node != b.node:
            out_node[a.node] = out_node.get(a.node, 0) + concurrent
            out_node[b.node] = out_node.get(b.node, 0) + concurrent
    worst, worst_level = 0.0, "intra_node"
    for i in range(p):
        peers = [(i - 1) % p] if cyclic else [j for j in (i - 1, i + 1) if 0 <= j < p and group[j] != group[i]]
        local = [j for j in peers if dev[j].node == dev[i].node]
        for j in peers:
            bw, lat = cluster.link(group[j], group[i])
            level = cluster.level(group[j], group[i])
            if level == "intra_node":
                bw = bw / len(local)
            else:
                bw = min(bw, cluster.node_bandwidth(dev[j].node) / out_node[dev[j].node])
            t = lat + per_flow / bw
            if t > worst:
                worst, worst_level = t, level
    return worst, worst_level

