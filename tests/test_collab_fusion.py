"""Fusion strategies, update compression and payload validation against independent numpy sums."""

from __future__ import annotations

import numpy as np
import pytest

from polyparallel.backends.collab import (
    CenterUpdate,
    DiLoCo,
    FedAdam,
    FedAvg,
    FedProx,
    FedYogi,
    Median,
    TrimmedMean,
    check_payload,
    decode_update,
    encode_update,
    is_statistic,
    make_fusion,
    payload_nbytes,
)

RNG = np.random.default_rng(7)
GLOBAL = {"w": RNG.normal(size=(3, 4)).astype(np.float32), "b": RNG.normal(size=(4,)).astype(np.float32)}
LOCALS = [{k: (v + RNG.normal(scale=0.1, size=v.shape)).astype(np.float32) for k, v in GLOBAL.items()}
          for _ in range(5)]
COUNTS = [10, 30, 5, 25, 30]


def _updates(locals_=LOCALS, counts=COUNTS):
    return [CenterUpdate(f"c{i}", p, n) for i, (p, n) in enumerate(zip(locals_, counts))]


def test_fedavg_is_the_sample_weighted_mean():
    out = FedAvg().fuse(GLOBAL, _updates())
    for k in GLOBAL:
        # written element by element, independently of the implementation's delta form
        expect = np.zeros(GLOBAL[k].shape)
        for idx in np.ndindex(GLOBAL[k].shape):
            expect[idx] = sum(n * float(p[k][idx]) for p, n in zip(LOCALS, COUNTS)) / sum(COUNTS)
        np.testing.assert_allclose(out[k], expect, rtol=1e-6, atol=1e-7)
        assert out[k].dtype == np.float32


def test_fedavg_of_known_arrays():
    g = {"a": np.zeros(2, np.float32)}
    ups = [CenterUpdate("x", {"a": np.array([1.0, 2.0], np.float32)}, 1),
           CenterUpdate("y", {"a": np.array([4.0, 8.0], np.float32)}, 3)]
    np.testing.assert_allclose(FedAvg().fuse(g, ups)["a"], [3.25, 6.5])


def test_fedprox_fuses_like_fedavg_and_exposes_mu():
    f = FedProx(mu=0.5)
    assert f.proximal_mu == 0.5
    for k, v in f.fuse(GLOBAL, _updates()).items():
        np.testing.assert_array_equal(v, FedAvg().fuse(GLOBAL, _updates())[k])


def test_fedadam_two_steps_by_hand():
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    f = FedAdam(lr=lr, beta1=b1, beta2=b2, tau=tau)
    x = {k: v.astype(np.float64) for k, v in GLOBAL.items()}
    m = {k: 0.0 for k in x}
    v = {k: 0.0 for k in x}
    cur = GLOBAL
    for _ in range(2):
        out = f.fuse(cur, _updates())
        for k in x:
            avg = sum(n * p[k].astype(np.float64) for p, n in zip(LOCALS, COUNTS)) / sum(COUNTS)
            d = avg - cur[k].astype(np.float64)
            m[k] = b1 * m[k] + (1 - b1) * d
            v[k] = b2 * v[k] + (1 - b2) * d * d
            x[k] = cur[k].astype(np.float64) + lr * m[k] / (np.sqrt(v[k]) + tau)
            np.testing.assert_allclose(out[k], x[k], rtol=1e-5, atol=1e-6)
        cur = out


def test_fedyogi_second_moment_is_additive():
    f = FedYogi(lr=0.1, beta1=0.0, beta2=0.5, tau=1e-3)
    g = {"a": np.zeros(1, np.float32)}
    ups = [CenterUpdate("x", {"a": np.array([2.0], np.float32)}, 1)]
    # v0 = 0, d = 2: v1 = 0 - 0.5 * 4 * sign(0 - 4) = 2; m1 = d = 2; x1 = 0.1 * 2 / (sqrt(2) + 1e-3)
    out = f.fuse(g, ups)
    np.testing.assert_allclose(out["a"], [0.1 * 2 / (np.sqrt(2) + 1e-3)], rtol=1e-6)
    np.testing.assert_allclose(f.state()["v/a"], [2.0])


