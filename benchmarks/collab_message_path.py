"""Where a Flower round's seconds go on loopback, against a plain TCP socket, and the lean message path.

For a ~1M and a ~25M-parameter MLP (``benchmarks/collab.py``'s ``SIZES``), ``--centers`` centers (3):

1. **plain socket**: the round's bytes (the model down to every center, an update of the same size
   up from each) over one pre-connected loopback TCP connection per center, centers in threads: bytes
   only, no serialisation. The floor any message path is held to.
2. **serialise / deserialise** (one message, measured in this process): Flower's path is the arrays
   packed into one buffer per dtype (:func:`~polyparallel.backends.collab._wire.pack_arrays`), the
   ``ArrayRecord``/``Message`` built and deflated into its content-addressed objects (protobuf, sha256
   object ids; what every hop does once more), and back (inflate, unpack). The lean path's is
   :func:`~polyparallel.backends.collab._lean.send_frame` / ``recv_frame`` layout work (a JSON header;
   the arrays go out from their own buffers and arrive as views).
3. **lean exchange**: the same exchange as 1 through ``send_frame``/``recv_frame`` with the model's real
   tensors (names, shapes, dtypes): the message path alone, to compare with 1 (target: within 2x).
4. **Flower round** and **lean round**: ``run_flower`` (``tuned``, its defaults: packed arrays, the short
   waits, in-memory SuperLink) with ``data_channel="flower"`` and ``"socket"``, ``--rounds`` rounds of
   ``H`` = ``--steps`` local steps, rounds 2.. split from the timing lines as in ``benchmarks/collab.py``:
   down (round start → the center has the model), compute, encode (the center's update encoded and bound
   to the round), up (sent → the server has it), wait (the server's checks of every update, and the
   slowest center), fusion. ``transit = down + up`` (means over centers) is the message path —
   serialisation, transport, deserialisation, every hop — compared with 1; ``not_compute = round −
   max compute − fusion`` is everything else too (encoding, the checks). Fused models are compared
   with the in-process engine's.

Run: ``nice .venv/bin/python benchmarks/collab_message_path.py`` (``--sizes 1M`` for the small one only).
Writes ``benchmarks/results/collab_message_path.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collab import SIZES, split_rounds

from polyparallel.backends.collab import CenterSpec, CollabConfig, run_inprocess
from polyparallel.backends.collab._engine import initial_params
from polyparallel.backends.collab._flower import run_flower
from polyparallel.backends.collab._lean import recv_frame, send_frame
from polyparallel.backends.collab._wire import encode_update


def _pairs(n: int) -> list[tuple[socket.socket, socket.socket]]:
    srv = socket.create_server(("127.0.0.1", 0))
    out = []
    for _ in range(n):
        c = socket.create_connection(srv.getsockname())
        s, _ = srv.accept()
        for x in (c, s):
            x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out.append((s, c))
    srv.close()
    return out


def _recv_n(sock: socket.socket, buf: bytearray) -> None:
    view, got = memoryview(buf), 0
    while got < len(buf):
        got += sock.recv_into(view[got:])


def exchange(n: int, down: dict, up: dict, lean: bool, repeats: int) -> float:
    """Median seconds of one round's exchange: ``down`` to ``n`` centers, ``up`` back from each, in parallel."""
    pairs = _pairs(n)
    blob_down = np.concatenate([v.reshape(-1).view(np.uint8) for v in down.values()])
    blob_up = np.concatenate([v.reshape(-1).view(np.uint8) for v in up.values()])
    times = []
    for _ in range(repeats):
        def center(s: socket.socket) -> None:
            if lean:
                recv_frame(s, 1 << 36)
                send_frame(s, {"kind": "update"}, up)
            else:
                _recv_n(s, bytearray(blob_down.nbytes))
                s.sendall(memoryview(blob_up))

        def server(s: socket.socket) -> None:
            if lean:
                send_frame(s, {"kind": "train"}, down)
                recv_frame(s, 1 << 36)
            else:
                s.sendall(memoryview(blob_down))
                _recv_n(s, bytearray(blob_up.nbytes))

        ths = [threading.Thread(target=f, args=(p,)) for s, c in pairs for f, p in ((center, c), (server, s))]
        t0 = time.perf_counter()
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        times.append(time.perf_counter() - t0)
    for s, c in pairs:
        s.close()
        c.close()
    return float(np.median(times))


def flower_serialise(arrays: dict, repeats: int) -> tuple[float, float]:
    """Seconds to turn ``arrays`` into Flower's message objects (pack, records, deflate + ids) and back."""
    from flwr.app import RecordDict
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

    from polyparallel.backends.collab._flower_app import _from_records, _to_records

    ser, de = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        msg = RecordDict(dict(_to_records(arrays)))  # a message's content; its header is ~100 bytes
        objects = get_all_nested_objects(msg)
        contents = {oid: o.deflate() for oid, o in objects.items()}
        t1 = time.perf_counter()
        back = inflate_object_from_contents(msg.object_id, contents)
        _from_records(back)
        t2 = time.perf_counter()
        ser.append(t1 - t0)
        de.append(t2 - t1)
    return float(np.median(ser)), float(np.median(de))


