"""Roofline compute model against hand-computed times."""

from __future__ import annotations

import math

import pytest

from polyparallel.cluster import Cluster, DeviceType
from polyparallel.cost_models.compute import COMPUTE_EFFICIENCY, MEMORY_EFFICIENCY, op_cost
from polyparallel.cost_models.synthetic import mlp_graph
from polyparallel.ir import OpKind

A100 = Cluster.preset("dgx-a100").device(0).type


def _attention_graph(b: int, h: int, s: int, d: int, causal: bool = False, dropout: bool = False,
                     target: str = "sdpa"):
    """One scaled-dot-product attention op over fp32 ``(b, h, s, d)`` q, k, v: ``(graph, op)``."""
    from polyparallel import ops
    from polyparallel.ir import Graph, Op, TensorKind, TensorSpec

    g = Graph("att")
    for n in ("q", "k", "v"):
        g.add_tensor(TensorSpec(n, (b, h, s, d), "float32", TensorKind.INPUT))
    g.add_tensor(TensorSpec("o", (b, h, s, d)))
    op = g.add_op(Op("att", OpKind.ATTENTION, target, ("q", "k", "v"), ("o",),
                     ops.attention((b, h, s, d), (b, h, s, d), (b, h, s, d), causal=causal),
                     attrs=(("dropout", True),) if dropout else ()))
    return g, op


def test_large_linear_is_compute_bound():
    g = mlp_graph(batch=8192, widths=(8192, 8192), bias=False)
    lin = g.ops[0]
    c = op_cost(g, lin, A100, "bf16")
    flops = 2 * 8192**3
    assert c.flops == flops and c.bound == "compute"
    assert c.forward == pytest.approx(flops / (312e12 * COMPUTE_EFFICIENCY[OpKind.CONTRACTION]))
    assert c.backward == pytest.approx(2 * c.forward)
    half = op_cost(g, lin, A100, "bf16", split=2)
    # half the work, as a (4096, 8192, 8192) GEMM: measured on the H200 at 0.685 of peak against
    # 0.697 for the square one, a ratio the A100 takes over
    assert half.forward == pytest.approx(c.forward / 2 * 0.697 / 0.685)
    fp32 = op_cost(g, lin, A100, "fp32", split=2)  # no shape table for fp32: the flat figure
    assert fp32.forward == pytest.approx(flops / 2 / (19.5e12 * COMPUTE_EFFICIENCY[OpKind.CONTRACTION]))


def test_uncalibrated_gpu_prices_gemms_by_measured_shape():
    """A skinny bf16 GEMM (256 tokens through a 16384 x 16384 weight): forward and input gradient are
    'out' GEMMs with s = 256 (0.641 of peak, measured on the H200 at L = 16384), the weight gradient
    sums over the 256 tokens ('reduce', 0.451); an H100 takes the measured figures, an A100 their
    ratio to the measured square GEMM (0.697) times its modelled 0.80."""
    g = mlp_graph(batch=256, widths=(16384, 16384), bias=False)
    lin = g.ops[0]
    f = 2 * 256 * 16384**2
    h100 = Cluster.preset("dgx-h100").device(0).type
    for dev, peak, scale in ((h100, 989.5e12, 1.0), (A100, 312e12, 0.80 / 0.697)):
        c = op_cost(g, lin, dev, "bf16")
        assert c.bound == "compute"
        assert c.forward == pytest.approx(f / (peak * 0.641 * scale))
        assert c.backward == pytest.approx(f / (peak * 0.641 * scale) + f / (peak * 0.451 * scale))
    big = mlp_graph(batch=8192, widths=(8192, 8192), bias=False)
    assert op_cost(big, big.ops[0], h100, "bf16").forward == pytest.approx(2 * 8192**3 / (989.5e12 * 0.697))


