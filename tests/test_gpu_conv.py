"""Convolutions on a calibrated GPU: measured rows per dtype and kernel class price conv ops."""

from __future__ import annotations

import pytest

from polyparallel.cluster import Cluster, gpu_calibrated_type
from polyparallel.cost_models.calibrate_gpu import conv_flops, conv_rows
from polyparallel.cost_models.compute import op_cost

A100 = Cluster.preset("dgx-a100").device(0).type


def _conv_graph(b: int, c: int, o: int, k: int, hw: int, stride: int = 1):
    """One 2-D convolution op (no bias, padding k // 2): ``(graph, op)``."""
    from polyparallel import ops
    from polyparallel.ir import Graph, Op, OpKind, TensorKind, TensorSpec

    g = Graph("conv")
    nest = ops.conv((b, c, hw, hw), (o, c, k, k), stride=stride, padding=k // 2)
    out_hw = nest.extents["h"]
    g.add_tensor(TensorSpec("x", (b, c, hw, hw), "float32", TensorKind.INPUT))
    g.add_tensor(TensorSpec("w", (o, c, k, k), "float32", TensorKind.PARAM))
    g.add_tensor(TensorSpec("y", (b, o, out_hw, out_hw)))
    return g, g.add_op(Op("conv", OpKind.CONV, "conv2d", ("x", "w"), ("y",), nest))


def _calibration() -> dict:
    """Synthetic GPU calibration: bf16 matmul 600 TFLOP/s; 3x3 conv 200/100 TFLOP/s (fwd/bwd), 1x1 400/300."""
    mm = {"bf16": [{"n": n, "flops": 2.0 * n**3, "seconds": 2.0 * n**3 / 600e12} for n in (1024, 8192)]}

    def rows(fw: float, bw: float) -> list[dict]:
        return [{"shape": [1], "flops": f, "forward_s": f / fw, "backward_s": f / bw} for f in (1e8, 1e12)]

    return {"kind": "cuda", "device_name": "synthetic", "memory_bytes": 80e9, "matmul": mm,
            "conv": {"bf16/3x3": rows(200e12, 100e12), "bf16/1x1": rows(400e12, 300e12)},
            "memory_bandwidth": 2000e9, "launch_overhead": 5e-6}


def test_conv_flops_closed_form_equals_the_loop_nest_count():
    for b, c, o, k, hw in ((2, 3, 5, 3, 7), (4, 16, 8, 1, 9), (1, 2, 2, 5, 6)):
        _, op = _conv_graph(b, c, o, k, hw)
        assert op.flops == conv_flops(b, c, o, k, hw)  # same padding: output = input size


def test_calibrated_conv_priced_by_its_kernel_class_forward_and_backward():
    gpu = gpu_calibrated_type(A100, _calibration())
    for k, c, fw, bw in ((3, 256, 200e12, 100e12), (1, 1024, 400e12, 300e12), (7, 256, 200e12, 100e12)):
        g, op = _conv_graph(32, c, c, k, 28)  # compute bound at these sizes; 7x7 is in the k > 1 class
        cost = op_cost(g, op, gpu, "bf16")
        assert cost.flops == op.flops and cost.bound == "compute"
        assert cost.forward == pytest.approx(op.flops / fw)
        assert cost.backward == pytest.approx(op.flops / bw)
    # a dtype without conv rows falls back to the matmul curve (fp32: none measured here -> data sheet)
    g, op = _conv_graph(32, 256, 256, 3, 28)
    sheet = op_cost(g, op, A100, "bf16")
    assert op_cost(g, op, gpu_calibrated_type(A100, {**_calibration(), "conv": {}}), "bf16").forward == \
        pytest.approx(op.flops / 600e12)
    assert sheet.forward == pytest.approx(op.flops / (312e12 * 0.65))  # data sheet x modelled conv efficiency


def test_calibrated_conv_keeps_the_memory_bound():
    # a 1x1 conv over few channels and a large image streams its activations: HBM bound, as for skinny GEMMs
    gpu = gpu_calibrated_type(A100, _calibration())
    g, op = _conv_graph(64, 4, 4, 1, 224)
    c = op_cost(g, op, gpu, "bf16")
    assert c.bound == "memory" and c.forward == pytest.approx(c.bytes / 2000e9)


def test_kernel_sizes_above_one_share_one_class():
    cal = _calibration()
    five = [{"shape": [1], "flops": 1e10, "forward_s": 1e10 / 150e12, "backward_s": 1e10 / 90e12}]
    cal["conv"]["bf16/5x5"] = five
    gpu = gpu_calibrated_type(A100, cal)
    rows = gpu.conv_curve("bf16", pointwise=False)
    assert len(rows) == 3 and (1e10, 1e10 / 150e12, 1e10 / 90e12) in rows
    assert gpu.conv_curve("bfloat16", pointwise=True) == gpu.conv_curve("bf16", pointwise=True)
    assert gpu.conv_curve("fp16", pointwise=True) == ()


def test_conv_rows_measure_forward_and_backward_on_cpu():
    from polyparallel.cost_models.calibrate import _time

    res = conv_rows(["fp32"], batch=2, shapes=((4, 8), (8, 8)), kernels=(3, 1),
                    timer=lambda fn: _time(fn, window=0.002, windows=2), device="cpu")
    assert set(res) == {"fp32/3x3", "fp32/1x1"}
    for key, rows in res.items():
        k = 3 if key.endswith("3x3") else 1
        for r, (c, hw) in zip(rows, ((4, 8), (8, 8))):
            _, op = _conv_graph(2, c, c, k, hw)
            assert r["shape"] == [2, c, c, k, hw] and r["flops"] == op.flops
            assert r["forward_s"] > 0 and r["backward_s"] >= 0
