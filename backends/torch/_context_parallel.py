r"""Context parallelism of the torch backend: ring attention over sequence shards, with causal load
balancing.

**Sharding.** The sequence of length ``S`` is cut into ``2·cp`` chunks of ``c = S/(2cp)``
positions; shard ``r`` holds chunks ``r`` and ``2cp-1-r`` (:func:`shard_positions`), so under a
causal mask every shard computes the same number of query-key pairs (the first chunks attend to
little, the last to much, and each shard holds one of each). Inputs and labels are gathered by
these positions (:func:`context_shard`); position embeddings look up the shard's positions and
tables read by position (rotary ``cos``/``sin``) keep their rows of them (:mod:`._sequence_parallel`
finds both, as for Ulysses). Every op but attention is position-wise, so it runs on the shard as on
the whole sequence; the loss is the mean of the shards' mean losses (equal token counts).

**Ring attention** (:class:`RingAttention`, a ``TorchFunctionMode`` over
``F.scaled_dot_product_attention``). Shard ``r`` keeps its queries and passes its ``K, V`` block to
shard ``r+1`` ``cp - 1`` times, receiving ``r-1``'s: at step ``i`` it holds the block of shard
``r - i``. Each pair of a query chunk ``a`` and a key chunk ``b`` is computed when ``b < a``
(whole), ``b = a`` (the causal triangle) and skipped when ``b > a``; without a causal mask every
pair is whole. The partial results merge by their log-sum-exp: with per-row ``ℓ = \log\sum_j
e^{s_j}`` of a block and output ``o = \mathrm{softmax}(s)\,V``,

.. math::  ℓ \leftarrow \log(e^{ℓ} + e^{ℓ_b}),\qquad
           o \leftarrow o\,e^{ℓ_{old} - ℓ} + o_b\,e^{ℓ_b - ℓ}.

Each block runs torch's fused (flash) attention kernel on the CPU, forward with its log-sum-exp,
backward given the rows' merged output and log-sum-exp, so no block's scores are held; on other
devices the same arithmetic is written out (not yet measured on a GPU). The backward pass (a
``torch.autograd.Function``) is FlashAttention's: with
``P = e^{s - ℓ}`` and ``D = \mathrm{rowsum}(dO \odot O)``, per pair ``dV_b \mathrel{+}= P^T dO``,
``dS = P \odot (dO\,V_b^T - D)``, ``dQ \mathrel{+}= dS\,K_b\,σ``, ``dK_b \mathrel{+}= dS^T Q\,σ``.
``K, V`` travel the ring again, each with the ``dK, dV`` accumulated for it; after the last step
one more shift brings the accumulators home (``2cp - 1`` transfers, the cost model's count).
Transfers are started before the block in hand is computed, so they overlap with it. A shard holds
its own ``K, V``, the block in hand and the one arriving: the ``1/cp`` memory of ring attention,
not the whole sequence's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = ["RingAttention", "context_shard", "ring_attention", "shard_positions"]


def shard_positions(length: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """The sequence positions shard ``rank`` of ``cp`` holds: chunks ``rank`` and ``2cp-1-rank`` of
    ``2cp`` equal chunks (``length`` divisible by ``2cp``)."""
    if length % (2 * cp):
        raise ValueError(f"context parallelism over cp={cp} cuts the sequence into {2 * cp} equal chunks; the "
                         f"sequence length {length} is not divisible by {2 * cp}")
    c = length // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


def context_shard(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Shard ``rank``'s positions (:func:`shard_positions`) of ``t`` along ``dim``."""
    return t.index_select(dim, shard_positions(t.shape[dim], cp, rank, t.device))


class _Ring:
    """Point-to-point shifts around one process group: send to the next rank, receive from the
    previous one (started at once, waited on later, so a transfer overlaps with compute)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, t: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        t = t.contiguous()
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group), dist.P2POp(dist.irecv, buf, self.prev, self.group)]
        return buf, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending: tuple[torch.Tensor, list[Any]]) -> torch.Tensor:
        buf, reqs = pending
        for r in reqs:
            r.wait()
        return buf


def _pairs(rank: int, src: int, cp: int, causal: bool) -> list[tuple[int, int, bool]]:
    """The (local query chunk, held key chunk, diagonal) pairs shard ``rank`` computes with the
    block of shard ``src``: chunk ``i`` of a shard ``x`` is global chunk ``x`` (i=0) or ``2cp-1-x``."""
    gq = (rank, 2 * cp - 1 - rank)
    gk = (src, 2 * cp - 1 - src)
    out = []
    for a in range(2):
        for b in range(2):
            if not causal or gk[b] < gq[a]:
                out.append((a, b, False))
            elif gk[b] == gq[a]:
                out.append((a, b, True))
    return out


def _acc(t: torch.Tensor) -> torch.dtype:
    """The accumulation precision: at least fp32 (bf16/fp16 blocks merge in fp32)."""
    return torch.promote_types(t.dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and per-row log-sum-exp, in the accumulation precision: torch's
    fused (flash) kernel on the CPU, which never holds the block's scores; written out elsewhere."""
    acc = _acc(q)
    if q.device.type == "cpu":
        o, lse = _FLASH_CPU(q, k, v, 0.0, diagonal, scale=scale)
        return o.to(acc), lse.to(acc)
    s = _scores(q.to(acc), k.to(acc), scale, diagonal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(acc)), lse


