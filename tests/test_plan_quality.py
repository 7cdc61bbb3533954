"""The search's plan equals a brute force over the same plan space and placement candidates.

The brute force (``benchmarks/plan_quality.brute_force``) prices every mesh shape, micro-batch size,
schedule, memory rung and placement candidate in full, without the search's pruning or bound; the
search must find a plan of the same step time on small cases.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import polyparallel.planning.plan_search as ps
from benchmarks.plan_quality import brute_force
from polyparallel.cluster import Cluster
from polyparallel.models import GPT, MLP, GPTConfig, Llama, LlamaConfig
from polyparallel.planning import search
from polyparallel.planning.model_graphs import ModelGraphs


def _gpt():
    ids = torch.zeros(2, 32, dtype=torch.long)
    return GPT(GPTConfig(vocab=256, seq=32, layers=2, hidden=64, heads=4)), (ids,), {"labels": ids}


def _llama():
    ids = torch.zeros(2, 32, dtype=torch.long)
    return Llama(LlamaConfig(vocab=256, seq=32, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128)), (ids,), \
        {"labels": ids}


def _mlp():
    return MLP((64, 256, 256, 10)), (torch.zeros(2, 64),), {}


@pytest.mark.parametrize("build,cluster,B", [(_gpt, "dgx-a100x1", 32), (_llama, "dgx-a100x1", 16),
                                             (_mlp, "local-cpu:4", 16)])
def test_search_finds_the_brute_force_optimum(build, cluster, B, monkeypatch):
    warnings.simplefilter("ignore")
    m, a, k = build()
    shared = ModelGraphs(m, a, k)
    monkeypatch.setattr(ps, "ModelGraphs", lambda *_, **__: shared)
    cl = Cluster.resolve(cluster)
    s = search(m, a, cl, example_kwargs=k, batch_size=B, constraints={"mode": "synchronous"})
    best, priced = brute_force(shared, cl, B)
    assert best is not None and priced > 20
    assert s.estimate.step_time_s == pytest.approx(best.step_time, rel=1e-9), (
        f"search {s.dp}/{s.tp}/{s.pp}/{s.sp} m{s.microbatches} vs brute force {best.config}")


def test_derived_plans_of_a_rebatched_graph_are_the_anchors_interpolated():
    """The search prices a re-batched graph's derived placements by interpolating the two anchor
    captures' OpPlans; they must equal the OpPlans priced op by op on that graph."""
    from polyparallel.cost_models import ParallelConfig
    from polyparallel.planning.derived import derived_plans, variants

    warnings.simplefilter("ignore")
    m, a, k = _llama()
    mdl = ModelGraphs(m, a, k)
    cl = Cluster.resolve("dgx-a100x1")
    g = mdl.graph(8)
    assert mdl.affine_of(g) is not None  # re-batched from the anchors, not captured
    cfg = ParallelConfig(tp=4, dp=2, dtype="bf16")
    fast = variants(g, mdl.graph(2), cl, cfg, "torch", mdl.affine_of)[0]
    slow = derived_plans(g, mdl.graph(2), cl, cfg, "torch")
    assert fast is not None and fast.source == "derived" and fast is not slow and fast.placements == slow.placements
    for x, y in zip(fast, slow):
        assert (x.split, x.param_split, [kd for kd, _ in x.tp_fwd + x.tp_bwd]) == \
            (y.split, y.param_split, [kd for kd, _ in y.tp_fwd + y.tp_bwd])
        for (_, bx), (_, by) in zip(x.tp_fwd + x.tp_bwd, y.tp_fwd + y.tp_bwd):
            assert bx == pytest.approx(by, rel=1e-12)
