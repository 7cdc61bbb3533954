"""The polyhedral model over a captured model: every op and edge of a real graph prices, with invariants."""

from __future__ import annotations

import warnings

import polyparallel as pp
from polyparallel import poly
from polyparallel.models import load_model
from polyparallel.transforms import canonicalize, fuse_elementwise


def test_every_op_and_edge_of_a_captured_gpt_prices():
    model, args, kwargs = load_model("gpt-tiny", batch_size=2, seq_len=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = fuse_elementwise(canonicalize(pp.capture(model, args, kwargs)))
    mesh = poly.DeviceMesh.of(dp=2, tp=2)
    poly.clear_cache()
    for op in g.ops:
        legal = poly.legal_placements(g, op, mesh)
        assert legal[0] == poly.Placement()
        for p in legal:
            c = poly.comm_of_op(g, op, p, mesh)
            # splitting only ever shrinks the work of the busiest device
            assert c.flops <= op.flops + 1e-6
    edges = 0
    for op in g.ops:
        for i, t in enumerate(op.inputs):
            if g.tensors[t].is_param or g.producer(t) is None:
                continue
            ec = poly.edge_costs(g, t, op, f"in{i}", mesh)
            edges += 1
            # replicated producer -> replicated consumer moves nothing
            assert ec.cost(0, 0).kind == "none" and ec.cost(0, 0).elements == 0
            for row in (*ec.reshards, *ec.backward):
                for r in row:
                    # a route never receives less than the exact lower bound, forward or backward
                    assert r.elements >= r.direct_elements >= 0
            # replicated both ways: the gradient needs no reshard either
            assert ec.backward_cost(0, 0).kind == "none"
    assert edges > 10
    assert poly.cache_stats()["all"]["hit_rate"] > 0.3  # the two decoder layers share their work
