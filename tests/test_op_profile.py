"""The profiled CPU prices (cost_models/op_profile.py, backends/torch/op_timing.py): the fit, the
attribution of measured nodes to priced ops, the prices a profile gives against their closed form,
and a real measurement."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from polyparallel.backends.torch.op_timing import measure_nodes, profiled_cluster
from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, estimate_step
from polyparallel.cost_models.compute import op_cost
from polyparallel.cost_models.op_profile import OpProfile, fingerprint, with_profile
from polyparallel.cost_models.profile_fit import _attribute
from polyparallel.models import MLP
from polyparallel.planning.model_graphs import ModelGraphs
from tests.test_calibrate import _calibration


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    """local-cpu clusters priced from a synthetic calibration of known rates (test_calibrate's)."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_calibration()))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(path))


def _mlp(widths=(32, 64, 64, 10)):
    torch.manual_seed(0)
    return MLP(widths), (torch.randn(4, widths[0]), torch.randint(0, widths[-1], (4,)))


def test_a_curve_is_the_line_through_the_measured_points_around_the_price():
    from polyparallel.cost_models.op_profile import on_curve

    pts = ((1e-4, 3e-4), (2e-4, 5e-4), (4e-4, 1.3e-3))  # steeper between the last two (out of cache)
    assert on_curve(pts, 1.5e-4) == pytest.approx(4e-4)  # halfway between the first two
    assert on_curve(pts, 3e-4) == pytest.approx(9e-4)
    assert on_curve(pts, 8e-4) == pytest.approx(1.3e-3 + 4 * 8e-4 - 4 * 4e-4)  # the last segment, extended
    assert on_curve(pts, 5e-5) == pytest.approx(2e-4)  # the first, extended down
    assert on_curve(((2e-4, 6e-4),), 1e-4) == pytest.approx(3e-4)  # one point: in proportion


def test_a_curve_falls_back_to_the_pooled_ratio_where_its_points_are_not_a_rising_line():
    from polyparallel.cost_models.op_profile import on_curve

    # slower at the smaller size (noise): no falling line, the pooled ratio instead
    assert on_curve(((1e-4, 5e-4), (4e-4, 4e-4)), 2e-4) == pytest.approx(9e-4 / 5e-4 * 2e-4)
    # a roofline that does not grow with the batch (a batch-independent op): the ratio
    assert on_curve(((1e-5, 2e-5), (1e-5, 2.2e-5)), 2e-5) == pytest.approx(4.2e-5 / 2e-5 * 2e-5)
    # an op the roofline prices at nothing (a view) costs what was measured
    assert on_curve(((0.0, 4e-6), (0.0, 6e-6)), 0.0) == pytest.approx(5e-6)
    # below the first point a steep line would go under proportional scaling: not below it
    assert on_curve(((1e-4, 1e-4), (2e-4, 5e-4)), 2e-5) == pytest.approx(2e-5)


def test_unpriced_nodes_are_charged_to_the_op_before_them():
    m, (x, y) = _mlp()
    g = ModelGraphs(m, (x, y), None).graph(4)
    ops = [op.source_node or op.name for op in g.ops]
    rows = [("prelude", 1.0, 10.0)] + [(n, 2.0, 20.0) for n in ops[:2]] + [("view_x", 0.5, 5.0)] + \
        [(n, 2.0, 20.0) for n in ops[2:]]
    got = _attribute(rows, g)
    # the node before any op goes to the first op; view_x to the op it follows
    assert got[g.ops[0].name] == (3.0, 30.0)
    assert got[g.ops[1].name] == (2.5, 25.0)
    assert sum(f for f, _ in got.values()) == pytest.approx(sum(r[1] for r in rows))
    assert sum(b for _, b in got.values()) == pytest.approx(sum(r[2] for r in rows))


def _profile_of(g, lines_by_world, opt=(), wrappers=()):
    """A profile whose every op lies on the line ``(a_f, c_f, a_b, c_b)`` of its world: two points
    spanning any roofline price these models have."""
    names = [op.name for op in g.ops]

    def curve(a, c):
        return tuple((r, a + c * r) for r in (0.0, 10.0))

    return OpProfile(fingerprint(g), tuple((w, tuple((n, curve(a_f, c_f), curve(a_b, c_b)) for n in names))
                                           for w, (a_f, c_f, a_b, c_b) in lines_by_world),
                     tuple(opt), (2, 4), "test profile", tuple(wrappers))


def test_a_profile_prices_each_op_on_its_line_through_the_roofline(calibrated):
    m, (x, y) = _mlp()
    mg = ModelGraphs(m, (x, y), None)
    cl = Cluster.preset("local-cpu:2")
    dt = cl.device(0).type
    one, two = (1e-5, 2.0, 3e-5, 4.0), (2e-5, 3.0, 5e-5, 7.0)
    prof = _profile_of(mg.graph(4), [(1, one), (2, two)], opt=[(1, (("sgd", 1.5),)), (2, (("sgd", 2.5),))])
    pcl = with_profile(cl, prof)
    assert "test profile" in pcl.device(0).type.source

    def closed_form(g, line):
        a_f, c_f, a_b, c_b = line
        roof = [op_cost(g, op, dt, eager=True) for op in g.ops]
        return sum(a_f + c_f * r.forward + a_b + c_b * r.backward for r in roof)

    g8 = mg.graph(8)  # another batch of the same model: the same profile
    plain = estimate_step(g8, cl, ParallelConfig(optimizer="sgd")).breakdown()
    est = estimate_step(g8, pcl, ParallelConfig(optimizer="sgd")).breakdown()
    assert est["compute"] == pytest.approx(closed_form(g8, one), rel=1e-9)
    assert est["optimizer"] == pytest.approx(1.5 * plain["optimizer"], rel=1e-9)
    # two data-parallel ranks: each prices its half batch on the line measured with two processes
    est2 = estimate_step(mg.graph(4), pcl, ParallelConfig(dp=2, optimizer="sgd")).breakdown()
    plain2 = estimate_step(mg.graph(4), cl, ParallelConfig(dp=2, optimizer="sgd")).breakdown()
    assert est2["compute"] == pytest.approx(closed_form(mg.graph(4), two), rel=1e-9)
    assert est2["optimizer"] == pytest.approx(2.5 * plain2["optimizer"], rel=1e-9)
    # another model is priced from the calibration alone
    om, (ox, oy) = _mlp((32, 48, 10))
    other = ModelGraphs(om, (ox, oy), None).graph(4)
    assert estimate_step(other, pcl, ParallelConfig(optimizer="sgd")).step_time == pytest.approx(
        estimate_step(other, cl, ParallelConfig(optimizer="sgd")).step_time)


def test_measured_nodes_are_the_exported_graphs_and_add_up_to_the_step():
    m, (x, y) = _mlp()
    rows, plain = measure_nodes(m, (x, y), {}, steps=3, warmup=1)
    g = ModelGraphs(m, (x, y), None).graph(4)
    names = [r[0] for r in rows]
    # every priced op was timed, in execution order
    ops = [op.source_node for op in g.ops]
    assert [n for n in names if n in ops] == ops
    by = {n: (f, b) for n, f, b in rows}
    linears = [op.source_node for op in g.ops if op.kind.value == "contraction"]
    assert all(by[n][0] > 0 and by[n][1] > 0 for n in linears)
    assert plain["forward"] > 0 and plain["backward"] > 0
    # the model was not trained by being measured
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), _mlp()[0].parameters(), strict=True))