def lean_layout(arrays: dict, repeats: int) -> float:
    """Seconds of the lean path's own work for one frame: header, per-array views (no transport)."""
    from polyparallel.backends.collab._lean import _layout

    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        spec, _, _ = _layout(arrays)
        json.dumps({"arrays": spec}).encode()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def federation(size: str, n: int, channel: str, rounds: int, steps: int, workroot: Path) -> dict:
    spec = SIZES[size]
    names = [f"c{i}" for i in range(n)]
    cfg = CollabConfig(centers=tuple(CenterSpec(c) for c in names), model=spec, rounds=rounds, local_steps=steps,
                       batch_size=16, lr=0.01, round_timeout_s=600, fusion="fedavg")
    rng = np.random.default_rng(0)
    data = {c: (rng.normal(size=(64, *spec.in_shape)).astype(np.float32), rng.integers(0, 10, 64)) for c in names}
    wd = workroot / f"{size}-{n}-{channel}"
    shutil.rmtree(wd, ignore_errors=True)
    res = run_flower(cfg, data, workdir=wd, timeout_s=1800, data_channel=channel)
    ref = run_inprocess(cfg, data)
    row = split_rounds(res, names, 1.0)
    busy_max = []
    ev = {(e["round"], e["who"], e["event"]): e["t"] for e in res.timing}
    for rec in res.rounds[1:]:
        busy_max.append(max(ev[(rec.round, c, "finished_training")] - ev[(rec.round, c, "received_model")]
                            for c in names))
    encode = float(np.mean([ev[(r.round, c, "sent_update")] - ev[(r.round, c, "finished_training")]
                            for r in res.rounds[1:] for c in names]))
    other = row["round"] - float(np.mean(busy_max)) - row["fusion"]
    return {"round": row["round"], "down": row["down"], "compute": row["compute"],
            "compute_max": float(np.mean(busy_max)), "encode": encode, "up": row["up"], "wait": row["wait"],
            "fusion": row["fusion"],
            "transit": row["down"] + row["up"], "not_compute": other,
            "matches_inprocess": all(np.array_equal(ref.params[k], res.params[k]) for k in ref.params)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,25M")
    ap.add_argument("--centers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--channels", default="flower,socket")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/collab_message_path.json"))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ppcollab-msgpath"))
    args = ap.parse_args()
    n = args.centers
    load0 = os.getloadavg()
    print(f"{os.cpu_count()} CPUs; load {load0}", flush=True)
    rows = []
    for size in args.sizes.split(","):
        spec = SIZES[size]
        model = initial_params(CollabConfig(centers=(CenterSpec("a"),), model=spec))
        update = encode_update({k: np.full_like(v, 1e-3) for k, v in model.items()}, "none")
        nbytes = n * (sum(v.nbytes for v in model.values()) + sum(v.nbytes for v in update.values()))
        plain = exchange(n, model, update, lean=False, repeats=args.repeats)
        lean_x = exchange(n, model, update, lean=True, repeats=args.repeats)
        fl_ser, fl_de = flower_serialise(model, max(3, args.repeats // 2))
        row = {"size": size, "params": int(sum(v.size for v in model.values())), "tensors": len(model),
               "centers": n, "round_bytes": nbytes, "plain_socket_s": plain, "lean_exchange_s": lean_x,
               "lean_vs_plain": lean_x / plain, "flower_serialise_s": fl_ser, "flower_deserialise_s": fl_de,
               "lean_layout_s": lean_layout(model, args.repeats)}
        for ch in args.channels.split(","):
            t0 = time.time()
            row[ch] = federation(size, n, ch, args.rounds, args.steps, args.workdir)
            row[ch]["wall_s"] = time.time() - t0
            row[ch]["transit_vs_plain"] = row[ch]["transit"] / plain
            f = row[ch]
            print(f"{size:>4} {n} centers {ch:>6}: round {f['round']:7.3f} s | down {f['down']:6.3f} compute "
                  f"{f['compute']:6.3f} (max {f['compute_max']:6.3f}) encode {f['encode']:6.3f} up {f['up']:6.3f} "
                  f"wait {f['wait']:6.3f} fusion {f['fusion']:6.3f} | transit (down + up) {f['transit']:7.3f} s = "
                  f"{f['transit_vs_plain']:6.1f}x plain; all but compute and fusion {f['not_compute']:7.3f} s "
                  f"| exact {f['matches_inprocess']}", flush=True)
        print(f"{size:>4}: {nbytes / 1e6:.0f} MB a round; plain socket {plain:.4f} s, lean exchange {lean_x:.4f} s "
              f"({lean_x / plain:.2f}x); Flower serialise {fl_ser:.3f} s + deserialise {fl_de:.3f} s per model "
              f"message; lean layout {row['lean_layout_s'] * 1e3:.2f} ms", flush=True)
        rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg()},
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}; load at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
