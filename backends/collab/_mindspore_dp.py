"""A MindSpore center with several devices: data parallelism over ranks launched by ``msrun``.

:class:`MindSporeDataParallelTrainer` starts MindSpore's own launcher once per center,
``msrun --worker_num=P --local_worker_num=P ... _mindspore_dp_worker.py``, which starts a scheduler and ``P`` ranks
that join MindSpore's communication (MCCL on CPU). Each rank connects back to this trainer over an
authenticated loopback connection, receives the model spec, the center's data and its SGD settings,
and then serves one request per round (:mod:`._mindspore_dp_worker`): load the global parameters, take ``H`` SGD
steps on its share of each global batch with gradients averaged over the ranks, send the model back
(rank 0). Start-up (msrun, the imports, the rendezvous) is paid once per center, not once per round.

Equivalence with the one-process MindSpore center: round ``t`` draws the same global batches
``I_1..I_H`` (``batch_indices``); rank ``r`` takes ``I_s[r·B/P : (r+1)·B/P]`` and the mean of the
ranks' gradients of their share means is ``∇ (1/B) Σ_{i∈I_s} ℓ_i``, the one-process gradient; the SGD
step (momentum fresh each round, FedProx term identical on every rank) is then the same on every rank.
Equal up to summation order (measured ≤ 1e-6, tests/test_mindspore_center.py).

What MindSpore 2.10 on CPU runs, and so what a MindSpore center's plan may say: data parallelism
(``dp = P``). Tensor and pipeline parallelism are MindSpore's ``semi_auto_parallel`` mode, whose
graph compiler accepts only Ascend and GPU ("Invalid communication backend: CPU"); the parallel
optimizer (ZeRO) is part of the same mode. Such plans are refused with that reason; ``polyparallel
export`` writes their configuration for an Ascend/GPU MindSpore cluster.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import numpy as np

from polyparallel.backends.collab._center import evaluate_torch
from polyparallel.backends.collab._rank_center import RankedCenter
from polyparallel.backends.torch._procs import free_port
from polyparallel.references import import_path

__all__ = ["MindSporeDataParallelTrainer", "check_mindspore_plan"]

WORKER = Path(__file__).with_name("_mindspore_dp_worker.py")


def check_mindspore_plan(plan: Mapping[str, Any] | None, devices: int, center: str = "") -> None:
    """ValueError naming the fix for a plan a MindSpore center on CPU does not run (see the module docstring)."""
    plan = dict(plan or {})
    who = f"center {center!r}" if center else "MindSpore center"
    why = []
    for k in ("tp", "pp", "sp"):
        if int(plan.get(k, 1)) != 1:
            why.append(f"{k}={plan[k]}")
    if int(plan.get("zero_stage", 0)):
        why.append(f"zero_stage={plan['zero_stage']}")
    if why:
        raise ValueError(f"{who} cannot run {', '.join(why)}: tensor, pipeline and optimizer sharding are MindSpore's "
                         "semi_auto_parallel mode, which MindSpore 2.10 compiles for Ascend and GPU only (on CPU: "
                         "'Invalid communication backend: CPU'); a MindSpore center runs dp over its "
                         f"{devices} devices — use dp={devices}, or `polyparallel export` the plan for an Ascend/GPU "
                         "MindSpore cluster")
    dp = int(plan.get("dp", devices))
    if dp != devices:
        raise ValueError(f"{who}: dp={dp} but the center has {devices} devices; a MindSpore center runs dp={devices}")


def _msrun() -> str:
    """msrun of this Python's environment (it starts its ranks with ``python`` from PATH)."""
    here = Path(sys.executable).parent / "msrun"
    found = str(here) if here.exists() else shutil.which("msrun")
    if not found:
        raise ValueError("msrun (MindSpore's launcher) is not installed: pip install 'polyparallel[mindspore]'")
    return found


