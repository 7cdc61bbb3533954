"""The server's faster checks give the numbers of the plain computations they replaced, bit for bit.

The references below are the earlier implementations (a float64 copy per tensor, ``np.median`` of a
copy without center ``i``, concatenated float64 copies), kept here as the independent computation."""

from __future__ import annotations

import numpy as np
import pytest

from polyparallel.backends.collab._server import _audit, _flat_step
from polyparallel.backends.collab._validation import (
    _loo_medians,
    check_values,
    direction_screen,
    params_norm,
    step_norm,
)


def _ref_direction(deltas, trained, min_cosine):
    names = list(deltas)
    d = np.stack([np.concatenate([np.asarray(deltas[c][k], np.float64).ravel() for k in trained]) for c in names])
    cos, refused = {}, set()
    for i, c in enumerate(names):
        ref = np.median(np.delete(d, i, axis=0), axis=0)
        n = float(np.linalg.norm(d[i]) * np.linalg.norm(ref))
        cos[c] = float(d[i] @ ref / n) if n > 0 else 0.0
        if min_cosine > -1.0 and cos[c] < min_cosine:
            refused.add(c)
    return cos, refused


def _updates(n, rng, ties=False):
    out = {}
    common = {"w": 2 * rng.standard_normal((37, 53)), "b": 2 * rng.standard_normal(53)}  # the centers agree
    for i in range(n):
        u = {"w": (common["w"] + rng.standard_normal((37, 53))).astype(np.float32),
             "b": (common["b"] + rng.standard_normal(53)).astype(np.float32),
             "bn.running_mean": rng.standard_normal(7).astype(np.float32)}
        if ties:  # many equal values across centers, zeros of both signs
            u["w"] = np.round(u["w"]).astype(np.float32)
            u["b"][:20] = -0.0 if i % 2 else 0.0
        if i == n - 1:
            u = {k: -3 * v for k, v in u.items()}  # one flipped, larger update
        out[f"c{i}"] = u
    return out


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 9])
def test_loo_medians_are_numpys_median_of_the_others(n):
    rng = np.random.default_rng(n)
    d = rng.standard_normal((n, 70001)).astype(np.float32).astype(np.float64)
    d[:, :20000] = np.round(d[:, :20000])
    d[:, 30000:31000] = 0.0
    got = _loo_medians(d)
    for i in range(n):
        assert np.array_equal(got[i], np.median(np.delete(d, i, axis=0), axis=0))


@pytest.mark.parametrize("n,ties", [(3, False), (4, True), (5, False), (6, True)])
def test_direction_screen_matches_the_plain_loop(n, ties):
    deltas = _updates(n, np.random.default_rng(10 + n), ties)
    trained = ["w", "b"]
    for min_cos in (-1.0, 0.0, 0.5):
        cos, refused = direction_screen(deltas, trained, min_cos)
        ref_cos, ref_refused = _ref_direction(deltas, trained, min_cos)
        assert cos == ref_cos  # exact floats
        assert set(refused) == ref_refused
    assert set(direction_screen(deltas, trained, 0.0)[1]) >= {f"c{n - 1}"}  # the flipped one is caught


def test_check_values_and_norms_match_float64_copies():
    rng = np.random.default_rng(3)
    q = (rng.standard_normal((40, 30)) * 20).astype(np.float32)
    q[3, 4] = -123.5  # the largest magnitude is negative
    m = float(np.max(np.abs(q.astype(np.float64))))
    assert m == 123.5
    assert check_values({"q/w": q}, "none", m) == []
    (why,) = check_values({"q/w": q}, "none", np.nextafter(m, 0))
    assert f"{m:.3g}" in why
    p = {"a": q, "b": rng.standard_normal(11).astype(np.float32)}
    assert params_norm(p) == float(np.sqrt(sum(float(np.sum(np.square(np.asarray(v, np.float64))))
                                               for v in p.values())))
    new = {k: v + rng.standard_normal(v.shape).astype(np.float32) for k, v in p.items()}
    assert step_norm(p, new) == params_norm({k: np.asarray(new[k], np.float64) - np.asarray(p[k], np.float64)
                                             for k in p})


def test_audit_and_flat_step_match_concatenated_copies():
    rng = np.random.default_rng(4)
    deltas = _updates(3, rng)
    old = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in deltas["c0"].items()}
    new = {k: v + rng.standard_normal(v.shape).astype(np.float32) for k, v in old.items()}
    flat, diff = _flat_step(old, new)
    step = np.concatenate([(np.asarray(new[k], np.float64) - np.asarray(old[k], np.float64)).ravel() for k in old])
    assert np.array_equal(flat, step)
    assert params_norm(diff) == step_norm(old, new)
    metrics = {c: {} for c in deltas}
    _audit(metrics, deltas, list(old), flat, {"c1": {"trust": 0.5}})
    for c, m in metrics.items():
        d = np.concatenate([np.asarray(deltas[c][k], np.float64).ravel() for k in old])
        assert m["cos_fused"] == float(d @ step / (np.linalg.norm(d) * np.linalg.norm(step)))
    assert metrics["c1"]["trust"] == 0.5