def test_elementwise_is_memory_bound_and_tiny_ops_hit_the_floor():
    g = mlp_graph(batch=4096, widths=(4096, 4096, 4096))
    relu = next(op for op in g.ops if op.kind is OpKind.ELEMENTWISE)
    c = op_cost(g, relu, A100, "bf16")
    nbytes = 2 * 4096 * 4096 * 2  # read + write at bf16
    assert c.bound == "memory" and c.bytes == nbytes
    assert c.forward == pytest.approx(nbytes / (2039e9 * MEMORY_EFFICIENCY))
    tiny = mlp_graph(batch=2, widths=(4, 4))
    t = op_cost(tiny, tiny.ops[0], A100, "bf16")
    assert t.bound == "launch" and t.forward == A100.launch_overhead


def test_calibrated_curve_reproduces_measurements():
    curve = ((2 * 64**3, 2 * 64**3 / 10e9), (2 * 512**3, 2 * 512**3 / 40e9))
    cpu = DeviceType("cpu", "cpu", (("fp32", 40e9),), 8e9, 1e12, 0.0, matmul_curve=curve)
    for n, rate in ((64, 10e9), (512, 40e9)):
        g = mlp_graph(batch=n, widths=(n, n), bias=False)
        assert op_cost(g, g.ops[0], cpu).forward == pytest.approx(2 * n**3 / rate)
    g = mlp_graph(batch=181, widths=(181, 181), bias=False)  # between: log-log interpolation
    rate = g.ops[0].flops / op_cost(g, g.ops[0], cpu).forward
    assert 10e9 < rate < 40e9


def test_unfused_attention_is_priced_per_statement():
    b, h, s, d = 8, 16, 2048, 64
    g, op = _attention_graph(b, h, s, d)
    S, R, T = b * h * s * s, b * h * s, b * h * s * d  # scores, softmax rows, one of q/k/v/o
    bw, mm, vec = 2039e9 * 0.8, 312e12 * 0.8, 19.5e12 * 0.5

    def k(flops, nbytes, rate):
        return max(flops / rate, nbytes / bw, 5e-6)

    want = (k(2 * S * d, 2 * (2 * T + S), mm)  # scores = q k^T, written out
            + k(3 * S, 2 * (S + R + S), vec)  # softmax: scores read back, probabilities written
            + k(2 * S * d, 2 * (S + R + 2 * T), mm))  # probabilities x v
    assert op_cost(g, op, A100, "bf16").forward == pytest.approx(want)
    # dropout on the probabilities: one more kernel reads them, writes them and a one-byte mask
    gd, opd = _attention_graph(b, h, s, d, dropout=True)
    assert op_cost(gd, opd, A100, "bf16").forward == pytest.approx(want + k(S, (2 + 2 + 1) * S, vec))
    assert op_cost(gd, opd, A100, "bf16", fused=True).forward == pytest.approx(
        op_cost(g, op, A100, "bf16", fused=True).forward)  # a fused kernel drops inside
    fused = op_cost(g, op, A100, "bf16", fused=True)
    assert fused.forward == pytest.approx(max(op.flops / (312e12 * 0.5), 2 * 4 * T / bw))
    assert fused.forward < want


@pytest.mark.parametrize("causal", [False, True])
def test_torch_math_sdpa_upcasts_16_bit_attention_to_fp32(causal):
    # torch's math kernel (SDPA without a fused kernel) computes bf16 attention in fp32, kernel by
    # kernel as torch 2.13's dispatch trace lists them: forward 3 casts in, 2 scalings, bmm, the mask
    # added (causal), _safe_softmax (softmax, eq, all, where), the probabilities cast back, bmm, the
    # output cast; backward the output-gradient cast, 2 bmm, softmax backward, 2 bmm, 2 scalings, 3 casts
    b, h, s, d = 4, 8, 1024, 64
    g, op = _attention_graph(b, h, s, d, causal=causal, target="aten.scaled_dot_product_attention.default")
    S, T = b * h * s * s, b * h * s * d
    bw, mm32 = 2039e9 * 0.8, 19.5e12 * 0.8

    def k(flops, nbytes):
        return max(flops / mm32, nbytes / bw, 5e-6)

    gemm = k(2 * S * d, 4 * (2 * T + S))
    safe_softmax = k(0, 8 * S) + k(0, 5 * S) + k(0, S) + k(0, 8 * S)  # softmax, eq, all, where
    fwd = (3 * k(0, 6 * T) + 2 * k(0, 8 * T) + gemm + (k(0, 8 * S) if causal else 0.0) + safe_softmax
           + k(0, 6 * S) + gemm + k(0, 6 * T))
    bwd = k(0, 6 * T) + 4 * gemm + k(0, 12 * S) + 2 * k(0, 8 * T) + 3 * k(0, 6 * T)
    cost = op_cost(g, op, A100, "bf16", fused=False)
    assert (cost.forward, cost.backward) == pytest.approx((fwd, bwd))
    # a fused kernel, another attention op, or fp32 itself: no upcast
    assert op_cost(g, op, A100, "bf16", fused=True).forward < fwd / 4
    other, oop = _attention_graph(b, h, s, d)
    assert op_cost(other, oop, A100, "bf16").forward < fwd / 2
    assert op_cost(g, op, A100, "fp32", fused=False).forward != pytest.approx(fwd)


