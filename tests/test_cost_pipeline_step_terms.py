"""What a pipeline step pays besides its stages' work, against the collectives by hand: the
gradient of a weight two stages share (a tied embedding and output head) all-reduced over them,
the micro-batch losses all-reduced over the world, and CPU stages' transfers as host work on both
ends."""

from __future__ import annotations

import pytest

from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, estimate_step
from polyparallel.cost_models.comm import p2p_time
from polyparallel.cost_models.synthetic import gpt_graph

BW, ALPHA = 100e9, 5e-6
V, H, S, B = 256, 64, 32, 2


def _node(p: int) -> Cluster:
    return Cluster.from_dict({"name": "n", "centers": [{"name": "c", "nodes": [
        {"device": "h100-sxm", "devices_per_node": p, "intra": {"bandwidth": BW, "latency": ALPHA}}]}]})


def _ar2(n: float) -> float:  # ring all-reduce over two ranks: the buffer once, two latencies
    return n / BW + 2 * ALPHA


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tied_embedding_gradient_all_reduced_over_its_stages(dtype):
    cfg = ParallelConfig(pp=2, microbatches=4, partition="layers", dtype=dtype)
    tied = estimate_step(gpt_graph(layers=4, hidden=H, heads=4, seq=S, vocab=V, batch=B), _node(2), cfg)
    untied = estimate_step(gpt_graph(layers=4, hidden=H, heads=4, seq=S, vocab=V, batch=B, tied=False),
                           _node(2), cfg)
    loss = _ar2(32)  # the micro-batch losses and target counts, over the world (two ranks)
    for st in untied.stages:
        assert st.part("data_parallel") == pytest.approx(loss)
    # the shared V x H weight's fp32 gradient (fp32 master weights under bf16 too), on both stages
    for st in tied.stages:
        assert st.part("data_parallel") == pytest.approx(loss + _ar2(4 * V * H))


def test_a_world_of_four_all_reduces_the_pipeline_loss_over_all_ranks():
    cfg = ParallelConfig(pp=4, microbatches=4, partition="layers")
    est = estimate_step(gpt_graph(layers=4, hidden=H, heads=4, seq=S, vocab=V, batch=B, tied=False), _node(4), cfg)
    ring4 = 2 * 3 / 4 * 32 / BW + 2 * 3 * ALPHA  # ring over four: 2(p-1)/p of the buffer, 2(p-1) latencies
    tree4 = 2 * 2 * ALPHA + 2 * 32 / BW  # a tree reduces then broadcasts: log2(p) latencies and the buffer each way
    for st in est.stages:  # the cheaper of the two, as NCCL picks the tree for small buffers
        assert st.part("data_parallel") == pytest.approx(min(ring4, tree4))


def test_cpu_stages_pay_each_transfer_on_both_ends():
    cl = Cluster.preset("local-cpu:2")
    m = 4
    g = gpt_graph(layers=4, hidden=H, heads=4, seq=S, vocab=V, batch=B, tied=False)
    est = estimate_step(g, cl, ParallelConfig(pp=2, microbatches=m, partition="layers"))
    hop = p2p_time(cl, 0, 1, B * S * H * 4)  # the fp32 residual stream, the one tensor crossing the cut
    for st in est.stages:
        # per micro-batch: the activation in the forward, its gradient in the backward, both ends busy
        assert st.part("p2p") == pytest.approx(2 * m * hop)
    gpu = estimate_step(g, _node(2), ParallelConfig(pp=2, microbatches=m, partition="layers"))
    gpu_hop = p2p_time(_node(2), 0, 1, B * S * H * 4)
    # GPUs' transfers are asynchronous: they show only as the waiting they cause
    assert gpu.stages[0].part("p2p") <= 2 * m * gpu_hop
    assert dict(gpu.stages[0].collectives)["p2p"] == pytest.approx(2 * m * gpu_hop)
