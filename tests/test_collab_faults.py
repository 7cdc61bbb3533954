"""Faults and identity over Flower (flwr 1.42, real SuperLink/SuperNode processes on 127.0.0.1).

A center killed mid-round (the round completes at the round timeout; the center restarts and is back
within seconds), a node presenting another center's key under a third center's name (refused, logged;
the real center is then accepted), and the deployment commands: ``polyparallel serve`` killed and
restarted (the centers reconnect, no round lost or repeated), ``polyparallel center`` killed with
SIGKILL and SIGTERM (its SuperNode and executor go with it), and credentials that cannot work (a
one-line error at start). Times are measured and printed (``pytest -s``); the bounds are the issue's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="the Flower engine needs flwr==1.42.0")

from polyparallel.backends.collab._flower import LoopbackFederation, free_port, write_center_data  # noqa: E402
from polyparallel.backends.collab._security import make_credentials  # noqa: E402
from polyparallel.backends.torch._procs import alive  # noqa: E402
from tests.collab_fixtures import mlp_config, random_data  # noqa: E402

NAMES = ("c0", "c1", "c2")


def _rounds(out: Path) -> list[dict]:
    p = out / "rounds.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def _until(cond, timeout_s: float, what: str, every: float = 0.05):
    end = time.time() + timeout_s
    while not (v := cond()):
        if time.time() > end:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every)
    return v


def _pids_with_home(home: Path) -> list[int]:
    """Live (non-zombie) processes whose environment carries FLWR_HOME=home."""
    tag = f"FLWR_HOME={home}".encode() + b"\0"
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag in f.read() and alive(int(pid)):
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_center_killed_mid_round_is_missed_at_the_timeout_and_rejoins_within_seconds(tmp_path):
    """c1's executor is stopped before the run, so c1 takes round 1's model and cannot answer; it is
    SIGKILLed then — mid-round for sure — and restarted at once with the same key. Round 1 fuses c0
    and c2 by the round timeout (earlier: the SuperLink reports c1's node unavailable after 2 missed
    heartbeats); c1 is activated again within 10 s and, with the default rejoin wait (a restarting
    center gets up to 30 s before the next round), trains rounds 2 and 3."""
    timeout = 20
    cfg = mlp_config(NAMES, rounds=3, min_centers=2, round_timeout_s=timeout)
    creds = make_credentials(tmp_path / "certs", NAMES)
    out = tmp_path / "out"
    with LoopbackFederation(tmp_path, write_center_data(tmp_path, random_data(NAMES, seed=3, grow=4)),
                            credentials=creds) as fed:
        for c in NAMES:
            fed.wait_connected(c, 60)
        os.kill(fed.latest("executor-c1").popen.pid, signal.SIGSTOP)  # c1 will take round 1 but not answer
        fed.submit(cfg, out)  # the default rejoin wait
        node = fed.latest("supernode-c1")
        _until(lambda: "ROUND 1]" in node.log_text(), 90, "c1 to receive round 1")
        fed.kill_center("c1")
        t_kill = time.time()
        fed.start_center("c1")
        fed.wait_connected("c1", 10)
        rejoin_s = time.time() - t_kill
        fed.wait(out, 90)
    got = _rounds(out)
    print(f"\nround 1 with c1 killed mid-round: {got[0]['seconds']:.2f} s (timeout {timeout} s); "
          f"c1 restarted and activated again {rejoin_s:.2f} s after the kill")
    assert [r["round"] for r in got] == [1, 2, 3]
    assert got[0]["accepted"] == ["c0", "c2"] and got[0]["missing"] == ["c1"] and got[0]["fused"]
    assert got[0]["seconds"] < timeout + 3
    assert rejoin_s < 10
    assert got[1]["accepted"] == got[2]["accepted"] == list(NAMES)
    assert fed.stray_pids() == []


def test_the_rejoin_grace_is_spent_once_per_lost_center():
    from polyparallel.backends.collab._flower_app import REJOIN_WAIT_S, rejoin_grace

    assert REJOIN_WAIT_S == 30.0
    assert rejoin_grace(30.0, 3, 3, None) == 0.0  # everyone is there
    assert rejoin_grace(30.0, 2, 3, None) == 30.0  # c1 just crashed: wait for it
    assert rejoin_grace(30.0, 2, 3, 2) == 0.0  # waited a whole grace already, it did not come back
    assert rejoin_grace(30.0, 1, 3, 2) == 30.0  # another center lost since: a grace for it
    assert rejoin_grace(0.0, 1, 3, None) == 0.0  # --rejoin-wait 0: never wait


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_supernode_that_gave_up_but_did_not_exit_counts_as_lost(tmp_path):
    """flwr 1.42's SuperNode sometimes logs that it gives up reconnecting to a restarted SuperLink and then
    blocks instead of exiting; the center's supervisor must treat it as lost (it restarts a lost one), not
    wait on it forever. Before it was activated again, a give-up line past the grace counts; one
    followed by a new activation does not."""
    from polyparallel.backends.collab._flower import _NODE_ID, _Proc

    fed = LoopbackFederation(tmp_path, {})
    log = tmp_path / "supernode-a.log"
    log.write_text(f"{_NODE_ID}7\nreconnecting\n")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        node = _Proc("supernode-a", sleeper, log)
        assert not fed._gave_up(node, grace_s=0.0)  # activated, nothing given up
        with log.open("a") as f:
            f.write("Giving up reconnection after 10.00 seconds and 5 tries.\n")
        assert not fed._gave_up(node, grace_s=0.5)  # seen now: it may still be on its way out
        time.sleep(0.6)
        assert fed._gave_up(node, grace_s=0.5)  # still alive past the grace: lost
        with log.open("a") as f:
            f.write(f"{_NODE_ID}9\n")
        assert not fed._gave_up(node, grace_s=0.0)  # activated again after it: fine
        sleeper.kill()
        sleeper.wait(10)
        log.write_text("Giving up reconnection after 10.00 seconds and 5 tries.\n")
        assert not fed._gave_up(node, grace_s=0.0)  # exited: the supervisor's exit check handles it
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait(10)


def test_a_failing_task_is_told_at_the_center_once_per_error():
    """The executor logs a failed ClientApp task with its traceback (default logging format, as it runs);
    `polyparallel center` shows each task's exception line (a center whose rows do not fit the model
    used to print "connected" and nothing else while the server logged errors every round)."""
    import io
    import logging

    from polyparallel.backends.collab import _warm_center as W

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    W.log.addHandler(handler)
    try:
        for bad in ("Expected 3D (unbatched) or 4D (batched) input to conv2d, but got input of size: [32, 64]",
                    "Expected 3D (unbatched) or 4D (batched) input to conv2d, but got input of size: [32, 64]",
                    "second"):
            try:
                try:
                    raise KeyError("inner")
                except KeyError:
                    raise RuntimeError(bad) from None
            except RuntimeError:
                W.log.exception(W.RAISED)
            W.log.warning("next record")
    finally:
        W.log.removeHandler(handler)
    got = W.client_failures(buf.getvalue())
    assert got[0] == got[1] == ("RuntimeError: Expected 3D (unbatched) or 4D (batched) input to conv2d, but got "
                                "input of size: [32, 64]")
    assert got[2] == "RuntimeError: second" and len(got) == 3
    assert W.client_failures("INFO:x:round 1 done\n") == []
    flwr_line = "\x1b[92mINFO \x1b[0m:      [RUN 1, ROUND 2]"  # Flower's own records end a traceback too
    assert W.client_failures(f"ERROR:w:{W.RAISED}\nTraceback (most recent call last):\n  x\nValueError: v\n"
                             f"{flwr_line}\n") == ["ValueError: v"]


def test_a_node_with_another_centers_key_claiming_a_third_name_is_refused(tmp_path):
    """Beside c1 and the real c2, a node holding c0's key starts with --node-config center="c2": the
    SuperLink admits it (the key is registered) as c0's node, and the ServerApp refuses its replies
    because that node is registered as c0 — logged in server.log, recorded under rejected and in the
    timing records, never counted as c2's. The real c2 is accepted in every round."""
    cfg = mlp_config(NAMES, rounds=2, min_centers=2, round_timeout_s=30)
    creds = make_credentials(tmp_path / "certs", NAMES)
    out = tmp_path / "out"
    with LoopbackFederation(tmp_path, write_center_data(tmp_path, random_data(NAMES, seed=3, grow=4)),
                            credentials=creds, autostart=False) as fed:
        fed.start_superlink()
        ids = {name: nid for nid, name in fed.node_names.items()}
        assert set(ids) == set(NAMES)
        fed.start_center("c1")
        fed.start_center("c2")
        # the impostor: another machine (its own workdir) with c0's private key, calling itself c2
        with LoopbackFederation(tmp_path / "impostor", {"c2": fed.centers["c2"]}, credentials=creds,
                                autostart=False) as imp:
            imp.start_center("c2", superlink=f"127.0.0.1:{fed.superlink_port}", private_key=creds.node_key("c0")[0])
            assert imp.wait_connected("c2", 60) == ids["c0"]  # admitted, but as c0's node
            fed.wait_connected("c1", 60)
            assert fed.wait_connected("c2", 60) == ids["c2"]
            fed.submit(cfg, out)
            fed.wait(out, 90)
        assert imp.stray_pids() == []
    got = _rounds(out)
    key = f"c2@node{ids['c0']}"
    for r in got:
        assert r["accepted"] == ["c1", "c2"] and list(r["rejected"]) == [key]
        assert "registered for 'c0' but claims to be 'c2'" in r["rejected"][key][0]
    timing = [json.loads(x) for x in (out / "timing.jsonl").read_text().splitlines()]
    assert [(e["round"], e["who"]) for e in timing if e["event"] == "rejected"] == [(1, key), (2, key)]
    log = (out / "server.log").read_text()
    assert f"refused a reply: node {ids['c0']} holds the key registered for 'c0' but claims to be 'c2'" in log
    assert fed.stray_pids() == []