def test_math_sdpa_keeps_fp32_probabilities_and_operands():
    # the upcast math kernel's backward keeps its fp32 probabilities (b·h·s·s), the scaled fp32
    # queries and keys and the fp32 values; flash attention keeps an fp32 log-sum-exp per row
    import torch
    from torch import nn

    import polyparallel as pp
    from polyparallel.cost_models import ParallelConfig, estimate_step

    b, h, s, hd = 2, 4, 128, 16

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(h * hd, 3 * h * hd)

        def forward(self, x, labels=None):
            q, k, v = self.qkv(x).view(b, s, 3, h, hd).permute(2, 0, 3, 1, 4)
            return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float().pow(2).mean()

    g = pp.capture(Attn(), (torch.zeros(b, s, h * hd),))
    gpu = Cluster.preset("dgx-a100")
    acts = {fused: estimate_step(g, gpu, ParallelConfig(dtype="bf16", fused_attention=fused)).memory[0].term(
        "activations") for fused in (True, False)}
    want = 4 * (b * h * s * s + 3 * b * h * s * hd) - 4 * b * h * s
    assert acts[False] - acts[True] == pytest.approx(want)
    # a CPU runs a fused kernel either way
    cpu = Cluster.preset("local-cpu:1")
    assert len({estimate_step(g, cpu, ParallelConfig(dtype="bf16", fused_attention=f)).memory[0].term(
        "activations") for f in (True, False)}) == 1


def test_constrained_point_counts_match_brute_force():
    """Domains with affine constraints (causal masks) are counted in closed form over one dim;
    checked against enumerating every point."""
    import itertools
    import random

    from polyparallel.ir import AffineExpr, _domain_points

    rng = random.Random(3)
    for _ in range(400):
        names = ["a", "b", "c"][: rng.randint(1, 3)]
        ext = {d: rng.randint(1, 6) for d in names}
        cons = []
        for _ in range(rng.randint(1, 3)):
            terms = tuple((d, k) for d in names if (k := rng.randint(-3, 3)) and rng.random() < 0.7)
            cons.append(AffineExpr(terms, rng.randint(-5, 5)))
        dims = (*((d, ext[d]) for d in names), ("free", 3))
        brute = 3 * sum(all(sum(k * dict(zip(names, pt))[d] for d, k in c.terms) + c.const >= 0 for c in cons)
                        for pt in itertools.product(*(range(ext[d]) for d in names)))
        assert _domain_points(dims, tuple(cons)) == brute
    s = AffineExpr((("s", 1), ("t", -1)), 0)
    assert _domain_points((("s", 8192), ("t", 8192)), (s,)) == 8192 * 8193 // 2  # a causal mask, instantly


def _gpu_calibration(bf16_rate: float = 600e12) -> dict:
    """A synthetic `calibrate --device cuda` result: constant matmul rates, attention 400/160 TFLOP/s."""
    mm = {dt: [{"n": n, "flops": 2.0 * n**3, "seconds": 2.0 * n**3 / r} for n in (1024, 8192)]
          for dt, r in (("bf16", bf16_rate), ("fp32", 50e12))}
    att = [{"shape": [1], "flops": f, "forward_s": f / 400e12, "backward_s": f / 160e12} for f in (1e9, 1e12)]
    return {"kind": "cuda", "device_name": "synthetic", "memory_bytes": 100e9, "matmul": mm,
            "attention": {"bf16": att}, "memory_bandwidth": 1631.2e9, "launch_overhead": 7e-6}


