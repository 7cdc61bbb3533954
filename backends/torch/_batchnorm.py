"""BatchNorm with the statistics of the whole data-parallel batch, as single-process training computes them.

Under data parallelism each replica sees a share of the global batch. torch's ``BatchNorm`` would
normalise every share with its own mean and variance (and keep per-replica running statistics),
which is not single-process training: the loss and the running statistics drift (1e-3 relative on a
small CNN). :func:`use_cross_rank_batchnorm` turns every ``BatchNorm1d/2d/3d`` (any input rank,
affine or not, with or without running statistics, ``momentum=None`` for the cumulative average)
into its cross-rank version. In training it computes, per channel, over every rank of ``group``:

    N  = Σ_r n_r                      (elements per channel; the shares may be unequal)
    μ  = Σ_r Σ x / N
    σ² = Σ_r Σ (x − μ)² / N           (biased, as BatchNorm normalises)

with a differentiable all-reduce (its backward all-reduces the gradient), so the backward pass
carries the cross-rank terms of ``∂μ/∂x`` and ``∂σ²/∂x``; the running statistics take ``μ`` and the
unbiased ``σ² N / (N − 1)`` with torch's momentum rule, identically on every rank. Sums and ``N``
travel in float64. The result equals single-process BatchNorm on the concatenated batch up to
floating-point summation order. Evaluation with running statistics is torch's own code.

torch's ``SyncBatchNorm`` does the same on CUDA only (it refuses CPU tensors) and over a group it
must be given at construction; this works on any device over the group the backend passes.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["has_batch_statistics", "use_cross_rank_batchnorm"]


class _SumAcrossRanks(torch.autograd.Function):
    """``Σ_r t_r`` on every rank; the gradient of a sum is the sum of the gradients."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _CrossRank:
    """Mixin placed before a ``_BatchNorm`` class: batch statistics over ``self.group``."""

    group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn: Any = self
        bn._check_input_dim(x)
        if not (bn.training or (bn.running_mean is None and bn.running_var is None)):
            return super().forward(x)  # type: ignore[misc]  # running statistics: nothing crosses ranks
        dims = [0, *range(2, x.dim())]
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        n_local = torch.tensor([xs.numel() // xs.shape[1]], dtype=torch.float64, device=x.device)
        packed = _SumAcrossRanks.apply(torch.cat([xs.sum(dims).double(), n_local]), self.group)
        n = packed[-1].detach()
        mean = (packed[:-1] / n).to(xs.dtype)
        xc = xs - mean.view(shape)
        var = (_SumAcrossRanks.apply((xc * xc).sum(dims).double(), self.group) / n).to(xs.dtype)
        out = xc * torch.rsqrt(var + bn.eps).view(shape)
        if bn.weight is not None:
            out = out * bn.weight.view(shape)
        if bn.bias is not None:
            out = out + bn.bias.view(shape)
        if bn.training and bn.track_running_stats and bn.running_mean is not None:
            with torch.no_grad():
                bn.num_batches_tracked.add_(1)
                # momentum None: the cumulative average, factor 1/num_batches_tracked, as torch's BatchNorm
                f = 1.0 / bn.num_batches_tracked.double() if bn.momentum is None else bn.momentum
                unbiased = var.double() * n / (n - 1)
                bn.running_mean.copy_(bn.running_mean * (1 - f) + mean.double() * f)
                bn.running_var.copy_(bn.running_var * (1 - f) + unbiased * f)
        return out.to(x.dtype)


@cache
def _cross_rank_class(cls: type) -> type:
    return type(f"CrossRank{cls.__name__}", (_CrossRank, cls), {"__module__": __name__})


def has_batch_statistics(model: nn.Module) -> bool:
    """Whether ``model`` holds a BatchNorm (any ``_BatchNorm``): in training it normalises with the
    statistics of the batch it is given, so how the batch is split changes the numbers."""
    return any(isinstance(m, _BatchNorm) for m in model.modules())


def use_cross_rank_batchnorm(model: nn.Module, group: Any, world: int) -> int:
    """Make every BatchNorm of ``model`` normalise with the statistics of the batch summed over
    ``group`` (``world`` ranks); return how many were changed (0 when ``world == 1``).

    The modules keep their parameters, buffers and hooks (only their class changes), so state dicts
    and optimisers see the same tensors. Raises ``ValueError`` for a BatchNorm whose class defines its
    own ``forward`` (``SyncBatchNorm``, a lazy or a user subclass that computes differently): it
    cannot be made cross-rank without knowing what it computes.
    """
    if world <= 1:
        return 0
    changed = 0
    for name, m in model.named_modules():
        if not isinstance(m, _BatchNorm) or isinstance(m, _CrossRank):
            continue
        if type(m).forward is not _BatchNorm.forward or isinstance(m, nn.modules.lazy.LazyModuleMixin):
            raise ValueError(f"module {name!r} ({type(m).__name__}) has its own BatchNorm forward; cross-rank batch "
                             "statistics need torch's BatchNorm1d/2d/3d (or batchnorm='per_replica', which "
                             "normalises each replica's share alone and does not equal single-process training)")
        m.__class__ = _cross_rank_class(type(m))
        m.group = group
        changed += 1
    return changed