def _block_grads(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor, scale: float,
                 diagonal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's contributions to dQ, dK, dV given the rows' *merged* output and log-sum-exp
    (FlashAttention's backward; ``delta = rowsum(dO * O)``): the fused CPU kernel, or written out."""
    acc = _acc(q)
    if q.device.type == "cpu":
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        grads = _FLASH_CPU_BACKWARD(do.to(q.dtype), q, k, v, out.to(q.dtype), lse.to(lse_dtype), 0.0, diagonal,
                                    scale=scale)
        return tuple(g.to(acc) for g in grads)  # type: ignore[return-value]
    qa, kb, vb, doa = q.to(acc), k.to(acc), v.to(acc), do.to(acc)
    p = torch.exp(_scores(qa, kb, scale, diagonal) - lse.unsqueeze(-1))
    ds = p * (torch.matmul(doa, vb.transpose(-1, -2)) - delta.unsqueeze(-1))
    return torch.matmul(ds, kb) * scale, torch.matmul(ds.transpose(-1, -2), qa) * scale, \
        torch.matmul(p.transpose(-1, -2), doa)


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                ring: _Ring) -> torch.Tensor:
        cp, r = ring.size, ring.rank
        c = q.shape[-2] // 2
        acc = _acc(q)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        for i in range(cp):
            pending = ring.start(kv) if i < cp - 1 else None
            for a, b, diag in _pairs(r, (r - i) % cp, cp, causal):
                rows, cols = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                o_b, lse_b = _block(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], scale, diag)
                o, old = out[..., rows, :], lse[..., rows]  # views: merged in place
                new = torch.logaddexp(old, lse_b)
                o.copy_(o * torch.exp(old - new).unsqueeze(-1) + o_b * torch.exp(lse_b - new).unsqueeze(-1))
                old.copy_(new)
            if pending is not None:
                kv = _Ring.wait(pending)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.ring = causal, scale, ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, scale = ctx.ring, ctx.causal, ctx.scale
        cp, r = ring.size, ring.rank
        c = q.shape[-2] // 2
        acc = _acc(q)
        delta = (dout.to(acc) * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        for i in range(cp):
            pending = ring.start(kv) if i < cp - 1 else None
            for a, b, diag in _pairs(r, (r - i) % cp, cp, causal):
                rows, cols = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                gq, gk, gv = _block_grads(dout[..., rows, :], q[..., rows, :], kv[0][..., cols, :],
                                          kv[1][..., cols, :], out[..., rows, :], lse[..., rows],
                                          delta[..., rows], scale, diag)
                dq[..., rows, :] += gq
                dkv[0][..., cols, :] += gk
                dkv[1][..., cols, :] += gv
            dkv = _Ring.wait(ring.start(dkv))  # the accumulators follow their block (home after the last)
            if pending is not None:
                kv = _Ring.wait(pending)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, *, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False, dropout_p: float = 0.0) -> torch.Tensor:
    """``scaled_dot_product_attention`` of this shard's queries ``[B, h, S/cp, d]`` against the
    whole sequence's keys and values, held in shards by the ``cp`` ranks of ``group``."""
    if dropout_p:
        raise ValueError("context-parallel attention with dropout_p > 0 is not executed; use dropout_p=0 or cp=1")
    if q.shape[-2] % 2:
        raise ValueError(f"ring attention holds two chunks per shard; the local sequence {q.shape[-2]} is odd")
    if k.shape[-3] != q.shape[-3]:
        if not enable_gqa or q.shape[-3] % k.shape[-3]:
            raise ValueError(f"ring attention: {q.shape[-3]} query heads and {k.shape[-3]} key heads without "
                             "enable_gqa")
        k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _RingAttentionFn.apply(q, k, v, bool(is_causal), s, _Ring(group))


class RingAttention(TorchFunctionMode):
    """Inside this mode every ``F.scaled_dot_product_attention`` on context-parallel shards runs as
    ring attention over the ``cp`` ranks of ``group`` (a process group or a 1-D device mesh)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group.get_group() if hasattr(group, "get_group") else group

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        given = dict(zip(names, args[3:]), **kwargs)
        if given.get("attn_mask") is not None:
            raise ValueError("context-parallel attention with an explicit attn_mask is not executed; use "
                             "is_causal=True or cp=1")
        if any(t.dim() != 4 for t in args[:3]):
            raise ValueError("context-parallel attention expects q, k, v of shape [batch, heads, seq, head_dim]")
        return ring_attention(*args[:3], self.group, is_causal=bool(given.get("is_causal", False)),
                              scale=given.get("scale"), enable_gqa=bool(given.get("enable_gqa", False)),
                              dropout_p=float(given.get("dropout_p", 0.0)))