def test_gpu_calibration_prices_by_the_measured_rates():
    from polyparallel.cluster import gpu_calibrated_type

    gpu = gpu_calibrated_type(A100, _gpu_calibration())
    assert gpu.memory_efficiency == pytest.approx(1631.2e9 / 2039e9) and gpu.memory == 100e9
    assert gpu.peak_flops("bf16") == 312e12  # the data sheet stays for what is not measured
    g = mlp_graph(batch=8192, widths=(8192, 8192), bias=False)
    f = 2 * 8192**3
    assert op_cost(g, g.ops[0], gpu, "bf16").forward == pytest.approx(f / 600e12)  # measured, above 80% of sheet
    assert op_cost(g, g.ops[0], gpu, "fp32").forward == pytest.approx(f / 50e12)  # its own dtype's curve
    # a skinny GEMM keeps the HBM bound (unlike a CPU curve): 16 x 8192 x 8192 moves the weight
    sk = mlp_graph(batch=16, widths=(8192, 8192), bias=False)
    c = op_cost(sk, sk.ops[0], gpu, "bf16")
    assert c.bound == "memory" and c.forward == pytest.approx(c.bytes / 1631.2e9)
    tiny = mlp_graph(batch=2, widths=(4, 4))
    assert op_cost(tiny, tiny.ops[0], gpu, "bf16").forward == 7e-6


def test_gpu_calibration_prices_fused_attention_forward_and_backward():
    from polyparallel.cluster import gpu_calibrated_type

    gpu = gpu_calibrated_type(A100, _gpu_calibration())
    g, op = _attention_graph(4, 16, 2048, 64)
    c = op_cost(g, op, gpu, "bf16", fused=True)
    assert c.forward == pytest.approx(op.flops / 400e12)
    assert c.backward == pytest.approx(op.flops / 160e12)  # measured backward, not kappa x forward
    unfused = op_cost(g, op, gpu, "bf16")  # unfused: its GEMM statements at the bf16 matmul curve
    assert unfused.forward > c.forward


def test_cluster_spec_references_a_gpu_calibration(tmp_path):
    import json

    (tmp_path / "cal.json").write_text(json.dumps(_gpu_calibration(700e12)))
    (tmp_path / "c.yaml").write_text(
        "name: one\ndevice_types:\n  a100-here:\n    peak: {fp32: 19.5 TFLOP/s, bf16: 312 TFLOP/s}\n"
        "    memory: 80 GB\n    memory_bandwidth: 2039 GB/s\n    calibration: cal.json\n"
        "centers:\n- name: c\n  nodes:\n  - {name: n, count: 1, devices_per_node: 1, device: a100-here}\n")
    dt = Cluster.load(tmp_path / "c.yaml").device(0).type
    assert dict(dt.matmul_curves)["bf16"][0][1] == pytest.approx(2 * 1024**3 / 700e12)
    assert "calibrated synthetic" in dt.source
    bad = _gpu_calibration()
    del bad["launch_overhead"]
    (tmp_path / "cal.json").write_text(json.dumps(bad))
    from polyparallel.cluster import ClusterSpecError

    with pytest.raises(ClusterSpecError, match="lacks 'launch_overhead'"):
        Cluster.load(tmp_path / "c.yaml")


def test_causal_mask_halves_fused_attention_work_but_not_unfused():
    cost = {}
    for causal in (False, True):
        g, op = _attention_graph(2, 8, 1024, 64, causal=causal)
        cost[causal] = (op_cost(g, op, A100, "bf16"), op_cost(g, op, A100, "bf16", fused=True), op.flops)
    # the IR counts the causal points exactly: s(s+1)/2 of s^2 (query, key) pairs
    assert cost[True][2] < 0.51 * cost[False][2]
    assert cost[True][0].flops == cost[False][0].flops  # unfused: the full score matrix is computed, then masked
    assert cost[True][0].forward == pytest.approx(cost[False][0].forward)
    assert cost[True][1].flops == cost[True][2] < cost[False][1].flops  # flash skips the masked blocks


