"""Flower deployment engine on loopback: a SuperLink, one SuperNode per center, ``flwr run``.

Every Flower process is a real OS process in its own process group (``start_new_session``), with
``FLWR_HOME`` in the federation's work directory, telemetry and update checks off, runtime dependency
installation off (nothing is fetched: the app runs in this interpreter's environment), and the
interpreter's ``bin`` first on ``PATH`` so Flower's own sub-launches (SuperExec, ServerApp, ClientApp)
use it too. :class:`LoopbackFederation` is a context manager whose exit kills every process group it
started (SIGTERM, then SIGKILL), whatever happened.

Two ways to run the centers' ClientApps:

- ``warm=False`` — Flower's default ``subprocess`` isolation: the SuperNode's SuperExec starts a fresh
  ``flwr-clientapp`` process for every message, which re-imports torch and rebuilds the model.
- ``warm=True`` — ``process`` isolation: the SuperNode runs no executor and we start one long-lived
  :mod:`._warm_center` process per center that takes tasks from the SuperNode's Runtime API and runs
  the ClientApp in-process, keeping imports, model and data between rounds.

What a round costs beyond computing (``benchmarks/collab.py``; 3 centers, 1M parameters, loopback):
Flower's fixed waits, not bytes. The defaults here shorten them (:mod:`._flwr_timing`): object-pull
retries from 0.02 s instead of 1 s doubling to 10 s, SuperNode reply checks every 0.02 s instead of
0.5 s and idle polls every 0.25 s instead of 3 s, the SuperLink's store in memory instead of SQLite,
and the arrays packed into one buffer per dtype so that a message is a handful of Flower objects.

Faults and identity (see ``docs/collab.md``): every process we start dies with the process that
started it (``PR_SET_PDEATHSIG``, so a SIGKILLed ``polyparallel center`` or ``serve`` takes its
SuperNode, executor or SuperLink along); SuperNodes heartbeat every ``heartbeat_s`` and retry
activation while a crashed predecessor is still "online" (:mod:`._supernode`, :mod:`._superlink`), so a
restarted center is back within seconds; :meth:`LoopbackFederation.supervise` restarts a center whose
SuperNode exited (the server went away) until it reconnects; with credentials, registering a key
returns its node id, and the ServerApp gets ``node id -> center name`` in the run config and refuses a
reply whose claimed name is not the one registered for the node that sent it.

The app handed to ``flwr run`` is a two-file Flower App written into the work directory: a
``pyproject.toml`` naming :data:`._flower_app.server_app` / ``client_app`` and carrying the run config,
and a one-line module importing them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polyparallel.backends.torch._procs import die_with_parent, free_port
from polyparallel.references import import_path

from ._config import REJOIN_WAIT_S, CollabConfig, FlowerRun
from ._engine import CollabResult, check_data
from ._models import resolve_reference
from ._pruning import with_input_of
from ._security import Credentials
from ._server import RoundRecord
from ._warm_center import client_failures

__all__ = ["FlowerError", "LoopbackFederation", "run_flower"]


class FlowerError(RuntimeError):
    """A Flower process failed or the run did not finish in time (the message names the log to read)."""


def _wait_port(port: int, timeout_s: float, proc: subprocess.Popen, log: Path) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        if proc.poll() is not None:
            raise FlowerError(f"process exited with {proc.returncode} before listening on {port}; see {log}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise FlowerError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s; see {log}")


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    log_start: int = 0  # the log's size when this process started (a restart appends to the same file)
    log_seen: int = -1  # the log's size when :meth:`log_grew` last looked

    def log_text(self) -> str:
        with self.log.open("rb") as f:
            f.seek(self.log_start)
            return f.read().decode(errors="replace")

    def log_grew(self) -> bool:
        """Whether the log has been written to since the last call (a supervisor polling it reads it
        again only then)."""
        size = self.log.stat().st_size if self.log.exists() else 0
        grew, self.log_seen = size != self.log_seen, size
        return grew


# `flwr supernode register KEY loopback --name NAME` for several keys: flwr 1.42's own helpers, one process
_REGISTER = """
import json, sys
from pathlib import Path
from flwr.cli.supernode.register import (RegisterNodeRequest, init_http_client_from_connection,
                                         read_superlink_connection, try_load_public_key)
