"""One training step's bookkeeping, for the training loop (``_train_loop``) and the layouts' steps: the
optimiser, scaling gradients by the loss weighting, finishing a step (scaler, device sync, seconds),
what rank 0 logs per step, and the collectives' time as torch's profiler records it."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

__all__ = ["NonFiniteLoss", "batch_counts", "check_finite", "comm_profile", "finish_step", "log_step",
           "make_optimizer", "scale_gradients"]


class NonFiniteLoss(ArithmeticError):
    """A step's loss is NaN or infinite: every later step would train on it."""


def check_finite(loss: float, step: int, stop: bool) -> None:
    """Raise :class:`NonFiniteLoss` when ``loss`` (the step's global loss, the same on every rank,
    so the ranks stop together) is not finite and ``stop``."""
    if stop and not math.isfinite(loss):
        raise NonFiniteLoss(f"the loss of step {step} is {loss}: lower the learning rate, look for NaN/inf in the "
                            "data (or a batch whose targets are all ignored), or pass stop_on_nonfinite=False "
                            "(CLI: --keep-nonfinite) to train on")


def scale_gradients(params: Any, factor: float) -> None:
    """Multiply the gradients of ``params`` by ``factor`` (a step's loss weighting, ``_loss_weighting``)."""
    if factor == 1.0:
        return
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)


def finish_step(prec: Any, opt: torch.optim.Optimizer, device: torch.device, t0: float) -> tuple[dict[str, Any], float]:
    """The optimizer step (through the precision's gradient scaler) and the step's seconds since
    ``t0``, the device synchronised; returns the scaler's log fields and the seconds."""
    amp = prec.step(opt)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return amp, time.perf_counter() - t0


def log_step(log: Path, step: int, loss: float, weighting: str, seconds: float, device: torch.device,
             **fields: Any) -> None:
    """Append rank 0's record of one step to ``train.jsonl`` (the launcher streams it as progress)."""
    rec = {"step": step, "loss": loss, "loss_weighting": weighting, "step_time_s": seconds, "device": device.type,
           "backend": dist.get_backend(), **fields}
    with log.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def make_optimizer(name: str, params: Any, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """torch's ``sgd``/``adam``/``adamw``; on CUDA its fused kernel (one pass over every state, as the
    cost model prices a GPU's optimizer step) unless a parameter is sharded (DTensor: foreach)."""
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    params = list(params)
    if device.type == "cuda" and not any(isinstance(p, DTensor) for p in params):
        return cls(params, lr=lr, fused=True)
    return cls(params, lr=lr)


@contextlib.contextmanager
def comm_profile(enabled: bool) -> Iterator[dict[str, Any]]:
    """Collect what torch's profiler records of collectives in the block into the yielded dict
    (``comm_s``: summed durations of ``gloo:*``/``nccl:*`` events; ``comm_ops``: their counts)."""
    rec: dict[str, Any] = {}
    if not enabled:
        yield rec
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield rec
    events = [e for e in prof.key_averages() if e.key.startswith(("gloo:", "nccl:"))]
    rec["comm_s"] = sum(e.cpu_time_total for e in events) * 1e-6
    rec["comm_ops"] = {e.key: e.count for e in events}


@contextlib.contextmanager
def memory_profile(enabled: bool, model: torch.nn.Module, opt: torch.optim.Optimizer,
                   device: torch.device) -> Iterator[dict[str, Any]]:
    """Record the block's peak tensor memory on this rank in the yielded dict (``peak_memory_bytes``):
    the CUDA allocator's peak, or on the CPU what torch's ``MemTracker`` counts (every live storage,
    the model's and optimizer's included)."""
    rec: dict[str, Any] = {}
    if not enabled:
        yield rec
        return
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield rec
        rec["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
        return
    from torch.distributed._tools.mem_tracker import MemTracker  # (torch's private tool: loaded when asked for)

    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        yield rec
    rec["peak_memory_bytes"] = int(sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values()))


def batch_counts(inputs: torch.Tensor) -> dict[str, int]:
    """What one step of the global batch ``inputs`` trains on, for throughput: ``samples`` (its
    rows) and, for token ids (integer inputs with a sequence dim), ``tokens``."""
    counts = {"samples": int(inputs.shape[0])}
    if inputs.dim() >= 2 and not inputs.is_floating_point() and not inputs.is_complex():
        counts["tokens"] = inputs.numel()
    return counts