def test_profiling_refuses_what_it_cannot_measure(tmp_path, monkeypatch):
    m, (x, y) = _mlp()
    mg = ModelGraphs(m, (x, y), None)
    with pytest.raises(ValueError, match="local-cpu"):
        profiled_cluster(Cluster.preset("dgx-a100"), mg)
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match="polyparallel calibrate"):
        profiled_cluster(Cluster.preset("local-cpu:2"), mg)


def test_a_profiled_search_measures_the_model_and_says_so(calibrated):
    import polyparallel as pp

    m, (x, y) = _mlp()
    said = []
    s = pp.search(m, (x, y), "local-cpu:2", batch_size=8, profile=True, progress=said.append)
    assert any("profiling" in line for line in said)
    src = s.cluster["device_types"]["cpu-process"]["source"]
    assert "ops profiled on this machine" in src and "2 procs x" in src
    assert s.estimate.step_time_s > 0
    assert not any("--profile" in n for n in s.search.notes)
    # without it, the notes say what the prices rest on and how to measure instead
    plain = pp.search(m, (x, y), "local-cpu:2", batch_size=8)
    assert any("--profile" in n for n in plain.search.notes)


def test_fsdp_is_priced_with_what_the_wrapper_was_measured_to_add(calibrated):
    m, (x, y) = _mlp()
    g = ModelGraphs(m, (x, y), None).graph(4)
    cl = Cluster.preset("local-cpu:2")
    line, opt = (1e-5, 2.0, 3e-5, 4.0), [(2, (("sgd", 1.0),))]
    bare = with_profile(cl, _profile_of(g, [(2, line)], opt=opt))
    over = (4e-4, 7e-4, 2e-3)
    wrapped = with_profile(cl, _profile_of(g, [(2, line)], opt=opt, wrappers=[(2, (("zero3/sgd", *over),))]))
    cfg = ParallelConfig(dp=2, zero_stage=3, optimizer="sgd")
    a, b = estimate_step(g, bare, cfg), estimate_step(g, wrapped, cfg)
    # the measured forward and backward overheads add to the step in place of the copies FSDP2 is
    # priced with otherwise: every layer's gathered weights copied out of the collective's buffer in
    # the forward and again in the backward, and its gradients into the reduce-scatter's, each a read
    # and a write of 4 bytes per element; the optimizer's DTensor part is the measured one
    from polyparallel.cost_models.compute import streaming_bandwidth

    copies = 3 * 8 * g.param_count() / streaming_bandwidth(cl.device(0).type)
    ba, bb = a.breakdown(), b.breakdown()
    assert bb["optimizer"] == pytest.approx(ba["optimizer"] - _sharded_extra(g, cl, cfg) + over[2], rel=1e-6)
    assert b.step_time - bb["optimizer"] == pytest.approx(a.step_time - ba["optimizer"] - copies + over[0] + over[1],
                                                          rel=1e-6)
    # DDP (ZeRO 0) does not take FSDP's overheads
    ddp = ParallelConfig(dp=2, optimizer="sgd")
    assert estimate_step(g, wrapped, ddp).step_time == pytest.approx(estimate_step(g, bare, ddp).step_time)


