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


# ---------------------------------------------------------------------------------------------
# host dispatch, eager elementwise kernels, normalisation rows, misaligned GEMMs, optimizer host


def _full_calibration(host_scale: float = 1.0) -> dict:
    """A synthetic calibration with every GPU measurement the compute and step models read."""
    cal = _calibration()
    cal["training_ops"] = {"elementwise": 30e-6 * host_scale, "linear": 90e-6 * host_scale,
                           "conv": 120e-6 * host_scale, "batch_norm": 100e-6 * host_scale,
                           "backward_call": 50e-6 * host_scale}
    cal["training_ops_bf16"] = {"linear": 150e-6 * host_scale, "conv": 200e-6 * host_scale,
                                "backward_call": 60e-6 * host_scale}
    cal["optimizer_host"] = {"sgd_momentum/foreach": {"fixed": 40e-6, "per_tensor": 3e-6}}
    cal["streaming"] = {"bf16/batch_norm": [{"numel": n, "forward_s": n / 50e9, "backward_s": n / 25e9}
                                            for n in (1e5, 1e8)]}
    cal["misaligned"] = {"bf16": [{"mkn": [1, 1, 1], "seconds": r, "padded_seconds": 1.0} for r in (4.0, 5.0, 6.0)]}
    return cal


def _small_cnn(batch: int = 4):
    import warnings

    import torch

    import polyparallel as pp
    from polyparallel.models import SmallCNN
    from polyparallel.transforms import canonicalize, fuse_elementwise

    with torch.device("meta"):
        m = SmallCNN()
    x, y = torch.zeros(batch, 1, 28, 28, device="meta"), torch.zeros(batch, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fuse_elementwise(canonicalize(pp.capture(m, (x,), {"labels": y})))


def _one_gpu(tmp_path, cal: dict) -> Cluster:
    import json

    (tmp_path / "cal.json").write_text(json.dumps(cal))
    spec = {"name": "one", "device_types": {"g": {
        "kind": "gpu", "peak": {"fp32": "19.5 TFLOP/s", "bf16": "312 TFLOP/s"}, "memory": "80 GB",
        "memory_bandwidth": "2039 GB/s", "calibration": str(tmp_path / "cal.json")}},
        "centers": [{"name": "c", "nodes": [{"name": "n", "count": 1, "devices_per_node": 1, "device": "g"}]}]}
    return Cluster.from_dict(spec, source="one")


def test_host_seconds_split_by_class_and_gradient_path():
    from polyparallel.cost_models.compute import BACKWARD_FACTOR, DEFAULT_BACKWARD_FACTOR, host_seconds
    from polyparallel.ir import OpKind

    g = _small_cnn()
    gpu = gpu_calibrated_type(A100, _full_calibration())
    fp32, bf16, eager = host_seconds(g, gpu, "fp32"), host_seconds(g, gpu, "bf16"), host_seconds(g, gpu, "bf16", True)
    cls = {"conv": 120e-6, "norm": 100e-6, "contraction": 90e-6}  # every other kind: the elementwise class
    for op, (f, b), (f16, b16), (fe, be) in zip(g.ops, fp32, bf16, eager):
        t = cls.get(str(op.kind), 30e-6)
        kb = BACKWARD_FACTOR.get(OpKind(op.kind), DEFAULT_BACKWARD_FACTOR)
        running_stats = op.target == "aten.add_.Tensor"  # a batch norm's counter update: no gradient
        assert f == pytest.approx(t / (1 + kb))
        assert b == (0.0 if running_stats else pytest.approx(t * kb / (1 + kb)))
        t16 = {"conv": 200e-6, "contraction": 150e-6}.get(str(op.kind), t)  # autocast classes where measured
        assert f16 + b16 == pytest.approx(t16 / (1 + kb) * (1 if running_stats else 1 + kb))
        # eager: each absorbed elementwise op (the ReLU after a batch norm) is one more elementwise dispatch
        assert fe + be == pytest.approx(f16 + b16 + 30e-6 * len(op.attr.get("fused", ())))
    assert sum(op.target == "aten.add_.Tensor" for op in g.ops) == 2


def test_eager_elementwise_and_batch_norm_rows():
    from polyparallel.cost_models.compute import op_bytes, streaming_bandwidth

    g = _small_cnn(batch=64)
    gpu = gpu_calibrated_type(A100, _full_calibration())
    bn = next(op for op in g.ops if op.attr.get("fused") and "batch_norm" in op.target)
    n = g.tensors[bn.inputs[0]].numel
    fused, eager = op_cost(g, bn, gpu, "bf16"), op_cost(g, bn, gpu, "bf16", eager=True)
    assert fused.forward == pytest.approx(n / 50e9) and fused.backward == pytest.approx(n / 25e9)
    # eager: the ReLU reads the normalised temporary and writes the output, bf16, at the copy bandwidth
    relu_bytes = 2 * n * 2
    bw = streaming_bandwidth(gpu)
    assert eager.forward == pytest.approx(fused.forward + max(relu_bytes / bw, 5e-6))
    assert eager.backward == pytest.approx(fused.backward + max(2 * relu_bytes / bw, 5e-6))
    # without rows the batch norm is a roofline of its distinct operands
    plain = op_cost(g, bn, A100, "bf16")
    assert plain.forward == pytest.approx(max(op_bytes(g, bn, "bf16") / streaming_bandwidth(A100), plain.flops /
                                              (A100.peak_flops("fp32") * 0.5), A100.launch_overhead))


def test_misaligned_gemm_pays_the_measured_factor():
    from polyparallel.cost_models.synthetic import mlp_graph

    gpu = gpu_calibrated_type(A100, _full_calibration())
    assert gpu.misaligned_factor == 5.0  # the median ratio
    odd, even = mlp_graph(batch=8192, widths=(4096, 4099), bias=False), mlp_graph(batch=8192, widths=(4096, 4104),
                                                                                 bias=False)
    c_odd, c_even = op_cost(odd, odd.ops[0], gpu, "bf16"), op_cost(even, even.ops[0], gpu, "bf16")
    assert c_even.forward == pytest.approx(c_even.flops / 600e12)
    assert c_odd.forward == pytest.approx(5.0 * c_odd.flops / 600e12)
    # fp32 (no curve measured here: the data sheet at the modelled 80%) has no 16-bit tile rule: no factor
    assert op_cost(odd, odd.ops[0], gpu, "fp32").forward == pytest.approx(c_odd.flops / (19.5e12 * 0.8))


def test_step_waits_for_the_host_and_the_optimizer_dispatch(tmp_path):
    from polyparallel.cost_models import ParallelConfig, estimate_step
    from polyparallel.cost_models.compute import host_seconds

    g = _small_cnn()
    cfg = ParallelConfig(dtype="bf16", optimizer="sgd_momentum", fused_optimizer=False, fused_elementwise=False)
    slow = _one_gpu(tmp_path, _full_calibration(host_scale=100.0))  # host-bound: ms per op, kernels of us
    dt = slow.device(0).type
    est = estimate_step(g, slow, cfg)
    host = sum(f + b for f, b in host_seconds(g, dt, "bf16", eager=True)) + 60e-6 * 100
    assert est.breakdown()["compute"] == pytest.approx(host)
    tensors = sum(t.kind == "param" for t in g.tensors.values())
    assert est.breakdown()["optimizer"] == pytest.approx(40e-6 + 3e-6 * tensors)
    # a fast host: the kernels' time, as without host measurements
    fast = _one_gpu(tmp_path, _full_calibration(host_scale=1e-6))
    nohost = _calibration() | {k: v for k, v in _full_calibration().items() if k in ("streaming", "misaligned")}
    ref = estimate_step(g, _one_gpu(tmp_path, nohost), cfg).breakdown()["compute"]
    assert estimate_step(g, fast, cfg).breakdown()["compute"] == pytest.approx(ref)


def test_eager_cross_entropy_peak_in_the_memory_model():
    from polyparallel.cost_models import ParallelConfig, estimate_step
    from polyparallel.cost_models.synthetic import gpt_graph

    batch, seq, vocab = 2, 128, 1000
    g = gpt_graph(layers=2, hidden=64, heads=4, seq=seq, vocab=vocab, batch=batch)
    cluster = Cluster.preset("dgx-a100")
    n = batch * seq * vocab  # logits
    for dtype, width in (("bf16", 2), ("fp32", 4)):
        fused = dict(estimate_step(g, cluster, ParallelConfig(dtype=dtype, fused_elementwise=True)).memory[0].terms)
        eager = dict(estimate_step(g, cluster, ParallelConfig(dtype=dtype, fused_elementwise=False)).memory[0].terms)
        # fp32 log-probabilities kept + their gradient + the logits' gradient, less the logits counted once
        assert eager["workspace"] - fused["workspace"] == pytest.approx(12 * n - width * n)
        assert eager["activations"] == fused["activations"]
    # vocabulary-parallel: each of the tp ranks holds its share of the logits
    tp = dict(estimate_step(g, cluster, ParallelConfig(dtype="bf16", tp=2, fused_elementwise=False)).memory[0].terms)
    tp0 = dict(estimate_step(g, cluster, ParallelConfig(dtype="bf16", tp=2, fused_elementwise=True)).memory[0].terms)
    assert tp["workspace"] - tp0["workspace"] == pytest.approx((12 * n - 2 * n) / 2)


def test_gpu_gemm_rows_are_the_skinny_rows_at_gpu_sizes():
    from polyparallel.cost_models.calibrate import _time
    from polyparallel.cost_models.calibrate_gpu import gemm_rows_gpu

    said: list[str] = []
    rows = gemm_rows_gpu("fp32", smalls=(8, 16, 64), larges=(32, 64), say=said.append, device="cpu",
                         timer=lambda fn: _time(fn, window=0.002, windows=1))
    pairs = [(s, big) for big in (32, 64) for s in (8, 16, 64) if s < big]  # s >= L is not skinny: skipped
    assert [(r["small"], r["large"]) for r in rows] == [p for p in pairs for _ in (0, 1)]
    assert [r["role"] for r in rows] == ["out", "reduce"] * len(pairs)
    assert all(r["flops"] == 2.0 * r["small"] * r["large"] ** 2 and r["seconds"] > 0 for r in rows)
    assert len(said) == len(pairs)


def test_host_classes_measured_are_the_classes_the_model_prices():
    from polyparallel.cost_models.calibrate import _time
    from polyparallel.cost_models.calibrate_gpu import HOST_OP_CLASSES, host_op_seconds
    from polyparallel.cost_models.compute import host_class
    from polyparallel.cost_models.synthetic import gpt_graph

    measured = host_op_seconds(chain=2, device="cpu", timer=lambda fn: _time(fn, window=0.001, windows=1))
    assert set(measured) == set(HOST_OP_CLASSES) and min(measured.values()) >= 0
    for g in (_small_cnn(), gpt_graph(layers=1, hidden=32, heads=2, seq=16, vocab=64)):
        assert {host_class(op) for op in g.ops} <= set(HOST_OP_CLASSES) - {"backward_call"}
