"""The lean message path: a Flower federation's rounds over one long-lived TCP connection per center.

Flower moves a round's arrays through six store-and-forward hops (ServerApp → SuperLink → SuperNode →
ClientApp and back), each serialising the message into content-addressed objects (protobuf, sha256),
with one HTTP request per object per hop and polls in between; on loopback that, not the bytes, is a
round (``benchmarks/collab_message_path.py``). With ``data_channel="socket"`` (``run_flower``, run
config ``data-channel``) Flower keeps what it is good at — the SuperNodes' enrolment, node
authentication, the run's life cycle — and carries one message per center per *run*: an invitation
holding the server's address and a fresh 128-bit token for that node. The ClientApp connects, presents
the token (so the connection belongs to the authenticated node the invitation went to) and then serves
every round over the connection: one frame down (the model and the round's ``config``), one frame up
(the update and its metrics), plus one each way for a federated evaluation. The round logic is the
same as over Flower messages (:func:`~._center.center_round`, :class:`~._server.FederationServer`), so
the fused model is the in-process engine's bit for bit.

A frame is an 8-byte little-endian header length, a JSON header (``kind``, the config or metrics, and per
array its name, dtype, shape and offset) and the arrays' raw bytes, each at a 64-byte aligned offset:
:func:`send_frame` writes each array from its own buffer (no concatenation, no per-array conversion) and
:func:`recv_frame` reads all of them into one buffer with ``recv_into`` and returns views into it.
Dtypes are numeric only, sizes bounded (``max_bytes``), names unique, every array inside the buffer.

Not carried over: the channel is plain TCP (node authentication covers the invitation, not the
socket; TLS on the channel is not implemented: use it on loopback or a trusted network), and a center
whose connection drops is missing for the rest of the run (no rejoin, unlike Flower messages).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ._buffered import buffered_rounds
from ._link import nbytes_of
from ._overlap import server_momentum
from ._server import CenterReply, aggregate_evaluations

__all__ = ["recv_frame", "send_frame", "serve_center", "serve_rounds"]

log = logging.getLogger("polyparallel.collab")

_LEN = struct.Struct("<Q")
_ALIGN = 64
_MAX_HEADER = 16 << 20
_KINDS = "biuf"


def _layout(arrays: Mapping[str, np.ndarray]) -> tuple[list[list[Any]], list[np.ndarray], int]:
    spec, bufs, off = [], [], 0
    for name, a in arrays.items():
        a = np.asarray(a)
        a = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes a 0-d array 1-d)
        if a.dtype.kind not in _KINDS:
            raise ValueError(f"array {name!r} has dtype {a.dtype}; only numeric arrays cross the channel")
        off += (-off) % _ALIGN
        spec.append([str(name), a.dtype.str, list(a.shape), off])
        bufs.append(a)
        off += a.nbytes
    return spec, bufs, off


def send_frame(sock: socket.socket, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None) -> int:
    """Send one frame: ``header`` (JSON-able) and ``arrays`` (raw bytes); returns the array bytes sent."""
    spec, bufs, total = _layout(arrays or {})
    head = json.dumps({**header, "arrays": spec, "nbytes": total}).encode()
    sock.sendall(_LEN.pack(len(head)) + head)
    pos = 0
    for (_, _, _, off), a in zip(spec, bufs):
        if off > pos:
            sock.sendall(bytes(off - pos))
        if a.nbytes:
            sock.sendall(memoryview(a.reshape(-1).view(np.uint8)))
        pos = off + a.nbytes
    return total


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection mid-frame")
        got += n


def recv_frame(sock: socket.socket, max_bytes: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Receive one frame; ``ValueError`` for a malformed one (the connection is then unusable)."""
    raw = bytearray(_LEN.size)
    _recv_exact(sock, memoryview(raw))
    (n,) = _LEN.unpack(raw)
    if n > _MAX_HEADER:
        raise ValueError(f"frame header of {n} bytes (at most {_MAX_HEADER})")
    head = bytearray(n)
    _recv_exact(sock, memoryview(head))
    header = json.loads(head)
    total = header.get("nbytes")
    if not isinstance(total, int) or not 0 <= total <= max_bytes:
        raise ValueError(f"frame of {total!r} array bytes (at most {max_bytes})")
    buf = bytearray(total)
    _recv_exact(sock, memoryview(buf))
    arrays: dict[str, np.ndarray] = {}
    for entry in header.pop("arrays", []):
        try:
            name, dt, shape, off = str(entry[0]), np.dtype(entry[1]), [int(d) for d in entry[2]], int(entry[3])
        except (TypeError, ValueError, IndexError) as e:
            raise ValueError(f"malformed array entry {entry!r}: {e}") from None
        count = int(np.prod(shape, dtype=np.int64))
        if dt.kind not in _KINDS or name in arrays or min(shape, default=0) < 0 or off < 0 \
                or off + count * dt.itemsize > total:
            raise ValueError(f"array {name!r} ({dt}, {shape} at {off}) does not fit a {total}-byte frame")
        arrays[name] = np.frombuffer(buf, dtype=dt, count=count, offset=off).reshape(tuple(shape))
    return header, arrays