def test_a_bf16_plan_is_priced_from_the_calibration_alone(calibrated):
    # the profile measured fp32 training: none of its parts (ops, optimizer ratio, FSDP's overheads)
    # prices a bf16 plan, while the fp32 plan takes all of them
    m, (x, y) = _mlp()
    g = ModelGraphs(m, (x, y), None).graph(4)
    cl = Cluster.preset("local-cpu:2")
    prof = _profile_of(g, [(2, (1e-5, 2.0, 3e-5, 4.0))], opt=[(2, (("sgd", 3.0),))],
                       wrappers=[(2, (("zero3/sgd", 4e-4, 7e-4, 2e-3),))])
    pcl = with_profile(cl, prof)
    for zero in (0, 3):
        bf16 = ParallelConfig(dp=2, zero_stage=zero, optimizer="sgd", dtype="bf16")
        assert estimate_step(g, pcl, bf16).step_time == pytest.approx(estimate_step(g, cl, bf16).step_time)
        fp32 = replace(bf16, dtype="fp32")
        assert estimate_step(g, pcl, fp32).step_time != pytest.approx(estimate_step(g, cl, fp32).step_time)


def _sharded_extra(g, cl, cfg):
    """What the calibration adds to FSDP's optimizer step for its DTensors: the step priced with and
    without them (ZeRO-3 with every parameter sharded against the same elements unsharded)."""
    dt = cl.device(0).type
    from polyparallel.cost_models.optimizer import OPTIMIZER_KERNELS

    n = sum(1 for t in g.tensors.values() if t.kind.value == "param")
    per_t = dict(dt.optimizer_tensor_overhead).get("sgd")
    per_d = dict(dt.optimizer_dtensor_overhead).get("sgd")
    if per_t is not None and per_d is not None:
        return n * (per_d - per_t)
    return OPTIMIZER_KERNELS.get("sgd", 9) * n * dt.sharded_op_overhead