def _cli(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "PYTHONUNBUFFERED": "1",
           "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    with log.open("ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "polyparallel", *args], cwd=cwd, env=env, stdout=fh,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_deployed_server_restart_loses_no_round_and_killed_centers_leave_nothing(tmp_path):
    """`polyparallel serve` (relative --credentials, --round-timeout) with two `polyparallel center`s:
    the server is SIGKILLed after its first round and started again; the centers reconnect and the
    resumed server fuses the remaining rounds: rounds.jsonl holds 1..5 once each, all fused. Then one
    center command is SIGKILLed and the other SIGTERMed: no SuperNode or executor of theirs survives.
    A third center started without the CA exits 2 with the reason instead of claiming to be connected."""
    names = ("c0", "c1")
    cfg = mlp_config(names, rounds=5, round_timeout_s=600)
    (tmp_path / "job.json").write_text(cfg.to_json())
    make_credentials(tmp_path / "certs", names)
    for c, (x, y) in random_data(names, seed=3, grow=4).items():
        np.savez(tmp_path / f"{c}.npz", x=x, y=y)
    port = free_port()
    serve_args = ["serve", "--config", "job.json", "--port", str(port), "--host", "127.0.0.1", "--out", "out",
                  "--workdir", "srv", "--credentials", "certs", "--round-timeout", "20"]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(serve := _cli(serve_args, tmp_path, tmp_path / "serve.log"))
        _until(lambda: "waiting for 2 centers" in (tmp_path / "serve.log").read_text(), 60, "the SuperLink")
        for c in names:
            procs.append(_cli(["center", "--name", c, "--superlink", f"127.0.0.1:{port}", "--data", f"{c}.npz",
                               "--workdir", f"w-{c}", "--ca", "certs/ca.pem", "--key", f"certs/{c}.key"],
                              tmp_path, tmp_path / f"{c}.log"))
        # a center without the CA (plain HTTP to the TLS SuperLink): an error at start, not "connected"
        plain_args = ["center", "--name", "c1", "--superlink", f"127.0.0.1:{port}", "--data", "c1.npz",
                      "--workdir", "w-plain", "--connect-timeout", "8"]
        procs.append(plain := _cli(plain_args, tmp_path, tmp_path / "plain.log"))
        out = tmp_path / "out"
        _until(lambda: _rounds(out), 90, "round 1")
        serve.send_signal(signal.SIGKILL)
        serve.wait(10)
        t_kill = time.time()
        killed_after = len(_rounds(out))
        assert not (out / "done.json").exists()
        procs.append(serve := _cli(serve_args, tmp_path, tmp_path / "serve.log"))
        _until(lambda: len(_rounds(out)) > killed_after, 90, "a round of the restarted server")
        resumed_s = time.time() - t_kill
        assert serve.wait(60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        got = _rounds(out)
        assert [r["round"] for r in got] == [1, 2, 3, 4, 5] and all(r["fused"] for r in got)
        assert all(r["accepted"] == list(names) for r in got)
        assert plain.wait(60) == 2
        plain_out = (tmp_path / "plain.log").read_text()
        assert "center c1 could not join" in plain_out and "connected to" not in plain_out, plain_out
        serve_out = (tmp_path / "serve.log").read_text()
        assert "server: " in serve_out and "resumed from" in serve_out  # the ServerApp's log reaches the user
        for c in names:
            assert "reconnected as node" in (tmp_path / f"{c}.log").read_text()
        kill_s = {}
        for c, sig in (("c0", signal.SIGKILL), ("c1", signal.SIGTERM)):
            center = procs[1 + names.index(c)]
            home = tmp_path / f"w-{c}" / "flwr-home"
            assert len(_pids_with_home(home)) >= 2  # its SuperNode and executor
            t0 = time.time()
            center.send_signal(sig)
            center.wait(10)
            _until(lambda h=home: not _pids_with_home(h), 10, f"{c}'s SuperNode and executor to exit")
            kill_s[c] = time.time() - t0
        print(f"\nserver SIGKILLed after round {killed_after}; restarted, next round recorded {resumed_s:.2f} s "
              f"after the kill; center command SIGKILL -> children gone in {kill_s['c0']:.2f} s, "
              f"SIGTERM -> {kill_s['c1']:.2f} s")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    for home in ("srv", "w-c0", "w-c1", "w-plain"):
        assert _until(lambda h=home: not _pids_with_home(tmp_path / h / "flwr-home"), 10, f"{home} processes")


def test_unusable_center_credentials_are_one_line_errors_at_start(tmp_path, capsys):
    from polyparallel.cli import main

    make_credentials(tmp_path, ["c0"])
    (tmp_path / "garbage.key").write_text("not a key\n")
    base = ["center", "--name", "c0", "--superlink", "127.0.0.1:1", "--data", str(tmp_path / "x.npz")]
    np.savez(tmp_path / "x.npz", x=np.zeros((2, 6), np.float32), y=np.zeros(2, np.int64))
    for extra, msg in (
        (["--ca", str(tmp_path / "nope.pem"), "--key", str(tmp_path / "c0.key")], "nope.pem: no such file"),
        (["--ca", str(tmp_path / "ca.pem"), "--key", str(tmp_path / "garbage.key")],
         "not an unencrypted OpenSSH private key"),
        (["--ca", str(tmp_path / "c0.pub"), "--key", str(tmp_path / "c0.key")], "not a PEM certificate"),
    ):
        with pytest.raises(SystemExit) as e:
            main([*base, *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    (tmp_path / "job.json").write_text(mlp_config(["c0", "c1"]).to_json())
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", str(tmp_path / "job.json"), "--credentials", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "c1.pub" in err and "Traceback" not in err
