"""The search's shortcuts give what the plain computation gives: op classes, the DDP bucket recurrence,
graphs re-batched from the anchors."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import polyparallel as pp
from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig
from polyparallel.cost_models import data_parallel as DP
from polyparallel.cost_models.compute import op_classes, op_cost
from polyparallel.cost_models.stage_layout import group_seconds, stage_layouts
from polyparallel.models import GPT, GPTConfig
from polyparallel.planning.model_graphs import Rebatcher, rebatch
from polyparallel.transforms import canonicalize, fuse_elementwise


def _capture(m, b):
    ids = torch.zeros(b, 32, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fuse_elementwise(canonicalize(pp.capture(m, (rebatch(ids, b, b),), {"labels": ids})))


@pytest.fixture(scope="module")
def gpt():
    return GPT(GPTConfig(vocab=128, seq=32, layers=3, hidden=64, heads=4))


def test_ops_of_one_class_cost_the_same_and_layers_share_classes(gpt):
    g = _capture(gpt, 2)
    cls = op_classes(g)
    assert len(cls) == len(g.ops) and len(set(cls)) < len(g.ops)  # the three layers' ops repeat
    dt = Cluster.resolve("dgx-a100x8").device(0).type
    seen: dict[tuple[int, float], tuple[float, float]] = {}
    for c, op in zip(cls, g.ops):
        for split in (1.0, 2.0):
            cost = op_cost(g, op, dt, "bf16", split=split)
            assert seen.setdefault((c, split), (cost.forward, cost.backward)) == (cost.forward, cost.backward)


def test_ddp_exposed_equals_the_bucket_recurrence():
    cl = Cluster.resolve("dgx-a100x8")
    cfg = ParallelConfig(dp=8, devices=tuple(range(8)))
    groups = stage_layouts(cl, cfg, tuple(range(8)))[0].dp_groups
    ccache: dict = {}

    def plain(grad_bytes: float, window: float) -> float:  # the recurrence as documented, bucket by bucket
        sizes = [min(DP.DDP_FIRST_BUCKET_BYTES, grad_bytes)]
        full, tail = divmod(grad_bytes - sizes[0], DP.DDP_BUCKET_BYTES)
        sizes += [DP.DDP_BUCKET_BYTES] * int(full) + ([tail] if tail > 0 else [])
        worst = 0.0
        for grp, gid in groups:
            done = produced = 0.0
            for b in sizes:
                produced += b
                t = group_seconds(cl, {}, (("all_reduce", b),), grp, gid)
                done = max(window * produced / grad_bytes, done) + t
            worst = max(worst, done - window)
        return max(0.0, worst)

    for grad_bytes, window in itertools.product((1e5, 3e7, 25 * 2**20 * 7, 2.3e9), (1e-4, 0.05, 2.0)):
        assert DP.ddp_exposed(cl, ccache, groups, grad_bytes, window) == plain(grad_bytes, window)
        assert DP.ddp_exposed(cl, ccache, groups, grad_bytes, window) == plain(grad_bytes, window)  # memoised


def test_rebatcher_serves_every_size_as_a_capture_would(gpt):
    lo, hi = _capture(gpt, 2), _capture(gpt, 4)
    rb = Rebatcher(lo, hi, 2, 4)
    for b in (3, 6):
        assert rb.at(b) == _capture(gpt, b)
    assert rb.at(3) is not rb.at(3) and rb.at(3).ops[0] is not rb.at(3).ops[0]  # each graph owns its ops
