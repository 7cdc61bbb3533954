"""Expert parallelism for Hugging Face MoE experts modules: each rank keeps ``1/ep`` of the experts.

The modules are HF's ``*Experts`` (Mixtral, Qwen-MoE, ...): 3-D ``gate_up_proj`` ``(E, 2F, D)`` and
``down_proj`` ``(E, D, F)`` with ``act_fn``, called as ``experts(hidden (T, D), top_k_index (T, k),
top_k_weights (T, k))`` by the sparse MoE block after its router. Under ``ep`` rank ``r`` of the
expert group keeps experts ``[r·E/ep, (r+1)·E/ep)``, and its forward

1. sorts its ``T·k`` routed rows by expert and tells every rank how many rows it sends each of its
   experts (an all-to-all of the counts);
2. dispatches the rows to the experts' ranks (an all-to-all with autograd: the backward sends the
   rows' gradients back);
3. runs each local expert on the rows it received from all ranks (``silu(gate)·up``, then down);
4. combines: the outputs go back to the rows' ranks (the reverse all-to-all), are unsorted, weighted
   by the router and summed over the ``k`` choices — what the single-process module computes.

Gradients: the dispatch's backward brings every rank's rows' gradients to the expert, so an expert
weight's gradient is the sum over the group's ranks of their (loss-weighted) backward; the replicas'
average that DDP applies to the other weights is a division by the number of replicas, applied here
by a hook on each expert weight. DDP is told to ignore the expert weights, FSDP2 leaves them
unsharded (``ignored_params``). The executor runs this with ``ep = dp`` (every data-parallel rank
in one expert group), so no two ranks hold the same expert and no expert gradient needs a reduction.

The all-to-alls run on a process group of their own: DDP's gradient all-reduces are issued from
backward hooks on the replica group, and the dispatch/combine backward all-to-alls interleaved with
them on one group could be ordered differently on two ranks.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

__all__ = ["apply_expert_parallel", "expert_modules"]


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The HF experts modules of ``model``: 3-D ``gate_up_proj`` and ``down_proj`` and an ``act_fn``."""
    out = []
    for path, mod in model.named_modules():
        gu, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
        if isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter) and gu.dim() == 3 and down.dim() == 3 \
                and hasattr(mod, "act_fn"):
            out.append((path, mod))
    return out


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    return all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)


def _forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             ) -> torch.Tensor:
    ep, local, group = self._ep_size, self._ep_local, self._ep_group
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = hidden[order // k]  # routed rows, sorted by expert
    counts = torch.bincount(flat, minlength=local * ep)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)  # rows of each (source rank, local expert)
    send_splits = counts.view(ep, local).sum(1).tolist()
    recv_splits = recv.view(ep, local).sum(1).tolist()
    got = _a2a(rows, recv_splits, send_splits, group)
    per = recv.view(ep, local).flatten().tolist()
    pieces = list(got.split(per))  # source-major, each source's rows by local expert
    outs: list[torch.Tensor | None] = [None] * len(pieces)
    for e in range(local):
        idx = [s * local + e for s in range(ep)]
        x = torch.cat([pieces[i] for i in idx])
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(self.act_fn(gate) * up, self.down_proj[e])
        for i, part in zip(idx, y.split([per[i] for i in idx])):
            outs[i] = part
    back = _a2a(torch.cat(outs), send_splits, recv_splits, group)  # type: ignore[arg-type]
    unsorted = torch.zeros_like(back).index_copy(0, order, back)
    out = (unsorted.view(tokens, k, -1) * top_k_weights[..., None]).sum(1)
    return out.to(hidden.dtype)


def apply_expert_parallel(model: nn.Module, ep: int, replicas: int, ranks: list[int]) -> list[str]:
    """Keep this rank's ``1/ep`` of every experts module's weights and run them expert-parallel over
    ``ranks`` (the expert group, this rank among them); return the expert weights' names for DDP to
    ignore. ``replicas``: the data-parallel replicas whose gradient average the other weights get."""
    group = dist.new_group(ranks)  # every rank creates every group, in the same order
    r = ranks.index(dist.get_rank())
    names = []
    for path, mod in expert_modules(model):
        n_exp = mod.gate_up_proj.shape[0]
        if n_exp % ep:
            raise ValueError(f"experts module {path!r} has {n_exp} experts, not divisible by ep={ep}")
        local = n_exp // ep
        for pname in ("gate_up_proj", "down_proj"):
            p = getattr(mod, pname)
            shard = nn.Parameter(p.data[r * local:(r + 1) * local].clone())
            shard.register_hook(lambda g, n=replicas: g / n)
            setattr(mod, pname, shard)
            names.append(f"{path}.{pname}" if path else pname)
        mod._ep_size, mod._ep_local, mod._ep_group = ep, local, group
        mod.forward = types.MethodType(_forward, mod)
    return names
