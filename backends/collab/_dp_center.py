"""Data parallelism inside a center: its local steps run as torch DDP over the center's devices.

A center with ``devices = P > 1`` keeps ``P`` long-lived worker processes (one per device; gloo on
CPU) that form a ``torch.distributed`` group and wrap the shared model in
``DistributedDataParallel`` — the execution the torch backend gives a strategy's ``dp`` axis with
ZeRO stage 0. The workers start once, with the center's data, and then serve one request per round:
load the global parameters, take ``H`` SGD steps, send the local model back. Process start-up, the
torch import and the process-group rendezvous are paid once per center, not once per round.

Equivalence with the single-process :class:`~._center.TorchTrainer`. Round ``t`` draws the same
global batches ``I_1..I_H`` (:func:`~._center.batch_indices`, ``|I_s| = B``); rank ``r`` takes the
contiguous share ``I_s[r·B/P : (r+1)·B/P]``. DDP all-reduces gradients with a mean, so with equal
shares the step direction is ``(1/P) Σ_r ∇ (1/(B/P)) Σ_{i∈share_r} ℓ_i = ∇ (1/B) Σ_{i∈I_s} ℓ_i``, the
single-process gradient. FedProx's ``mu/2 ||w − x||²`` is added on every rank and averages to itself.
BatchNorm must normalise with the statistics of the *global* batch for the same to hold, so every
BatchNorm takes its batch statistics over all ranks, as the torch backend's data parallelism does
(:func:`polyparallel.backends.torch._batchnorm.use_cross_rank_batchnorm`: mean and biased variance
of the global batch through a differentiable all-reduce, running statistics updated identically on
every rank). The result equals single-process training up to floating-point summation order.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np

from ._center import CenterData, evaluate_torch
from ._models import ModelSpec

__all__ = ["DataParallelTrainer"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, init_method: str, conn: Any, spec_json: str, x: np.ndarray, y: np.ndarray,
            center: Mapping[str, Any]) -> None:
    """One device of the center: join the group, wrap the model in DDP, serve rounds until told to stop."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from polyparallel.backends.torch._batchnorm import use_cross_rank_batchnorm

    from ._center import batch_indices, local_sgd
    from ._models import build_torch_model, load_torch_state, torch_state

    try:
        torch.set_num_threads(int(center["threads"]))
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=float(center["timeout_s"])))
        stats_group = dist.new_group(backend="gloo")  # BatchNorm's collectives apart from DDP's buckets
        spec = ModelSpec.from_json(spec_json)
        model = build_torch_model(spec, int(center["seed"]))
        use_cross_rank_batchnorm(model, stats_group, world)
        # buffers (BatchNorm statistics) are equal on every rank by construction: no per-step broadcast
        ddp = DistributedDataParallel(model, forward_sync_buffers=False)
        xt = torch.from_numpy(np.ascontiguousarray(x))
        yt = torch.from_numpy(np.ascontiguousarray(y)).long()
        conn.send(("ready", rank))
    except BaseException as e:  # the parent reports it; the peers time out of the rendezvous
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    b = min(int(center["batch_size"]), len(x))
    share = b // world
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the center process is gone: leave with it
            break
        if msg[0] == "stop":
            break
        try:
            _, params, steps, round_idx, proximal_mu, lr = msg
            load_torch_state(model, params)
            model.train()
            opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=float(center["momentum"]))
            batches = (idx[rank * share:(rank + 1) * share] for idx in batch_indices(
                len(x), int(center["batch_size"]), steps, int(center["seed"]), int(center["center_index"]), round_idx))
            losses = local_sgd(model, ddp, opt, xt, yt, batches, proximal_mu, logit_bias=center["logit_bias"])
            # DDP keeps the replicas identical: rank 0 alone sends the model back
            conn.send(("done", torch_state(model) if rank == 0 else None, losses))
        except BaseException as e:
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))
            break
    with contextlib.suppress(Exception):  # a peer already left; nothing to tear down cleanly
        dist.destroy_process_group()


def _stop(procs: list[Any], conns: list[Any]) -> None:
    for c in conns:
        with contextlib.suppress(OSError, ValueError):  # the worker is already gone
            c.send(("stop",))
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    for c in conns:
        c.close()


@dataclass
class DataParallelTrainer(CenterData):
    """Local SGD of one center as DDP over ``devices`` long-lived worker processes (see module docstring).

    The global batch ``batch_size`` (or the whole center's data when it is smaller) must divide evenly
    over the devices. Call :meth:`close` (or use it as a context manager) to stop the workers; they
    also leave when this process exits.
    """

    devices: int = 2
    threads: int = 1
    timeout_s: float = 300.0
    _procs: list[Any] = field(default_factory=list, init=False, repr=False)
    _conns: list[Any] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.devices < 2:
            raise ValueError(f"DataParallelTrainer needs devices >= 2, got {self.devices} (use TorchTrainer)")
        b = min(self.batch_size, len(self.x))
        if b % self.devices:
            raise ValueError(f"center {self.center_index}: global batch {b} does not split evenly over "
                             f"{self.devices} devices; choose batch_size a multiple of {self.devices}")
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")  # fork after torch threads exist is unsafe; spawn is clean
        init = f"tcp://127.0.0.1:{_free_port()}"
        center = {"seed": self.seed, "center_index": self.center_index, "batch_size": self.batch_size,
                  "momentum": self.momentum, "threads": self.threads, "timeout_s": self.timeout_s,
                  "logit_bias": self.logit_bias()}  # from the whole center's labels, as one process would
        for rank in range(self.devices):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, name=f"collab-dp{self.center_index}-r{rank}", daemon=True,
                            args=(rank, self.devices, init, child, self.model_spec.to_json(), self.x, self.y, center))
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns)
        for rank in range(self.devices):
            self._recv(rank, "start")

    def _recv(self, rank: int, what: str) -> tuple:
        conn, proc = self._conns[rank], self._procs[rank]
        end = time.time() + self.timeout_s
        while not conn.poll(0.1):
            if not proc.is_alive():
                self.close()
                raise RuntimeError(f"data-parallel worker rank {rank} of center {self.center_index} died "
                                   f"(exit code {proc.exitcode}) during {what}")
            if time.time() > end:
                self.close()
                raise RuntimeError(f"data-parallel worker rank {rank} of center {self.center_index} did not "
                                   f"answer within {self.timeout_s:.0f} s during {what}")
        msg = conn.recv()
        if msg[0] == "error":
            self.close()
            raise RuntimeError(f"data-parallel worker of center {self.center_index} failed during {what}: {msg[1]}")
        return msg

    def train(self, global_params: Mapping[str, np.ndarray], *, steps: int, round_idx: int,
              proximal_mu: float = 0.0) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        if not self._procs:
            raise RuntimeError("this DataParallelTrainer was closed")
        params = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in global_params.items()}
        for conn in self._conns:
            conn.send(("round", params, steps, round_idx, float(proximal_mu), self.lr_at(round_idx)))
        replies = [self._recv(r, f"round {round_idx}") for r in range(self.devices)]
        local = replies[0][1]
        # each rank's loss is the mean over its equal share: the global-batch loss is their mean
        loss = float(np.mean([np.mean(r[2]) for r in replies]))
        return local, {"train_loss": loss}

    def evaluate(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        return evaluate_torch(self.model_spec, params, x, y, threads=self.threads)

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self._procs:
            self._finalizer()
            self._procs, self._conns = [], []

    def __enter__(self) -> DataParallelTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

