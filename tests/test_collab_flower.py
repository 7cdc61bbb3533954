"""The Flower deployment engine (flwr 1.42, real SuperLink/SuperNode processes on 127.0.0.1).

Main cross-check: the model fused over Flower equals, bit for bit, the in-process engine's for the
same config and data. Also: what a center's reply holds (parameters and numbers, nothing else), and a
center crashing between rounds and rejoining.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="the Flower engine needs flwr==1.42.0")

from polyparallel.backends.collab import CenterSpec, CollabConfig, initial_params, run_inprocess  # noqa: E402
from polyparallel.backends.collab._flower import (  # noqa: E402
    LoopbackFederation,
    read_outputs,
    run_flower,
    write_center_data,
)
from tests.collab_fixtures import SPEC, mlp_config, random_data  # noqa: E402


def _data(names, n=48):
    return random_data(names, n, seed=3, grow=4)


def _cfg(names, **kw):
    return mlp_config(names, **kw)


def _no_stray_processes(workdir):
    """No process started for this federation survives it (found by its FLWR_HOME in /proc)."""
    return LoopbackFederation(workdir, {}).stray_pids()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_flower_with_tls_and_node_auth_fuses_exactly_what_the_inprocess_engine_fuses(tmp_path):
    """The main cross-check, deployed as for real: TLS on every SuperLink API, SuperNode authentication
    with registered keys; a SuperNode with an unknown key is refused while the others train."""
    from polyparallel.backends.collab._security import make_credentials, make_node_key

    names = ("a", "b", "c")
    cfg = _cfg(names, fusion="fedadam", compression="int8")
    data = _data(names)
    creds = make_credentials(tmp_path / "certs", names)
    paths = write_center_data(tmp_path, data)
    out = tmp_path / "out"
    with LoopbackFederation(tmp_path, paths, credentials=creds) as fed:
        intruder_key, _ = make_node_key(tmp_path / "certs", "intruder")  # never registered
        fed.centers = {**fed.centers, "intruder": paths["a"]}
        fed.start_center("intruder", private_key=intruder_key, wait=False)
        fed.submit(cfg, out)
        fed.wait(out, 200)
        intruder = next(p for p in fed.procs if p.name == "supernode-intruder")
        intruder.popen.wait(timeout=60)
        assert intruder.popen.returncode != 0
        assert "Failed to activate SuperNode" in intruder.log.read_text()
    assert "insecure" not in (tmp_path / "flwr-home" / "config.toml").read_text()
    res = read_outputs(out)
    ref = run_inprocess(cfg, data)
    assert [r.accepted for r in res.rounds] == [names, names]
    for k, v in ref.params.items():
        np.testing.assert_array_equal(res.params[k], v)
    assert not np.array_equal(res.params["fc1.weight"], initial_params(cfg)["fc1.weight"])
    assert [r.bytes_up for r in res.rounds] == [r.bytes_up for r in ref.rounds]
    events = {(e["round"], e["who"], e["event"]) for e in res.timing}
    for r in (1, 2):
        assert {(r, c, "sent_update") for c in names} <= events and (r, "server", "fusion_end") in events
    assert _no_stray_processes(tmp_path) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fltrust_over_flower_trains_on_the_servers_root_set_as_in_process(tmp_path):
    """The root set reaches the ServerApp only (run config ``root-data``); the fused model and the
    audit's trust values are the in-process engine's."""
    names = ("a", "b", "c")
    cfg = _cfg(names, fusion="fltrust")
    data = _data(names)
    root = random_data(("root",), seed=11, grow=0)["root"]  # the server's own rows, no center's
    res = run_flower(cfg, data, workdir=tmp_path, root_data=root, timeout_s=240)
    ref = run_inprocess(cfg, data, root_data=root)
    for k, v in ref.params.items():
        np.testing.assert_array_equal(res.params[k], v)
    for got, want in zip(res.rounds, ref.rounds, strict=True):
        assert got.accepted == names
        assert {c: got.metrics[c]["trust"] for c in names} == {c: want.metrics[c]["trust"] for c in names}
    assert _no_stray_processes(tmp_path) == []


def test_only_parameters_and_metrics_leave_a_center(tmp_path):
    """Run the ClientApp on a message as the SuperNode would and read everything in its reply."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from polyparallel.backends.collab._flower_app import client_app
    from polyparallel.backends.collab._validation import model_digest, reply_binding
    from polyparallel.backends.collab._wire import pack_arrays, unpack_arrays

    cfg = _cfg(("a", "b"), compression="fp16")
    nonce = 0xA5A5_1234_5678
    data = _data(("a", "b"))
    paths = write_center_data(tmp_path, data)
    x0 = initial_params(cfg)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    buffers, layout = pack_arrays(x0)
    msg = Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in buffers.items()}),
                              "layout": ConfigRecord(layout),
                              "config": ConfigRecord({"round": 1, "nonce": nonce, "proximal_mu": 0.0})}),
                  dst_node_id=7, message_type="train")
    ctx = Context(run_id=1, node_id=7, node_config={"center": "b", "data": str(paths["b"])}, state=RecordDict(),
                  run_config={"collab-config": cfg.to_json(), "out-dir": str(tmp_path)})
    reply = client_app(message=msg, context=ctx)
    content = reply.content
    assert set(content.keys()) == {"update", "layout", "metrics", "center"}
    assert set(dict(content["layout"])) == {"names", "dtypes", "ranks", "shapes"}  # strings and ints only
    assert set(content["update"].keys()) == {np.dtype(np.float16).str}  # one fp16 buffer
    update = unpack_arrays({k: v.numpy() for k, v in content["update"].items()}, dict(content["layout"]))
    assert set(update) == {f"q/{k}" for k in x0}
    for k, a in update.items():
        assert a.shape == x0[k[2:]].shape and a.dtype == np.float16
    assert dict(content["center"]) == {"name": "b"}
    metrics = dict(content["metrics"])
    # round, model_digest (of the global model received) and the binding of the update to the round's nonce
    assert set(metrics) == {"num_samples", "train_loss", "t_received", "t_trained", "t_sent", "round", "model_digest",
                            "binding"}
    assert metrics["num_samples"] == len(data["b"][0])
    assert metrics["round"] == 1 and metrics["model_digest"] == model_digest(x0)
    assert metrics["binding"] == reply_binding(nonce, 1, model_digest(x0), update)
    x, y = data["b"]
    raw = b"".join(arr.numpy().tobytes() for arr in content["update"].values())
    assert x[:1].tobytes()[:16] not in raw and y.tobytes()[:16] not in raw  # no rows of data inside


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_crashed_center_rejoins_and_a_restarted_server_resumes(tmp_path):
    """Center b is SIGKILLed after round 1 and restarted (a new node); the first ServerApp leaves after
    round 2 (as a server taken down between rounds) and a new one is submitted: it resumes from the
    checkpoint with no round lost or repeated. Center c trains in MindSpore when it is installed."""
    names = ("a", "b", "c")
    try:
        import mindspore  # noqa: F401

        c_framework = "mindspore"
    except ImportError:
        c_framework = "torch"
    cfg = CollabConfig(centers=(CenterSpec("a"), CenterSpec("b"), CenterSpec("c", framework=c_framework)),
                       model=SPEC, rounds=3, local_steps=3, batch_size=16, lr=0.1, min_centers=2,
                       round_timeout_s=30)
    data = _data(names)
    out = tmp_path / "out"

    def rounds_done():
        p = out / "rounds.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []

    def wait_rounds(n, end):
        while len(rounds_done()) < n and time.time() < end:
            time.sleep(0.1)

    end = time.time() + 200
    with LoopbackFederation(tmp_path, write_center_data(tmp_path, data)) as fed:
        fed.submit(cfg, out, max_rounds=2)
        wait_rounds(1, end)
        fed.kill_center("b")  # SIGKILL while round 2 goes out: no goodbye to the SuperLink
        fed.start_center("b")  # back (as a new node) before round 2's timeout ends
        while not (out / "stopped-after-2.json").exists() and time.time() < end:
            time.sleep(0.1)  # the first server went away after round 2 ...
        fed.submit(cfg, out)  # ... and a new one picks up from its checkpoint
        fed.wait(out, max(1.0, end - time.time()))
        got = rounds_done()
    assert (out / "stopped-after-2.json").exists()  # round 3 was fused by the second, resumed server
    assert [r["round"] for r in got] == [1, 2, 3]
    assert [tuple(r["accepted"]) for r in got] == [names, ("a", "c"), names]
    assert got[1]["fused"] and "b" in got[1]["missing"]
    ref = run_inprocess(cfg, data, absent={2: ("b",)})
    with np.load(out / "final.npz") as z:
        for k, v in ref.params.items():
            np.testing.assert_array_equal(z[k], v)
    assert _no_stray_processes(tmp_path) == []