@pytest.mark.parametrize(("kernel", "s", "fwd_tflops", "bwd_tflops"), [
    ("fa2", 8192, 333, 318), ("fa2", 2048, 298, 291), ("cudnn", 4096, 518, 499), ("fa3", 16384, 616, 561)])
def test_published_attention_kernels_price_at_their_published_rates(kernel, s, fwd_tflops, bwd_tflops):
    # FlashAttention-3 paper (H100 SXM5, head dim 128, B*S = 16k, 16 heads): a causal attention op of
    # exactly that shape takes FlashAttention's FLOP count (the masked half out) at the labelled
    # rate, forward and backward (2.5x the forward's FLOPs)
    h100 = Cluster.preset("dgx-h100").device(0).type
    b = 16384 // s
    g, op = _attention_graph(b, 16, s, 128, causal=True)
    fa_flops = 4 * b * 16 * s * s * 128 / 2
    c = op_cost(g, op, h100, "bf16", fused=True, attention_kernel=kernel)
    # (rows are indexed by the products' FLOPs, the op's count adds its softmax: 0.6% at head dim 128)
    assert c.forward == pytest.approx(fa_flops / (fwd_tflops * 1e12), rel=0.01)
    assert c.backward == pytest.approx(2.5 * fa_flops / (bwd_tflops * 1e12), rel=0.01)
    # unset: the device's own rows (an H100 without a calibration takes the H200's torch 2.11 run)
    assert op_cost(g, op, h100, "bf16", fused=True).forward < c.forward or kernel != "fa2"


def test_attention_kernel_outside_its_published_scope_names_the_fix():
    from polyparallel.cost_models import parallel_config as pc

    g, op = _attention_graph(4, 16, 2048, 128, causal=True)
    with pytest.raises(ValueError, match=r"Hopper GPUs.*leave attention_kernel unset"):
        op_cost(g, op, A100, "bf16", fused=True, attention_kernel="fa2")
    h100 = Cluster.preset("dgx-h100").device(0).type
    with pytest.raises(ValueError, match="16-bit attention"):
        op_cost(g, op, h100, "fp32", fused=True, attention_kernel="fa2")
    with pytest.raises(ValueError, match=r"attention_kernel='fa0'.*fa2, cudnn, fa3, fa1 or none"):
        pc.execution_options({"attention_kernel": "fa0"})
    assert pc.execution_options(pc.parse_execution(["attention_kernel=none"])) == (("attention_kernel", None),)


@pytest.mark.parametrize(("preset", "causal", "d", "s", "tflops"), [
    ("dgx-a100", True, 128, 2048, 69), ("dgx-a100", True, 128, 16384, 83), ("dgx-a100", True, 64, 512, 58),
    ("dgx-a100", False, 128, 4096, 80), ("dgx-h100", True, 128, 2048, 108), ("dgx-h100", True, 128, 8192, 135),
    ("dgx-h100", True, 64, 1024, 123), ("dgx-h100", False, 64, 16384, 168)])
def test_fa1_prices_flashattention_v1_at_its_published_rates(preset, causal, d, s, tflops):
    # FlashAttention-2 paper, Figures 4 (A100 80GB SXM4) and 7 (H100 80GB SXM5), "FlashAttention" bars:
    # forward + backward TFLOP/s at B*S = 16k tokens, hidden 2048, FLOPs counted 4*B*S^2*H*d (halved
    # with a causal mask) x 3.5 for forward + backward
    dev = Cluster.preset(preset).device(0).type
    h = 2048 // d
    b = 16384 // s
    g, op = _attention_graph(b, h, s, d, causal=causal)
    c = op_cost(g, op, dev, "bf16", fused=True, attention_kernel="fa1")
    fa_flops = 3.5 * 4 * b * h * s * s * d / (2 if causal else 1)
    assert c.forward + c.backward == pytest.approx(fa_flops / (tflops * 1e12), rel=0.01)
    assert c.backward == pytest.approx(2.5 * c.forward)
    # the rate is the sequence's, whatever the batch and heads: 8x the batch, the same rate
    g8, op8 = _attention_graph(8 * b, h, s, d, causal=causal)
    c8 = op_cost(g8, op8, dev, "bf16", fused=True, attention_kernel="fa1")
    assert c8.forward == pytest.approx(8 * c.forward, rel=1e-6)


