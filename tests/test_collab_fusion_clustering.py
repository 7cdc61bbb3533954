"""FLAME's and FoolsGold's decisions on synthetic updates against computations written out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from polyparallel.backends.collab._fusion import CenterUpdate, majority_cluster, make_fusion

GLOBAL = {"conv.weight": np.zeros((2, 3), np.float32), "bn.running_mean": np.zeros(2, np.float32)}


def _updates(directions: list[np.ndarray], stats: list[np.ndarray], counts: list[int]) -> list[CenterUpdate]:
    return [CenterUpdate(f"c{i}", {"conv.weight": d.reshape(2, 3).astype(np.float32),
                                   "bn.running_mean": m.astype(np.float32)}, n)
            for i, (d, m, n) in enumerate(zip(directions, stats, counts))]


def _two_clusters_and_an_outlier() -> tuple[list[CenterUpdate], list[int]]:
    """7 centers: 4 close to direction a (one of them 3x longer), 2 close to b (orthogonal to a), one -a."""
    rng = np.random.default_rng(3)
    a, b = np.array([1.0, 1, 0, 0, 0, 0]), np.array([0.0, 0, 0, 1, 1, 0])
    dirs = [a + rng.normal(scale=0.05, size=6) for _ in range(4)] + [b + rng.normal(scale=0.05, size=6)
                                                                    for _ in range(2)] + [-2.0 * a]
    dirs[1] = 3.0 * dirs[1]
    stats = [rng.normal(size=2) for _ in dirs]
    return _updates(dirs, stats, [10, 20, 30, 40, 50, 60, 70]), [0, 1, 2, 3]


def test_flame_keeps_the_majority_direction_and_fuses_its_clipped_mean():
    ups, kept = _two_clusters_and_an_outlier()
    flame = make_fusion("flame", noise=0.0)
    out = flame.fuse(GLOBAL, ups)
    w = [np.asarray(u.params["conv.weight"], np.float64).ravel() for u in ups]
    norms = [float(np.sqrt(sum(x * x for x in v))) for v in w]
    s = sorted(norms)[3]  # the median of 7 norms, every center's
    n_kept = sum(ups[i].num_samples for i in kept)
    expect = sum(ups[i].num_samples / n_kept * min(1.0, s / norms[i]) * w[i] for i in kept)
    np.testing.assert_allclose(out["conv.weight"].ravel(), expect, rtol=1e-6)
    stats = sum(ups[i].num_samples / n_kept * np.asarray(ups[i].params["bn.running_mean"], np.float64)
                for i in kept)
    np.testing.assert_allclose(out["bn.running_mean"], stats, rtol=1e-6)  # statistics: not clipped, no noise
    trust = {c: v["trust"] for c, v in flame.scores.items()}
    assert [c for c, t in trust.items() if t == 0] == ["c4", "c5", "c6"]  # the b pair and the outlier
    assert trust["c1"] == pytest.approx(s / norms[1]) and trust["c1"] < 0.5  # the long one is clipped
    assert [trust[f"c{i}"] for i in kept] == pytest.approx([min(1.0, s / norms[i]) for i in kept])


def test_flame_noise_is_seeded_per_round_and_leaves_the_statistics_alone():
    ups, _ = _two_clusters_and_an_outlier()
    clean = make_fusion("flame", noise=0.0).fuse(GLOBAL, ups)
    a, b = make_fusion("flame", noise=0.5, seed=1), make_fusion("flame", noise=0.5, seed=1)
    first, again = a.fuse(GLOBAL, ups), b.fuse(GLOBAL, ups)
    np.testing.assert_array_equal(first["conv.weight"], again["conv.weight"])  # same seed, same round
    assert not np.array_equal(a.fuse(GLOBAL, ups)["conv.weight"], first["conv.weight"])  # next round: new draw
    assert not np.allclose(first["conv.weight"], clean["conv.weight"])
    np.testing.assert_allclose(first["bn.running_mean"], clean["bn.running_mean"], rtol=1e-6)
    b.load_state(a.state())
    np.testing.assert_array_equal(b.fuse(GLOBAL, ups)["conv.weight"], a.fuse(GLOBAL, ups)["conv.weight"])


def test_majority_cluster_is_hdbscans():
    cluster = pytest.importorskip("sklearn.cluster")
    rng = np.random.default_rng(0)
    for _ in range(100):
        k = int(rng.integers(2, 10))
        x = rng.normal(size=(k, 3))
        dist = np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))
        labels = cluster.HDBSCAN(min_cluster_size=k // 2 + 1, min_samples=1, metric="precomputed",
                                 allow_single_cluster=True).fit(dist).labels_
        assert majority_cluster(dist) == np.flatnonzero(labels >= 0).tolist()
    assert majority_cluster(np.array([[0, 1, 5], [1, 0, 4], [5, 4, 0.0]])) == [0, 1]  # of 3: the closest pair


def test_foolsgold_silences_alike_sybils_and_keeps_a_lone_center():
    rng = np.random.default_rng(5)
    honest = [rng.normal(size=6) for _ in range(3)]
    sybil = rng.normal(size=6)
    ups = _updates([*honest, sybil, sybil * 1.01], [np.zeros(2)] * 5, [10] * 5)
    fg = make_fusion("foolsgold")
    out = fg.fuse(GLOBAL, ups)
    trust = [fg.scores[f"c{i}"]["trust"] for i in range(5)]
    assert trust[3] == trust[4] == 0.0 and min(trust[:3]) > 0
    w = np.array(trust[:3])
    np.testing.assert_allclose(out["conv.weight"].ravel(), w @ np.stack(honest) / w.sum(), rtol=1e-5)
