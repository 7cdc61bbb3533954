"""Op-family builders: executing their loop nests reproduces numpy/torch, FLOPs match closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from polyparallel import ops
from polyparallel.ir import Role

from .nest_eval import run

rng = np.random.default_rng(0)


@pytest.mark.parametrize(("src", "dst"), [((2, 12), (2, 3, 4)), ((2, 3, 4), (6, 4)), ((2, 6), (4, 3)),
                                           ((1, 4, 1), (4,)), ((4,), (2, 1, 2)), ((3, 4, 5), (60,))])
def test_reshape_accesses_reproduce_numpy(src, dst):
    x = rng.standard_normal(src)
    out = run(ops.reshape(src, dst), {"in0": x}, {"out0": dst})["out0"]
    np.testing.assert_array_equal(out, x.reshape(dst))


def test_reshape_that_is_not_a_split_or_merge_is_refused():
    with pytest.raises(ops.NotModelled, match="not affine"):
        ops.reshape((6, 4), (4, 6))


def test_views_reproduce_numpy():
    x = rng.standard_normal((2, 3, 4))
    perm = (2, 0, 1)
    np.testing.assert_array_equal(run(ops.permute(x.shape, perm), {"in0": x}, {"out0": (4, 2, 3)})["out0"],
                                  x.transpose(perm))
    np.testing.assert_array_equal(run(ops.slice_(x.shape, 2, 1, 4, 2), {"in0": x}, {"out0": (2, 3, 2)})["out0"],
                                  x[:, :, 1:4:2])
    np.testing.assert_array_equal(run(ops.select(x.shape, 1, -1), {"in0": x}, {"out0": (2, 4)})["out0"], x[:, -1])
    y = rng.standard_normal((3, 1))
    np.testing.assert_array_equal(run(ops.expand(y.shape, (2, 3, 5)), {"in0": y}, {"out0": (2, 3, 5)})["out0"],
                                  np.broadcast_to(y, (2, 3, 5)))
    np.testing.assert_array_equal(run(ops.pad(y.shape, [(1, 2), (0, 1)]), {"in0": y}, {"out0": (6, 2)})["out0"],
                                  np.pad(y, [(1, 2), (0, 1)]))
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((2, 5))
    np.testing.assert_array_equal(run(ops.concat([a.shape, b.shape], 1), {"in0": a, "in1": b},
                                      {"out0": (2, 8)})["out0"], np.concatenate([a, b], 1))
    parts = run(ops.split((2, 8), [3, 5], 1), {"in0": np.concatenate([a, b], 1)}, {"out0": (2, 3), "out1": (2, 5)})
    np.testing.assert_array_equal(parts["out0"], a)
    np.testing.assert_array_equal(parts["out1"], b)
    c = rng.standard_normal((2, 3))
    for axis in (0, 1, 2, -1):  # a new dim at every place
        want = np.stack([a, c], axis)
        np.testing.assert_array_equal(run(ops.stack([a.shape, c.shape], axis), {"in0": a, "in1": c},
                                          {"out0": want.shape})["out0"], want)


@pytest.mark.parametrize(("a", "b"), [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((4,), (2, 4, 3)),
                                      ((2, 1, 3, 4), (5, 4, 2)),
                                      ((3, 4), (4,))])
def test_matmul_accesses_reproduce_numpy(a, b):
    x, y = rng.standard_normal(a), rng.standard_normal(b)
    ref = np.matmul(x, y)
    nest = ops.matmul(a, b)
    out = run(nest, {"in0": x, "in1": y}, {"out0": ref.shape})["out0"]
    np.testing.assert_allclose(out, ref, rtol=1e-12)
    assert nest.flops() == 2 * math.prod(ref.shape) * a[-1]


def test_einsum_and_linear():
    x, w = rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 4))
    nest = ops.einsum("bsk,nk->bsn", [x.shape, w.shape])
    np.testing.assert_allclose(run(nest, {"in0": x, "in1": w}, {"out0": (2, 3, 5)})["out0"],
                               np.einsum("bsk,nk->bsn", x, w))
    lin = ops.linear(x.shape, w.shape, (5,))
    assert lin.flops() == 2 * 2 * 3 * 5 * 4 + 2 * 3 * 5
    assert lin.role("k") == Role.REDUCTION and lin.role("n") == Role.PARALLEL


@pytest.mark.parametrize(("stride", "padding", "dilation", "groups"), [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 2, 1),
                                                                      (2, 0, 1, 2), (1, 1, 1, 4)])
def test_conv_accesses_reproduce_torch(stride, padding, dilation, groups):
    x = torch.randn(2, 4, 7, 6, dtype=torch.float64)
    w = torch.randn(8, 4 // groups, 3, 3, dtype=torch.float64)
    ref = F.conv2d(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups)
    nest = ops.conv(tuple(x.shape), tuple(w.shape), stride=stride, padding=padding, dilation=dilation,
                    groups=groups)
    out = run(nest, {"in0": x.numpy(), "in1": w.numpy()}, {"out0": tuple(ref.shape)})["out0"]
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-10, atol=1e-10)
    assert nest.flops() == 2 * ref.numel() * (4 // groups) * 9


def test_pool_window_matches_torch():
    x = torch.randn(1, 2, 7, 7, dtype=torch.float64)
    ref = F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=True)
    nest = ops.pool(tuple(x.shape), 3, stride=2, padding=1)
    out = run(nest, {"in0": x.numpy()}, {"out0": tuple(ref.shape)})["out0"] / 9  # window sum / window size
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-12)
    assert nest.flops() == ref.numel() * 9


def test_causal_attention_flops_closed_form():
    B, H, S, D = 2, 4, 16, 8
    nest = ops.attention((B, H, S, D), (B, H, S, D), (B, H, S, D), causal=True)
    tri = S * (S + 1) // 2
    assert nest.flops() == B * H * tri * (2 * D + 3 + 2 * D)
    full = ops.attention((B, H, S, D), (B, H, S, D), (B, H, S, D))
    assert full.flops() == B * H * S * S * (4 * D + 3)


def test_gqa_attention_keeps_accesses_affine():
    nest = ops.attention((2, 8, 4, 16), (2, 2, 4, 16), (2, 2, 4, 16))
    assert {d.name for d in nest.dims} >= {"h", "g"}
    assert nest.dim("h").extent == 2 and nest.dim("g").extent == 4


def test_elementwise_broadcast_reproduces_numpy():
    a, b = rng.standard_normal((2, 1, 4)), rng.standard_normal((3, 1))
    nest = ops.elementwise(None, [a.shape, b.shape])
    out = run(nest, {"in0": a, "in1": b}, {"out0": (2, 3, 4)}, fn=lambda u, v: u + v)["out0"]
    np.testing.assert_allclose(out, a + b)


def test_reduce_reproduces_numpy():
    x = rng.standard_normal((2, 3, 4))
    out = run(ops.reduce(x.shape, [1], keepdim=True), {"in0": x}, {"out0": (2, 1, 4)})["out0"]
    np.testing.assert_allclose(out, x.sum(1, keepdims=True))
    out = run(ops.reduce(x.shape, None), {"in0": x}, {"out0": ()})["out0"]
    np.testing.assert_allclose(out, x.sum())


def test_norm_and_loss_roles():
    ln = ops.layer_norm((2, 5, 8), (8,))
    assert ln.role("f") == Role.REDUCTION and [s.name for s in ln.statements] == ["stats", "normalize"]
    assert ln.flops() == 2 * 5 * 8 * (3 + 4)
    ce = ops.cross_entropy((6, 10), (6,))
    assert ce.role("c") == Role.REDUCTION
    emb = ops.embedding((100, 16), (2, 5))
    assert emb.flops() == 0 and emb.role("v") == Role.REDUCTION


def test_empty_outputs_are_unsupported_not_crashes():
    with pytest.raises(ops.NotModelled, match="empty"):
        ops.pool((1, 1, 2, 2), 3)
    with pytest.raises(ops.NotModelled, match="empty"):
        ops.conv((1, 1, 2, 2), (1, 1, 3, 3))
