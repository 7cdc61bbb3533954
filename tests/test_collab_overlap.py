"""Communication off the critical path (issue 39): the lean message path (``_lean``), overlapped fusion
(``_overlap``) and the simulator's price of it."""

from __future__ import annotations

import json
import socket
import threading

import numpy as np
import pytest

from polyparallel.backends.collab._lean import _accept, recv_frame, send_frame


# ------------------------------------------------------------------------------------------ lean path
def test_frame_round_trip_bit_exact_and_aligned():
    rng = np.random.default_rng(0)
    arrays = {"w": rng.normal(size=(7, 3)).astype(np.float32), "h": rng.normal(size=5).astype(np.float16),
              "q": rng.integers(-127, 128, size=(3, 3)).astype(np.int8), "s": np.array(2.5, np.float32),
              "empty": np.zeros((0, 4), np.float32), "d": rng.normal(size=9)}
    a, b = socket.socketpair()
    with a, b:
        sent = send_frame(a, {"kind": "train", "config": {"round": 3}}, arrays)
        header, got = recv_frame(b, 1 << 20)
    assert header["kind"] == "train" and header["config"] == {"round": 3}
    assert list(got) == list(arrays)
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        np.testing.assert_array_equal(got[k], v)
    offsets = [e[3] for e in send_frame.__globals__["_layout"](arrays)[0]]
    assert all(o % 64 == 0 for o in offsets)
    assert sent == offsets[-1] + arrays["d"].nbytes


def _raw_frame(sock: socket.socket, header: bytes, body: bytes = b"") -> None:
    sock.sendall(len(header).to_bytes(8, "little") + header + body)


@pytest.mark.parametrize("header, body, why", [
    (b'{"nbytes": 100, "arrays": []}', b"\0" * 100, "array bytes"),                      # over max_bytes (64)
    (b'{"nbytes": 8, "arrays": [["x", "<f4", [3], 0]]}', b"\0" * 8, "does not fit"),     # runs past the end
    (b'{"nbytes": 8, "arrays": [["x", "|O", [1], 0]]}', b"\0" * 8, "does not fit"),      # an object array
    (b'{"nbytes": 8, "arrays": [["x", "<f4", [1], 0], ["x", "<f4", [1], 4]]}', b"\0" * 8, "does not fit"),
])
def test_malformed_frames_are_refused(header, body, why):
    a, b = socket.socketpair()
    with a, b:
        _raw_frame(a, header, body)
        with pytest.raises(ValueError, match=why):
            recv_frame(b, 64)


def test_object_arrays_are_not_sent():
    a, b = socket.socketpair()
    with a, b, pytest.raises(ValueError, match="numeric"):
        send_frame(a, {}, {"x": np.array(["a"], dtype=object)})


def test_channel_admits_only_the_invited_token_under_the_registered_name():
    listener = socket.create_server(("127.0.0.1", 0))
    addr = listener.getsockname()
    tokens = {"good": 7, "other": 8}

    def knock(token: str, center: str) -> None:
        with socket.create_connection(addr) as s:
            send_frame(s, {"kind": "hello", "token": token, "center": center})
            s.recv(1)  # until the server closes it (refused) or the test ends

    clients = [threading.Thread(target=knock, args=a, daemon=True)
               for a in (("forged", "a"), ("other", "a"), ("good", "a"))]
    for t in clients:
        t.start()
        t.join(0.3)  # in this order
    with listener:
        peers = _accept(listener, tokens, {"a", "b"}, {7: "a", 8: "b"}, want=1, timeout_s=10, max_bytes=0)
    assert list(peers) == ["a"] and peers["a"].node == 7  # the forged token and node 8 claiming 'a' refused
    for p in peers.values():
        p.sock.close()