def test_diloco_nesterov_matches_torch_sgd():
    import torch

    f = DiLoCo(lr=0.7, momentum=0.9)
    w = torch.nn.Parameter(torch.from_numpy(GLOBAL["w"].astype(np.float64).copy()))
    opt = torch.optim.SGD([w], lr=0.7, momentum=0.9, nesterov=True)
    cur = {"w": GLOBAL["w"]}
    for step in range(3):
        locals_ = [{"w": (cur["w"] + 0.05 * (i + 1 + step)).astype(np.float32)} for i in range(3)]
        ups = [CenterUpdate(f"c{i}", p, n) for i, (p, n) in enumerate(zip(locals_, [1, 2, 3]))]
        avg = sum(n * p["w"].astype(np.float64) for p, n in zip(locals_, [1, 2, 3])) / 6
        w.grad = torch.from_numpy(cur["w"].astype(np.float64) - avg)  # the outer gradient
        opt.step()
        cur = f.fuse(cur, ups)
        np.testing.assert_allclose(cur["w"], w.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fusion", [FedAdam(lr=0.5), FedYogi(lr=0.5), DiLoCo(lr=0.7, momentum=0.9)])
def test_server_optimisers_average_running_statistics(fusion):
    """BatchNorm statistics take the weighted average x + Δ; extrapolating them made variances negative."""
    g = {"bn.weight": np.ones(3, np.float32), "bn.running_var": np.ones(3, np.float32),
         "bn.running_mean": np.zeros(3, np.float32)}
    assert [is_statistic(k) for k in g] == [False, True, True]
    for _ in range(4):  # the variances shrink every round: momentum would overshoot below zero
        locals_ = [{k: (0.2 * v + 0.01 * i).astype(np.float32) for k, v in g.items()} for i in range(3)]
        ups = [CenterUpdate(f"c{i}", p, n) for i, (p, n) in enumerate(zip(locals_, [1, 2, 3]))]
        avg = {k: sum(n * p[k].astype(np.float64) for p, n in zip(locals_, [1, 2, 3])) / 6 for k in g}
        g = fusion.fuse(g, ups)
        for k in ("bn.running_var", "bn.running_mean"):
            np.testing.assert_allclose(g[k], avg[k], rtol=1e-6)
        assert not np.allclose(g["bn.weight"], avg["bn.weight"])  # the trained parameter is optimised
    assert (g["bn.running_var"] > 0).all()


def test_trimmed_mean_matches_sorted_arrays():
    out = TrimmedMean(beta=0.2).fuse(GLOBAL, _updates())
    for k in GLOBAL:
        stack = np.stack([p[k] for p in LOCALS]).reshape(5, -1)
        expect = np.array([np.mean(sorted(col)[1:4]) for col in stack.T]).reshape(GLOBAL[k].shape)
        np.testing.assert_allclose(out[k], expect, rtol=1e-6)


def test_median_neutralises_a_byzantine_center():
    bad = {k: np.full_like(v, 1e6) for k, v in GLOBAL.items()}
    ups = [*_updates()[:4], CenterUpdate("evil", bad, 10_000)]
    med = Median().fuse(GLOBAL, ups)
    honest = np.stack([p["w"] for p in LOCALS[:4]])
    assert np.all(med["w"] >= honest.min(0)) and np.all(med["w"] <= honest.max(0))
    # the median of 4 honest values and +inf-like one is the 3rd smallest honest value
    np.testing.assert_allclose(med["w"], np.sort(honest, axis=0)[2], rtol=1e-6)
    assert np.abs(FedAvg().fuse(GLOBAL, ups)["w"]).max() > 1e5  # while FedAvg is dragged away


def test_make_fusion_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown fusion strategy 'fedfoo'"):
        make_fusion("fedfoo")
    with pytest.raises(ValueError, match="bad options"):
        make_fusion("fedavg", mu=1.0)
    with pytest.raises(ValueError, match="beta"):
        TrimmedMean(beta=0.5)


@pytest.mark.parametrize("method,tol,ratio", [("none", 0.0, 1.0), ("fp16", 1e-3, 0.5), ("int8", None, 0.25)])
def test_compression_round_trip_and_bytes(method, tol, ratio):
    delta = {"w": RNG.normal(scale=0.01, size=(64, 32)).astype(np.float32),
             "b": RNG.normal(scale=0.01, size=(32,)).astype(np.float32), "z": np.zeros((4, 4), np.float32)}
    payload = encode_update(delta, method)
    back = decode_update(payload, method)
    raw = sum(v.nbytes for v in delta.values())
    for k, d in delta.items():
        if method == "int8":
            rows = d.reshape(d.shape[0], -1) if d.ndim >= 2 else d.reshape(1, -1)
            half_step = (np.abs(rows).max(1) / 127 / 2)[:, None]
            assert np.all(np.abs((back[k] - d).reshape(rows.shape)) <= half_step + 1e-9)
        else:
            np.testing.assert_allclose(back[k], d, atol=tol * np.abs(d).max() if tol else 0)
    scales = 4 * (64 + 1 + 4) if method == "int8" else 0
    assert payload_nbytes(payload) == int(raw * ratio) + scales
    assert check_payload(payload, delta, method) == []


def test_malformed_payloads_are_named():
    ref = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}
    good = encode_update(ref, "int8")
    assert check_payload(good, ref, "int8") == []
    bad_shape = {**good, "q/w": np.zeros((2, 3), np.int8)}
    assert any("shape (2, 3), expected (3, 2)" in p for p in check_payload(bad_shape, ref, "int8"))
    bad_dtype = {**good, "q/w": np.zeros((3, 2), np.float32)}
    assert any("dtype float32, expected int8" in p for p in check_payload(bad_dtype, ref, "int8"))
    nan = encode_update(ref, "none")
    nan["q/b"] = np.array([0.0, np.nan], np.float32)
    assert any("non-finite" in p for p in check_payload(nan, ref, "none"))
    missing = {k: v for k, v in good.items() if k != "s/b"}
    assert check_payload(missing, ref, "int8") == ["missing tensor 's/b'"]
    extra = {**encode_update(ref, "fp16"), "q/secret": np.zeros(1, np.float16)}
    assert check_payload(extra, ref, "fp16") == ["unexpected tensor 'q/secret'"]