def test_a_sharded_op_pays_the_measured_dtensor_dispatch(calibrated):
    from polyparallel.cost_models.op_profile import profiled_op

    m, (x, y) = _mlp()
    g = ModelGraphs(m, (x, y), None).graph(4)
    cl = Cluster.preset("local-cpu:2")
    line = (1e-5, 2.0, 3e-5, 4.0)
    pcl = with_profile(cl, _profile_of(g, [(2, line)], wrappers=[(2, (("tp/op", 1e-3, 2e-3, 0.0),))]))
    dt, op = pcl.device(0).type, g.ops[0]
    plain = profiled_op(g, op, dt, 2, 2.0, False, "fp32")
    r = op_cost(g, op, cl.device(0).type, split=2.0, eager=True)
    # the shard's own roofline on the line, and the measured dispatch on top when its weights are DTensors
    assert plain == (pytest.approx(1e-5 + 2.0 * r.forward), pytest.approx(3e-5 + 4.0 * r.backward))
    sharded = profiled_op(g, op, dt, 2, 2.0, True, "fp32")
    assert sharded == (pytest.approx(plain[0] + 1e-3), pytest.approx(plain[1] + 2e-3))
    # bf16 is not what was measured: no profiled price
    assert profiled_op(g, op, dt, 2, 2.0, False, "bf16") is None


def test_collectives_are_priced_at_the_link_the_profile_measured(calibrated):
    m, (x, y) = _mlp()
    g = ModelGraphs(m, (x, y), None).graph(4)
    cl = Cluster.preset("local-cpu:2")
    alpha, bw = 1e-3, 2e8
    pcl = with_profile(cl, _profile_of(g, [(2, (0.0, 1.0, 0.0, 2.0))]), link=(alpha, bw))
    assert (pcl.nodes[0].intra.latency, pcl.nodes[0].intra.bandwidth) == (alpha, bw)
    dp = estimate_step(g, pcl, ParallelConfig(dp=2, optimizer="sgd")).breakdown()["data_parallel"]
    grads = 4 * sum(t.numel for t in g.tensors.values() if t.kind.value == "param")
    # ring all-reduces over 2 processes, 2(p-1)α + 2(p-1)/p · n/B: the fp32 gradients, and the step's
    # loss and target count (4 float64)
    assert dp == pytest.approx(2 * alpha + grads / bw + 2 * alpha + 32 / bw, rel=1e-6)


class _BNNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                        torch.nn.Conv2d(8, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                        torch.nn.Linear(4 * 4 * 4, 5))

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.body(x), y)


def test_cross_rank_batchnorm_collectives_are_priced(calibrated):
    # the torch backend computes training-mode BatchNorm over the replicas: per op two all-reduces in
    # the forward (sums and count, 8(C+1) bytes; squared deviations, 8C) and two in the backward
    from polyparallel.cost_models.comm import collective_time

    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    cl = Cluster.preset("local-cpu:2")
    train, frozen = _BNNet(), _BNNet()
    frozen.eval()  # running statistics: nothing crosses ranks
    cfg = ParallelConfig(dp=2, optimizer="sgd")
    dp_train = estimate_step(ModelGraphs(train, (x, y), None).graph(4), cl, cfg).breakdown()["data_parallel"]
    dp_eval = estimate_step(ModelGraphs(frozen, (x, y), None).graph(4), cl, cfg).breakdown()["data_parallel"]

    def ar(n):
        return collective_time(cl, "all_reduce", n, [0, 1]).seconds

    expected = sum(2 * (ar(8 * (c + 1)) + ar(8 * c)) for c in (8, 4))
    assert dp_train - dp_eval == pytest.approx(expected, rel=1e-6)
