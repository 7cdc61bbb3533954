"""The calibration pipeline: synthetic measurements in, known α/β and throughputs out; one real run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, estimate_step
from polyparallel.cost_models.calibrate import (
    THREADS_PER_PROCESS,
    TRAINING_OP_CLASSES,
    calibrate,
    fit_alpha_beta,
    fit_training_op_overhead,
    slowest_rank,
)
from polyparallel.cost_models.comm import collective_time, ring_time, tree_time
from polyparallel.cost_models.compute import op_cost
from polyparallel.cost_models.synthetic import mlp_graph
from polyparallel.ir import OpKind
from polyparallel.transforms import fuse_elementwise

SIZES = (4096, 65536, 1 << 20, 8 << 20)


def _ring(p: int, n: float, alpha: float, bw: float) -> float:
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bw


def _matmul_rows(rate_of_n: dict[int, float]) -> list[dict[str, float]]:
    return [{"n": n, "flops": 2.0 * n**3, "seconds": 2.0 * n**3 / r} for n, r in rate_of_n.items()]


def _calibration(cores: int = 2) -> dict:
    """A calibration file as `calibrate` writes it, from known rates and a known gloo α/β per group size."""
    rates = {1: {64: 20e9, 256: 40e9, 1024: 50e9}, 2: {64: 15e9, 256: 30e9, 1024: 36e9},
             4: {64: 6e9, 256: 14e9, 1024: 18e9}}
    gloo = {2: (150e-6, 1.5e9), 4: (600e-6, 0.6e9)}
    points = [{"p": p, "bytes": n, "seconds": _ring(p, n, *gloo[p])} for p in gloo for n in SIZES]
    return {
        "cores": cores, "threads_per_process": 1, "memory_bandwidth": 10e9, "launch_overhead": 2e-6,
        "memory_bytes": 16e9, "matmul": {"1": _matmul_rows(rates[1])},
        "per_processes": {str(p): {"matmul": _matmul_rows(r), "memory_bandwidth": 10e9 / p,
                                   "launch_overhead": 2e-6 * p} for p, r in rates.items()},
        "collectives": {"points": points,
                        "fit": fit_alpha_beta([(q["p"], q["bytes"], q["seconds"]) for q in points]),
                        "fit_by_group_size": {str(p): fit_alpha_beta([(q["p"], q["bytes"], q["seconds"])
                                                                      for q in points if q["p"] == p])
                                              for p in gloo}},
    }


def test_fit_recovers_alpha_and_bandwidth_of_exact_ring_times():
    alpha, bw = 80e-6, 2.5e9
    pts = [(p, n, _ring(p, n, alpha, bw)) for p in (2, 3, 4) for n in SIZES]
    fit = fit_alpha_beta(pts)
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-9)
    assert fit["bandwidth"] == pytest.approx(bw, rel=1e-9)
    assert fit["median_rel_error"] < 1e-9


def test_fit_equals_the_closed_form_of_two_points():
    # two (n, t) points of one group size determine α and 1/B: solve the 2x2 system by hand
    p, (n1, t1), (n2, t2) = 3, (1e4, 7e-4), (4e6, 9e-3)
    k = 2 * (p - 1) / p
    inv_b = (t2 - t1) / (k * (n2 - n1))
    alpha = (t1 - k * n1 * inv_b) / (2 * (p - 1))
    fit = fit_alpha_beta([(p, n1, t1), (p, n2, t2)])
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-9)
    assert fit["bandwidth"] == pytest.approx(1 / inv_b, rel=1e-9)


def test_fit_weights_relative_errors_and_stays_non_negative():
    rng = np.random.default_rng(0)
    alpha, bw = 200e-6, 1e9
    pts = [(p, n, _ring(p, n, alpha, bw) * float(rng.uniform(0.95, 1.05))) for p in (2, 4) for n in SIZES
           for _ in range(3)]
    fit = fit_alpha_beta(pts)
    # ±5% noise on every point: the relative-error fit stays within a few percent on both terms
    assert fit["alpha"] == pytest.approx(alpha, rel=0.05)
    assert fit["bandwidth"] == pytest.approx(bw, rel=0.05)
    # latency-free points (pure bandwidth): the fit may not invent a negative latency
    flat = fit_alpha_beta([(2, n, n / 1e9) for n in SIZES])
    assert flat["alpha"] == pytest.approx(0.0, abs=1e-12) and flat["bandwidth"] == pytest.approx(1e9)
    with pytest.raises(ValueError, match="at least 2"):
        fit_alpha_beta([(2, 1e3, 1e-4)])
    with pytest.raises(ValueError, match="p >= 2"):
        fit_alpha_beta([(1, 1e3, 1e-4), (1, 1e6, 1e-3)])


def test_fit_with_a_given_bandwidth_fits_the_latency_alone():
    alpha, bw = 150e-6, 2e9
    pts = [(p, n, _ring(p, n, alpha, bw)) for p in (2, 4) for n in SIZES]
    fit = fit_alpha_beta(pts, bandwidth=bw)
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-9) and fit["bandwidth"] == pytest.approx(bw)
    # flat times (four processes on two cores, every size as slow): the free fit finds no slope, the
    # bounded one keeps the bandwidth and puts the time into the latency; one point is enough for it
    flat = [(4, n, 4e-3) for n in SIZES]
    assert fit_alpha_beta(flat)["bandwidth"] == float("inf")
    one = fit_alpha_beta(flat[:1], bandwidth=bw)
    assert one["alpha"] == pytest.approx((4e-3 - 1.5 * SIZES[0] / bw) / 6, rel=1e-9)


def test_slowest_rank_takes_the_slowest_of_every_quantity():
    a = {"matmul": _matmul_rows({64: 20e9, 256: 40e9}), "memory_bandwidth": 8e9, "launch_overhead": 2e-6}
    b = {"matmul": _matmul_rows({64: 25e9, 256: 30e9}), "memory_bandwidth": 6e9, "launch_overhead": 3e-6}
    m = slowest_rank([a, b])
    assert [r["flops"] / r["seconds"] for r in m["matmul"]] == pytest.approx([20e9, 30e9])
    assert m["memory_bandwidth"] == 6e9 and m["launch_overhead"] == 3e-6


def test_local_cpu_prices_with_the_rates_and_links_measured_for_its_process_count(tmp_path, monkeypatch):
    cal = _calibration()
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(path))
    for p, rate in ((1, 40e9), (2, 30e9), (4, 14e9)):
        c = Cluster.preset(f"local-cpu:{p}")
        dt = c.device(0).type
        # a 256-wide square matmul runs at exactly the rate measured at that size with p processes alive
        g = mlp_graph(batch=256, widths=(256, 256), bias=False)
        assert op_cost(g, g.ops[0], dt).forward == pytest.approx(2 * 256**3 / rate)
        assert dt.memory_bandwidth == pytest.approx(10e9 / p) and dt.launch_overhead == pytest.approx(2e-6 * p)
        assert "1 thread(s)/process" in dt.source
    # the gloo link of a p-process cluster is the α/β fitted to that group size's points
    for p, (alpha, bw) in ((2, (150e-6, 1.5e9)), (4, (600e-6, 0.6e9))):
        c = Cluster.preset(f"local-cpu:{p}")
        assert c.link(0, 1) == (pytest.approx(bw, rel=1e-6), pytest.approx(alpha, rel=1e-6))
        # and the ring all-reduce priced on that link reproduces the measured points
        for n in (65536, 8 << 20):
            assert ring_time("all_reduce", n, p, *c.link(0, 1)) == pytest.approx(_ring(p, n, alpha, bw), rel=1e-6)
    # with 2 ranks the ring is also what the cost model picks
    two = Cluster.preset("local-cpu:2")
    assert collective_time(two, "all_reduce", 1 << 20, (0, 1)).seconds == pytest.approx(
        _ring(2, 1 << 20, 150e-6, 1.5e9), rel=1e-6)


def test_unmeasured_process_counts_share_the_cores_of_one_process(tmp_path, monkeypatch):
    cal = _calibration(cores=2)
    del cal["per_processes"]["4"]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(path))
    dt = Cluster.preset("local-cpu:4").device(0).type
    # 4 processes on 2 cores: each gets half of what one process alone measured
    assert dt.peak_flops("fp32") == pytest.approx(50e9 / 2)
    assert dt.memory_bandwidth == pytest.approx(10e9 / 2) and dt.launch_overhead == pytest.approx(4e-6)
    # 3 processes would each have a core if there were 3: with 2 cores, a 2/3 share
    assert Cluster.preset("local-cpu:3").device(0).type.peak_flops("fp32") == pytest.approx(50e9 * 2 / 3)


def test_single_process_step_is_priced_from_the_single_process_rates(tmp_path, monkeypatch):
    # the 129x error of the last session: one process was priced with a 2-thread curve measured
    # under contention; now it is the 1-thread rate of one process, and the step is its sum of GEMMs
    cal = _calibration()
    flat = {n: 40e9 for n in (16, 64, 256, 1024, 4096)}
    cal["per_processes"]["1"]["matmul"] = _matmul_rows(flat)
    cal["per_processes"]["1"]["memory_bandwidth"] = 1e15  # elementwise work free: only the GEMMs count
    cal["per_processes"]["1"]["launch_overhead"] = 0.0
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(path))
    g = mlp_graph(batch=512, widths=(512, 512, 512), bias=False)
    est = estimate_step(g, Cluster.preset("local-cpu:1"), ParallelConfig(optimizer="sgd"))
    gemm = sum(op.flops for op in g.ops if op.kind.value == "contraction")
    assert est.breakdown()["compute"] == pytest.approx(3 * gemm / 40e9, rel=1e-2)


def test_calibrate_measures_this_machine_with_the_training_thread_count(tmp_path, monkeypatch):
    # a real (small) run: one process alone and a 2-process gloo group, both written to the file
    out = tmp_path / "cal.json"
    res = calibrate(out, group_sizes=(2,), sizes=(4096, 1 << 16), matmul_sizes=(32, 64), iters=3,
                    attention_shapes=((1, 2, 16, 8),), gemm=((1, 4), (64,)), optimizer_sets=((2, 256), (2, 4096)),
                    rounds=2)
    assert json.loads(out.read_text())["cores"] == res["cores"] and res["threads_per_process"] == 1
    assert set(res["per_processes"]) == {"1", "2"}
    # every process measured on the thread count a torch-backend worker trains with
    assert [k["threads"] for k in res["per_processes"].values()] == [THREADS_PER_PROCESS] * 2
    assert res["per_processes"]["2"]["dtensor_overhead"] >= 0 and "dtensor_overhead" not in res["per_processes"]["1"]
    # the training-op floor of every P, from the same rounds, and the fit of it that the device type carries
    for k in res["per_processes"].values():
        assert set(k["training_ops"]) == set(TRAINING_OP_CLASSES) and min(k["training_ops"].values()) >= 0
        assert k["training_op_overhead"] >= 0
    assert all(r["seconds"] > 0 for k in res["per_processes"].values() for r in k["matmul"])
    assert [(q["p"], q["bytes"]) for q in res["collectives"]["points"]] == [(2, 4096), (2, 1 << 16)]
    assert res["collectives"]["fit_by_group_size"]["2"]["alpha"] >= 0
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(out))
    dt = Cluster.preset("local-cpu:2").device(0).type
    measured = res["per_processes"]["2"]["matmul"][-1]
    assert dt.peak_flops("fp32") >= measured["flops"] / measured["seconds"] * (1 - 1e-9)
    assert dt.training_op_overhead == res["per_processes"]["2"]["training_op_overhead"]
    assert set(res["per_processes"]["2"]["optimizer_tensor_overhead"]) == {"sgd", "adam", "adamw"}
    assert dict(dt.optimizer_tensor_overhead) == res["per_processes"]["2"]["optimizer_tensor_overhead"]
    # the framework terms: skinny GEMMs, optimizer per element, gradient accumulation, carried as measured
    two = res["per_processes"]["2"]
    assert [(r["role"], r["small"], r["large"]) for r in two["gemm"]] == [
        ("out", 1, 64), ("reduce", 1, 64), ("out", 4, 64), ("reduce", 4, 64)]
    assert dt.gemm_rates == tuple(sorted((r["role"], r["small"], r["large"], r["seconds"]) for r in two["gemm"]))
    assert {o: [e for e, _ in rows] for o, rows in two["optimizer_element"].items()} == {
        o: [512.0, 8192.0] for o in ("sgd", "adam", "adamw")}
    assert dict(dt.optimizer_element_rates)["adam"] == tuple(tuple(r) for r in two["optimizer_element"]["adam"])
    assert two["grad_accumulation"] >= 0 and dt.grad_accumulation == two["grad_accumulation"]
    assert two["tp_op_overhead"] >= 0 and dt.sharded_op_overhead == two["tp_op_overhead"]
    assert dict(dt.optimizer_dtensor_overhead) == two["optimizer_dtensor_overhead"] and set(
        two["optimizer_dtensor_overhead"]) == {"sgd", "adam", "adamw"}
    row = res["per_processes"]["2"]["attention"][0]
    assert row["shape"] == [1, 2, 16, 8] and row["forward_s"] > 0 and row["backward_s"] >= 0
    assert dt.attention_curve("fp32") == ((row["flops"], row["forward_s"], row["backward_s"]),)


def test_sharded_ops_pay_the_measured_dtensor_dispatch(tmp_path, monkeypatch):
    cal = _calibration()
    cal["per_processes"]["2"]["dtensor_overhead"] = 40e-6
    cal["per_processes"]["4"]["dtensor_overhead"] = 90e-6
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(path))
    assert Cluster.preset("local-cpu:2").device(0).type.sharded_op_overhead == 40e-6
    assert Cluster.preset("local-cpu:3").device(0).type.sharded_op_overhead == 90e-6  # nearest, larger on a tie
    assert Cluster.preset("local-cpu:1").device(0).type.sharded_op_overhead == 40e-6
    dt = Cluster.preset("local-cpu:2").device(0).type
    g = mlp_graph(batch=256, widths=(256, 256), bias=False)
    plain, sharded = op_cost(g, g.ops[0], dt, split=2), op_cost(g, g.ops[0], dt, split=2, sharded=True)
    # forward: one DTensor dispatch; backward: two GEMMs, two dispatches
    assert sharded.forward - plain.forward == pytest.approx(40e-6)
    assert sharded.backward - plain.backward == pytest.approx(2 * 40e-6)


def test_cpu_optimizer_costs_kernels_per_parameter_tensor(tmp_path, monkeypatch):
    cal = _calibration()
    for k in cal["per_processes"].values():
        k["memory_bandwidth"] = 1e18  # no streaming term: only the per-tensor kernel floors remain
        k["launch_overhead"] = 3e-6
        k["dtensor_overhead"] = 50e-6
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(path))
    g = mlp_graph(batch=64, widths=(128, 128, 128), bias=True)  # 3 Linear (the last to classes): 6 tensors
    two = Cluster.preset("local-cpu:2")
    adam = 9  # kernels per tensor of torch's single-tensor Adam
    ddp = estimate_step(g, two, ParallelConfig(dp=2, optimizer="adam")).breakdown()["optimizer"]
    assert ddp == pytest.approx(adam * 6 * 3e-6)
    # FSDP2 shards every parameter: every update kernel also pays DTensor's dispatch
    fsdp = estimate_step(g, two, ParallelConfig(dp=2, zero_stage=3, optimizer="adam")).breakdown()["optimizer"]
    assert fsdp == pytest.approx(adam * 6 * (3e-6 + 50e-6))
    # tensor parallelism: the parameters of its modules are DTensors (here all three Linears are split)
    tp = estimate_step(g, two, ParallelConfig(tp=2, optimizer="adam")).breakdown()["optimizer"]
    assert tp == pytest.approx(fsdp)
    sgd = estimate_step(g, two, ParallelConfig(dp=2, optimizer="sgd")).breakdown()["optimizer"]
    assert sgd == pytest.approx(6 * 3e-6)
    # accelerators run multi-tensor optimizer kernels: no per-tensor floor there
    gpu = estimate_step(g, Cluster.preset("dgx-a100"), ParallelConfig(dp=2, optimizer="adam"))
    assert gpu.breakdown()["optimizer"] < adam * 6 * 5e-6


# ---------------------------------------------------------------------------------------------
# the training-op floor: measured per op class, fitted, carried, priced per op forward/backward
# ---------------------------------------------------------------------------------------------


def test_training_op_fit_recovers_the_per_op_cost_of_exact_measurements():
    tau, omega = 1.5e-6, 4e-6
    # κ = 2 for every measured class: a tiny op costs 2τ + 3ω forward and backward
    exact = {c: 2 * tau + 3 * omega for c in TRAINING_OP_CLASSES}
    assert fit_training_op_overhead(exact, tau) == pytest.approx(omega, rel=1e-12)
    # unequal classes: the least-squares ω of T_c − 2τ = 3ω is the mean of (T_c − 2τ)/3, by hand
    per_op = {"scale": 8.6e-6, "linear": 29e-6, "softmax": 5.4e-6}
    want = sum((t - 2 * tau) / 3 for t in per_op.values()) / 3
    assert fit_training_op_overhead(per_op, tau) == pytest.approx(want, rel=1e-12)
    # ops no slower than two raw kernels: no negative host cost
    assert fit_training_op_overhead({"scale": tau}, tau) == 0.0
    with pytest.raises(ValueError, match="unknown training-op classes"):
        fit_training_op_overhead({"conv": 1e-5}, tau)
    with pytest.raises(ValueError, match="at least one"):
        fit_training_op_overhead({}, tau)


def test_slowest_rank_takes_the_slowest_training_op_floor():
    a = {"matmul": _matmul_rows({64: 20e9}), "memory_bandwidth": 8e9, "launch_overhead": 2e-6,
         "training_ops": {"scale": 8e-6, "linear": 30e-6}, "training_op_overhead": 5e-6}
    b = {**a, "training_ops": {"scale": 9e-6, "linear": 25e-6}, "training_op_overhead": 6e-6}
    m = slowest_rank([a, b])
    assert m["training_op_overhead"] == 6e-6 and m["training_ops"] == {"scale": 9e-6, "linear": 30e-6}


def test_local_cpu_carries_the_training_op_floor_of_its_process_count(tmp_path, monkeypatch):
    cal = _calibration(cores=2)
    for p, k in cal["per_processes"].items():
        k["training_op_overhead"] = 3e-6 * int(p)
    del cal["per_processes"]["4"]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(path))
    assert Cluster.preset("local-cpu:1").device(0).type.training_op_overhead == pytest.approx(3e-6)
    assert Cluster.preset("local-cpu:2").device(0).type.training_op_overhead == pytest.approx(6e-6)
    # not measured with 4 processes: one process's floor, time-shared 2 cores between 4 processes
    assert Cluster.preset("local-cpu:4").device(0).type.training_op_overhead == pytest.approx(2 * 3e-6)
    for k in cal["per_processes"].values():
        del k["training_op_overhead"]
    path.write_text(json.dumps(cal))
    # a calibration from before the floor was measured prices none, as it did
    assert Cluster.preset("local-cpu:2").device(0).type.training_op_overhead == 0.0
    assert Cluster.preset("dgx-a100").device(0).type.training_op_overhead == 0.0


def test_training_op_floor_is_charged_per_torch_op_forward_and_per_backward_kernel(tmp_path, monkeypatch):
    import dataclasses

    def graph():
        return fuse_elementwise(mlp_graph(batch=4, widths=(8, 8, 8), bias=True))

    g = graph()
    base = Cluster.preset("dgx-a100").device(0).type
    omega = 7e-6
    dt = dataclasses.replace(base, training_op_overhead=omega)
    fused = [op for op in g.ops if op.attr.get("fused")]
    assert fused, "the linear + relu of a hidden layer fuse into one op"
    seen = set()
    for op in g.ops:
        a = len(op.attr.get("fused", ()))
        kb = 1.0 if OpKind(op.kind) in (OpKind.EMBEDDING, OpKind.GATHER) else 2.0
        plain, priced = op_cost(g, op, base), op_cost(g, op, dt)
        # the op and each fused elementwise op: ω forward; κ of the op and 2 per fused op backward
        assert priced.forward - plain.forward == pytest.approx((1 + a) * omega, rel=1e-9)
        assert priced.backward - plain.backward == pytest.approx((kb + 2 * a) * omega, rel=1e-9)
        seen.add(a)
    assert seen == {0, 1}
    # a whole one-process step on a calibrated CPU: Σ over ops of (1 + a + κ + 2a)·ω more compute
    want = sum((3 + 3 * len(op.attr.get("fused", ()))) * omega for op in g.ops)
    cal = _calibration()
    path = tmp_path / "cal.json"
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(path))
    compute = []
    for w in (0.0, omega):
        cal["per_processes"]["1"]["training_op_overhead"] = w
        path.write_text(json.dumps(cal))
        est = estimate_step(graph(), Cluster.preset("local-cpu:1"), ParallelConfig(optimizer="sgd"))
        compute.append(est.breakdown()["compute"])
    assert compute[1] - compute[0] == pytest.approx(want, rel=1e-9)


def test_gloo_collectives_are_priced_as_rings_at_every_size(tmp_path, monkeypatch):
    cal = _calibration()
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(path))
    four = Cluster.preset("local-cpu:4")
    bw, alpha = four.link(0, 1)
    n = 4096.0  # small: a tree (2⌈log₂4⌉α = 4α) would beat the ring's 2(p−1)α = 6α
    assert tree_time("all_reduce", n, 4, bw, alpha) < ring_time("all_reduce", n, 4, bw, alpha)
    c = collective_time(four, "all_reduce", n, range(4))
    # gloo runs a ring, and its α–β was fitted with the ring formula: 2(p−1)α + 2(p−1)/p · n/B
    assert c.algorithm == "ring" and c.seconds == pytest.approx(6 * alpha + 1.5 * n / bw, rel=1e-12)
    b = collective_time(four, "broadcast", n, range(4))
    assert b.algorithm == "ring" and b.seconds == pytest.approx(n / bw + 3 * alpha, rel=1e-12)
    # the same link run by a library with trees (NCCL) picks the tree: the ring is the link's property
    nccl = Cluster.from_dict({"name": "n", "centers": [{"name": "c", "nodes": [
        {"device": "h100-sxm", "devices_per_node": 4, "intra": {"bandwidth": bw, "latency": alpha}}]}]})
    t = collective_time(nccl, "all_reduce", n, range(4))
    assert t.algorithm == "tree" and t.seconds == pytest.approx(4 * alpha + 2 * n / bw, rel=1e-12)


def test_cpu_attention_is_priced_by_the_measured_fused_kernel_rows(tmp_path, monkeypatch):
    from polyparallel.cost_models.calibrate import attention_flops
    from polyparallel.cost_models.synthetic import gpt_graph

    fwd_rate, bwd_rate = 6e9, 2e9  # torch's CPU flash kernel: far below the 30-50 GFLOP/s matmuls
    cal = _calibration()
    for k in cal["per_processes"].values():
        k["attention"] = [{"shape": [b, 4, s, 32], "flops": attention_flops(b, 4, s, 32),
                           "forward_s": attention_flops(b, 4, s, 32) / fwd_rate,
                           "backward_s": attention_flops(b, 4, s, 32) / bwd_rate} for b, s in ((1, 32), (4, 256))]
    k2 = cal["per_processes"]["2"]
    fast, slow = dict(k2, attention=k2["attention"]), dict(k2, attention=[dict(r) for r in k2["attention"]])
    for r in slow["attention"]:
        r["forward_s"] *= 3
    # the slowest rank's rows
    merged = slowest_rank([fast, slow])["attention"][0]
    assert merged["forward_s"] == pytest.approx(3 * fast["attention"][0]["forward_s"])
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(path))
    g = gpt_graph(layers=1, hidden=128, heads=4, seq=64, vocab=256, batch=4, causal=True)
    att = next(op for op in g.ops if op.kind is OpKind.ATTENTION)
    # the rows count FLOPs as the IR does (the IR adds the softmax's 3 per kept pair)
    assert att.flops == pytest.approx(attention_flops(4, 4, 64, 32) + 3 * 4 * 4 * 64 * 65 / 2)
    dt = Cluster.preset("local-cpu:2").device(0).type
    c = op_cost(g, att, dt)
    assert c.forward == pytest.approx(att.flops / fwd_rate) and c.backward == pytest.approx(att.flops / bwd_rate)
    # split over 2 devices (sequence parallel): half the FLOPs at the measured rate
    assert op_cost(g, att, dt, split=2).forward == pytest.approx(att.flops / 2 / fwd_rate)
    # asked for unfused (explicit), or no rows measured: per-statement kernels at matmul rates, as before
    assert op_cost(g, att, dt, fused=False).forward != pytest.approx(c.forward, rel=0.05)
    for k in cal["per_processes"].values():
        del k["attention"]
    path.write_text(json.dumps(cal))
    old = Cluster.preset("local-cpu:2").device(0).type
    assert old.attention_curves == () and op_cost(g, att, old).forward == pytest.approx(
        op_cost(g, att, dt, fused=False).forward)


def test_cpu_optimizer_pays_the_measured_cost_per_parameter_tensor(tmp_path, monkeypatch):
    cal = _calibration()
    for k in cal["per_processes"].values():
        k["memory_bandwidth"] = 1e18  # no streaming term: only the per-tensor costs remain
        k["launch_overhead"], k["dtensor_overhead"] = 3e-6, 50e-6
        k["optimizer_tensor_overhead"] = {"adam": 60e-6, "sgd": 15e-6}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(path))
    g = mlp_graph(batch=64, widths=(128, 128, 128), bias=True)  # 6 parameter tensors
    two = Cluster.preset("local-cpu:2")
    assert dict(two.device(0).type.optimizer_tensor_overhead) == {"adam": 60e-6, "sgd": 15e-6}
    # the measured host work per tensor runs after the streaming (here just its floor, τ)
    ddp = estimate_step(g, two, ParallelConfig(dp=2, optimizer="adam")).breakdown()["optimizer"]
    assert ddp == pytest.approx(3e-6 + 6 * 60e-6)
    assert estimate_step(g, two, ParallelConfig(dp=2, optimizer="sgd")).breakdown()["optimizer"] == pytest.approx(
        3e-6 + 6 * 15e-6)
    # FSDP2: every one of Adam's 9 kernels per tensor also pays DTensor's dispatch
    fsdp = estimate_step(g, two, ParallelConfig(dp=2, zero_stage=3, optimizer="adam")).breakdown()["optimizer"]
    assert fsdp == pytest.approx(3e-6 + 6 * 60e-6 + 9 * 6 * 50e-6)
    # with a finite bandwidth the streaming of Adam's state adds: torch's CPU step runs Adam's
    # kernels one tensor at a time, each a pass over fp32 state: 18 accesses x 4 B per parameter
    # (lerp_ 3, mul_ 2, addcmul_ 3, sqrt 2, div_ 2, add_ 2, addcdiv_ 4)
    for k in cal["per_processes"].values():
        k["memory_bandwidth"] = 1e9
    path.write_text(json.dumps(cal))
    params = sum(t.numel for t in g.tensors.values() if t.kind.value == "param")
    stream = estimate_step(g, Cluster.preset("local-cpu:2"), ParallelConfig(dp=2, optimizer="adam"))
    assert stream.breakdown()["optimizer"] == pytest.approx(18 * 4 * params / (1e9 * 0.8) + 6 * 60e-6)
    # an optimizer not measured keeps the kernel-floor price: AdamW's 10 kernels per tensor
    adamw = estimate_step(g, two, ParallelConfig(dp=2, optimizer="adamw")).breakdown()["optimizer"]
    assert adamw == pytest.approx(10 * 6 * 3e-6)


def test_other_work_is_the_machines_busy_time_less_the_calibrations_own():
    from polyparallel.cost_models.machine_load import other_work

    # 10 s on 2 cores (20 CPU-seconds): 12 busy (user, system), 6 idle, 2 stolen; the calibration's
    # own processes used 9 of the 12, so other work kept (12 - 9) / 10 = 0.3 cores busy
    start = {"machine": [100.0, 0.0, 50.0, 400.0, 0.0, 0.0, 0.0, 10.0], "own": 5.0}
    end = {"machine": [110.0, 0.0, 52.0, 406.0, 0.0, 0.0, 0.0, 12.0], "own": 14.0}
    assert other_work(start, end, 2) == {"others": pytest.approx(0.3), "steal": pytest.approx(0.1)}
    # the calibration's own load (the load average it leaves behind) is not other work
    assert other_work(start, {**end, "own": 17.0}, 2)["others"] == 0.0
    assert other_work({"machine": [], "own": 0.0}, end, 2) == {}


def test_a_calibration_measured_under_load_says_so_where_it_prices(tmp_path, monkeypatch):
    from polyparallel.cost_models.machine_load import calibration_warnings

    quiet = {**_calibration(cores=2), "load_average": 0.3, "other_work": {"others": 0.1, "steal": 0.01}}
    assert calibration_warnings(quiet) == []
    # the load average before it counts only where the CPU counters are missing: it also holds work
    # that ended just before (a test run), which the counters show took no CPU time during it
    assert calibration_warnings({**quiet, "load_average": 2.0}) == []
    busy = {**quiet, "load_average": 5.2, "other_work": {}}
    [w] = calibration_warnings(busy)
    assert "load average 5.2 on 2 cores" in w and "calibrate" in w
    [w] = calibration_warnings({**quiet, "other_work": {"others": 1.4, "steal": 0.0}})
    assert "other processes kept 1.4 cores busy on 2 cores" in w
    [w] = calibration_warnings({**quiet, "other_work": {"others": 0.0, "steal": 0.12}})
    assert "lost 12% of its CPU time to its hypervisor" in w
    burst = {**quiet, "matmul": {"1": _matmul_rows({64: 1e6, 256: 40e9, 1024: 50e9})}}
    [w] = calibration_warnings(burst)
    assert "matmul 64x64" in w and "under 1%" in w
    # a search priced from it names the warning with the calibration it used
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({**busy, "warnings": calibration_warnings(busy)}))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(path))
    assert "WARNING: the machine was busy" in Cluster.preset("local-cpu:2").device(0).type.source