def test_run_flower_checks_its_arguments_before_starting_anything(tmp_path):
    with pytest.raises(ValueError, match="data given for centers"):
        run_flower(_cfg(("a",)), {"zz": _data(("zz",))["zz"]}, workdir=tmp_path)
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_two_device_center_trains_data_parallel_inside_flower(tmp_path):
    """Center a has 2 devices: its long-lived Flower executor keeps 2 DDP worker processes across rounds.
    Flower fuses exactly what the in-process engine fuses with the same data-parallel center, and that
    equals the federation whose center a trains in one process up to float32 rounding."""
    names = ("a", "b")
    cfg = CollabConfig(centers=(CenterSpec("a", devices=2), CenterSpec("b")), model=SPEC, rounds=2, local_steps=3,
                       batch_size=16, lr=0.1, round_timeout_s=120)
    data = _data(names)
    res = run_flower(cfg, data, workdir=tmp_path, supernode_poll_s=0.2, timeout_s=240)
    assert [r.accepted for r in res.rounds] == [names, names]
    ref = run_inprocess(cfg, data)
    for k, v in ref.params.items():
        np.testing.assert_array_equal(res.params[k], v)
    one = run_inprocess(CollabConfig(**{**cfg.__dict__, "centers": (CenterSpec("a"), CenterSpec("b"))}), data)
    for k, v in one.params.items():
        np.testing.assert_allclose(res.params[k], v, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(res.params["fc1.weight"], initial_params(cfg)["fc1.weight"])
    assert _no_stray_processes(tmp_path) == []


def test_shortened_object_pull_backoff_is_what_flower_uses():
    """Flower retries a missing object after 1 s, then 2 s; after the patch after 0.02 s, then 0.04 s."""
    from flwr.supercore.inflatable import inflatable_utils as u
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

    from polyparallel.backends.collab._flwr_timing import capped_time, set_object_pull_backoff

    saved = {fn: dict(fn.__kwdefaults__) for fn in (u.pull_objects, u.pull_and_inflate_object_from_tree)}
    tries: list[float] = []

    def pull(object_id: str) -> bytes:
        tries.append(time.monotonic())
        if len(tries) < 3:
            raise ObjectUnavailableError(object_id)
        return b"ok"

    try:
        set_object_pull_backoff(0.02)
        assert u.pull_objects(["x"], pull, max_concurrent_pulls=1) == {"x": b"ok"}
        assert u.pull_and_inflate_object_from_tree.__kwdefaults__["initial_backoff"] == 0.02
    finally:
        for fn, kw in saved.items():
            fn.__kwdefaults__ = kw
    gaps = np.diff(tries)
    assert len(tries) == 3 and 0.015 < gaps[0] < 0.5 and 0.03 < gaps[1] < 0.5  # ±20% jitter, doubling
    with pytest.raises(ValueError, match="0 < initial_s <= cap_s"):
        set_object_pull_backoff(0.5, 0.1)
    fast = capped_time(0.05, 0.01)
    t0 = time.monotonic()
    fast.sleep(3)  # the SuperNode's idle poll
    fast.sleep(0.5)  # its reply check
    assert time.monotonic() - t0 < 0.5 and fast.time is time.time