def _stop(proc: subprocess.Popen, conns: list[Any], log_dir: str) -> None:
    for c in conns:
        with contextlib.suppress(OSError, ValueError):
            c.send(("stop",))
            c.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # msrun and its ranks are one process group, started by this trainer
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    shutil.rmtree(log_dir, ignore_errors=True)


@dataclass
class MindSporeDataParallelTrainer(RankedCenter):
    """Local SGD of one MindSpore center over ``devices`` msrun ranks (see the module docstring). The
    global batch ``min(batch_size, len(x))`` must divide evenly over the ranks. Call :meth:`close`."""

    plan: Mapping[str, Any] | None = None
    startup_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.devices < 2:
            raise ValueError(f"a data-parallel MindSpore center needs devices >= 2, got {self.devices}")
        check_mindspore_plan(self.plan, self.devices, str(self.center_index))
        if not self.model_spec.user and self.model_spec.kind == "cnn" and self.model_spec.norm == "batch":
            raise ValueError(f"center {self.center_index}: the built-in cnn has BatchNorm, which the ranks of a "
                             "data-parallel MindSpore center would compute on their own shares (cross-rank BatchNorm "
                             "is not implemented for MindSpore centers); use norm='group', devices=1 or torch")
        b = min(self.batch_size, len(self.x))
        if b % self.devices:
            raise ValueError(f"center {self.center_index}: its global batch {b} does not split evenly over "
                             f"{self.devices} MindSpore ranks; use a batch_size divisible by {self.devices}")
        self._start()

    def _start(self) -> None:
        t0 = time.perf_counter()
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        self._log_dir = tempfile.mkdtemp(prefix="polyparallel-ms-center-")
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               "POLYPARALLEL_MS_CENTER": f"127.0.0.1:{listener.address[1]}", "POLYPARALLEL_MS_KEY": key.hex(),
               "PYTHONPATH": import_path()}
        cmd = [_msrun(), f"--worker_num={self.devices}", f"--local_worker_num={self.devices}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", f"--log_dir={self._log_dir}",
               "--join=True", str(WORKER)]
        self._proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conns, self._log_dir)
        conns: dict[int, Any] = {}
        accepted: list[Any] = []

        def accept() -> None:
            with contextlib.suppress(OSError):
                for _ in range(self.devices):
                    accepted.append(listener.accept())

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        end = time.time() + self.timeout_s
        while t.is_alive() and time.time() < end and self._proc.poll() is None:
            t.join(0.2)
        listener.close()
        if len(accepted) < self.devices:
            self.close()
            raise RuntimeError(f"MindSpore center {self.center_index}: {len(accepted)} of {self.devices} msrun ranks "
                               f"connected ({self._why()})")
        for c in accepted:
            _, rank = c.recv()
            conns[rank] = c
        self._conns[:] = [conns[r] for r in range(self.devices)]
        payload = {"center_index": self.center_index, "batch_size": self.batch_size, "lr": self.lr,
                   "momentum": self.momentum, "seed": self.seed, "lr_schedule": self.lr_schedule,
                   "rounds": self.rounds, "logit_adjust": self.logit_adjust}
        for c in self._conns:
            c.send((self.model_spec.to_json(), self.x, self.y, payload))
        for r in range(self.devices):
            self._recv(r, "start")
        self.startup_s = time.perf_counter() - t0

    def _why(self) -> str:
        code = self._proc.poll()
        logs = sorted(Path(self._log_dir).glob("worker_*.log"))
        tail = ""
        for log in logs:
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln]
            if lines:
                tail = f"; {log.name}: {lines[-1].strip()}"
                break
        return (f"msrun exited with {code}" if code is not None else f"no answer within {self.timeout_s:.0f} s") + tail

    def _dead(self, rank: int) -> str | None:
        return self._why() if self._proc.poll() is not None else None

    def _late(self, rank: int) -> str:
        return self._why()

    def evaluate(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        return evaluate_torch(self.model_spec, params, x, y)