def _connect(address: str, timeout_s: float) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _model_bytes(params: Mapping[str, np.ndarray]) -> int:
    return int(sum(4 * np.asarray(v).size for v in params.values()))


# --------------------------------------------------------------------------------------------- center
def serve_center(address: str, token: str, center: str, on_train: Callable[..., tuple[dict, dict]],
                 on_evaluate: Callable[[dict[str, np.ndarray]], dict[str, float]], timeout_s: float,
                 max_bytes: int, on_sent: Callable[[], None] | None = None,
                 on_plan: Callable[[list], None] | None = None) -> int:
    """A center's side: connect, present ``token``, then answer frames until ``done``; returns rounds served.

    ``on_train(model, control, config, t_sent)`` -> ``(payload, metrics)`` (with ``outer_u=`` the server's
    outer momentum buffer when the frame carries one, ``u/`` keys: overlapped fusion's guess of the next
    model, :func:`~._overlap.guess_next`); ``on_evaluate(model)`` -> metrics;
    ``on_sent()`` runs after each update is sent, before the next frame is read (an overlapped center's
    steps ahead, :class:`~._overlap.OverlapCenter`: the next model travels meanwhile);
    ``on_plan(plan)`` runs before a frame that carries a pruning job's plan (after the cut: every frame)
    is trained or evaluated (the center cuts its model alike, once).
    """
    rounds = 0
    with _connect(address, timeout_s) as sock:
        send_frame(sock, {"kind": "hello", "token": token, "center": center})
        while True:
            sock.settimeout(None)  # the server's round may wait on slower centers for a long time
            header, arrays = recv_frame(sock, max_bytes)
            kind = header.get("kind")
            if kind == "done":
                return rounds
            model = {k[2:]: v for k, v in arrays.items() if k.startswith("x/")}
            if header.get("plan") and on_plan is not None:
                on_plan(header["plan"])
            if kind == "train":
                control = {k[2:]: v for k, v in arrays.items() if k.startswith("c/")} or None
                outer = {k[2:]: v for k, v in arrays.items() if k.startswith("u/")}
                payload, metrics = on_train(model, control, header["config"], float(header["t_sent"]),
                                            **({"outer_u": outer} if outer else {}))
                metrics["t_sent"] = time.time()
                send_frame(sock, {"kind": "update", "metrics": metrics, "t_sent": metrics["t_sent"]}, payload)
                rounds += 1
                if on_sent is not None:
                    on_sent()
            elif kind == "evaluate":
                send_frame(sock, {"kind": "metrics", "metrics": on_evaluate(model)})
            else:
                raise ValueError(f"unknown frame kind {kind!r}")


# --------------------------------------------------------------------------------------------- server
class _Peer:
    def __init__(self, name: str, node: int, sock: socket.socket) -> None:
        self.name, self.node, self.sock = name, node, sock