client = init_http_client_from_connection(read_superlink_connection("loopback"))
ids = {name: client.RegisterNode(request=RegisterNodeRequest(public_key=try_load_public_key(Path(key)),
                                                             name=name)).node_id
       for name, key in json.loads(sys.argv[1])}
print(json.dumps(ids))
"""

_NODE_ID = "SuperNode ID: "  # what flwr 1.42's SuperNode logs once the SuperLink activated it
_GAVE_UP = "Giving up reconnection"  # what it logs when it stops retrying a lost SuperLink


@dataclass
class LoopbackFederation:
    """SuperLink + SuperNodes (+ warm center executors) on 127.0.0.1, stopped on exit.

    Args:
        workdir: directory for FLWR_HOME, logs, data files and outputs.
        centers: center name -> its data: an ``.npz`` path (``x``, ``y``), a ``package.module:function``
            data source, or ``""`` for the job's ``CenterSpec.data``.
        warm: long-lived ClientApp executors (``process`` isolation) instead of a process per message.
        executor_poll_s: how often an idle executor asks its SuperNode for a task.
        autostart: ``with`` starts the SuperLink and every center (else only cleanup is managed).
        supernode_poll_s: cap on the SuperNodes' fixed 3 s idle poll of the SuperLink (None: 3 s).
        supernode_wait_s: cap on the SuperNodes' fixed 0.5 s checks for the ClientApp's reply (None: 0.5 s).
        pull_backoff_s: first retry of a message object that is not yet where it is pulled from, in
            the SuperNodes, executors and ServerApp (None: Flower's 1 s, doubling to 10 s). Any of
            these three set runs the SuperNodes through :mod:`._supernode`; see :mod:`._flwr_timing`
            for why they dominate a loopback round.
        superlink_database: the SuperLink's state and object store: None keeps them in memory; a file
            name in ``workdir`` makes them survive a SuperLink restart (registered keys included) but
            stores every message object in SQLite, ~2 s more per round on loopback (3 centers, 1M
            parameters). The federation's own checkpoint does not need it.
        pack_arrays: send the model and the updates as one buffer per dtype (see :mod:`._flower_app`);
            False: one message object per tensor (the benchmark compares the two).
        data_channel: ``flower`` (every round's arrays in Flower messages) or ``socket`` (the lean path,
            :mod:`._lean`: one long-lived TCP connection per center carries the rounds).
        credentials: TLS on the SuperLink's HTTP APIs and SuperNode authentication (only the
            public keys registered with :meth:`register_center` may join); None: plain HTTP, no auth.
        heartbeat_s: the SuperNodes' heartbeat interval (Flower: 30 s, at least 10 s): a SuperNode that
            died is "online" for 2 intervals after its last heartbeat, and its key cannot rejoin before
            (None: Flower's limits and interval).
        activate_wait_s: how long a starting SuperNode retries while its node is still online.
        connect_wait_s: how long a SuperNode retries an unreachable SuperLink before it exits (None:
            Flower's default, forever with back-off up to 20 s); :meth:`supervise` then restarts it.
    """

    workdir: Path
    centers: Mapping[str, Path | str]
    warm: bool = True
    executor_poll_s: float = 0.05
    startup_timeout_s: float = 60.0
    autostart: bool = True
    supernode_poll_s: float | None = 0.25
    supernode_wait_s: float | None = 0.02
    pull_backoff_s: float | None = 0.02
    superlink_database: str | None = None
    pack_arrays: bool = True
    data_channel: str = "flower"
    credentials: Credentials | None = None
    heartbeat_s: float | None = 2.0
    activate_wait_s: float = 30.0
    connect_wait_s: float | None = None
    procs: list[_Proc] = field(default_factory=list)
    node_names: dict[int, str] = field(default_factory=dict)  # node id -> center, from key registration
    superlink_port: int = 0
    node_ports: dict[str, int] = field(default_factory=dict)
    _old_term: Any = field(default=None, repr=False)
    _gave_up_at: dict[int, float] = field(default_factory=dict, repr=False)  # SuperNode pid -> when it gave up

    # ------------------------------------------------------------------ processes
    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        bindir = str(Path(sys.executable).parent)
        env.update({
            "FLWR_HOME": str(self.workdir / "flwr-home"),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": str(self.executor_poll_s),
            "PATH": bindir + os.pathsep + env.get("PATH", ""),
            "PYTHONPATH": import_path(),  # the user's model and data modules import there as here
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
        })
        return env

    def _spawn(self, name: str, argv: list[str]) -> _Proc:
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        parent = os.getpid()
        with log.open("ab") as fh:
            start = fh.tell()
            # killed with us, even by SIGKILL (no __exit__ then): nothing trains on after its center is gone
            p = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=self.env, cwd=self.workdir, start_new_session=True,
                                 preexec_fn=lambda: die_with_parent(parent))
        proc = _Proc(name, p, log, start)
        self.procs.append(proc)
        return proc

    def start(self) -> LoopbackFederation:
        self.start_superlink()
        for name in self.centers:  # the SuperNodes start side by side (seconds each on a busy machine)
            self.start_center(name, wait=False)
        for name in self.centers:
            self.start_executor(name)
        return self

    def start_superlink(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Start the SuperLink (Fleet, Control and Runtime APIs on one HTTP port) and point FLWR_HOME at it."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.superlink_port = port or free_port()
        home = self.workdir / "flwr-home"
        home.mkdir(parents=True, exist_ok=True)
        cr = self.credentials
        transport = f'root-certificates = "{cr.ca}"\n' if cr else "insecure = true\n"
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
            f'address = "127.0.0.1:{self.superlink_port}"\n{transport}')
        tls = (["--ssl-certfile", str(cr.server_cert), "--ssl-keyfile", str(cr.server_key),
                "--ssl-ca-certfile", str(cr.ca), "--enable-supernode-auth"] if cr else ["--insecure"])
        db = ["--database", str(self.workdir / self.superlink_database)] if self.superlink_database else []
        argv = ["flower-superlink", *tls, "--host", host, "--port", str(self.superlink_port), *db,
                "--disable-runtime-dependency-installation"]
        if self.heartbeat_s is not None:
            argv = [sys.executable, "-m", "polyparallel.backends.collab._superlink",
                    "--min-heartbeat-s", str(min(self.heartbeat_s, 10.0)), "--", *argv[1:]]
        link = self._spawn("superlink", argv)
        _wait_port(self.superlink_port, self.startup_timeout_s, link.popen, link.log)
        if cr:
            self.register_centers((name, pub) for name, _, pub in cr.node_keys if name in self.centers)

    def register_center(self, name: str, public_key: Path) -> None:
        """Allow the SuperNode holding the private half of ``public_key`` to join (``flwr supernode register``)."""
        self.register_centers([(name, public_key)])

    def register_centers(self, keys: Iterable[tuple[str, Path]]) -> None:
        """Register each ``(center, public key)`` with the SuperLink (what ``flwr supernode register`` does,
        for all keys in one process: a Flower CLI start is seconds on a busy machine).

        The SuperLink answers with the node id each key will have: it goes into :attr:`node_names`,
        which :meth:`submit` hands to the ServerApp (a reply is counted only under its node's name).
        """
        keys = [(n, str(k)) for n, k in keys]
        if not keys:
            return
        res = subprocess.run([sys.executable, "-c", _REGISTER, json.dumps(keys)], env=self.env, cwd=self.workdir,
                             capture_output=True, text=True, timeout=self.startup_timeout_s)
        try:
            ids = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else None
        except (ValueError, IndexError):
            ids = None
        if not isinstance(ids, dict) or set(ids) != {n for n, _ in keys} or not all(ids.values()):
            raise FlowerError(f"registering the keys of {[n for n, _ in keys]} failed: {res.stdout[-1500:]} "
                              f"{res.stderr[-1500:]}")
        self.node_names.update({int(nid): name for name, nid in ids.items()})

    def start_center(self, name: str, superlink: str | None = None, private_key: Path | None = None,
                     wait: bool = True) -> None:
        """Start (or restart) the SuperNode of ``name`` and, when warm, its executor.

        ``superlink`` is the SuperLink's ``host:port`` (default: the one this object started);
        ``private_key`` overrides the center's key from :attr:`credentials`; ``wait=False`` returns
        once the SuperNode is spawned (then :meth:`start_executor` starts the executor).
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()  # a fresh port: the killed node's may linger in TIME_WAIT
        self.node_ports[name] = port
        cr = self.credentials
        if cr:
            key = private_key or cr.node_key(name)[0]
            transport = ["--root-certificates", str(cr.ca), "--auth-supernode-private-key", str(key)]
        else:
            transport = ["--insecure"]
        argv = ["flower-supernode", *transport, "--superlink", superlink or f"127.0.0.1:{self.superlink_port}",
                "--node-config", f'center="{name}" data="{self.centers[name]}"',
                "--host", "127.0.0.1", "--port", str(port)]
        if self.warm:
            argv += ["--isolation", "process"]
        if self.connect_wait_s is not None:
            argv += ["--max-wait-time", str(self.connect_wait_s)]
        if (self.supernode_poll_s, self.supernode_wait_s, self.pull_backoff_s, self.heartbeat_s) != (None,) * 4:
            patch = ["--poll-s", str(3.0 if self.supernode_poll_s is None else self.supernode_poll_s),
                     "--wait-s", str(0.5 if self.supernode_wait_s is None else self.supernode_wait_s)]
            if self.pull_backoff_s is not None:
                patch += ["--pull-backoff-s", str(self.pull_backoff_s)]
            if self.heartbeat_s is not None:
                patch += ["--heartbeat-s", str(self.heartbeat_s), "--activate-wait-s", str(self.activate_wait_s)]
            # run as a file, not as a module of the package: importing polyparallel would add a third to the
            # SuperNode's start, which is most of a crashed center's time to rejoin
            argv = [sys.executable, str(Path(__file__).with_name("_supernode.py")), *patch, "--", *argv[1:]]
        self._spawn(f"supernode-{name}", argv)
        if wait:
            self.start_executor(name)

    def start_executor(self, name: str) -> None:
        """Once center ``name``'s SuperNode listens, start its warm executor (nothing when not warm)."""
        node = self.latest(f"supernode-{name}")
        assert node is not None, f"center {name}'s SuperNode was not started"
        port = self.node_ports[name]
        _wait_port(port, self.startup_timeout_s, node.popen, node.log)
        if self.warm:
            backoff = [] if self.pull_backoff_s is None else ["--pull-backoff-s", str(self.pull_backoff_s)]
            self._spawn(f"executor-{name}", [sys.executable, "-m", "polyparallel.backends.collab._warm_center",
                                             "--runtime-api-address", f"127.0.0.1:{port}",
                                             "--poll-s", str(self.executor_poll_s), *backoff])

    def _superlink_pid(self) -> int:
        link = self.latest("superlink")
        return link.popen.pid if link is not None and link.popen.poll() is None else 0

    def kill_center(self, name: str) -> None:
        """SIGKILL a center's SuperNode and executor (a crash, not a shutdown)."""
        for p in self.procs:
            if p.name in (f"supernode-{name}", f"executor-{name}") and p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait(timeout=10)

    def latest(self, name: str) -> _Proc | None:
        """The last process started under ``name`` (``superlink``, ``supernode-C``, ``executor-C``)."""
        return next((p for p in reversed(self.procs) if p.name == name), None)

    def node_id(self, name: str) -> int | None:
        """The node id center ``name``'s current SuperNode was activated as, None while it is not (yet)."""
        node = self.latest(f"supernode-{name}")
        text = node.log_text() if node else ""
        if _NODE_ID not in text:
            return None
        return int(text[text.rindex(_NODE_ID) + len(_NODE_ID):].split()[0])

    def wait_connected(self, name: str, timeout_s: float) -> int:
        """Block until center ``name``'s SuperNode is activated at the SuperLink; its node id.

        Raises :class:`FlowerError` with the SuperNode's last log line when it exits first (a wrong
        certificate, an unknown key, no SuperLink) or ``timeout_s`` passes.
        """
        end = time.time() + timeout_s
        node = self.latest(f"supernode-{name}")
        if node is None:
            raise FlowerError(f"center {name} was not started")
        while (nid := self.node_id(name)) is None:
            if node.popen.poll() is not None or time.time() > end:
                lines = [ln for ln in node.log_text().splitlines() if ln.strip()]
                why = lines[-1].strip() if lines else "no output"
                state = (f"its SuperNode exited with {node.popen.returncode}" if node.popen.poll() is not None
                         else f"not connected after {timeout_s:.0f} s")
                raise FlowerError(f"center {name}: {state}: {why} (log: {node.log})")
            time.sleep(0.1)
        return nid

    def supervise(self, name: str, superlink: str | None = None, reconnect_s: float = 600.0,
                  on_event: Callable[[str], None] | None = None) -> None:
        """Keep center ``name`` connected: block while it runs; when its SuperNode or executor exits (the
        SuperLink went away and the SuperNode gave up, or a crash), stop the other and start both again,
        every second, until it is activated again. Raise :class:`FlowerError` once it has been
        disconnected for ``reconnect_s`` seconds."""
        say = on_event or (lambda _: None)
        lost: float | None = None
        told: set[str] = set()  # the task failures already shown
        while True:
            procs = [p for p in (self.latest(f"supernode-{name}"), self.latest(f"executor-{name}")) if p]
            for p in procs[1:]:  # a round that fails here (its data, its model) is said here, once per error
                if p.log_grew():
                    for why in dict.fromkeys(client_failures(p.log_text())):
                        if why not in told:
                            told.add(why)
                            say(f"center {name}: a task failed here: {why} (log: {p.log})")
            hung = self._gave_up(procs[0]) if procs and procs[0].name.startswith("supernode") else False
            if hung:  # alive but done for: it will not reconnect, so it is restarted as if it had exited
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(procs[0].popen.pid, signal.SIGKILL)
                procs[0].popen.wait(timeout=10)
            if lost is None and any(p.popen.poll() is not None for p in procs):
                dead = next(p for p in procs if p.popen.poll() is not None)
                lost = time.time()
                say(f"center {name}: {dead.name} " + ("gave up reconnecting and did not exit" if hung else
                                                      f"exited with {dead.popen.returncode}")
                    + f"; reconnecting (for up to {reconnect_s:.0f} s)")
            if lost is not None:
                if time.time() - lost > reconnect_s:
                    raise FlowerError(f"center {name}: not reconnected within {reconnect_s:.0f} s; see "
                                      f"{self.workdir / 'logs'}")
                if any(p.popen.poll() is not None for p in procs):
                    self.kill_center(name)
                    time.sleep(1.0)
                    try:
                        self.start_center(name, superlink=superlink)
                    except FlowerError:
                        continue
                if self.node_id(name) is not None:
                    say(f"center {name}: reconnected as node {self.node_id(name)} after {time.time() - lost:.1f} s")
                    lost = None
            time.sleep(0.2)

    def _gave_up(self, node: _Proc, grace_s: float = 5.0) -> bool:
        """Whether a SuperNode logged that it gave up reconnecting (after its last activation) and has
        not exited ``grace_s`` after that was first seen: flwr 1.42's SuperNode sometimes stays alive
        then, blocked, and never connects again."""
        if node.popen.poll() is not None:
            return False
        if node.log_grew():  # read again only when written to: the verdict on the text stands until then
            text = node.log_text()
            if text.rfind(_GAVE_UP) <= text.rfind(_NODE_ID):
                self._gave_up_at.pop(node.popen.pid, None)
            else:
                self._gave_up_at.setdefault(node.popen.pid, time.time())
        seen = self._gave_up_at.get(node.popen.pid)
        return seen is not None and time.time() - seen > grace_s

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.procs if p.popen.poll() is None]
            for p in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, sig)
            end = time.time() + 5
            for p in alive:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(timeout=max(0.1, end - time.time()))
        self.kill_strays()

    def kill_strays(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every process carrying this federation's FLWR_HOME: Flower's own launches may leave our
        groups (detached ServerApp and SuperExec, parent-pid monitors that take seconds), and a server
        restarted in the same workdir after a SIGKILL finds its predecessor's still there."""
        end = time.time() + timeout_s
        while (stray := self.stray_pids()) and time.time() < end:
            for pid in stray:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def stray_pids(self) -> list[int]:
        """Live processes (other than zombies) that carry this federation's FLWR_HOME."""
        tag = f"FLWR_HOME={self.workdir / 'flwr-home'}".encode() + b"\0"
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if tag in f.read():
                        found.append(int(pid))
            except OSError:
                continue
        return found

    def __enter__(self) -> LoopbackFederation:
        # SIGTERM must unwind through __exit__ (Python's default would skip it and orphan Flower's processes)
        self._old_term = None
        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            return self.start() if self.autostart else self
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._old_term is not None:
                signal.signal(signal.SIGTERM, self._old_term)
                self._old_term = None

    def watch(self) -> None:
        """Block while every started process is alive (a center deployment); raise when one exits."""
        while True:
            for p in self.procs:
                if p.popen.poll() is not None:
                    raise FlowerError(f"{p.name} exited with {p.popen.returncode}; see {p.log}")
            time.sleep(0.5)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ({p.log})\n" + p.log.read_text(errors="replace")[-3000:] for p in self.procs)

    # ------------------------------------------------------------------ runs
    def submit(self, config: CollabConfig, out_dir: Path, *, eval_data: Path | None = None,
               poll_s: float = 0.05, max_rounds: int = 0, center_wait_s: float = 600.0,
               rejoin_wait_s: float = REJOIN_WAIT_S, root_data: Path | None = None,
               client_app: str | None = None) -> int:
        """Write the Flower App for ``config``, start it with ``flwr run`` and return the run id.

        Submitting again with the same ``out_dir`` resumes from the server's last checkpoint.
        ``center_wait_s``: how long the ServerApp waits for ``config.required_centers`` centers to be
        connected before a round (it fails after that instead of recording rounds nobody trained);
        ``rejoin_wait_s``: how long it waits, before a later round, for every center to be connected
        (a grace for a center that is restarting, once per lost center, see
        :func:`~._flower_app.rejoin_grace`; 0: a round starts with ``required_centers``).
        ``root_data``: ``.npz`` (``x``, ``y``) of the server's own root set, for a fusion that needs one (FLTrust).
        ``client_app``: ``"package.module:name"`` of the ClientApp the centers run instead of polyparallel's
        (importable by the centers; the adversarial tests' misbehaving center).
        """
        app = self.workdir / "app"
        app.mkdir(parents=True, exist_ok=True)
        module, _, name = (client_app or "polyparallel.backends.collab._flower_app:client_app").partition(":")
        (app / "ppcollab_app.py").write_text(
            '"""Flower App entry points of a polyparallel federation."""\n'
            f"import {module} as _clients\nfrom polyparallel.backends.collab import _flower_app\n\n"
            "# plain assignments: `flwr run` finds the components by reading this file, not importing it\n"
            f"server_app = _flower_app.server_app\nclient_app = _clients.{name}\n")
        run_config = FlowerRun(
            config.to_json(), str(out_dir), eval_data=str(eval_data or ""), root_data=str(root_data or ""),
            poll_s=poll_s, max_rounds=max_rounds, pull_backoff_s=self.pull_backoff_s or 0.0,
            pack_arrays=self.pack_arrays, data_channel=self.data_channel,
            node_names=json.dumps({str(k): v for k, v in self.node_names.items()}), center_wait_s=center_wait_s,
            rejoin_wait_s=rejoin_wait_s, superlink_pid=self._superlink_pid()).run_config()
        import tomli_w

        (app / "pyproject.toml").write_text(tomli_w.dumps({
            "build-system": {"requires": ["setuptools"], "build-backend": "setuptools.build_meta"},
            "project": {"name": "ppcollab", "version": "1.0.0", "description": "polyparallel federation",
                        "license": "MIT", "dependencies": []},
            "tool": {"flwr": {"app": {"publisher": "polyparallel",
                                      "components": {"serverapp": "ppcollab_app:server_app",
                                                     "clientapp": "ppcollab_app:client_app"},
                                      "config": run_config}}},
        }))
        with contextlib.suppress(FileNotFoundError):  # left by a server that was killed: this one resumes
            (out_dir / "failed.json").unlink()
        res = subprocess.run(["flwr", "run", str(app), "loopback", "--format", "json"], env=self.env,
                             cwd=self.workdir, capture_output=True, text=True, timeout=self.startup_timeout_s)
        try:
            reply = json.loads(res.stdout[res.stdout.index("{"):])
            ok = res.returncode == 0 and reply.get("success")
        except ValueError:
            ok = False
        if not ok:
            raise FlowerError(f"`flwr run` failed ({res.returncode}): {res.stdout[-2000:]} {res.stderr[-2000:]}")
        return int(reply["run-id"])

    def stop_run(self, run_id: int) -> None:
        """Stop a run (``flwr stop``): its ServerApp ends; the SuperLink and the centers stay up.

        Caution (flwr 1.42): a SuperNode whose ClientApp is mid-task when its run stops keeps waiting
        for that task's reply and takes no new messages; stop between rounds.
        """
        res = subprocess.run(["flwr", "stop", str(run_id), "loopback"], env=self.env, cwd=self.workdir,
                             capture_output=True, text=True, timeout=self.startup_timeout_s)
        if res.returncode != 0:
            raise FlowerError(f"`flwr stop {run_id}` failed: {res.stdout[-1500:]} {res.stderr[-1500:]}")

    def wait(self, out_dir: Path, timeout_s: float, on_round: Callable[[RoundRecord], None] | None = None,
             on_log: Callable[[str], None] | None = None) -> None:
        """Block until the ServerApp wrote ``done.json`` in ``out_dir``; ``on_round`` gets each round's
        record as it appears, ``on_log`` each line of the ServerApp's log (``server.log``: rejections,
        refused identities, resumption)."""
        end = time.time() + timeout_s
        link = next(p for p in reversed(self.procs) if p.name == "superlink")
        seen = 0
        log_at = 0

        def report() -> None:
            nonlocal seen, log_at
            slog = out_dir / "server.log"
            if on_log is not None and slog.exists():
                with slog.open("rb") as f:
                    f.seek(log_at)
                    chunk = f.read()
                done = chunk[: chunk.rfind(b"\n") + 1]
                log_at += len(done)
                for line in done.decode(errors="replace").splitlines():
                    on_log(line)
            p = out_dir / "rounds.jsonl"
            if on_round is None or not p.exists():
                return
            lines = p.read_text().splitlines()
            complete = lines if p.read_text().endswith("\n") else lines[:-1]  # a line being written waits
            for line in complete[seen:]:
                on_round(RoundRecord.from_dict(json.loads(line)))
            seen = max(seen, len(complete))

        while not (out_dir / "done.json").exists():
            report()
            if (out_dir / "failed.json").exists():
                err = json.loads((out_dir / "failed.json").read_text())
                raise FlowerError(f"the federation's ServerApp failed: {err['error']}")
            if link.popen.poll() is not None:
                raise FlowerError(f"the SuperLink exited with {link.popen.returncode}; see {link.log}")
            if time.time() > end:
                raise FlowerError(f"the federation did not finish in {timeout_s:.0f} s; logs under "
                                  f"{self.workdir / 'logs'} and {self.workdir / 'flwr-home'}")
            time.sleep(0.1)
        report()


def read_outputs(out_dir: Path) -> CollabResult:
    """The result the ServerApp left in ``out_dir``."""
    with np.load(out_dir / "final.npz") as z:
        params = {k: z[k] for k in z.files}
    rounds = [RoundRecord.from_dict(json.loads(line)) for line in (out_dir / "rounds.jsonl").read_text().splitlines()]
    timing = [json.loads(x) for x in (out_dir / "timing.jsonl").read_text().splitlines()]
    pruning = None
    if (out_dir / "pruning.json").exists():  # a pruning job: its plan, masks, and the full-size model at the cut
        pruning = json.loads((out_dir / "pruning.json").read_text())
        if (out_dir / "pruning_cut.npz").exists():
            with np.load(out_dir / "pruning_cut.npz") as z:
                pruning["cut_params"] = {k: z[k] for k in z.files}
    return CollabResult(params, tuple(rounds), tuple(timing), pruning)


def write_center_data(workdir: Path, data: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, Path | str]:
    paths: dict[str, Path | str] = {}
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    for name, (x, y) in data.items():
        paths[name] = workdir / "data" / f"{name}.npz"
        np.savez(paths[name], x=x, y=y)
    return paths


def run_flower(config: CollabConfig, data: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None, *,
               workdir: str | Path | None = None, eval_data: tuple[np.ndarray, np.ndarray] | None = None,
               warm: bool = True, timeout_s: float = 600.0, poll_s: float = 0.05,
               supernode_poll_s: float | None = 0.25, supernode_wait_s: float | None = 0.02,
               pull_backoff_s: float | None = 0.02, superlink_database: str | None = None,
               pack_arrays: bool = True, credentials: Credentials | None = None, data_channel: str = "flower",
               on_round: Callable[[RoundRecord], None] | None = None,
               root_data: tuple[np.ndarray, np.ndarray] | None = None) -> CollabResult:
    """Run the federation with Flower on 127.0.0.1 and return what the ServerApp fused.

    Args:
        config: the job; data: center name -> ``(x, y)`` (written to one file per center, read only
            by that center's SuperNode) for the centers without a data source of their own
            (``CenterSpec.data``: the SuperNode loads it, nothing is written).
        workdir: where FLWR_HOME, logs and outputs go (a temporary directory, removed after, if None).
        eval_data: held-out ``(x, y)`` evaluated by the server after each round.
        warm: long-lived ClientApp executors (see the module docstring).
        timeout_s: limit for the whole run; every process is stopped when it passes.
        poll_s: the ServerApp's and executors' polling interval.
        supernode_poll_s, supernode_wait_s, pull_backoff_s, superlink_database, pack_arrays, data_channel:
            Flower's fixed waits, the SuperLink's store, the message layout and the path of the rounds'
            arrays, see :class:`LoopbackFederation`.
        credentials: run with TLS and SuperNode authentication (see :func:`~._security.make_credentials`).
        on_round: called with each round's record as the ServerApp writes it (progress).
        root_data: the server's own ``(x, y)`` root set (FLTrust), read by the ServerApp only.
    """
    check_data(config, data)
    if data_channel not in ("flower", "socket"):
        raise ValueError(f"data_channel must be 'flower' or 'socket', got {data_channel!r}")
    if config.prune is not None:  # the ServerApp traces the model on zeros shaped like a center's rows
        config = with_input_of(config, next((x for x, _ in (data or {}).values()),
                                            eval_data[0] if eval_data is not None else None))
    late = [c.name for c in config.centers if c.joins_after]
    if late:
        raise ValueError(f"centers {late} join after the start (joins_after), an emulation of the in-process engine; "
                         "over Flower a center joins by starting its SuperNode later: use engine='inprocess'")
    if config.buffer and (data_channel != "socket" or config.holdout > 0):
        raise ValueError(f"buffered asynchronous rounds (buffer={config.buffer}) over Flower run on the lean data "
                         "channel, without the centers' held-out evaluation (their connections are busy training): use "
                         "data_channel='socket' (--data-channel socket) and holdout=0 (eval_data evaluates on the "
                         "server), engine='inprocess' or buffer=0")
    if config.overlap and data_channel != "socket":
        raise ValueError(f"overlapped fusion (overlap={config.overlap}) over Flower runs on the lean data channel: "
                         "use data_channel='socket' (--data-channel socket), engine='inprocess' or overlap=0")
    # the Flower processes import these with this process's import path: fail here, before starting them
    if config.model.user:
        resolve_reference(config.model.kind)
    for c in config.centers:
        if c.data:
            resolve_reference(c.data, "data source")
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="ppcollab-"))
        wd = Path(workdir).resolve()
        paths = write_center_data(wd, data or {})
        paths.update({c.name: "" for c in config.centers if c.data})  # the center loads its own
        ev, root = None, None
        if eval_data is not None:
            ev = wd / "data" / "_eval.npz"
            np.savez(ev, x=eval_data[0], y=eval_data[1])
        if root_data is not None:
            root = wd / "data" / "_root.npz"
            np.savez(root, x=root_data[0], y=root_data[1])
        out = wd / "out"
        fed = stack.enter_context(LoopbackFederation(
            wd, paths, warm=warm, executor_poll_s=poll_s, supernode_poll_s=supernode_poll_s,
            supernode_wait_s=supernode_wait_s, pull_backoff_s=pull_backoff_s, superlink_database=superlink_database,
            pack_arrays=pack_arrays, credentials=credentials, data_channel=data_channel))
        fed.submit(config, out, eval_data=ev, poll_s=poll_s, root_data=root)
        try:
            fed.wait(out, timeout_s, on_round)
        except FlowerError as e:
            raise FlowerError(f"{e}\n{fed.logs()}") from None
        return read_outputs(out)
