"""The launcher's agent: torch.distributed.run, started before it is needed and dying with the
``train()`` process that started it (:mod:`._procs`); on Linux it forks its ranks instead of
starting a Python per rank.

``train()`` starts the agent (:func:`start`, ``python -m polyparallel.backends.torch._agent``)
as it begins its pre-launch checks, so that the agent's imports overlap the model capture; the CLI
starts it even before importing torch (:func:`prestart`). The agent imports what the ranks need
and waits for one line on stdin (:func:`go`): torch.distributed.run's arguments and the log file
to write to from then on. If ``train()`` refuses the run, it kills the agent, which has written
nothing and started nothing.

A rank started as ``python -m ..._entry`` imports torch, torch.distributed, DTensor and, at its
first DDP/FSDP wrap, torch._dynamo again in every process (~4-5 s on 2 cores, the largest part of a
tiny run's launch). Here the agent imports them once, then has torch's elastic launcher fork the
ranks (``start_method="fork"``) and call :func:`._entry.main` in each: the agent has run no tensor
op and started no thread pool that a forked child would inherit, and CUDA is initialised only in
the ranks. Rendezvous, restarts, the failure summary and the per-rank environment are
torch.distributed.run's own. ``POLYPARALLEL_WORKER_START=exec`` (and any platform but Linux)
starts each rank with its own interpreter as torch.distributed.run does by default.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from polyparallel.backends.torch._entry import main
from polyparallel.backends.torch._procs import AGENT_PID_ENV, LAUNCHER_PID_ENV, die_with_parent

__all__ = ["discard", "go", "prestart", "start", "take", "worker_env"]

WORKER_START_ENV = "POLYPARALLEL_WORKER_START"
ENTRY = "polyparallel.backends.torch._entry"
# what every rank imports, imported once in the agent (the ranks inherit them through fork);
# DistributedDataParallel and fully_shard import torch._dynamo on first use
PRELOAD = ("polyparallel.backends.torch._worker", "polyparallel.backends.torch._plan",
           "polyparallel.backends.torch._tensor_parallel", "polyparallel.backends.torch._checkpoint", ENTRY,
           "torch._dynamo")
_warm: tuple[subprocess.Popen[bytes], dict[str, str]] | None = None


def worker_env() -> dict[str, str]:
    """The agent's (and ranks') environment: this one, with this process's ``sys.path`` (the ranks
    import whatever the caller could, e.g. a test module's functions), one OpenMP thread unless
    set, unbuffered output (launcher.log gets every line as it is printed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    return env


def start(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start an agent that imports what the ranks need, then waits for :func:`go`. Its output
    until then goes to a pipe (:func:`go` copies it into the log). Its own session: a Ctrl-C in the
    terminal reaches only ``train()``, which then kills the tree."""
    return subprocess.Popen([sys.executable, "-m", "polyparallel.backends.torch._agent"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def prestart() -> None:
    """Start an agent now for the next :func:`take` in this process (the CLI, before it imports torch)."""
    global _warm
    env = worker_env()
    _warm = (start(env), env)


def discard() -> None:
    """Kill the agent :func:`prestart` started, if no :func:`take` took it."""
    global _warm
    warm, _warm = _warm, None
    if warm is not None:
        warm[0].kill()
        warm[0].wait()


def take(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The agent :func:`prestart` started, if it runs with ``env``; else a new one."""
    global _warm
    warm, _warm = _warm, None
    if warm is not None:
        agent, its_env = warm
        if its_env == env and agent.poll() is None:
            return agent
        agent.kill()
        agent.wait()
    return start(env)


def go(agent: subprocess.Popen[bytes], argv: list[str], log: Path) -> None:
    """Have ``agent`` run ``torch.distributed.run ARGV``, its output (and the ranks') appended to
    ``log``; what it printed before is copied there too. OSError (BrokenPipeError) if it died."""
    assert agent.stdin is not None and agent.stdout is not None
    agent.stdin.write((json.dumps({"argv": argv, "log": str(log)}) + "\n").encode())
    agent.stdin.close()
    out = agent.stdout

    def copy() -> None:  # until the agent points its output at the log (EOF here)
        with out, log.open("ab") as f:
            while chunk := out.read1(65536):
                f.write(chunk)
                f.flush()

    threading.Thread(target=copy, name="agent-output", daemon=True).start()


def _forking(config_from_args: Any) -> Any:
    """torch.distributed.run's ``config_from_args``, with the ranks forked to :func:`._entry.main`."""

    def config(args: Any) -> Any:
        cfg, cmd, cmd_args = config_from_args(args)
        if args.module and args.training_script == ENTRY:
            cfg.start_method = "fork"
            return cfg, main, list(args.training_script_args)
        return cfg, cmd, cmd_args

    return config


def _serve() -> None:
    fork = sys.platform.startswith("linux") and os.environ.get(WORKER_START_ENV, "fork") == "fork"
    if fork:
        import torch.distributed.run as tdr

        for name in PRELOAD:
            importlib.import_module(name)
    line = sys.stdin.readline()
    if not line:  # train() refused the run, or is gone
        return
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if fork:
        tdr.config_from_args = _forking(tdr.config_from_args)
        tdr.main(request["argv"])
    else:
        sys.argv = ["torch.distributed.run", *request["argv"]]
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    die_with_parent(int(launcher) if launcher else None)
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    _serve()