def test_packed_arrays_come_back_bit_for_bit_and_a_bad_layout_is_named():
    """pack/unpack (the Flower messages' layout): every array equal in dtype, shape and bytes, order kept."""
    from polyparallel.backends.collab._wire import pack_arrays, unpack_arrays

    arrays = {"q/w": RNG.integers(-127, 128, size=(5, 3)).astype(np.int8), "s/w": RNG.random(5).astype(np.float32),
              "q/b": RNG.integers(-127, 128, size=(3,)).astype(np.int8), "steps": np.array(7, np.int64),
              "empty": np.zeros((0, 4), np.float32), "bn.mean": RNG.normal(size=(2, 1, 3)).astype(np.float32)}
    buffers, layout = pack_arrays(arrays)
    assert sorted(buffers) == sorted({"|i1", "<f4", "<i8"})
    assert buffers["|i1"].size == 18 and buffers["<f4"].size == 5 + 0 + 6
    back = unpack_arrays(buffers, layout)
    assert list(back) == list(arrays)
    for k, a in arrays.items():
        assert back[k].dtype == a.dtype and back[k].shape == a.shape and back[k].tobytes() == a.tobytes()
    with pytest.raises(ValueError, match="the <f4 buffer has 12 elements, the layout uses 11"):
        unpack_arrays({**buffers, "<f4": np.zeros(12, np.float32)}, layout)
    with pytest.raises(ValueError, match="runs past the end"):
        unpack_arrays({**buffers, "<f4": np.zeros(4, np.float32)}, layout)
    with pytest.raises(ValueError, match="layout dtypes"):
        unpack_arrays({k: v for k, v in buffers.items() if k != "<i8"}, layout)
    with pytest.raises(ValueError, match="ranks"):
        unpack_arrays(buffers, {**layout, "shapes": layout["shapes"][:-1]})
    with pytest.raises(ValueError, match="lacks 'names'"):
        unpack_arrays(buffers, {k: v for k, v in layout.items() if k != "names"})
    with pytest.raises(ValueError, match="only numeric"):
        pack_arrays({"x": np.array(["a"])})
