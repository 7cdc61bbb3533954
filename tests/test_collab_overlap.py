"""Communication off the critical path (issue 39): the lean message path (``_lean``), overlapped fusion
(``_overlap``) and the simulator's price of it."""

from __future__ import annotations

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
