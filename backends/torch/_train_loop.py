"""The training loop every torch worker runs, whatever the parallel layout.

Resume from the latest checkpoint, then per step: the global batch from ``data_fn(step)``, this
rank's share of it, the forward and backward, the optimiser step, rank 0's line in ``train.jsonl``,
the stop on a non-finite loss and the periodic checkpoint. What differs between layouts is a
:class:`TrainingMode`: the whole model on every rank (``_worker``: DP / FSDP2, TP, Ulysses SP, EP,
gradient accumulation) or this rank's pipeline chunks and their schedule (``_pipeline``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

from polyparallel.backends.torch._checkpoint import resume, save_checkpoint
from polyparallel.backends.torch._precision import Precision
from polyparallel.backends.torch._steps import (
    batch_counts,
    check_finite,
    comm_profile,
    finish_step,
    log_step,
    memory_profile,
)
from polyparallel.references import resolve

__all__ = ["TrainingMode", "train"]

Batch = tuple[torch.Tensor, torch.Tensor]


def _no_fields(x: torch.Tensor) -> dict[str, Any]:
    return {}


@dataclass
class TrainingMode:
    """What one parallel layout brings to :func:`train`.

    ``model``: the parameters this rank holds and a checkpoint saves (under their model paths);
    ``opt`` steps them through ``prec``'s gradient scaler. ``share(inputs, labels)``: this rank's part
    of a global batch, on its device. ``forward_backward(x, y)``: one step's gradients on that part,
    reduced as the layout needs; returns the step's global loss and its weighting
    (``_loss_weighting``), the same on every rank. ``optim_key``: the optimiser's checkpoint key.
    ``log_first(x)`` and ``log_last``: rank 0's extra log fields, before and after the common ones.
    """

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    prec: Precision
    share: Callable[[torch.Tensor, torch.Tensor], Batch]
    forward_backward: Callable[[torch.Tensor, torch.Tensor], tuple[float, str]]
    optim_key: str = "optim"
    log_first: Callable[[torch.Tensor], dict[str, Any]] = _no_fields
    log_last: dict[str, Any] = field(default_factory=dict)


def _compiled(plan: Any) -> dict[str, Any]:
    """With ``compile="regional"``: the graphs torch.compile has built in this process so far
    (``compiled_graphs``; 0 would mean every region fell back to eager)."""
    if plan.compile != "regional":
        return {}
    return {"compiled_graphs": int(counters["stats"]["unique_graphs"])}


def train(job: dict[str, Any], run_dir: Path, rank: int, device: torch.device, mode: TrainingMode) -> Iterator[int]:
    """Train ``mode`` for ``job["steps"]`` steps, from the checkpoint if there is one; yields each
    step index as it starts (a failing rank's report names it)."""
    data_fn = resolve(job["data_fn"])
    global_batch = job["plan"].global_batch
    log = run_dir / "train.jsonl"
    ckpt = Path(job["checkpoint_dir"]) if job.get("checkpoint_dir") else None
    start = resume(ckpt, mode.model, mode.opt, log if rank == 0 else None, mode.optim_key)
    for step in range(start, job["steps"]):
        yield step
        inputs, labels = data_fn(step)
        if inputs.shape[0] != global_batch:
            raise ValueError(f"data_fn({step}) returned a batch of {inputs.shape[0]}; the strategy's global_batch is "
                             f"{global_batch}")
        x, y = mode.share(inputs, labels)
        if device.type == "cuda":
            torch.cuda.synchronize()
        with comm_profile(bool(job.get("profile_comm"))) as comm, \
                memory_profile(bool(job.get("profile_memory")), mode.model, mode.opt, device) as mem:
            t0 = time.perf_counter()
            mode.opt.zero_grad(set_to_none=True)
            global_loss, weighting = mode.forward_backward(x, y)
            amp, dt = finish_step(mode.prec, mode.opt, device, t0)
        if rank == 0:
            log_step(log, step, global_loss, weighting, dt, device, **mode.log_first(x), **batch_counts(inputs),
                     **comm, **mem, **amp, **_compiled(job["plan"]), **mode.log_last)
        check_finite(global_loss, step, job.get("stop_on_nonfinite", True))
        if ckpt is not None and ((step + 1) % job["checkpoint_every"] == 0 or step + 1 == job["steps"]):
            save_checkpoint(ckpt, step, mode.model, mode.opt, rank, mode.optim_key, job=job)
