"""Exactness of the polyhedral model against brute-force enumeration: halos of convolutions and
pooling split over their rows, masked (causal, sliding-window) attention footprints, pooling
output extents against torch, and the route and price each one gets."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from polyparallel import ops
from polyparallel.cluster import Cluster
from polyparallel.cost_models.comm import collective_time
from polyparallel.ir import ANY, Graph, LoopNest, Op, OpKind, TensorKind, TensorSpec
from polyparallel.poly import DeviceMesh, Placement, TensorLayout, layout_distribution, operand_need, reshard


def _graph(*tensors: tuple[str, tuple[int, ...], str]) -> Graph:
    g = Graph("t")
    for name, shape, kind in tensors:
        g.add_tensor(TensorSpec(name, shape, kind=TensorKind(kind)))
    return g


def brute_need(nest: LoopNest, operand: str, shape: tuple[int, ...], placement: Placement,
               mesh: DeviceMesh) -> list[set[tuple[int, ...]]]:
    """Per device: the elements of ``operand`` its share of the domain reads (every point walked)."""
    out = []
    for p in range(mesh.size):
        box = {}
        for d in nest.dims:
            lo, hi = mesh.bounds(d.extent, placement.axes_of(d.name))
            box[d.name] = range(int(lo[p]), int(hi[p]))
        got: set[tuple[int, ...]] = set()
        for st in nest.statements:
            reads = [a for a in st.reads if a.operand == operand]
            if not reads:
                continue
            for pt in itertools.product(*(box[d] for d in st.dims)):
                env = dict(zip(st.dims, pt))
                if any(c.eval(env) < 0 for c in st.constraints):
                    continue
                for a in reads:
                    idx = tuple(e.eval(env) if e is not ANY else None for e in a.index)
                    if all(i is None or 0 <= i < n for i, n in zip(idx, shape)):
                        assert None not in idx
                        got.add(idx)
        out.append(got)
    return out


def brute_block(shape: tuple[int, ...], layout: TensorLayout, mesh: DeviceMesh) -> list[set[tuple[int, ...]]]:
    out = []
    for p in range(mesh.size):
        ranges = []
        for n, axes in zip(shape, layout.shards):
            lo, hi = mesh.bounds(n, axes)
            ranges.append(range(int(lo[p]), int(hi[p])))
        out.append(set(itertools.product(*ranges)))
    return out


# -- 1. halos: convolution and pooling windows split over rows ----------------------------------------
HALO_CASES = [  # (op, kernel, stride, padding, dilation, H, W)
    ("conv", 3, 1, 1, 1, 12, 5),
    ("conv", 3, 2, 1, 1, 13, 5),
    ("conv", 3, 2, 0, 1, 12, 8),   # a clipped, strided window along the unsplit W axis
    ("conv", 5, 1, 2, 1, 12, 4),
    ("conv", 3, 1, 2, 2, 12, 4),   # dilated
    ("conv", 1, 2, 0, 1, 12, 6),   # ResNet's strided 1x1 downsample: no halo
    ("pool", 3, 2, 1, 1, 12, 5),
    ("pool", 2, 2, 0, 1, 11, 7),   # odd extents: the last row / column is never read
]


@pytest.mark.parametrize("mesh_axes", [{"sp": 3}, {"sp": 4}, {"dp": 2, "sp": 3}])
@pytest.mark.parametrize("case", HALO_CASES)
def test_halo_volume_and_route_against_brute_force(case, mesh_axes):
    kind, k, s, pad, dil, H, W = case
    B, C = 2, 2
    mesh = DeviceMesh.of(**mesh_axes)
    x = (B, C, H, W)
    if kind == "conv":
        nest = ops.conv(x, (3, C, k, k), stride=s, padding=pad, dilation=dil)
        g = _graph(("x", x, "activation"), ("w", (3, C, k, k), "param"), ("y", (B, 3, 1, 1), "activation"))
        op = Op("op", OpKind.CONV, "conv2d", ("x", "w"), ("y",), nest)
    else:
        nest = ops.pool(x, k, stride=s, padding=pad, dilation=dil)
        g = _graph(("x", x, "activation"), ("y", (B, C, 1, 1), "activation"))
        op = Op("op", OpKind.POOL, "max_pool2d", ("x",), ("y",), nest)
    g.add_op(op)
    split = Placement.parse("b:dp,h:sp" if "dp" in mesh_axes else "h:sp")
    held = TensorLayout(x, (("dp",) if "dp" in mesh_axes else (), (), ("sp",), ()))
    need = operand_need(g, op, split, mesh, "in0")
    want_need = brute_need(nest, "in0", x, split, mesh)
    assert need.counts().tolist() == [len(n) for n in want_need]
    missing = [len(n - h) for n, h in zip(want_need, brute_block(x, held, mesh))]
    assert need.missing(layout_distribution(held, mesh)).tolist() == missing
    r = reshard(held, need, mesh)
    if max(missing) == 0:
        assert r.kind == "none"
    else:
        # a neighbour exchange along sp, of exactly the rows the neediest device lacks
        assert r.kind == "halo", str(r)
        step = r.steps[0]
        assert step.axes == ("sp",) and step.group == mesh.axis("sp").size
        assert step.elements == max(missing) == r.direct_elements and step.total == sum(missing)
    # a replicated producer already holds every window: nothing moves
    assert reshard(TensorLayout.replicated(x), need, mesh).kind == "none"


def test_halo_is_priced_as_a_neighbour_exchange_not_an_all_to_all():
    c = Cluster.preset("dgx-a100x8")  # 8 nodes of 8 A100s
    n = 4 << 20
    two = collective_time(c, "halo", n, [0, 1]).seconds
    node = collective_time(c, "halo", n, list(range(8))).seconds
    cluster = collective_time(c, "halo", n, list(range(48))).seconds
    bw, lat = c.link(0, 1)
    # two devices: one message of the whole halo; inside a node each device receives its halo
    # from two neighbours over its own link: the same bytes, the same time
    assert two == pytest.approx(lat + n / bw)
    assert node == pytest.approx(two)
    # across nodes the boundary flows take the network, each half of the halo
    nbw, nlat = c.link(7, 8)
    assert cluster == pytest.approx(max(lat + n / bw, nlat + n / 2 / min(nbw, c.node_bandwidth(0) / 2)))
    # an all-to-all over the 48 devices moving the same bytes per device costs more
    assert collective_time(c, "all_to_all", n * 48 / 47, list(range(48))).seconds > cluster


# -- 2. masked footprints: keys and values under a causal or sliding-window mask ----------------------
@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("mesh_axes", [{"sp": 4}, {"sp": 3}, {"dp": 2, "sp": 2}])
def test_masked_kv_footprint_against_brute_force(window, mesh_axes):
    B, H, Hk, S, D = 2, 4, 2, 12, 3
    mesh = DeviceMesh.of(**mesh_axes)
    q, kv = (B, H, S, D), (B, Hk, S, D)
    nest = ops.attention(q, kv, kv, causal=True, window=window)
    g = _graph(("q", q, "activation"), ("k", kv, "activation"), ("v", kv, "activation"), ("o", q, "activation"))
    op = g.add_op(Op("attn", OpKind.ATTENTION, "sdpa", ("q", "k", "v"), ("o",), nest))
    split = Placement.parse("b:dp,s:sp" if "dp" in mesh_axes else "s:sp")
    held = TensorLayout(kv, (("dp",) if "dp" in mesh_axes else (), (), ("sp",), ()))
    for operand in ("in1", "in2"):
        need = operand_need(g, op, split, mesh, operand)
        want = brute_need(nest, operand, kv, split, mesh)
        assert need.counts().tolist() == [len(n) for n in want]
        missing = [len(n - h) for n, h in zip(want, brute_block(kv, held, mesh))]
        r = reshard(held, need, mesh)
        # priced at the exact volume the neediest device lacks, never a full all-gather of K / V
        assert r.elements == max(missing) == r.direct_elements
        assert sum(s.total for s in r.steps) == sum(missing)
        assert "all-gather" not in r.kind
        sp = mesh.axis("sp").size
        block = S // sp
        if window is not None and window - 1 <= block:
            assert r.kind == "halo" and r.steps[0].group == sp  # the window reaches the previous block only
        elif max(missing):
            # the prefix of earlier blocks: an exchange among the sp devices, not the whole mesh
            assert r.kind in ("p2p", "halo") and r.steps[0].axes == ("sp",) and r.steps[0].group == sp
    # FLOPs: the masked domain counted exactly (scores, softmax, p.v per visible pair)
    visible = sum(1 for s in range(S) for t in range(S) if t <= s and (window is None or t > s - window))
    assert nest.flops() == B * H * visible * (2 * D + 3 + 2 * D)


# -- 3. pooling output extents against torch ---------------------------------------------------------
def test_pool_output_extents_match_torch_over_a_grid():
    import torch
    import torch.nn.functional as F

    checked = 0
    for size, k, s, pad, dil, ceil in itertools.product((5, 6, 7, 8, 11), (1, 2, 3), (1, 2, 3), (0, 1), (1, 2),
                                                        (False, True)):
        if pad > k // 2:
            continue  # torch: padding at most half the kernel
        x = torch.zeros(1, 1, size, size + 1)
        try:
            want = F.max_pool2d(x, k, s, pad, dil, ceil_mode=ceil).shape
        except RuntimeError:
            continue  # torch refuses it (empty output)
        try:
            nest = ops.pool((1, 1, size, size + 1), k, stride=s, padding=pad, dilation=dil, ceil_mode=ceil)
        except ops.NotModelled:
            pytest.fail(f"torch pools size={size} k={k} s={s} p={pad} d={dil} ceil={ceil} but the model refuses")
        got = tuple(nest.dim(d).extent for d in ("h", "w"))
        assert got == tuple(want[2:]), (size, k, s, pad, dil, ceil)
        checked += 1
    assert checked > 200


# -- 4. Megatron's grouped-query attention: two loop dims on one tp axis, factorised ------------------
def test_megatron_gqa_on_tp4_is_a_placement_of_the_factorised_mesh():
    from polyparallel.poly import comm_of_op, legal_placements

    B, Hq, Hk, S, D = 1, 8, 2, 4, 2  # 8 query heads, 2 KV heads, tp = 4
    q, kv = (B, Hq, S, D), (B, Hk, S, D)
    nest = ops.attention(q, kv, kv, causal=True)
    g = _graph(("q", q, "activation"), ("k", kv, "activation"), ("v", kv, "activation"), ("o", q, "activation"))
    op = g.add_op(Op("attn", OpKind.ATTENTION, "sdpa", ("q", "k", "v"), ("o",), nest))

    def heads(sets: list[set[tuple[int, ...]]]) -> list[set[int]]:
        return [{i[1] for i in s} for s in sets]

    # Megatron: device c holds query heads 2c, 2c+1 and the one KV head they read, c // 2
    megatron_q = [{2 * c, 2 * c + 1} for c in range(4)]
    megatron_kv = [{c // 2} for c in range(4)]
    # on the plain tp = 4 axis no legal placement gives that layout (one mesh axis, one loop dim)
    flat = DeviceMesh.of(tp=4)
    for pl in legal_placements(g, op, flat):
        got_q = heads(brute_need(nest, "in0", q, pl, flat))
        got_kv = heads(brute_need(nest, "in1", kv, pl, flat))
        assert (got_q, got_kv) != (megatron_q, megatron_kv), str(pl)
    # the same devices with tp factorised 2 x 2: KV heads over the outer factor, a group's query heads
    # over the inner one
    mesh = flat.factor("tp", tp_kv=2, tp_q=2)
    assert mesh.device_ids == flat.device_ids
    pl = Placement.parse("h:tp_kv,g:tp_q")
    assert pl in legal_placements(g, op, mesh)
    assert heads(brute_need(nest, "in0", q, pl, mesh)) == megatron_q
    assert heads(brute_need(nest, "in1", kv, pl, mesh)) == megatron_kv
    # the column-parallel projections' outputs on the coarse axis, refined: query heads split over tp
    # (2 per device) and the KV projection's 2 heads x D columns split over tp (half a head per device)
    col = Placement.parse("n:tp").refine("tp", ("tp_kv", "tp_q"))
    assert str(col) == "n:tp_kv+tp_q"
    q_held = TensorLayout(q, ((), ("tp_kv", "tp_q"), (), ()))
    kv_held = TensorLayout(kv, ((), ("tp_kv",), (), ("tp_q",)))
    assert brute_block(q, q_held, mesh) == brute_block(q, TensorLayout(q, ((), ("tp",), (), ())), flat)
    for operand, shape, held in (("in0", q, q_held), ("in1", kv, kv_held), ("in2", kv, kv_held)):
        need = operand_need(g, op, pl, mesh, operand)
        want = brute_need(nest, operand, shape, pl, mesh)
        assert need.counts().tolist() == [len(n) for n in want]
        missing = [len(n - h) for n, h in zip(want, brute_block(shape, held, mesh))]
        r = reshard(held, need, mesh)
        assert r.elements == max(missing)
        if operand == "in0":
            assert r.kind == "none"  # the query heads are where the projection left them
        else:
            # each device gathers the other half of its KV head from its tp_q partner: an all-gather
            # over the inner factor of exactly S x D / 2 elements
            assert r.kind == "all-gather" and r.steps[0].axes == ("tp_q",) and max(missing) == B * S * D // 2
    c = comm_of_op(g, op, pl, mesh)
    assert not c.forward and not c.partial_outputs
    assert c.flops * 4 == nest.flops()  # a quarter of the (masked) work on every device


# -- 5. transposed convolution: FLOPs, output shape and values against torch --------------------------
@pytest.mark.parametrize("stride,padding,output_padding,dilation,groups,k", [
    (2, 0, 0, 1, 1, 2),   # UNet's 2x2 stride-2 upsampling
    (2, 0, 1, 1, 1, 2),   # output_padding past the last tap: a zero-filled row
    (2, 1, 1, 1, 1, 3),
    (1, 0, 0, 2, 1, 3),
    (3, 2, 1, 1, 2, 4),
])
def test_conv_transpose_against_torch(stride, padding, output_padding, dilation, groups, k):
    import torch
    import torch.nn.functional as F

    from .nest_eval import run

    torch.manual_seed(0)
    B, C, O, H, W = 2, 4, 6, 3, 4
    x = torch.randn(B, C, H, W, dtype=torch.float64)
    w = torch.randn(C, O // groups, k, k, dtype=torch.float64)
    bias = torch.randn(O, dtype=torch.float64)
    want = F.conv_transpose2d(x, w, bias, stride=stride, padding=padding, output_padding=output_padding,
                              groups=groups, dilation=dilation)
    nest = ops.conv_transpose(x.shape, w.shape, bias.shape, stride=stride, padding=padding,
                              output_padding=output_padding, dilation=dilation, groups=groups)
    # FLOPs: one multiply-add per (input pixel, input channel, output channel of its group, kernel tap)
    # whose output is not cropped, and the bias once per output element
    def taps(n_in: int, n_out: int) -> int:
        return sum(1 for i in range(n_in) for r in range(k) if 0 <= i * stride + r * dilation - padding < n_out)

    pairs = taps(H, want.shape[2]) * taps(W, want.shape[3])
    assert nest.flops() == 2 * B * C * (O // groups) * pairs + want.numel()
    if padding == 0 and output_padding == 0:
        assert pairs == H * W * k * k  # the closed form: nothing cropped
    # values: the multiply-add statement walked point by point (the bias statement is a plain add)
    plain = ops.conv_transpose(x.shape, w.shape, None, stride=stride, padding=padding, output_padding=output_padding,
                               dilation=dilation, groups=groups)
    got = run(plain, {"in0": x.numpy(), "in1": w.numpy()}, {"out0": tuple(want.shape)})["out0"]
    np.testing.assert_allclose(got + bias.numpy()[None, :, None, None], want.numpy(), rtol=1e-12, atol=1e-12)


def test_conv_transpose_captured_from_torch_and_onnx():
    import onnx
    import torch
    from onnx import TensorProto, helper, numpy_helper

    import polyparallel as pp
    from polyparallel.frontends.onnx import capture_onnx
    from polyparallel.poly import legal_placements

    up = torch.nn.Sequential(torch.nn.ConvTranspose2d(4, 2, 2, stride=2))
    x = torch.randn(1, 4, 8, 8)
    flops = 2 * 1 * 4 * 2 * 8 * 8 * 2 * 2 + 1 * 2 * 16 * 16
    g = pp.capture(up, (x,))
    (op,) = [o for o in g.ops if o.kind == OpKind.CONV]
    assert op.nest is not None and op.flops == flops and g.shape(op.outputs[0]) == tuple(up(x).shape)
    # splitting the input rows of a 2x2 stride-2 upsampling moves nothing: each device writes its own rows
    assert Placement.parse("h:sp") in legal_placements(g, op, DeviceMesh.of(sp=4))
    # ONNX, with the output shape given instead of the padding (the crop split as the spec says)
    w = numpy_helper.from_array(np.zeros((4, 2, 3, 3), dtype=np.float32), "w")
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], output_shape=[15, 15])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    want = torch.nn.functional.conv_transpose2d(x, torch.zeros(4, 2, 3, 3), stride=2, padding=1)
    (op,) = [o for o in capture_onnx(onnx.shape_inference.infer_shapes(m)).ops if o.kind == OpKind.CONV]
    assert tuple(want.shape[2:]) == (15, 15)
    taps = sum(1 for i in range(8) for r in range(3) if 0 <= 2 * i + r - 1 < 15)
    assert op.nest is not None and op.flops == 2 * 4 * 2 * taps * taps


# -- 6. spatial parallelism of image models in the step model ----------------------------------------
def test_spatial_sp_prices_conv_halos_and_the_backend_refuses_by_name():
    import torch

    import polyparallel as pp
    from polyparallel.backends.torch.capabilities import plan_problems
    from polyparallel.cost_models import estimate_step
    from polyparallel.cost_models.parallel_config import ParallelConfig
    from polyparallel.cost_models.spatial import spatial_plan

    from .zoo import UNet

    H = W = 32
    g = pp.capture(UNet(width=8), (torch.randn(1, 3, H, W), torch.randint(0, 4, (1, H, W))))
    sp = 4
    convs = [op for op in g.ops if op.kind == OpKind.CONV and op.nest is not None and
             any(d.name == "r" and d.extent == 3 for d in op.nest.dims)]
    assert convs
    for op in convs:
        split, fwd, bwd = spatial_plan(g, op, sp, "bf16")
        _b, c, _h, w = g.shape(op.inputs[0])
        # a 3x3 pad-1 conv: an inner device lacks one row above and one below its block, c x w each, in bf16
        assert split == sp and fwd == (("halo", 2 * c * w * 2),)
        # the gradient rows sent back to their owners (none for the graph's input)
        assert bwd == ((("halo", 2 * c * w * 2),) if g.producer(op.inputs[0]) is not None else ())
    for op in g.ops:
        if op.kind == OpKind.POOL:
            assert spatial_plan(g, op, sp, "bf16") == (sp, (), ())  # 2x2 windows inside each block
    # BatchNorm over rows split: its statistics are all-reduced (2 numbers per channel)
    bn = [op for op in g.ops if "batch_norm" in op.target]
    assert bn and all(any(k == "all_reduce" for k, _ in spatial_plan(g, op, sp, "bf16")[1]) for op in bn)
    c = Cluster.preset("dgx-a100x8")
    est = estimate_step(g, c, ParallelConfig(dp=1, sp=sp, dtype="bf16", devices=tuple(range(sp))))
    assert est.breakdown()["sequence_parallel"] > 0  # no longer free for a net without attention
    (why,) = plan_problems(g, ParallelConfig(dp=1, sp=2))
    assert "image rows" in why and "sp=1" in why
    # a model with attention (a ViT: rank-4 [B, heads, S, D] after a patch convolution) keeps Ulysses
    q = (1, 2, 8, 4)
    vit = _graph(("q", q, "activation"), ("k", q, "activation"), ("v", q, "activation"), ("o", q, "activation"),
                 ("img", (1, 3, 8, 8), "input"), ("pw", (4, 3, 2, 2), "param"), ("p", (1, 4, 4, 4), "activation"))
    patch = ops.conv((1, 3, 8, 8), (4, 3, 2, 2), stride=2)
    vit.add_op(Op("patch", OpKind.CONV, "conv2d", ("img", "pw"), ("p",), patch))
    attn = vit.add_op(Op("attn", OpKind.ATTENTION, "sdpa", ("q", "k", "v"), ("o",), ops.attention(q, q, q)))
    assert spatial_plan(vit, attn, sp, "bf16") is None


@pytest.mark.parametrize("shape,scale", [((1, 2, 5), 2), ((1, 2, 4), 3), ((1, 1, 3, 4), 2), ((1, 1, 3, 3), 4)])
def test_linear_upsampling_reads_the_taps_torch_weights(shape, scale):
    import torch
    import torch.nn.functional as F

    mode = {3: "linear", 4: "bilinear"}[len(shape)]
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    y = F.interpolate(x, scale_factor=scale, mode=mode, align_corners=False)
    nest = ops.upsample_linear(shape, [scale] * (len(shape) - 2))
    spatial = len(shape) - 2
    # two taps per upsampled axis per output element, two FLOPs each
    assert nest.flops() == y.numel() * 2 ** spatial * 2
    taps: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
    for st in nest.statements:
        (w,), (r,) = st.writes, st.reads
        for env in (dict(zip(st.dims, p)) for p in itertools.product(*(range(nest.dim(d).extent) for d in st.dims))):
            out = tuple(e.eval(env) for e in w.index)
            src = tuple(min(max(e.eval(env), 0), n - 1) for e, n in zip(r.index, shape))  # the clamped edge
            taps.setdefault(out, set()).add(src)
    assert sorted(taps) == sorted(itertools.product(*(range(n) for n in y.shape)))  # every output written
    for idx in taps:
        (g,) = torch.autograd.grad(y[idx], x, retain_graph=True)
        support = {tuple(i) for i in torch.nonzero(g).tolist()}
        assert support <= taps[idx], idx  # every input torch weights is read


def test_linear_upsampling_captured_from_torch_and_onnx():
    import onnx
    import torch
    import torch.nn.functional as F
    from onnx import TensorProto, helper

    import polyparallel as pp
    from polyparallel.frontends.onnx import capture_onnx

    class Up(torch.nn.Module):
        def forward(self, x):
            return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)

    g = pp.capture(Up(), (torch.randn(1, 2, 4, 4),))
    (op,) = g.ops
    assert op.nest is not None and op.flops == 2 * 8 * 8 * 4 * 2
    scales = helper.make_tensor("scales", TensorProto.FLOAT, [4], [1, 1, 2, 2])
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [scales])
    m = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    (op,) = capture_onnx(m).ops
    assert op.nest is not None and op.flops == 2 * 8 * 8 * 4 * 2