def _accept(listener: socket.socket, tokens: Mapping[str, int], names: set[str], node_names: Mapping[int, str],
            want: int, timeout_s: float, max_bytes: int) -> dict[str, _Peer]:
    """The invited centers' connections, each checked against its token (and the node's registered name)."""
    peers: dict[str, _Peer] = {}
    end = time.time() + timeout_s
    while len(peers) < want and time.time() < end:
        listener.settimeout(max(0.01, end - time.time()))
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            break
        sock.settimeout(timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            hello, _ = recv_frame(sock, 0)
            node = tokens.get(str(hello.get("token")))
            claimed = str(hello.get("center"))
            why = ("no invitation holds its token" if node is None else
                   f"node {node} holds the key registered for {node_names[node]!r} but claims to be {claimed!r}"
                   if node_names and node_names.get(node) != claimed else
                   f"{claimed!r} is not a center of this federation" if claimed not in names else
                   f"{claimed!r} is connected already" if claimed in peers else "")
        except (ValueError, OSError) as e:
            why, claimed, node = f"bad hello: {e}", "?", None
        if why:
            log.warning("data channel: refused a connection: %s", why)
            sock.close()
            continue
        peers[claimed] = _Peer(claimed, int(node), sock)
    return peers


def _ask(peers: dict[str, _Peer], frames: Mapping[str, tuple[dict, dict]], timeout_s: float, max_bytes: int
         ) -> dict[str, tuple[dict, dict, float]]:
    """Send each peer its frame and read its answer, all peers at once; the dead are dropped from ``peers``."""
    out: dict[str, tuple[dict, dict, float]] = {}
    lost: list[str] = []

    def one(p: _Peer) -> None:
        try:
            p.sock.settimeout(timeout_s)
            send_frame(p.sock, *frames[p.name])
            header, arrays = recv_frame(p.sock, max_bytes)
            out[p.name] = (header, arrays, time.time())
        except (OSError, ValueError, ConnectionError) as e:
            log.warning("data channel: lost %s: %s", p.name, e)
            lost.append(p.name)

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in peers.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in lost:
        peers[name].sock.close()
        del peers[name]
    return out


def _serve_buffered(peers: dict[str, _Peer], server: Any, config: Any, out: Path,
                    evaluate: Callable[[dict[str, np.ndarray]], dict[str, float]] | None, max_bytes: int,
                    stop_after: int | None) -> None:
    """Buffered asynchronous rounds (:mod:`._buffered`) over the connections: a thread per center sends
    it the newest version as soon as its previous update is in, and hands the update to the server's
    buffer; the centers' side is the synchronous one (:func:`serve_center`, a round per frame)."""
    mu = server.fusion.proximal_mu

    def serve(p: _Peer, board: Any, replies: Any) -> None:
        v = 0
        try:
            p.sock.settimeout(config.round_timeout_s)
            while (item := board.newer_than(v)) is not None:
                v, x_v, nonce, _ = item
                cfg = {"round": v, "nonce": nonce, "proximal_mu": mu}
                send_frame(p.sock, {"kind": "train", "config": cfg, "t_sent": time.time()},
                           {f"x/{k}": a for k, a in x_v.items()})
                header, payload = recv_frame(p.sock, max_bytes)
                if header.get("kind") != "update" or not isinstance(header.get("metrics"), dict):
                    raise ValueError(f"a {header.get('kind')!r} frame where an update was due")
                replies.put((p.name, payload, header["metrics"]))
        except (OSError, ValueError, ConnectionError) as e:
            replies.put((p.name, None, {"error": f"data channel: lost {p.name}: {e}"}))

    def centers(board: Any, replies: Any) -> list[threading.Thread]:
        return [threading.Thread(target=serve, args=(p, board, replies), name=f"channel-{p.name}", daemon=True)
                for p in peers.values()]

    def record(rec: Any) -> None:
        with (out / "rounds.jsonl").open("a") as f:
            f.write(json.dumps(rec.to_dict()) + "\n")

    buffered_rounds(config, server, None, None if evaluate is None else lambda p, v: evaluate(p), stop_after,
                    on_round=record, centers=centers)


def _plan_of(server: Any) -> dict[str, Any]:
    """A pruning job's plan once the server has cut, for a frame's header (the center cuts its model alike)."""
    plan = server.cut_plan
    return {} if plan is None else {"plan": plan}


def _serve_synchronous(peers: dict[str, _Peer], server: Any, config: Any, out: Path,
                       evaluate: Callable[[dict[str, np.ndarray]], dict[str, float]] | None, links: Mapping[str, Any],
                       max_bytes: int, stop_after: int | None) -> None:
    """Synchronous rounds over the connections: each round's model to every center, their updates back,
    one fusion; recorded as the Flower loop records them."""
    ran = 0
    while not server.done and (stop_after is None or ran < stop_after) and peers:
        ran += 1
        r, params = server.begin_round()
        arrays = {f"x/{k}": v for k, v in params.items()}
        control = server.control()
        if control is not None:
            arrays.update({f"c/{k}": v for k, v in control.items()})
        u = server_momentum(server) if config.overlap else None
        if u is not None:
            arrays.update({f"u/{k}": v for k, v in u.items()})
        cfg = {"round": r, "nonce": server.nonce(r), "proximal_mu": server.fusion.proximal_mu}
        sent_to = len(peers)
        head = {"kind": "train", "config": cfg, "t_sent": time.time(), **_plan_of(server)}
        answers = _ask(peers, {p: (head, arrays) for p in peers}, config.round_timeout_s, max_bytes)
        replies, delivered = [], []
        for name in sorted(answers):
            header, payload, t_arrived = answers[name]
            if header.get("kind") != "update" or not isinstance(header.get("metrics"), dict):
                log.warning("round %d: malformed reply from %s dropped", r, name)
                continue
            if name in links:  # an emulated uplink: received when the link would deliver it
                t_arrived = links[name].delivered("up", nbytes_of(payload), float(header["t_sent"]), t_arrived)
                delivered.append(t_arrived)
            replies.append(CenterReply(name, payload, header["metrics"]))
            server.timing.record(r, "server", name, "update_received", t=t_arrived)
        if delivered and max(delivered) > time.time():
            time.sleep(max(delivered) - time.time())
        round_eval = evaluate
        if round_eval is None and config.holdout > 0:
            def round_eval(p: dict[str, np.ndarray]) -> dict[str, float]:
                head = {"kind": "evaluate", **_plan_of(server)}  # the model evaluated may be just cut
                got = _ask(peers, {q: (head, {f"x/{k}": v for k, v in p.items()}) for q in peers},
                           config.round_timeout_s, max_bytes)
                return aggregate_evaluations({n: {k: float(v) for k, v in h.get("metrics", {}).items()}
                                              for n, (h, _, _) in got.items()})
        rec = server.finish_round(r, replies, sent_to=sent_to, evaluate=round_eval)
        with (out / "rounds.jsonl").open("a") as f:
            f.write(json.dumps(rec.to_dict()) + "\n")


def serve_rounds(grid: Any, server: Any, config: Any, nodes: list[int], node_names: Mapping[int, str], out: Path,
                 evaluate: Callable[[dict[str, np.ndarray]], dict[str, float]] | None, links: Mapping[str, Any],
                 host: str = "127.0.0.1", stop_after: int | None = None) -> None:
    """The ServerApp's rounds over the data channel (see the module docstring); records as the Flower loop does."""
    from flwr.app import ConfigRecord, RecordDict

    listener = socket.create_server((host, 0))
    address = f"{host}:{listener.getsockname()[1]}"
    tokens = {secrets.token_hex(16): n for n in nodes}
    by_node = {n: t for t, n in tokens.items()}
    msgs = [grid.create_message(RecordDict({"channel": ConfigRecord({"address": address, "token": by_node[n]})}),
                                "train", n, group_id="channel") for n in nodes]
    ids = set(grid.push_messages(msgs))
    max_bytes = 3 * _model_bytes(server.params) + (1 << 20)  # model + control, or an update with its scales
    peers = _accept(listener, tokens, {c.name for c in config.centers}, node_names, len(nodes),
                    config.round_timeout_s, max_bytes)
    listener.close()
    log.info("data channel %s: %d centers connected (%s)", address, len(peers), ", ".join(sorted(peers)))
    try:
        if config.buffer:  # asynchronous buffered rounds: each connection takes the newest version when free
            _serve_buffered(peers, server, config, out, evaluate, max_bytes, stop_after)
        else:
            _serve_synchronous(peers, server, config, out, evaluate, links, max_bytes, stop_after)
    finally:
        for p in peers.values():
            with contextlib.suppress(OSError):
                send_frame(p.sock, {"kind": "done"})
            p.sock.close()
        end = time.time() + 30.0  # the invitations' answers: the ClientApps end their task
        while ids and time.time() < end:
            for m in grid.pull_messages(ids):
                ids.discard(m.metadata.reply_to_message_id)
            time.sleep(0.05)