@pytest.mark.slow
def test_rounds_over_the_data_channel_fuse_what_the_inprocess_engine_fuses(tmp_path):
    """Flower enrols the centers and carries one invitation each; the rounds (SCAFFOLD: the control
    variates down and up; a federated evaluation every round) go over the sockets, bit for bit."""
    from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, run_inprocess
    from polyparallel.backends.collab._flower import run_flower

    rng = np.random.default_rng(1)
    names = ["a", "b", "c"]
    cfg = CollabConfig(centers=tuple(CenterSpec(n) for n in names), model=ModelSpec("mlp", (16,), 4, hidden=8),
                       rounds=3, local_steps=3, batch_size=8, lr=0.1, fusion="scaffold", holdout=0.25,
                       round_timeout_s=120)
    data = {n: (rng.normal(size=(40, 16)).astype(np.float32), rng.integers(0, 4, 40)) for n in names}
    res = run_flower(cfg, data, workdir=tmp_path, data_channel="socket", timeout_s=240)
    ref = run_inprocess(cfg, data)
    assert [r.fused for r in res.rounds] == [True] * 3
    for k in ref.params:
        np.testing.assert_array_equal(res.params[k], ref.params[k])
    assert [r.eval for r in res.rounds] == [r.eval for r in ref.rounds]
    assert (tmp_path / "out" / "server.log").read_text().count("data channel") >= 1



@pytest.mark.slow
def test_overlapped_rounds_over_the_data_channel_fuse_what_the_inprocess_engine_fuses(tmp_path):
    """Overlap over Flower: each center runs ahead on its connection after sending, merges the model
    when its frame is read; a federated evaluation arrives while it runs ahead and must not disturb its
    steps; SCAFFOLD's c and the outer momentum come down with the model, c_i+ goes up. Bit for bit the
    in-process overlapped engine."""
    from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, run_inprocess
    from polyparallel.backends.collab._flower import run_flower

    rng = np.random.default_rng(2)
    names = ["a", "b", "c"]
    cfg = CollabConfig(centers=tuple(CenterSpec(n) for n in names), model=ModelSpec("mlp", (16,), 4, hidden=8),
                       rounds=3, local_steps=4, batch_size=8, lr=0.1, momentum=0.5, fusion="scaffold", holdout=0.25,
                       fusion_options={"lr": 0.7, "momentum": 0.9}, overlap=3, round_timeout_s=120)
    data = {n: (rng.normal(size=(40, 16)).astype(np.float32), rng.integers(0, 4, 40)) for n in names}
    res = run_flower(cfg, data, workdir=tmp_path, data_channel="socket", timeout_s=240)
    ref = run_inprocess(cfg, data)
    for k in ref.params:
        np.testing.assert_array_equal(res.params[k], ref.params[k])
    assert [r.eval for r in res.rounds] == [r.eval for r in ref.rounds]
    sync = run_inprocess(CollabConfig.from_json(cfg.to_json().replace('"overlap": 3', '"overlap": 0')), data)
    assert any(not np.array_equal(sync.params[k], ref.params[k]) for k in ref.params)
    with pytest.raises(ValueError, match="data_channel='socket'"):
        run_flower(cfg, data, workdir=tmp_path / "again")

# ------------------------------------------------------------------------------------ overlapped fusion
def _digits(centers: int = 3):
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = (d.data / 16).astype(np.float32), d.target
    order = np.random.default_rng(0).permutation(len(y))
    k = centers + 1
    return ({n: (x[order[i::k]], y[order[i::k]]) for i, n in enumerate("abcde"[:centers])},
            (x[order[centers::k]], y[order[centers::k]]))


def _cfg(overlap: int = 0, **kw):
    from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec

    link = kw.pop("link", {})
    base = dict(centers=tuple(CenterSpec(n, **link) for n in kw.pop("names", "abc")),
                model=ModelSpec("mlp", (64,), 10, hidden=kw.pop("hidden", 16)), rounds=4, local_steps=6, batch_size=16,
                lr=0.05, momentum=0.5, fusion="fedavg")
    return CollabConfig(**{**base, **kw}, overlap=overlap)


