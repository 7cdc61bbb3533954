"""ZeRO-1 whose gradients are all-reduced (``grad_reduce="all_reduce"``: DeepSpeed's BF16_Optimizer)
against the ring collectives by hand: an all-reduce of the fp32 gradients and an all-gather of the
16-bit weights, after the last backward."""

from __future__ import annotations

import pytest

from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, estimate_step
from polyparallel.cost_models.synthetic import mlp_graph

BW, ALPHA = 100e9, 5e-6


def _node(p: int) -> Cluster:
    return Cluster.from_dict({"name": "n", "centers": [{"name": "c", "nodes": [
        {"device": "h100-sxm", "devices_per_node": p, "intra": {"bandwidth": BW, "latency": ALPHA}}]}]})


def test_all_reduce_zero1_by_hand():
    g = mlp_graph(batch=32, widths=(64, 128, 128), classes=10)
    n = g.param_count()
    est = estimate_step(g, _node(2), ParallelConfig(dp=2, zero_stage=1, dtype="bf16", grad_overlap=0.0,
                                                     grad_reduce="all_reduce"))
    # two ranks: the all-reduce sends and receives the whole fp32 gradient once, the all-gather
    # half of the bf16 weights; each pays the link latency per ring step
    all_reduce = 4 * n / BW + 2 * ALPHA
    all_gather = 2 * n / 2 / BW + ALPHA
    loss = 32 / BW + 2 * ALPHA  # the step's loss and target count, all-reduced over the replicas
    assert est.stages[0].part("data_parallel") == pytest.approx(all_reduce + all_gather + loss)
    kinds = dict(est.stages[0].collectives)
    assert "data_parallel all_reduce+all_gather (before overlap)" in kinds


def test_all_reduce_costs_more_than_reduce_scatter_in_a_pipeline():
    g = mlp_graph(batch=32, widths=(256, 256, 256, 256), classes=10)
    base = dict(dp=2, pp=2, microbatches=4, zero_stage=1, dtype="bf16", grad_overlap=0.0)
    rs = estimate_step(g, _node(4), ParallelConfig(**base))
    ar = estimate_step(g, _node(4), ParallelConfig(**base, grad_reduce="all_reduce"))
    for a, b, mem in zip(ar.stages, rs.stages, ar.memory):
        grads = 2 * mem.term("weights")  # the stage's fp32 gradients: twice its bf16 weights
        # ring over two ranks: the all-reduce moves the whole gradient (two latencies), the
        # reduce-scatter half of it (one)
        assert a.part("data_parallel") - b.part("data_parallel") == pytest.approx(grads / 2 / BW + ALPHA)
        assert a.part("compute") == b.part("compute")


@pytest.mark.parametrize("cfg", [ParallelConfig(dp=2, grad_reduce="all_reduce"),
                                 ParallelConfig(dp=2, zero_stage=2, grad_reduce="all_reduce"),
                                 ParallelConfig(dp=2, zero_stage=1, grad_reduce="allreduce")])
def test_grad_reduce_refused_outside_zero1(cfg):
    with pytest.raises(ValueError, match="grad_reduce"):
        cfg.validate()
