"""CPU framework terms measured by `polyparallel calibrate` and priced by the cost model.

Skinny GEMMs (a Linear layer on few tokens), the optimizer step per parameter element and
gradient accumulation across micro-batches: each measurement recovers known synthetic
parameters, each price equals its closed form, and a bad calibration entry is a clear error.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from polyparallel.cluster import Cluster, ClusterSpecError
from polyparallel.cost_models import ParallelConfig, estimate_step
from polyparallel.cost_models import calibrate as cal_mod
from polyparallel.cost_models.compute import gemm_rate, gemm_shape, op_cost
from polyparallel.cost_models.optimizer import optimizer_element_time
from polyparallel.cost_models.synthetic import mlp_graph
from polyparallel.ir import TensorKind

from .test_calibrate import _calibration

SMALL, LARGE = (1, 2, 4, 8, 16, 32), (256, 1024)


def _power_rate(role: str, s: float, big: float) -> float:
    """A known skinny-GEMM rate, a power law in s and L (log-log interpolation is exact on it)."""
    return (3e8 if role == "out" else 1e8) * s**0.8 * (big / 256) ** 0.25


def _gemm_rows() -> list[dict]:
    return [{"role": role, "small": s, "large": big, "flops": 2.0 * s * big * big,
             "seconds": 2.0 * s * big * big / _power_rate(role, s, big)}
            for big in LARGE for s in SMALL for role in ("out", "reduce")]


def _cpu(tmp_path, monkeypatch, edit=None, procs: int = 1):
    cal = _calibration()
    for k in cal["per_processes"].values():
        k["memory_bandwidth"], k["launch_overhead"] = 1e18, 0.0  # only the GEMMs and the new terms cost
        k["gemm"] = _gemm_rows()
    if edit:
        edit(cal)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(path))
    return Cluster.preset(f"local-cpu:{procs}")


def _square_rate(cl: Cluster, flops: float) -> float:
    from polyparallel.cost_models.compute import _curve_rate

    return _curve_rate(cl.device(0).type.curve("fp32"), flops)


# -- skinny GEMMs ----------------------------------------------------------------------------------


def test_gemm_shape_reads_rows_reduction_and_columns_from_the_nest():
    g = mlp_graph(batch=8, widths=(64, 256), bias=True)
    lin = g.ops[0]
    assert gemm_shape(lin) == (8, 64, 256)  # x[b, k] · W[n, k]ᵀ: m = b, k = in-features, n = out-features
    assert gemm_shape(lin, split=4) == (8, 64, 64)  # a tensor-parallel split divides the largest side
    relu = next(op for op in g.ops if op.kind.value == "elementwise")
    assert gemm_shape(relu) is None


def test_gemm_rate_interpolates_the_measured_rows_exactly_on_a_power_law(tmp_path, monkeypatch):
    dt = _cpu(tmp_path, monkeypatch).device(0).type
    assert len(dt.gemm_rates) == len(SMALL) * len(LARGE) * 2
    # on measured points, between them (s = 3, L = 512) and in both roles: the power law itself
    for m, k, n, role, s, big in ((2, 1024, 1024, "out", 2, 1024), (1024, 2, 1024, "reduce", 2, 1024),
                                  (512, 512, 3, "out", 3, 512), (512, 3, 512, "reduce", 3, 512),
                                  (6, 300, 300, "out", 6, 300)):
        assert gemm_rate(dt, m, k, n) == pytest.approx(_power_rate(role, s, big), rel=1e-9)
    # clamped outside the measured L; not skinny (no penalty) above the largest measured s
    assert gemm_rate(dt, 4, 4096, 4096) == pytest.approx(_power_rate("out", 4, 1024), rel=1e-9)
    assert gemm_rate(dt, 64, 512, 512) == math.inf
    # a device without rows prices by the square curve alone
    assert gemm_rate(dataclasses.replace(dt, gemm_rates=()), 2, 1024, 1024) == math.inf


def test_contraction_forward_and_backward_gemms_are_each_priced_at_their_shape(tmp_path, monkeypatch):
    cl = _cpu(tmp_path, monkeypatch)
    dt = cl.device(0).type
    g = mlp_graph(batch=4, widths=(512, 512), bias=False)
    lin = g.ops[0]
    f = float(lin.flops)
    c = op_cost(g, lin, dt)
    sq = _square_rate(cl, f)
    # forward (4 × 512)·(512 × 512): "out" at s = 4; input gradient (4 × 512)·(512 × 512): the same;
    # weight gradient (512 × 4)·(4 × 512): "reduce" at s = 4; each capped by the square curve
    r_out, r_red = min(sq, _power_rate("out", 4, 512)), min(sq, _power_rate("reduce", 4, 512))
    assert c.forward == pytest.approx(f / r_out, rel=1e-9)
    assert c.backward == pytest.approx(f / r_out + f / r_red, rel=1e-9)
    # without rows: the FLOP-indexed square curve, backward 2x forward
    plain = op_cost(g, lin, dataclasses.replace(dt, gemm_rates=()))
    assert plain.forward == pytest.approx(f / sq, rel=1e-9) and plain.backward == pytest.approx(2 * f / sq)
    assert c.forward > 2 * plain.forward  # a 4-token layer is far slower than a square GEMM of its FLOPs


def test_step_compute_of_a_micro_batched_mlp_is_the_sum_of_its_gemms(tmp_path, monkeypatch):
    cl = _cpu(tmp_path, monkeypatch)
    g = mlp_graph(batch=2, widths=(256, 256, 256), bias=False)
    est = estimate_step(g, cl, ParallelConfig(optimizer="sgd", microbatches=4))
    want = 0.0
    for op in g.ops:
        if op.kind.value != "contraction":
            continue
        m, k, n = gemm_shape(op)
        sq = _square_rate(cl, op.flops)
        want += op.flops * (2 / min(sq, _power_rate("out", m, math.sqrt(k * n))) +
                            1 / min(sq, _power_rate("reduce", m, math.sqrt(k * n))))
    others = sum(op_cost(g, op, cl.device(0).type).total for op in g.ops if op.kind.value != "contraction")
    assert est.breakdown()["compute"] == pytest.approx(4 * (want + others), rel=1e-9)


def test_gemm_rows_measure_both_roles_at_every_size():
    rows = cal_mod.gemm_rows((1, 4), (32,), window=0.001)
    assert [(r["role"], r["small"], r["large"]) for r in rows] == [
        ("out", 1, 32), ("reduce", 1, 32), ("out", 4, 32), ("reduce", 4, 32)]
    assert all(r["flops"] == 2.0 * r["small"] * 32 * 32 and r["seconds"] > 0 for r in rows)


# -- optimizer step per element ----------------------------------------------------------------------


def test_optimizer_element_rate_recovers_a_known_per_tensor_and_per_element_cost(monkeypatch):
    per_tensor, per_element = {"sgd": 4e-6, "adam": 40e-6}, {"sgd": 0.3e-9, "adam": 4e-9}

    def fake_time(fn, window=0.03, windows=5, max_calls=100_000):
        opt = fn.__self__  # opt.step: price it from the optimizer's own tensors
        name = "adam" if isinstance(opt, __import__("torch").optim.Adam) else "sgd"
        ps = [p for grp in opt.param_groups for p in grp["params"]]
        return len(ps) * per_tensor[name] + sum(p.numel() for p in ps) * per_element[name]

    monkeypatch.setattr(cal_mod, "_time", fake_time)
    got = cal_mod.optimizer_element_rates(("sgd", "adam"), working_sets=((2, 64), (3, 1000)))
    assert got == {o: [[128.0, pytest.approx(r, rel=1e-9)], [3000.0, pytest.approx(r, rel=1e-9)]]
                   for o, r in per_element.items()}


def test_optimizer_element_time_interpolates_in_log_elements():
    rates = ((1e4, 1e-9), (1e6, 5e-9))
    assert optimizer_element_time(rates, 1e5) == pytest.approx(3e-9, rel=1e-12)  # halfway in log
    assert optimizer_element_time(rates, 10) == 1e-9 and optimizer_element_time(rates, 1e9) == 5e-9


def test_cpu_optimizer_step_is_elements_times_the_measured_rate_plus_the_per_tensor_cost(tmp_path, monkeypatch):
    rates = [[1e4, 1e-9], [1e6, 5e-9]]

    def edit(cal):
        for k in cal["per_processes"].values():
            k["optimizer_element"] = {"adam": rates}
            k["optimizer_tensor_overhead"] = {"adam": 20e-6}

    cl = _cpu(tmp_path, monkeypatch, edit, procs=2)
    g = mlp_graph(batch=8, widths=(256, 256, 256), bias=True)  # 6 parameter tensors
    n = sum(t.numel for t in g.tensors.values() if t.kind is TensorKind.PARAM)
    want = n * optimizer_element_time(rates, n) + 6 * 20e-6
    assert estimate_step(g, cl, ParallelConfig(dp=2)).breakdown()["optimizer"] == pytest.approx(want, rel=1e-12)
    # ZeRO shards the state: half the elements, at the smaller working set's rate
    z = estimate_step(g, cl, ParallelConfig(dp=2, zero_stage=1)).breakdown()["optimizer"]
    assert z == pytest.approx(n / 2 * optimizer_element_time(rates, n / 2) + 6 * 20e-6, rel=1e-12)
    # an optimizer without per-element rows keeps the streaming price
    sgd = estimate_step(g, cl, ParallelConfig(dp=2, optimizer="sgd")).breakdown()["optimizer"]
    assert sgd == pytest.approx(3 * 4 * n / (1e18 * 0.8), rel=1e-9)


# -- gradient accumulation ---------------------------------------------------------------------------


def test_grad_accumulation_rate_is_the_median_pairwise_difference_per_element(monkeypatch):
    fresh, extra, width = 1e-3, 0.5e-3, 64

    class Clock:  # each pair reads the clock 3 times: start, after the fresh, after the accumulating pass
        def __init__(self):
            self.calls, self.now = 0, 0.0

        def perf_counter(self):
            step = (1.0, fresh, fresh + extra)[self.calls % 3]
            self.calls += 1
            self.now += step
            return self.now

    monkeypatch.setattr(cal_mod, "time", Clock())
    assert cal_mod.grad_accumulation_rate(width=width, tokens=2, pairs=5) == pytest.approx(extra / width**2)


def test_micro_batches_after_the_first_pay_the_measured_gradient_accumulation(tmp_path, monkeypatch):
    a = 2e-9
    g = mlp_graph(batch=2, widths=(128, 128, 128), bias=True)
    n = sum(t.numel for t in g.tensors.values() if t.kind is TensorKind.PARAM)
    comp = {}
    for acc in (0.0, a):
        def edit(cal, acc=acc):
            cal["per_processes"]["1"]["grad_accumulation"] = acc

        cl = _cpu(tmp_path, monkeypatch, edit)
        for m in (1, 4):
            est = estimate_step(g, cl, ParallelConfig(optimizer="sgd", microbatches=m))
            comp[acc, m] = est.breakdown()["compute"]
            assert sum(est.breakdown().values()) == pytest.approx(est.step_time, rel=1e-12)
    assert comp[a, 1] == pytest.approx(comp[0.0, 1], rel=1e-12)  # one micro-batch stores its gradient
    assert comp[a, 4] - comp[0.0, 4] == pytest.approx(3 * n * a, rel=1e-9)  # three accumulate into it


# -- bad calibration files ---------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value", "says"), [
    ("gemm", [{"role": "sideways", "small": 2, "large": 64, "seconds": 1e-5}], "role 'out' or 'reduce'"),
    ("gemm", [{"role": "out", "small": 2, "large": 64, "seconds": -1.0}], "seconds > 0"),
    ("gemm", [{"role": "out", "small": 2}], "malformed"),
    ("optimizer_element", {"adam": [[0, 1e-9]]}, "elements > 0"),
    ("optimizer_element", {"adam": "fast"}, "malformed"),
    ("grad_accumulation", -1e-9, "negative"),
])
def test_a_bad_framework_entry_in_the_calibration_file_is_a_clear_error(tmp_path, monkeypatch, key, value, says):
    def edit(cal):
        cal["per_processes"]["2"][key] = value

    with pytest.raises(ClusterSpecError) as e:
        _cpu(tmp_path, monkeypatch, edit, procs=2)
    msg = str(e.value)
    assert says in msg and "cal.json" in msg and "per_processes[2]" in msg and "polyparallel calibrate" in msg


# -- DTensor: tensor-parallel kernels and the optimizer per sharded tensor ---------------------------


def test_tp_kernel_overhead_recovers_the_per_kernel_cost_of_a_timed_column_linear():
    delta, plain = 30e-6, 400e-6
    column = plain + 2 * delta  # one forward and one weight-gradient kernel, no collective
    assert cal_mod.tp_kernel_overhead(column, plain) == pytest.approx(delta, rel=1e-12)
    assert cal_mod.tp_kernel_overhead(plain - 1e-6, plain) == 0.0  # never negative


def _dtensor_edit(cal):
    for p in ("2", "4"):
        k = cal["per_processes"][p]
        k["dtensor_overhead"], k["tp_op_overhead"] = 5e-6, 30e-6 * int(p)
        k["optimizer_tensor_overhead"] = {"adam": 20e-6}
        k["optimizer_dtensor_overhead"] = {"adam": 300e-6}


def test_tensor_parallel_ops_pay_the_measured_tp_kernel_overhead(tmp_path, monkeypatch):
    cl = _cpu(tmp_path, monkeypatch, _dtensor_edit, procs=2)
    dt = cl.device(0).type
    assert dt.sharded_op_overhead == 60e-6  # the tensor-parallel figure, preferred over the 1-element add
    assert dict(dt.optimizer_dtensor_overhead) == {"adam": 300e-6}
    assert Cluster.preset("local-cpu:3").device(0).type.sharded_op_overhead == 120e-6  # nearest P, larger on a tie
    g = mlp_graph(batch=8, widths=(64, 64), bias=False)
    plain, sharded = op_cost(g, g.ops[0], dt, split=2), op_cost(g, g.ops[0], dt, split=2, sharded=True)
    assert sharded.forward - plain.forward == pytest.approx(60e-6) and \
        sharded.backward - plain.backward == pytest.approx(2 * 60e-6)


def test_optimizer_pays_the_measured_cost_per_sharded_tensor(tmp_path, monkeypatch):
    cl = _cpu(tmp_path, monkeypatch, _dtensor_edit, procs=2)
    g = mlp_graph(batch=8, widths=(256, 256, 256), bias=True)  # 6 parameter tensors, all split by tp
    n = sum(t.numel for t in g.tensors.values() if t.kind is TensorKind.PARAM)
    stream = 4 * 18 * n / (1e18 * 0.8)  # Adam's accesses at an unbounded bandwidth
    # plain DDP: every tensor plain; FSDP2: every tensor a DTensor (and half the elements)
    ddp = estimate_step(g, cl, ParallelConfig(dp=2)).breakdown()["optimizer"]
    assert ddp == pytest.approx(stream + 6 * 20e-6, rel=1e-9)
    fsdp = estimate_step(g, cl, ParallelConfig(dp=2, zero_stage=3)).breakdown()["optimizer"]
    assert fsdp == pytest.approx(stream / 2 + 6 * 300e-6, rel=1e-9)
    # tensor parallel: the split tensors are DTensors, the others plain (the step model splits all six here)
    tp = estimate_step(g, cl, ParallelConfig(tp=2)).breakdown()["optimizer"]
    assert tp == pytest.approx(stream / 2 + 6 * 300e-6, rel=1e-9)
    # without the per-sharded-tensor figure: the plain cost plus Adam's 9 kernels' DTensor dispatch each
    def no_dt(cal):
        _dtensor_edit(cal)
        for k in cal["per_processes"].values():
            k.pop("optimizer_dtensor_overhead", None)

    old = estimate_step(g, _cpu(tmp_path, monkeypatch, no_dt, procs=2), ParallelConfig(dp=2, zero_stage=3))
    assert old.breakdown()["optimizer"] == pytest.approx(stream / 2 + 6 * 20e-6 + 9 * 6 * 60e-6, rel=1e-9)


def test_a_fused_linear_relu_keeps_its_gemm_price_in_eager_mode(tmp_path, monkeypatch):
    from polyparallel.transforms import fuse_elementwise

    cl = _cpu(tmp_path, monkeypatch)
    dt = cl.device(0).type
    g = fuse_elementwise(mlp_graph(batch=4, widths=(512, 512, 512), bias=False))
    lin = next(op for op in g.ops if op.attr.get("fused"))  # the hidden Linear with its ReLU absorbed
    f = float(lin.flops)  # the GEMM's and the absorbed ReLU's, one kernel
    sq = _square_rate(cl, f)
    want = f / min(sq, _power_rate("out", 4, 512))
    # eager runs the ReLU as its own kernel (free here: unbounded bandwidth, no floor): the GEMM's price stays
    for eager in (False, True):
        c = op_cost(g, lin, dt, eager=eager)
        assert c.forward == pytest.approx(want, rel=1e-6)
