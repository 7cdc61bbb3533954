"""Communication costs against the α–β closed forms."""

from __future__ import annotations

import math

import pytest

from polyparallel.cluster import Cluster
from polyparallel.cost_models.comm import collective_time, p2p_time, ring_time, tree_time

B, ALPHA = 50e9, 4e-6


def one_node(p: int) -> Cluster:
    return Cluster.from_dict({"name": "n", "centers": [{"name": "c", "nodes": [
        {"device": "h100-sxm", "devices_per_node": p, "intra": {"bandwidth": B, "latency": ALPHA}}]}]})


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_ring_all_reduce_closed_form(p):
    n = 1e9  # large: ring is cheaper than the tree
    want = 2 * (p - 1) / p * n / B + 2 * (p - 1) * ALPHA
    c = collective_time(one_node(p), "all_reduce", n, range(p))
    assert c.algorithm == "ring"
    assert c.seconds == pytest.approx(want, rel=1e-12)
    assert ring_time("all_reduce", n, p, B, ALPHA) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_gather_scatter_closed_forms(kind):
    p, n = 4, 64e6
    c = collective_time(one_node(p), kind, n, range(p))
    assert c.seconds == pytest.approx((p - 1) / p * n / B + (p - 1) * ALPHA, rel=1e-12)


def test_tree_wins_small_messages_at_scale():
    p, n = 8, 1024.0
    c = collective_time(one_node(p), "all_reduce", n, range(p))
    assert c.algorithm == "tree"
    assert c.seconds == pytest.approx(2 * n / B + 2 * math.log2(p) * ALPHA)
    assert c.seconds < ring_time("all_reduce", n, p, B, ALPHA)
    # the crossover: the ring wins once the bandwidth term dominates
    assert tree_time("all_reduce", 1e9, p, B, ALPHA) > ring_time("all_reduce", 1e9, p, B, ALPHA)
    assert tree_time("broadcast", n, p, B, ALPHA) == pytest.approx(3 * (n / B + ALPHA))
    assert tree_time("all_gather", n, p, B, ALPHA) is None


def test_hierarchical_all_reduce_on_dgx_cluster():
    c = Cluster.preset("dgx-a100x4")
    n = 1e9
    b1, a1 = 300e9 * 0.8, 3e-6  # NVSwitch per GPU
    b2, a2 = 8 * 25e9 * 0.9, 5e-6  # a node's 8 IB rails together
    k0, k1 = 8, 4
    # reduce-scatter + all-gather in the node, then 8 concurrent rail all-reduces of n/8 across nodes
    want = 2 * ((k0 - 1) / k0 * n / b1 + (k0 - 1) * a1) + (2 * (k1 - 1) / k1 * (n / k0) / (b2 / k0) + 2 * (k1 - 1) * a2)
    got = collective_time(c, "all_reduce", n, range(32))
    assert got.algorithm == "hierarchical" and got.level == "inter_node"
    assert got.seconds == pytest.approx(want, rel=1e-9)
    assert [name for name, _ in got.parts] == ["reduce_scatter@intra_node", "all_gather@intra_node",
                                              "all_reduce(ring)@inter_node"]
    # one GPU per node: a plain ring over one IB rail each
    rail = collective_time(c, "all_reduce", n, [0, 8, 16, 24])
    assert rail.seconds == pytest.approx(2 * 3 / 4 * n / (25e9 * 0.9) + 2 * 3 * a2, rel=1e-9)


def test_cross_center_priced_on_slowest_link():
    c = Cluster.preset("aisynergy-5")
    a, b = c.devices_of(center=0)[0], c.devices_of(center=4)[0]  # beijing, chengdu (1 Gb/s up, 2 down)
    n = 100e6
    got = collective_time(c, "all_reduce", n, [a, b])
    assert got.level == "inter_center"
    assert got.seconds == pytest.approx(2 * 0.5 * n / (1e9 / 8) + 2 * 35e-3, rel=1e-9)
    assert p2p_time(c, a, b, n) == pytest.approx(35e-3 + n / (2e9 / 8))
    assert p2p_time(c, b, a, n) == pytest.approx(35e-3 + n / (1e9 / 8))


def test_trivial_and_bad_groups():
    c = one_node(4)
    assert collective_time(c, "all_reduce", 1e6, [2]).seconds == 0.0
    assert collective_time(c, "p2p", 1e6, [0, 1]).seconds == pytest.approx(ALPHA + 1e6 / B)
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time(c, "allreduce", 1e6, [0, 1])
    with pytest.raises(ValueError, match="between two devices"):
        collective_time(c, "p2p", 1e6, [0, 1, 2])


def test_concurrent_groups_share_the_node_ports():
    """FSDP with tp=4 on DGX nodes: the dp groups of the 4 tp ranks gather at once, 2 members per node
    each; the 4 groups split every node's 8 IB rails, so each inter-node flow gets one rail."""
    c = Cluster.preset("dgx-a100x4")
    b1 = 300e9 * 0.8  # NVSwitch per GPU
    b2, a2 = 8 * 25e9 * 0.9, 5e-6  # a node's 8 IB rails together
    group = [0, 1, 8, 9, 16, 17, 24, 25]  # tp rank 0 of the two tp4 groups of each node
    n = 1e9
    alone = collective_time(c, "all_gather", n, group)
    shared = collective_time(c, "all_gather", n, group, concurrent=4)
    intra = (2 - 1) / 2 * n / b1
    # the inter-node level: 2 flows of n/2 per node, over a quarter of the node's ports each; NCCL's
    # ring over all 8 ranks takes 7 steps, each as slow as the inter-node hop
    assert alone.seconds == pytest.approx(intra + 3 / 4 * (n / 2) / (b2 / 2) + 7 * a2, rel=1e-9)
    assert shared.seconds == pytest.approx(intra + 3 / 4 * (n / 2) / (b2 / 4 / 2) + 7 * a2, rel=1e-9)
    # one member per node already rides its own rail: sharing the node's ports with 8 groups changes nothing
    rail = [0, 8, 16, 24]
    assert collective_time(c, "all_gather", n, rail, concurrent=8).seconds == \
        pytest.approx(collective_time(c, "all_gather", n, rail).seconds, rel=1e-12)
    with pytest.raises(ValueError, match="concurrent"):
        collective_time(c, "all_gather", n, group, concurrent=0)
