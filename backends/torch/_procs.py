"""The launcher's process tree: make it die with ``train()`` and kill all of it on any exit.

torch's elastic agent starts every worker with ``start_new_session=True``, so killing the agent's
process group leaves the workers running. Three mechanisms together leave nothing behind:

- the agent and every worker ask Linux to SIGKILL them when their parent dies
  (``prctl(PR_SET_PDEATHSIG)``, :func:`die_with_parent`): killing ``train()``'s process (even with
  SIGKILL, where no Python code runs) takes the agent with it, and the agent takes the workers;
- every worker records its PID and start time in ``RUN_DIR/pids/`` (:func:`record_pid`);
- :func:`kill_tree` SIGKILLs the agent's group, every descendant of the agent found in ``/proc``
  (processes that had not yet recorded their PID), every recorded PID still running the process
  that recorded it, and every process in a session or group one of those leads.

Only Linux has ``PR_SET_PDEATHSIG`` and ``/proc``; elsewhere the agent's group is killed only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["AGENT_PID_ENV", "LAUNCHER_PID_ENV", "alive", "die_with_parent", "free_port", "kill_tree", "record_pid",
           "recorded_pids"]

LAUNCHER_PID_ENV = "POLYPARALLEL_LAUNCHER_PID"  # set by train() for the agent
AGENT_PID_ENV = "POLYPARALLEL_AGENT_PID"  # set by the agent wrapper for its workers
_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent exits; exit at once if the parent
    ``expected_parent`` is already gone (it died before the request was made)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)  # orphaned between fork and prctl: the launcher is gone, so is the run


def _stat(pid: int) -> tuple[str, int, int, int, int] | None:
    """``(state, ppid, pgid, sid, start ticks)`` of ``pid`` from ``/proc``, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = text[text.rindex(")") + 2:].split()  # after "pid (comm) ", which may contain spaces
    return f[0], int(f[1]), int(f[2]), int(f[3]), int(f[19])


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a zombie holds no memory and runs nothing; it
    waits for its parent, or for init after the parent was killed, to reap it)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def record_pid(run_dir: Path, name: str) -> None:
    """Write ``RUN_DIR/pids/NAME.pid``: this process's PID and start time (so that a PID reused by
    an unrelated process later is never killed)."""
    d = run_dir / "pids"
    d.mkdir(parents=True, exist_ok=True)
    st = _stat(os.getpid())
    tmp = d / f".{name}.tmp"
    tmp.write_text(f"{os.getpid()} {st[4] if st else -1} {time.time():.6f}\n")
    os.replace(tmp, d / f"{name}.pid")


def recorded_pids(run_dir: Path) -> dict[int, int]:
    """PID -> start ticks of the processes recorded in ``RUN_DIR/pids``."""
    out = {}
    for p in sorted((run_dir / "pids").glob("*.pid")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid, start = p.read_text().split()[:2]
            out[int(pid)] = int(start)
    return out


def _table() -> dict[int, tuple[str, int, int, int, int]]:
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                procs[int(entry)] = st
    return procs


def _victims(root: int | None, recorded: dict[int, int]) -> set[int]:
    procs = _table()
    family: set[int] = set()
    if root is not None and root in procs:
        family.add(root)
        grew = True
        while grew:
            kids = {p for p, st in procs.items() if st[1] in family} - family
            family |= kids
            grew = bool(kids)
    family |= {p for p, start in recorded.items() if p in procs and procs[p][4] == start}
    # children a worker started after the scan above are in its session (workers lead one each)
    family |= {p for p, st in procs.items() if st[2] in family or st[3] in family}
    me, mine = os.getpid(), set()
    while me > 1 and me in procs:  # never this process or its ancestors
        mine.add(me)
        me = procs[me][1]
    return family - mine


def kill_tree(root: int | None, recorded: Iterable[tuple[int, int]] = (), wait_s: float = 5.0) -> list[int]:
    """SIGKILL ``root`` (a running, not yet reaped child: the agent), its process group, its
    descendants and the recorded ``(pid, start ticks)`` processes still running; wait up to
    ``wait_s`` for them to be gone; return the PIDs still alive after that (normally none).

    ``root=None`` (the agent has exited and was reaped, so its PID may be reused) kills only the
    recorded processes and their sessions.
    """
    rec = dict(recorded)
    if root is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(root, signal.SIGKILL)
    if not sys.platform.startswith("linux"):
        return []
    killed: set[int] = set()
    for _ in range(3):  # a process forked between the scan and the kill is found by the next scan
        new = _victims(root, rec) - killed
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed |= new
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(alive(p) for p in killed):
        time.sleep(0.02)
    return sorted(p for p in killed if alive(p))


def free_port() -> int:
    """A TCP port free on the loopback interface now (for a rendezvous or a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