def test_fa1_between_and_beyond_the_figure_and_padded_head_dims():
    h100 = Cluster.preset("dgx-h100").device(0).type

    def rate(b, h, s, d):
        g, op = _attention_graph(b, h, s, d, causal=True)
        c = op_cost(g, op, h100, "bf16", fused=True, attention_kernel="fa1")
        return 3.5 * 4 * b * h * s * s * d / 2 / (c.forward + c.backward) / 1e12

    # 3k: log-log between the 2k (108) and 4k (126) bars; 64k: the 16k bar (137), flat past the figure
    assert rate(2, 16, 3072, 128) == pytest.approx(108 * (126 / 108) ** (math.log(1.5) / math.log(2)), rel=0.01)
    assert rate(1, 8, 65536, 128) == pytest.approx(137, rel=0.01)
    # head dimension 112 (MPT-30B) runs in the kernel's 128-wide block: the 128 rate times 112/128
    assert rate(4, 16, 2048, 112) == pytest.approx(108 * 112 / 128, rel=0.01)
    g, op = _attention_graph(4, 16, 2048, 128, causal=True)
    with pytest.raises(ValueError, match=r"fa1.*A100 and H100.*leave attention_kernel unset"):
        op_cost(g, op, Cluster.preset("dgx-h100").device(0).type, "fp32", fused=True, attention_kernel="fa1")
    g, op = _attention_graph(2, 4, 512, 256, causal=True)
    with pytest.raises(ValueError, match="head dimension of at most 128"):
        op_cost(g, op, h100, "bf16", fused=True, attention_kernel="fa1")


def test_kernel_rates_taken_on_one_part_scale_to_another_parts_peak():
    # a cluster spec's own H100 at a lower power limit (torchtitan's Grand Teton parts: 500 W) is the
    # same chip at a lower clock: the published attention rates (taken on an H100 SXM5, 989.5 TFLOP/s)
    # and the H200's measured rows run slower by the peaks' ratio, as its GEMMs do (efficiency x its
    # own peak); the catalog's H100 keeps them as published
    from dataclasses import replace

    from polyparallel.cost_models.compute import gemm_shape

    h100 = Cluster.preset("dgx-h100").device(0).type
    slow = replace(h100, name="h100-500w", peak=tuple((k, v * 0.9) for k, v in h100.peak))
    g, op = _attention_graph(2, 16, 8192, 128, causal=True)
    for kernel in ("fa2", "cudnn", "fa3", "fa1", None):
        ref = op_cost(g, op, h100, "bf16", fused=True, attention_kernel=kernel)
        own = op_cost(g, op, slow, "bf16", fused=True, attention_kernel=kernel)
        assert own.forward == pytest.approx(ref.forward / 0.9, rel=1e-9), kernel
        assert own.backward == pytest.approx(ref.backward / 0.9, rel=1e-9), kernel
    # the same for a GEMM (big enough to be compute bound)
    from polyparallel import ops
    from polyparallel.ir import Graph, Op, TensorKind, TensorSpec

    gm = Graph("mm")
    gm.add_tensor(TensorSpec("a", (8192, 8192), "float32", TensorKind.INPUT))
    gm.add_tensor(TensorSpec("b", (8192, 8192), "float32", TensorKind.PARAM))
    gm.add_tensor(TensorSpec("c", (8192, 8192)))
    mm = gm.add_op(Op("mm", OpKind.CONTRACTION, "matmul", ("a", "b"), ("c",), ops.matmul((8192, 8192), (8192, 8192))))
    assert gemm_shape(mm) is not None
    assert op_cost(gm, mm, slow, "bf16").forward == pytest.approx(op_cost(gm, mm, h100, "bf16").forward / 0.9)
