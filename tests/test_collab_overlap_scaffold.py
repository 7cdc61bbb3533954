"""SCAFFOLD with overlapped fusion (issue 39): the steps ahead are corrected by the previous round's
``c`` and the center's ``c_i`` of the same age, the steps after the merge by the new ones, ``c_i⁺`` is
the mean raw gradient over the round's ``H`` steps (``backends/collab/_overlap.py``'s docstring says why)."""

from __future__ import annotations

import numpy as np


def _setup(names: str = "ab", rows: int = 120, **kw):
    from sklearn.datasets import load_digits

    from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec

    d = load_digits()
    x, y = (d.data / 16).astype(np.float32), d.target
    order = np.random.default_rng(3).permutation(len(y))
    # label skew: center i sees mostly the digits of its half, so c_i differ and the correction matters
    data = {}
    for i, n in enumerate(names):
        mine = order[(y[order] < 5) == (i % 2 == 0)][i // 2 * rows:(i // 2 + 1) * rows]
        data[n] = (x[mine], y[mine])
    base = dict(centers=tuple(CenterSpec(n) for n in names), model=ModelSpec("mlp", (64,), 10, hidden=12),
                rounds=3, local_steps=4, batch_size=16, lr=0.05, momentum=0.5, fusion="scaffold",
                fusion_options={"lr": 0.7, "momentum": 0.9})
    return CollabConfig(**{**base, **kw}), data


def test_scaffold_overlap_zero_is_synchronous_scaffold_bit_for_bit():
    """Through the pipelined engine with the merge before any step (overlap 0), SCAFFOLD with DiLoCo's
    outer step fuses exactly what the synchronous engine's center_round computes."""
    from polyparallel.backends.collab import run_inprocess

    cfg, data = _setup("abc", holdout=0.2)
    sync = run_inprocess(cfg, data)
    piped = run_inprocess(cfg, data, pipelined=True)
    for k in sync.params:
        np.testing.assert_array_equal(piped.params[k], sync.params[k])
    assert [r.eval for r in piped.rounds] == [r.eval for r in sync.rounds]


def _by_hand(cfg, data) -> dict[str, np.ndarray]:
    """Overlapped SCAFFOLD written out with plain tensors: SGD with heavy-ball momentum by hand, each
    gradient + (c − c_i), c_i⁺ the mean raw gradient of the H steps, the server's Nesterov outer step
    and c = the sample-weighted mean of the reported c_i; the steps ahead start from the center's guess
    of the next model, the outer step with its own update for the average."""
    import torch

    from polyparallel.backends.collab._center import batch_indices
    from polyparallel.backends.collab._engine import initial_params
    from polyparallel.backends.collab._models import build_torch_model, load_torch_state

    H, k, lr, beta = cfg.local_steps, cfg.overlap, cfg.lr, cfg.momentum
    opts = dict(cfg.fusion_options)
    net = build_torch_model(cfg.model, 0)
    names = [n for n, _ in net.named_parameters()]
    x = {n: v.astype(np.float64) for n, v in initial_params(cfg).items()}
    u = {n: np.zeros_like(v) for n, v in x.items()}  # the server's outer momentum
    ci = {c: {n: np.zeros(x[n].shape, np.float32) for n in names} for c in data}
    ci_prev = {c: dict(v) for c, v in ci.items()}  # the c_i of the round before, which c_prev averages
    own: dict[str, dict] = {}  # the center's own model after its last round
    x_last, u_last = x, u  # the fused model the centers last trained on, the server's momentum as of it
    c_prev = None

    def steps(c, params, buf, idx, corr):
        load_torch_state(net, {n: v.astype(np.float32) for n, v in params.items()})
        p = dict(net.named_parameters())
        gsum = {n: np.zeros(x[n].shape, np.float64) for n in names}
        xs, ys = torch.from_numpy(data[c][0]), torch.from_numpy(data[c][1]).long()
        for b in idx:
            net.zero_grad()
            torch.nn.functional.cross_entropy(net(xs[b]), ys[b]).backward()
            for n in names:
                g = p[n].grad.numpy().astype(np.float64)
                gsum[n] += g
                g = g + corr[n]
                buf[n] = g if n not in buf else beta * buf[n] + g
                with torch.no_grad():
                    p[n] -= torch.from_numpy((lr * buf[n]).astype(np.float32))
        return {n: v.detach().numpy().astype(np.float64) for n, v in net.state_dict().items()}, buf, gsum

    for r in range(1, cfg.rounds + 1):
        c = {n: sum(len(data[j][1]) * ci[j][n].astype(np.float64) for j in data) / sum(len(v[1]) for v in data.values())
             for n in names} if r > 1 else {n: np.zeros(x[n].shape) for n in names}
        deltas = []
        for i, cn in enumerate(data):
            idx = batch_indices(len(data[cn][1]), cfg.batch_size, H, cfg.seed, i, r)
            if r == 1:  # nothing ahead
                a, buf, g_a, start, kk = x, {}, {n: 0.0 for n in names}, x, 0
            else:  # the k steps ahead, from its guess of x_r, corrected by the previous round's c
                mu = opts["momentum"]
                start = {n: x_last[n] + opts["lr"] * ((1 + mu) * (own[cn][n] - x_last[n]) - mu * mu * u_last[n])
                         for n in x}
                kk = k
                a, buf, g_a = steps(cn, start, {}, idx[:k], {n: c_prev[n] - ci_prev[cn][n] for n in names})
            merged = {n: x[n] + (a[n] - start[n]) for n in x}
            e, _, g_b = steps(cn, merged, buf, idx[kk:], {n: c[n] - ci[cn][n] for n in names})
            own[cn] = e
            ci_prev[cn], ci[cn] = ci[cn], {n: ((g_a[n] + g_b[n]) / H).astype(np.float32) for n in names}
            deltas.append({n: e[n] - x[n] for n in x})
        avg = {n: np.mean([d[n] for d in deltas], axis=0) for n in x}  # equal sample counts
        x_last, u_last = dict(x), {n: v.copy() for n, v in u.items()}
        for n in x:
            u[n] = opts["momentum"] * u[n] - avg[n]
            x[n] = x[n] - opts["lr"] * (-avg[n] + opts["momentum"] * u[n])
        c_prev = c
    return x


def test_overlapped_scaffold_matches_an_independent_computation():
    """Three rounds, H 4, overlap 2 (round 3's steps ahead use c_2 and the c_i of round 1): the
    engine's fused model is the one written out by hand, and not synchronous SCAFFOLD's (the check
    tells them apart)."""
    from polyparallel.backends.collab import run_inprocess

    cfg, data = _setup(overlap=2)
    assert len({len(v[1]) for v in data.values()}) == 1
    res = run_inprocess(cfg, data)
    want = _by_hand(cfg, data)
    for n in want:
        np.testing.assert_allclose(res.params[n], want[n], rtol=1e-4, atol=1e-5)
    sync = run_inprocess(_setup(overlap=0)[0], data)
    assert max(float(np.abs(sync.params[n] - want[n]).max()) for n in want) > 1e-3
