"""Mixed precision as the cost model prices it: low-precision compute, fp32 master weights and optimizer state.

The strategy's ``dtype`` decides (:data:`.capabilities.EXECUTED_DTYPES`):

* ``"fp32"``: nothing changes;
* ``"bf16"``: the forward (and the loss) runs under ``torch.autocast(dtype=torch.bfloat16)``, which
  computes matmuls, convolutions and attention in bf16 and keeps the ops autocast lists as
  precision-sensitive (softmax, cross entropy, ...) in fp32. Parameters stay fp32: they are the
  master weights, their gradients are fp32 and the optimizer's state is fp32, as the memory model
  counts them (2-byte weights + 2-byte gradients + 4-byte master copy = the 8 bytes per parameter of
  fp32 weights and gradients). Where FSDP2 shards the parameters (``zero_stage >= 1``), its
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` all-gathers them in bf16 (the
  2-byte weights the step model moves) and reduce-scatters gradients in fp32 into fp32 shards;
  autocast still wraps the forward so the loss is computed in fp32;
* ``"fp16"``: the same with float16, plus a gradient scaler: the backpropagated loss is multiplied
  by a dynamic scale so small fp16 gradients do not flush to zero, the gradients are divided by it
  before the optimizer step, and a step whose gradients overflowed is skipped (the scale halves).
  The scaler is torch's ``ShardedGradScaler`` over the whole world: ranks holding different
  gradient shards (FSDP, tensor or pipeline parallelism) agree on whether any overflowed, so every
  rank skips or takes the same steps. Step records carry ``loss_scale`` and ``skipped``.

Backward runs outside autocast (ops replay the dtype their forward used), so pipeline stages get
autocast inside each stage's forward (:func:`autocast_forward`) and the loss tail, not around the
schedule, which interleaves forwards and backwards.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

__all__ = ["Precision"]

_COMPUTE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """One rank's precision settings for the strategy's ``dtype`` on ``device``."""

    def __init__(self, dtype: str, device: torch.device) -> None:
        if dtype not in _COMPUTE:
            raise ValueError(f"dtype {dtype!r}: the torch backend trains in {', '.join(_COMPUTE)}")
        self.dtype, self.device = dtype, device
        self.compute: torch.dtype | None = _COMPUTE[dtype]
        self.scaler: Any = None
        if dtype == "fp16":
            self.scaler = _local_shard_scaler()(device.type, process_group=dist.group.WORLD)
            # the scale starts on the first scale() call, which pipeline stages without the loss never make
            self.scaler.scale(torch.ones((), device=device))

    def autocast(self) -> Any:
        """The context a forward (and its loss) runs under."""
        if self.compute is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute)

    def fsdp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``fully_shard``: low-precision all-gathers, fp32 gradient reduction."""
        if self.compute is None:
            return {}
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=torch.float32)}

    def autocast_forward(self, module: torch.nn.Module) -> torch.nn.Module:
        """Run ``module``'s forward under :meth:`autocast` (its own attribute, so parameter names and
        wrappers applied to the module are unchanged); returns it."""
        if self.compute is not None:
            fwd = module.forward

            @functools.wraps(fwd)
            def forward(*args: Any, **kwargs: Any) -> Any:
                with self.autocast():
                    return fwd(*args, **kwargs)

            module.forward = forward  # type: ignore[method-assign]
        return module

    @property
    def loss_scale(self) -> float:
        """What :meth:`scale` multiplies a loss by now."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def step(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer step (unscaled, skipped on overflow with fp16); what to add to the step record."""
        if self.scaler is None:
            opt.step()
            return {} if self.compute is None else {"dtype": self.dtype}
        scale = self.loss_scale
        self.scaler.step(opt)
        self.scaler.update()
        # the scale backs off exactly when some rank's gradients were not finite (and the step skipped)
        return {"dtype": self.dtype, "loss_scale": scale, "skipped": self.loss_scale < scale}


@functools.cache
def _local_shard_scaler() -> type:
    """torch's ``ShardedGradScaler`` checking and unscaling each rank's local gradient shards.

    Its own unscale hands every gradient of a device and dtype to one foreach op, which refuses
    plain tensors mixed with DTensors (tensor parallelism shards some modules' parameters and
    replicates the others); each rank's local shards are what it holds, and the overflow flag is
    all-reduced over the process group afterwards, so checking them covers every shard."""
    class LocalShardScaler(ShardedGradScaler):
        def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                            allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
            grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                            grads.setdefault((g.device, g.dtype), []).append(g)
                found: dict[torch.device, torch.Tensor] = {}
                for (device, _), gs in grads.items():
                    if device not in found:
                        found[device] = found_inf if found_inf.device == device else found_inf.to(device)
                    torch._amp_foreach_non_finite_check_and_unscale_(gs, found[device], inv_scale.to(device))
            return found or {found_inf.device: found_inf}

    return LocalShardScaler
