"""The element-wise passes of a step over parameter-sized state: the optimizer's update and gradient accumulation.

:func:`optimizer_seconds` prices ``T_opt``, the optimizer step of one stage after the backward
(:mod:`.step`'s docstring, "Step"): a streaming pass over the parameters, their gradients and the
optimizer state (``local · (3g + 2(b_master + s_opt))`` bytes fused, ``local · 4 · k_acc`` bytes
for torch's multi-tensor or single-tensor kernels), or on a calibrated CPU ``N·r(N) + n_t·c_t``
from the measured rates per element and per tensor (:func:`optimizer_element_time`), at least the
host's dispatch where that was measured. :func:`accumulation_seconds` prices what every
micro-batch's backward adds into the gradient accumulator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from polyparallel.ir import TRAINING_DTYPE_BYTES

from .compute import streaming_bandwidth
from .memory import OPTIMIZER_STATE_BYTES
from .op_profile import OpProfile
from .parallel_config import ParallelConfig
from .stage_layout import StageTerms

__all__ = ["FOREACH_ACCESSES", "OPTIMIZER_KERNELS", "accumulation_seconds", "optimizer_element_time",
           "optimizer_seconds"]

# kernels per parameter tensor of torch's single-tensor optimizer step (torch/optim/adam.py etc.):
# Adam: step += 1, lerp_, mul_ + addcmul_, sqrt / c + eps, addcdiv_
OPTIMIZER_KERNELS = {"adam": 9, "adamw": 10, "lamb": 12, "lion": 5, "sgd": 1, "sgd_momentum": 3}
# fp32 accesses per parameter of torch's multi-tensor (foreach) step, kernel by kernel
# (torch/optim/adam.py _multi_tensor_adam, not capturable): lerp_(m, g) 3, mul_(v) 2,
# addcmul_(v, g, g) 3, sqrt(v) 2, div_ 2, add_(eps) 2, addcdiv_(p, m, .) 4 = 18; AdamW's
# decoupled decay mul_(p) adds 2; SGD add_(p, g) 3, with momentum mul_/add_(buf) + add_(p) 8
FOREACH_ACCESSES = {"adam": 18, "adamw": 20, "lamb": 24, "lion": 10, "sgd": 3, "sgd_momentum": 8}


def optimizer_seconds(cfg: ParallelConfig, terms: StageTerms, s: int, local: float, dgrp_size: int,
                      prof: OpProfile | None, fsdp: tuple[float, ...] | None) -> float:
    """``T_opt`` of stage ``s``: the optimizer step over the ``local`` parameter elements this rank
    updates. ``dgrp_size``: the stage's data-parallel group (ZeRO shards over it); ``prof``: the
    device's measured profile of this model, if any; ``fsdp``: what that profile measured FSDP2 adding
    to a step (its third figure the optimizer's part)."""
    dt, params = terms.types[s], terms.params[s]
    gb = TRAINING_DTYPE_BYTES[cfg.dtype]
    master = 4 if gb < 4 else 0
    opt_bytes = local * (gb * 3 + 2 * (master + OPTIMIZER_STATE_BYTES.get(cfg.optimizer, 0)))
    if not cfg.fused_optimizer or dt.kind == "cpu":
        # torch's unfused step: the same kernels foreach runs (one tensor at a time on a CPU,
        # where the torch backend never asks for the fused kernel), each a pass over fp32 state
        opt_bytes = local * 4 * FOREACH_ACCESSES.get(cfg.optimizer, 18)
    t_opt = max(opt_bytes / streaming_bandwidth(dt), dt.launch_overhead) if params else 0.0
    rates = dict(dt.optimizer_element_rates).get(cfg.optimizer)
    if rates and params:
        # measured per element at the stage's own working set (in cache or in memory), not streamed
        t_opt = local * optimizer_element_time(rates, local)
    sharded_extra = 0.0
    if dt.kind == "cpu" and terms.param_tensors:
        # torch's CPU optimizers update tensor by tensor (no multi-tensor kernels there): each
        # parameter tensor costs ~k kernels at least at the kernel floor, plus DTensor's dispatch
        # per kernel for sharded ones (FSDP2 shards all of them, tensor parallelism its own).
        # Where calibration measured the step per tensor (on tensors too small for their kernels
        # to take time: the host's loop and dispatch), that host work runs in series with the
        # streaming on the one thread, so it adds to it
        k = OPTIMIZER_KERNELS.get(cfg.optimizer, 9)
        per_tensor = dict(dt.optimizer_tensor_overhead).get(cfg.optimizer)
        dtensors = terms.param_tensors[s] if cfg.zero_stage >= 1 and dgrp_size > 1 else terms.tp_param_tensors[s]
        n_t, dispatch = terms.param_tensors[s], k * dtensors * dt.sharded_op_overhead
        per_dtensor = dict(dt.optimizer_dtensor_overhead).get(cfg.optimizer)
        if per_tensor is None:
            t_opt = max(t_opt, k * n_t * dt.launch_overhead + dispatch)
        elif per_dtensor is not None:
            # measured per sharded tensor too: the whole host cost of a DTensor's update
            t_opt += (n_t - dtensors) * per_tensor + dtensors * per_dtensor
            sharded_extra = dtensors * (per_dtensor - per_tensor)
        else:
            t_opt += n_t * per_tensor + dispatch
            sharded_extra = dispatch
    ratio = prof.optimizer_ratio(cfg.world, cfg.optimizer) if prof is not None else None
    if ratio is not None:
        # the model's plain step as measured against its price (op_profile.py); what DTensors
        # add on top stays as the calibration measured it
        t_opt = ratio * (t_opt - sharded_extra) + (fsdp[2] if fsdp is not None else sharded_extra)
    host = dict((k, (a, b)) for k, a, b in dt.optimizer_host).get(
        f"{cfg.optimizer}/{'fused' if cfg.fused_optimizer else 'foreach'}")
    if host and terms.param_tensors and dt.kind != "cpu":
        # an accelerator's optimizer step is dispatched by the host (measured: a fixed part and a
        # part per tensor); the device cannot finish it sooner than the host enqueues it
        t_opt = max(t_opt, host[0] + host[1] * terms.param_tensors[s])
    return t_opt


def accumulation_seconds(cfg: ParallelConfig, terms: StageTerms, s: int, local: float, held: float) -> float:
    """Seconds per micro-batch's backward of stage ``s`` that adding its weight gradients into the
    accumulator takes: ``local`` elements this rank's optimizer updates, ``held`` those whose
    gradients it holds whole (all but ZeRO-2/3's shards)."""
    dt, m = terms.types[s], cfg.microbatches
    gb = TRAINING_DTYPE_BYTES[cfg.dtype]
    if cfg.grad_accumulation == "cast_add":
        # DeepSpeed's BF16_Optimizer, after every micro-batch's backward: the fresh 16-bit
        # gradient read and cast into a temporary fp32 tensor (gb + 4 bytes), which is added to
        # the fp32 buffer (both read, the buffer written: 3 x 4), the first micro-batch's included
        return (gb + 16) / streaming_bandwidth(dt) * (local if cfg.zero_stage >= 2 else held)
    # autograd adds every micro-batch's weight gradient after the first into .grad: on average
    # (m-1)/m of the stage's local gradient elements per micro-batch (calibrated CPUs measure it)
    rate = dt.grad_accumulation
    if not rate and dt.kind != "cpu":
        # uncalibrated accelerators: one streaming pass reading the new gradient at the compute
        # precision and reading and writing the accumulator at the reduction precision (torch's
        # AccumulateGrad on fp32 .grad; Megatron-LM's main_grad hook, megatron/model/distributed.py;
        # Llama 3's "FP32 gradient accumulation")
        rate = (gb + 2 * max(gb, 4)) / streaming_bandwidth(dt)
    return rate * (m - 1) / m * (local if cfg.zero_stage >= 2 else held)


def optimizer_element_time(rates: Sequence[tuple[float, float]], elements: float) -> float:
    """Seconds per parameter element of an optimizer step over ``elements`` elements.

    ``rates``: measured ``(elements, seconds per element)`` rows (``polyparallel calibrate``, by
    working-set size: in cache, in memory), interpolated linearly in ``log elements`` and
    clamped at both ends.
    """
    pts = sorted((math.log(e), r) for e, r in rates)
    return float(np.interp(math.log(max(elements, 1.0)), [x for x, _ in pts], [r for _, r in pts]))