def test_overlap_after_zero_steps_is_the_synchronous_round_bit_for_bit():
    """The pipelined engine with the merge before any step of the next round (overlap 0) fuses exactly
    what the synchronous in-process engine fuses: the merge is then x_r + 0 and the round starts from x_r."""
    from polyparallel.backends.collab import run_inprocess

    data, _ = _digits()
    cfg = _cfg(0, fusion="centered_clip", holdout=0.2)
    sync = run_inprocess(cfg, data)
    piped = run_inprocess(cfg, data, pipelined=True)
    for k in sync.params:
        np.testing.assert_array_equal(piped.params[k], sync.params[k])
    assert [r.eval for r in piped.rounds] == [r.eval for r in sync.rounds]
    assert all(m["exposed_s"] >= 0 for r in piped.rounds for m in r.metrics.values())


def test_overlapped_rounds_are_the_delayed_outer_step():
    """An independent computation of the one-round-delayed outer step (overlap = H) with each center's
    own trainer: round r trains H steps from the center's own model s to a, merges m = x_r + (a - s) and
    sends m - x_r; FedAvg of equal-sized centers is their mean."""
    from polyparallel.backends.collab import run_inprocess
    from polyparallel.backends.collab._engine import initial_params
    from polyparallel.backends.collab._trainers import make_trainer

    data, _ = _digits(2)
    data = {n: (x[:200], y[:200]) for n, (x, y) in data.items()}
    cfg = _cfg(6, names="ab", rounds=3)
    res = run_inprocess(cfg, data)
    trainers = {n: make_trainer(cfg, n, *data[n]) for n in "ab"}
    x = {k: v.astype(np.float64) for k, v in initial_params(cfg).items()}
    own: dict[str, dict[str, np.ndarray]] = {}
    for r in range(1, cfg.rounds + 1):
        x32 = {k: v.astype(np.float32) for k, v in x.items()}
        deltas = []
        for n, t in trainers.items():
            start = own.get(n, x32)
            a, _ = t.train(start, steps=cfg.local_steps, round_idx=r)
            merged = a if r == 1 else {k: x32[k] + (a[k] - start[k]) for k in x32}
            own[n] = merged
            deltas.append({k: merged[k].astype(np.float32) - x32[k] for k in x32})
        x = {k: x[k] + np.mean([d[k].astype(np.float64) for d in deltas], axis=0) for k in x}
    for k in x:
        np.testing.assert_allclose(res.params[k], x[k], rtol=1e-5, atol=1e-6)
    # and not the synchronous result: the check can tell the two apart
    sync = run_inprocess(_cfg(0, names="ab", rounds=3), data)
    assert max(float(np.abs(sync.params[k] - x[k]).max()) for k in x) > 1e-3


@pytest.mark.slow
def test_overlap_hides_communication_on_a_slow_link_and_keeps_digits_accuracy():
    """Emulated link 2 MB/s, 150 ms each way: a center waits the upload, the fusion and the download in
    every synchronous round; overlapped by a whole round (160 steps) it waits for less of it. (The
    centers share this machine's cores with the server: under load a center starved of CPU makes the
    others wait for its update, which the long latency keeps small against what is hidden.)"""
    from polyparallel.backends.collab import run_inprocess

    data, test = _digits()
    link = dict(down_Bps=2e6, up_Bps=2e6, latency_s=0.15)
    out = {}
    for k in (0, 160):
        res = run_inprocess(_cfg(k, link=link, hidden=64, rounds=5, local_steps=160), data, eval_data=test,
                            pipelined=True)
        later = [m for r in res.rounds[1:] for m in r.metrics.values()]
        comm_events = [e for e in res.timing if e["event"] == "comm"]
        assert len(comm_events) == len(later)
        out[k] = (sum(m["exposed_s"] for m in later), sum(m["comm_s"] for m in later),
                  res.rounds[-1].eval["accuracy"])
    (sync_exposed, sync_comm, sync_acc), (ov_exposed, ov_comm, ov_acc) = out[0], out[160]
    # synchronous: every transfer is waited for; each of 3 centers' 4 later rounds pays 150 ms each way
    assert sync_comm > 4 * 3 * 2 * 0.15 and sync_exposed > 0.9 * sync_comm, out
    assert ov_exposed < 0.75 * sync_exposed and ov_comm - ov_exposed > 0.3 * ov_comm, out  # hidden behind steps
    assert abs(ov_acc - sync_acc) <= 0.03 and sync_acc > 0.9, out


def test_overlap_is_refused_where_it_is_not_defined():
    from polyparallel.backends.collab import CenterSpec

    with pytest.raises(ValueError, match=r"overlap must be a whole number of local steps in \[0, local_steps=6\]"):
        _cfg(7)
    assert _cfg(2, fusion="scaffold").overlap == 2  # SCAFFOLD overlapped: tests/test_collab_overlap_scaffold.py
    with pytest.raises(ValueError, match="SCAFFOLD"):
        _cfg(0, fusion="scaffold", buffer=2)
    with pytest.raises(ValueError, match="several devices"):
        _cfg(2, centers=(CenterSpec("a", devices=2), CenterSpec("b")))
    assert "overlap" not in _cfg(0).to_json() and _cfg(3).to_json().count('"overlap": 3') == 1
    from polyparallel.backends.collab import CollabConfig

    assert CollabConfig.from_json(_cfg(3).to_json()).overlap == 3


def test_overlap_flag_reports_exposed_and_hidden_communication(tmp_path, capsys):
    from tests.test_collab_cli import _run

    code, out, err = _run(["collab", "--centers", "a,b", "--synthetic", "64", "--in-shape", "16", "--rounds", "3",
                           "-H", "4", "--overlap", "4", "--link", "1 MB/s,1 MB/s,10 ms", "--holdout", "0.25",
                           "--fusion", "fedavg", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert "round 2/3" in out and "comm exposed" in out and "hidden" in out
    events = [json.loads(x) for x in (tmp_path / "timing.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "comm" for e in events) == 4  # rounds 2 and 3, two centers
    code, _, err = _run(["collab", "--centers", "a,b", "--synthetic", "64", "--in-shape", "16", "-H", "4",
                         "--overlap", "5"], capsys)
    assert code == 2 and "overlap must be a whole number of local steps" in err


# ------------------------------------------------------------------------------------------ simulator
def test_simulated_overlap_prices_exposed_communication():
    """One center: each round is H steps plus what is left of the communication c = U + F + K + D after
    the k overlapped steps; k = 0 is the synchronous round."""
    from polyparallel.cost_models.collab_simulator import SimInputs, _overlapped, simulate_rounds

    s, H, P, bw, lat, fixed = 0.01, 20, 10**6, 4e7, 0.02, 0.3
    comm = 2 * (lat + 4 * P / bw) + 2e-8 * P + fixed
    for k in (0, 5, 10, 20):
        x = SimInputs.make(["a"], s, H, P, down_Bps=bw, up_Bps=bw, latency_s=lat, fixed_s=fixed, overlap=k)
        res = simulate_rounds(x, 6) if k else _overlapped(x, *_phases(x, 6))
        np.testing.assert_allclose(res.round_s[1:-1], H * s + max(0.0, comm - k * s), rtol=1e-12)
        assert res.summary()["exposed_comm_s"] == pytest.approx(max(0.0, comm - k * s))
        assert res.summary()["exposed_comm_s"] + res.summary()["hidden_comm_s"] == pytest.approx(comm)
        if not k:  # the synchronous simulation, round for round
            np.testing.assert_allclose(res.round_s, simulate_rounds(x, 6).round_s, rtol=1e-12)


def _phases(x, rounds):
    R, N = rounds, x.n
    d = np.full((R, N), x.latency_s + x.model_bytes / x.down_Bps)
    u = np.full((R, N), x.latency_s + x.upload_bytes / x.up_Bps)
    c = np.full((R, N), x.local_steps * x.step_s)
    return d, c, u, np.full(R, x.fuse_s_per_param * x.params * N), np.full(R, x.fixed_s)


def test_simulated_overlap_waits_for_the_slowest_center():
    """Two centers, one 3x slower: the fast one's exposed time includes waiting for the slow one's update."""
    from polyparallel.cost_models.collab_simulator import SimInputs, simulate_rounds

    x = SimInputs.make(["fast", "slow"], [0.01, 0.03], 10, 1000, fixed_s=0.0, fuse_s_per_param=0.0, overlap=10)
    res = simulate_rounds(x, 5)
    np.testing.assert_allclose(res.round_s[1:], 10 * 0.03)  # the slow center sets the pace, its comm hidden
    np.testing.assert_allclose(res.dur["wait"][1:, 0], 10 * 0.02)
    np.testing.assert_allclose(res.dur["wait"][1:, 1], 0.0, atol=1e-12)


def test_simulate_command_prices_overlapped_rounds(tmp_path, capsys):
    from tests.test_collab_cli import _run
    from tests.test_collab_simulator import _strategy

    path = tmp_path / "s.json"
    _strategy().to_json(path)
    code, out, err = _run(["simulate", str(path), "--rounds", "5", "--json", "--fixed-s", "0.5"], capsys)
    assert code == 0, err
    sync = json.loads(out)
    code, out, err = _run(["simulate", str(path), "--rounds", "5", "--json", "--fixed-s", "0.5", "--overlap", "5"],
                          capsys)
    assert code == 0, err
    ov = json.loads(out)
    # the slow center (5 x 0.03 s) hides 0.15 s of its communication: rounds shorter by that much
    assert ov["overlap"] == 5 and ov["hidden_comm_s"] > 0
    assert ov["mean_round_s"] == pytest.approx(sync["mean_round_s"] - 4 / 5 * 5 * 0.03)  # rounds 2-5
    code, out, err = _run(["simulate", str(path), "--overlap", "6"], capsys)
    assert code == 2 and "overlap must be in [0, H=5]" in err and len(err.strip().splitlines()) == 1


def test_overlapped_rounds_meet_a_communication_budget_at_a_smaller_H():
    """One center, step s, budget t: synchronous rounds need (K + D + U) <= t (K + D + U + H s + F),
    rounds overlapped by a whole round c - H s <= t c with c = K + D + U + F (the fusion is hidden too)."""
    import math

    from polyparallel.cost_models.collab_simulator import SimInputs, choose_local_steps

    s, P, bw, lat, fixed, t = 0.002, 10**6, 4e7, 0.02, 0.3, 0.2
    x = SimInputs.make(["a"], s, 1, P, down_Bps=bw, up_Bps=bw, latency_s=lat, fixed_s=fixed)
    comm, fuse = 2 * (lat + 4 * P / bw) + fixed, 2e-8 * P
    c = comm + fuse
    h_sync, _ = choose_local_steps(x, t)
    h_over, sim = choose_local_steps(x, t, overlapped=True)
    assert abs(h_sync - math.ceil((comm * (1 - t) - t * fuse) / (t * s))) <= 1
    assert abs(h_over - math.ceil(c * (1 - t) / s)) <= 1
    assert sim.inputs.overlap == h_over and sim.round_s[-1] == pytest.approx(max(c, h_over * s))


# ------------------------------------------------------------------------------- buffered asynchronous rounds
def test_buffer_of_every_center_is_the_synchronous_round_bit_for_bit():
    """With K = N every fusion takes one update from each center, all trained from the newest version
    (a center never trains twice from one version): the synchronous rounds exactly."""
    from polyparallel.backends.collab import run_inprocess

    data, _ = _digits()
    sync = run_inprocess(_cfg(0, fusion="centered_clip"), data)
    buffered = run_inprocess(_cfg(0, fusion="centered_clip", buffer=3), data)
    for k in sync.params:
        np.testing.assert_array_equal(buffered.params[k], sync.params[k])
    assert all(m["staleness"] == 0 for r in buffered.rounds for m in r.metrics.values())


def test_a_slow_center_does_not_block_buffered_rounds():
    from polyparallel.backends.collab import run_inprocess
    from polyparallel.backends.collab._buffered import SlowTrainer
    from polyparallel.backends.collab._trainers import make_trainer

    data, test = _digits()
    out = {}
    for k, rounds in ((0, 4), (2, 40)):  # synchronous rounds (centers one after another), then buffered
        cfg = _cfg(0, hidden=32, rounds=rounds, local_steps=20, buffer=k, max_staleness=40)
        slow = SlowTrainer(make_trainer(cfg, "c", *data["c"]), factor=4.0)  # its rounds 4x its training, on any machine
        res = run_inprocess(cfg, data, eval_data=test, trainers={"c": slow})
        out[k] = (float(np.median([r.seconds for r in res.rounds[1:]])), res.rounds[-1].eval["accuracy"], res)
    (_, _, sync), (_, buf_acc, res) = out[0], out[2]
    assert all(len(r.accepted) == 3 for r in sync.rounds)  # the slow center is in (and paces) every sync round
    # buffered: the fusions go on without it, the fast centers fill them (counts, not wall-clock times,
    # which a loaded machine stretches)
    count = {n: sum(n in r.accepted for r in res.rounds) for n in "abc"}
    assert count["c"] < min(count["a"], count["b"]) / 2, count
    stale = [m for r in res.rounds for c, m in r.metrics.items() if c == "c"]
    assert stale and all(m["staleness"] >= 1 for m in stale)  # its updates arrive versions late, weighted:
    assert all(m["staleness_weight"] == pytest.approx((1 + m["staleness"]) ** -0.5) for m in stale)
    assert sum(len(r.accepted) for r in res.rounds) == 2 * 40 and buf_acc > 0.9, buf_acc


def test_a_center_joining_mid_run_starts_from_the_current_model(tmp_path):
    """Buffered rounds with c joining once version 4 is out: the first three fusions are a's and b's, and
    c's first update was trained from the version that was newest when it joined, not from the first."""
    from polyparallel.backends.collab import CenterSpec, run_inprocess
    from polyparallel.backends.collab._flower import run_flower

    data, _ = _digits()
    late = (CenterSpec("a"), CenterSpec("b"), CenterSpec("c", joins_after=3))
    res = run_inprocess(_cfg(0, rounds=8, buffer=2, max_staleness=8, centers=late), data)
    assert all(set(r.accepted) <= {"a", "b"} for r in res.rounds[:3])
    joined = [m for r in res.rounds for c, m in r.metrics.items() if c == "c"]
    assert joined and joined[0]["trained_on"] >= 4, [m["trained_on"] for m in joined]
    for bad, why in (({"buffer": 3}, r"buffer in \[1, 2\]"), ({"buffer": 0}, r"buffer in \[1, 2\]")):
        with pytest.raises(ValueError, match=why):
            _cfg(0, centers=late, **bad)
    with pytest.raises(ValueError, match="joins_after must be a number of versions >= 0"):
        CenterSpec("c", joins_after=-1)
    with pytest.raises(ValueError, match="use engine='inprocess'"):
        run_flower(_cfg(0, rounds=2, buffer=2, centers=late), data, data_channel="socket")


def test_stale_updates_are_checked_against_their_version():
    """An update staler than max_staleness is refused; a stale update altered after its center bound it
    is refused by its own version's binding (a stale update is not a free pass)."""
    from polyparallel.backends.collab import run_inprocess
    from polyparallel.backends.collab._buffered import SlowTrainer
    from polyparallel.backends.collab._trainers import make_trainer

    data, _ = _digits()
    cfg = _cfg(0, rounds=30, buffer=2, max_staleness=0)
    res = run_inprocess(cfg, data, trainers={"c": SlowTrainer(make_trainer(cfg, "c", *data["c"]), extra_s=0.05)})
    refused = [why for r in res.rounds for c, whys in r.rejected.items() if c == "c" for why in whys]
    assert refused and all("keeps versions" in w for w in refused)

    def alter(r, payload, metrics, nonce):
        return {k: v * 1.01 for k, v in payload.items()}, metrics

    res = run_inprocess(_cfg(0, rounds=4, buffer=2), data, tamper={"b": alter},
                        trainers={"c": SlowTrainer(make_trainer(cfg, "c", *data["c"]), extra_s=0.05)})
    why = [w for r in res.rounds for w in r.rejected.get("b", ())]
    assert why and all("binding does not match" in w for w in why)
    assert all("b" not in r.accepted for r in res.rounds)
    with pytest.raises(ValueError, match="buffered asynchronous rounds"):
        _cfg(2, buffer=2)
