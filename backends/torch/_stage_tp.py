r"""Tensor parallelism inside pipeline stages: a Megatron pass over the exported graph, on local shards.

Pipeline stages are ``fx.GraphModule`` chunks of the model's ``torch.export`` graph (:mod:`._pipeline`):
ATen ops whose view sizes are constants of the global shapes, parameters read by ``get_attr``, so
``parallelize_module`` (which works on ``nn.Module`` forwards, :mod:`._tensor_parallel`) does not
apply. This pass rewrites the exported graph, before it is cut into stages, so that every rank of a
stage's ``tp`` group computes on its shards, as Megatron's column/row-parallel layers do:

* the plan's tensor-parallel modules (``ExecPlan.tp_plan``, the same one the unpipelined path gets)
  say which parameters are sharded: a column-parallel Linear's weight and bias by rows (dim 0, the
  rows of a fused ``q|k|v`` projection regrouped rank-major by :func:`._tensor_parallel.qkv_rows`
  first, so each rank holds whole heads of ``q``, ``k`` and ``v``), a row-parallel Linear's weight by
  columns (dim 1, its bias whole), a vocabulary-parallel embedding's table by rows (HF ``Conv1D``'s
  ``addmm(b, x, w)`` stores ``w`` as ``(inputs, outputs)``: its two dims swap roles). On the workers
  they become ``DTensor`` parameters on the ``tp`` mesh (checkpoints save them sharded, FSDP2 shards
  them further over ``dp``), read in the graph through ``to_local`` right before the op using them;
* a state is propagated through the graph: every value is whole (replicated over ``tp``) or this
  rank's block of one dim. A column-parallel Linear reads a whole input through :func:`copy_to_tp`
  (identity forward, gradient all-reduce backward: Megatron's ``f``; one per input, shared by the
  Linears reading it, e.g. ``q, k, v`` or LLaMA's ``gate`` and ``up``) and leaves its output split
  along the features; pointwise ops, views, transposes, splits of a fused projection into its
  blocks (``split``, ``chunk``, or slices of whole blocks), stacks of values split alike (GPT-J's
  rotary), reductions along other dims (QK-norm),
  ``scaled_dot_product_attention`` over split heads, and attention written out (the
  products ``q @ k.T`` and ``p @ v`` of blocks split alike along a batch dim, a softmax along
  another dim, dropout, each rank drawing its own shard's mask) keep the split (a view's constant
  sizes are rewritten to the local ones: the block of dim ``d`` is the block of the output dim
  with the same period, :func:`_view_dim`); a row-parallel Linear reads the split features, its
  partial product is all-reduced (:func:`reduce_from_tp`: all-reduce forward, identity backward,
  Megatron's ``g``) and its bias added after; a vocabulary-parallel embedding looks up the ids its
  rows hold and all-reduces (:func:`vocab_parallel_embedding`); a column-parallel Linear whose
  output is gathered (``col_gather``) all-gathers its features (:func:`gather_from_tp`);
* a value split over ``tp`` that reaches the loss (``col_to_loss``, a class-parallel cross entropy)
  enters the loss tail as a ``DTensor`` sharded along that dim and the tail runs under
  ``loss_parallel``, so the logits are never gathered; every other op reading a split value is
  refused before launch (:class:`Unsupported` naming it).

The collectives are those the cost model prices for Megatron TP: per transformer block one
all-reduce forward (after each row-parallel Linear) and one backward (before each group of
column-parallel Linears reading one input), plus the embedding's and the loss's.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.tensor import DTensor, Shard

from polyparallel.backends.torch._tensor_parallel import qkv_rows
from polyparallel.backends.torch.capabilities import Unsupported, chunked_evenly

__all__ = ["StageTP", "copy_to_tp", "gather_from_tp", "local_tensor", "reduce_from_tp", "shard_graph",
           "shard_parameters", "vocab_parallel_embedding"]

aten = torch.ops.aten

# the process groups the graph's collectives run on, by name (fx graphs hold constants, not groups)
_GROUPS: dict[str, Any] = {}


def _group(name: str) -> Any:
    return _GROUPS[name]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        g = g.contiguous().clone()
        dist.all_reduce(g, group=_group(ctx.group))
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous().clone()
        dist.all_reduce(x, group=_group(group))
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:  # type: ignore[override]
        pg = _group(group)
        ctx.rank, ctx.n = dist.get_rank(pg), dist.get_world_size(pg)
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(ctx.n)]
        dist.all_gather(parts, x.contiguous(), group=pg)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return g.chunk(ctx.n, dim=-1)[ctx.rank].contiguous(), None


def copy_to_tp(x: torch.Tensor, group: str) -> torch.Tensor:
    """Megatron's ``f``: identity forward, the gradient all-reduced over ``tp`` backward."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: str) -> torch.Tensor:
    """Megatron's ``g``: the partial sums all-reduced over ``tp`` forward, identity backward."""
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: str) -> torch.Tensor:
    """The feature blocks of the ``tp`` ranks concatenated (last dim); backward keeps this rank's."""
    return _GatherFromTP.apply(x, group)


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, start: int, group: str,
                             padding_idx: int = -1) -> torch.Tensor:
    """Rows ``[start, start + len(weight))`` of the table are this rank's: look up the ids among
    them, zeros for the others, and all-reduce the partial rows. ``padding_idx``, the table's row
    that gets no gradient (``nn.Embedding(padding_idx=...)``), keeps none on the rank holding it."""
    outside = (ids < start) | (ids >= start + weight.shape[0])
    local_pad = padding_idx - start if 0 <= padding_idx - start < weight.shape[0] else -1
    rows = aten.embedding.default(weight, (ids - start).masked_fill(outside, 0), local_pad)
    return reduce_from_tp(rows.masked_fill(outside.unsqueeze(-1), 0), group)


def local_tensor(p: Any) -> torch.Tensor:
    """A DTensor parameter's local shard (differentiable; its gradient comes back as a DTensor)."""
    return p.to_local() if hasattr(p, "to_local") else p


@dataclass(frozen=True)
class _Split:
    """A value holding this rank's block of dim ``dim``; ``segments``: the fused blocks (``q|k|v``)
    the dim is regrouped by, each split over ``tp`` (one segment for a plain split)."""

    dim: int
    segments: tuple[int, ...]


_SAME = {aten.contiguous.default, aten.clone.default, aten.alias.default, aten.detach.default,
         aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.lift_fresh_copy.default,
         aten.type_as.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
          aten.unflatten.int, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default}
_SIZED = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}


def _shape(n: Any) -> tuple[int, ...] | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    return str(list(stack.values())[-1][0]) if stack else ""


def _view_dim(gin: tuple[int, ...], gout: tuple[int, ...], d: int, tp: int) -> int | None:
    """The output dim of a reshape from ``gin`` to ``gout`` whose blocks over ``tp`` hold exactly the
    elements of the blocks of input dim ``d``: the dim with the same period (size times row-major
    stride), splitting evenly; None when the blocks of ``d`` are no block of one output dim."""
    def period(shape: tuple[int, ...], i: int) -> int:
        p = 1
        for s in shape[i:]:
            p *= s
        return p

    want = period(gin, d)
    for e, size in enumerate(gout):
        if size > 1 and period(gout, e) == want:
            # a dim kept whole through the view holds the same blocks, even ones torch.chunk cut unevenly
            return e if size % tp == 0 or size == gin[d] else None
    return None


class StageTP:
    """The tensor-parallel rewrite of one exported graph (module docstring).

    ``kinds``: module path -> tp kind (``ExecPlan.tp_plan``); ``fused``: module path -> the blocks of
    a fused projection; ``tp``: the degree. :meth:`rewrite` raises :class:`Unsupported` naming the
    op when a split value would be consumed as if it were whole; ``rank`` and ``group`` only give
    the vocabulary offsets and the collectives' group name (no communication happens here).
    """

    def __init__(self, kinds: dict[str, str], fused: dict[str, tuple[int, ...]], tp: int, rank: int = 0,
                 group: str = "tp") -> None:
        self.kinds, self.fused, self.tp, self.rank, self.group = kinds, fused, tp, rank, group
        self.state: dict[fx.Node, Any] = {}  # node -> _Split, or a tuple of them (split), None: whole
        self.params: dict[str, tuple[int, tuple[int, ...]]] = {}  # get_attr target -> (dim, segments)
        self.copies: dict[fx.Node, fx.Node] = {}  # whole input -> its copy_to_tp
        self.tail: set[fx.Node] = set()  # the loss tail: ops using the labels (run on DTensors)

    # -- helpers ---------------------------------------------------------------------------
    def _local(self, n: int) -> int:
        """This rank's share of a dim of ``n`` split over tp, as ``torch.chunk`` cuts it."""
        c = -(-n // self.tp)
        return max(0, min(c, n - self.rank * c))

    def _param(self, node: Any, dim: int, segments: tuple[int, ...] = (), uneven: bool = False) -> None:
        """Shard parameter ``node`` along ``dim`` (by the fused blocks ``segments``). ``uneven``: a
        vocabulary dim may not divide by tp; it is then cut as ``torch.chunk`` and DTensor cut it
        (``ceil(N/tp)`` rows per rank, fewer on the last), which every rank must get some of."""
        if not isinstance(node, fx.Node) or node.op != "get_attr":
            raise Unsupported(f"tensor parallelism inside pipeline stages: {node} is not a parameter read")
        shape = _shape(node)
        segs = segments or ((shape[dim],) if shape else ())
        old = self.params.setdefault(str(node.target), (dim, segs))
        if old != (dim, segs):
            raise Unsupported(f"parameter {node.target!r} is split two ways over tp ({old} and {(dim, segs)}) by the "
                              "modules sharing it")
        if shape is None or (any(s % self.tp for s in segs) and not (uneven and len(segs) == 1
                                                                    and chunked_evenly(segs[0], self.tp))):
            raise Unsupported(f"parameter {node.target!r} ({shape}) does not split evenly over tp={self.tp}")

    def _insert(self, graph: fx.Graph, before: fx.Node, fn: Any, args: tuple[Any, ...], like: Any) -> fx.Node:
        with graph.inserting_before(before):
            n = graph.call_function(fn, args)
        n.meta["val"] = like.meta.get("val") if isinstance(like, fx.Node) else None
        n.meta["attached_to"] = before.name  # cut before `before`, this goes with it (_pipeline.split_model)
        return n

    def _whole(self, n: fx.Node, what: str) -> None:
        for a in n.all_input_nodes:
            if self.state.get(a) is not None:
                raise Unsupported(f"op {n.name!r} ({n.target}) reads {a.name!r}, split over tp, as a whole tensor "
                                  f"({what}): tensor parallelism inside pipeline stages does not execute this "
                                  "placement")

    # -- the pass --------------------------------------------------------------------------
    def rewrite(self, gm: fx.GraphModule) -> dict[str, int]:
        """Rewrite ``gm``'s graph in place; returns the values left split (name -> dim)."""
        graph = gm.graph
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        for n in graph.nodes:
            if (n.op == "call_function" and any(a in self.tail for a in n.all_input_nodes)) or n is inputs[-1]:
                self.tail.add(n)
        for n in list(graph.nodes):
            if n.op == "call_function" and n.meta.get("attached_to") is None:
                self.state[n] = self._visit(graph, n)
            elif n.op == "output":
                self._whole(n, "the model's output")
        # parameters split over tp are read through to_local right before each op using them
        for n in list(graph.nodes):
            if n.op == "get_attr" and str(n.target) in self.params:
                for u in list(n.users):
                    loc = self._insert(graph, u, local_tensor, (n,), n)
                    u.replace_input_with(n, loc)
        graph.lint()
        gm.recompile()
        return {n.name: s.dim for n, s in self.state.items() if isinstance(s, _Split)}

    def _visit(self, graph: fx.Graph, n: fx.Node) -> Any:
        t = n.target
        path = _module_path(n)
        kind = self.kinds.get(path)
        st = self.state
        ins = [a for a in n.all_input_nodes if a.op != "get_attr"]
        split_ins = [(a, st.get(a)) for a in ins if isinstance(st.get(a), _Split)]
        out = _shape(n)
        if t in (aten.linear.default, aten.addmm.default) and kind is not None:
            return self._linear(graph, n, kind, path)
        if t is aten.embedding.default and kind == "emb_row":
            self._whole(n, "embedding ids")
            self._param(n.args[0], 0, uneven=True)
            shard = -(-(_shape(n.args[0]) or (0,))[0] // self.tp)  # torch.chunk's rows per rank
            pad = n.args[2] if len(n.args) > 2 else n.kwargs.get("padding_idx", -1)
            n.target = vocab_parallel_embedding
            n.args = (n.args[0], n.args[1], self.rank * shard, self.group, pad)
            n.kwargs = {}
            return None
        if kind is not None and t in (aten.linear.default, aten.addmm.default, aten.embedding.default):
            raise Unsupported(f"module {path!r} is {kind} over tp but its op {n.name!r} ({t}) is not executed so")
        if t is operator.getitem:
            parts = st.get(n.args[0])
            return parts[n.args[1]] if isinstance(parts, tuple) else None
        if not split_ins:
            return None
        if n in self.tail:
            # the loss tail runs on DTensors of the global shapes: only a class-parallel loss reads a split value
            if t in _LOSSES and len(split_ins) == 1 and split_ins[0][0] is n.args[0] and split_ins[0][1].dim == 1:
                return None
            self._whole(n, "in the loss, only cross entropy over split classes (dim 1) is executed")
        (a0, s0) = split_ins[0]
        # (a dropout keeps the split: each rank draws its own shard's mask, as Megatron's attention dropout)
        if t in _SAME or t is aten.dropout.default:
            return s0 if n.args[0] is a0 else self._whole(n, "an argument")
        if t is aten.t.default:
            return _Split(1 - s0.dim, s0.segments)
        if t is aten.transpose.int:
            nd = len(_shape(a0) or ())
            i, j = (x % nd for x in n.args[1:3])
            d = j if s0.dim == i else i if s0.dim == j else s0.dim
            return _Split(d, s0.segments)
        if t is aten.permute.default:
            nd = len(_shape(a0) or ())
            perm = [p % nd for p in n.args[1]]
            return _Split(perm.index(s0.dim), s0.segments)
        if t in (aten.slice.Tensor, aten.select.int) and n.args[0] is a0:
            nd = len(_shape(a0) or ())
            dim = (n.args[1] if len(n.args) > 1 else 0) % nd
            if dim == s0.dim:
                return self._slice_blocks(n, a0, s0)
            return _Split(s0.dim - (t is aten.select.int and dim < s0.dim), s0.segments)
        if t in _VIEWS or t in _SIZED:
            return self._view(n, a0, s0, out)
        if t in _SPLITS:
            return self._split(n, a0, s0)
        if t is aten.cat.default:
            # (an empty 1-D tensor, e.g. an HF cache's initial state, is skipped by cat)
            tensors = [x for x in n.args[0] if _shape(x) != (0,)]
            nd = len(out or ())
            dim = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % nd
            states = {st.get(x) for x in tensors}
            if len(states) != 1 or s0.dim == dim:
                raise Unsupported(f"op {n.name!r} concatenates tensors split differently over tp")
            return s0
        if t is aten.stack.default:
            nd = len(out or ())
            axis = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % nd
            if len({st.get(x) for x in n.args[0]}) != 1:
                raise Unsupported(f"op {n.name!r} stacks tensors split differently over tp")
            return _Split(s0.dim + (axis <= s0.dim), s0.segments)
        if t in (aten.matmul.default, aten.bmm.default):
            return self._product(n, out)
        if t in _REDUCTIONS and n.args[0] is a0:
            return self._reduction(n, a0, s0)
        if t in (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default):
            nd = len(out or ())
            if n.args[0] is not a0 or s0.dim == n.args[1] % nd:
                raise Unsupported(f"op {n.name!r} ({t}) normalises along its dim split over tp")
            return s0
        if t is aten.scaled_dot_product_attention.default:
            q, k, v = n.args[:3]
            mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
            if not all(isinstance(st.get(x), _Split) and st[x].dim == 1 and len(st[x].segments) == 1
                       for x in (q, k, v)):
                raise Unsupported(f"attention {n.name!r}: q, k and v must all be split over their heads (dim 1)")
            ms = _shape(mask)
            if isinstance(mask, fx.Node) and (st.get(mask) is not None or (ms and len(ms) == 4 and ms[1] != 1)):
                raise Unsupported(f"attention {n.name!r} has a mask per head: not split over tp")
            return _Split(1, st[q].segments)
        if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
            return self._pointwise(n, out)
        self._whole(n, "no rule splits it")
        return None

    def _linear(self, graph: fx.Graph, n: fx.Node, kind: str, path: str) -> Any:
        # linear(x, w, b) with w (outputs, inputs); HF Conv1D's addmm(b, x, w) with w (inputs, outputs)
        addmm = n.target is aten.addmm.default
        if addmm:
            b, x, w = n.args[:3]
            if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
                raise Unsupported(f"op {n.name!r} of {path!r} scales its product (addmm's alpha, beta)")
        else:
            x, w = n.args[0], n.args[1]
            b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        out_dim = 1 if addmm else 0  # the weight's output features
        sx = self.state.get(x)
        nd = len(_shape(n) or ())
        if kind == "row":
            if not isinstance(sx, _Split) or sx.dim != len(_shape(x) or ()) - 1 or len(sx.segments) != 1:
                raise Unsupported(f"row-parallel Linear {path!r} (op {n.name!r}) reads {x} whole, not split along "
                                  "its features over tp")
            self._param(w, 1 - out_dim)
            n.target = aten.mm.default if addmm else n.target
            n.args, n.kwargs = (x, w), {}
            users = list(n.users)
            with graph.inserting_after(n):
                red = graph.call_function(reduce_from_tp, (n, self.group))
            red.meta["val"] = n.meta.get("val")
            red.meta["attached_to"] = "after " + n.name
            last = red
            if b is not None:
                with graph.inserting_after(red):
                    last = graph.call_function(aten.add.Tensor, (red, b))
                last.meta["val"] = n.meta.get("val")
                last.meta["attached_to"] = "after " + n.name
            for u in users:
                u.replace_input_with(n, last)
            return None
        if kind not in ("col", "col_gather", "col_to_loss"):
            raise Unsupported(f"module {path!r}: tp kind {kind!r} is not executed inside pipeline stages")
        if sx is not None:
            raise Unsupported(f"column-parallel Linear {path!r} (op {n.name!r}) reads {x}, which is split over tp")
        segs = self.fused.get(path, ())
        vocab = kind == "col_to_loss" and not segs  # the output layer: its classes may not divide by tp
        self._param(w, out_dim, segs, uneven=vocab)
        if b is not None:
            self._param(b, 0, segs, uneven=vocab)
        if x not in self.copies:
            self.copies[x] = self._insert(graph, n, copy_to_tp, (x, self.group), x)
        n.replace_input_with(x, self.copies[x])
        width = (_shape(w) or (0, 0))[out_dim]
        split = _Split(nd - 1, segs or (width,))
        if kind != "col_gather":
            return split
        if segs:
            raise Unsupported(f"fused projection {path!r} cannot be gathered")
        users = list(n.users)
        with graph.inserting_after(n):
            g = graph.call_function(gather_from_tp, (n, self.group))
        g.meta["val"] = n.meta.get("val")
        g.meta["attached_to"] = "after " + n.name
        self.state[n] = split
        for u in users:
            u.replace_input_with(n, g)
        return split

    def _view(self, n: fx.Node, a0: fx.Node, s0: _Split, out: tuple[int, ...] | None) -> _Split:
        gin = _shape(a0)
        if gin is None or out is None:
            raise Unsupported(f"op {n.name!r}: no shapes recorded to split it over tp")
        if n.target is aten.expand.default:
            e = s0.dim + len(out) - len(gin)
            if out[e] != gin[s0.dim]:
                raise Unsupported(f"op {n.name!r} broadcasts a dim split over tp")
        else:
            e = _view_dim(gin, out, s0.dim, self.tp)
            if e is None or (len(s0.segments) > 1 and out[e] != gin[s0.dim]):
                raise Unsupported(f"op {n.name!r} ({n.target}) reshapes {a0.name!r}, split over tp along dim "
                                  f"{s0.dim} of {gin}, to {out}: the shards are no block of one dim")
        if n.target in _SIZED:
            sizes = list(n.args[1])
            if sizes[e] != -1:
                sizes[e] = self._local(out[e])
            n.args = (n.args[0], sizes, *n.args[2:])
        segs = s0.segments if out[e] == gin[s0.dim] else (out[e],)
        return _Split(e, segs)

    def _split(self, n: fx.Node, a0: fx.Node, s0: _Split) -> Any:
        gin = _shape(a0) or ()
        nd = len(gin)
        dim = (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) % nd
        outs = n.meta.get("val")
        widths = [int(v.shape[dim]) for v in outs]
        if dim != s0.dim:
            return tuple(s0 for _ in widths)
        if tuple(widths) != s0.segments:
            raise Unsupported(f"op {n.name!r} splits {a0.name!r} (split over tp in blocks {s0.segments}) into "
                              f"{widths}: only a fused projection's own blocks are split locally")
        if n.target is aten.chunk.default:
            pass  # equal blocks: the local chunks are the blocks' shards
        elif n.target is aten.split.Tensor:
            n.args = (n.args[0], n.args[1] // self.tp, *n.args[2:])
        else:
            n.args = (n.args[0], [w // self.tp for w in n.args[1]], *n.args[2:])
        return tuple(_Split(dim, (w,)) for w in widths)

    def _slice_blocks(self, n: fx.Node, a0: fx.Node, s0: _Split) -> _Split:
        """A slice along the dim split over tp that takes whole blocks of a fused projection (Phi-3's
        ``qkv[..., :q_width]``): each rank's local value holds its shard of every block one after
        another, so the slice becomes the same blocks' local offsets."""
        gin = _shape(a0) or ()
        args = [*n.args, *[None] * (5 - len(n.args))]
        start, end, step = args[2], args[3], 1 if args[4] is None else args[4]
        size = gin[s0.dim] if gin else 0
        start = 0 if start is None else (start + size if start < 0 else min(start, size))
        end = size if end is None else (end + size if end < 0 else min(end, size))
        edges = [0]
        for w in s0.segments:
            edges.append(edges[-1] + w)
        if n.target is not aten.slice.Tensor or step != 1 or start not in edges or end not in edges or start >= end:
            raise Unsupported(f"op {n.name!r} ({n.target}) indexes {a0.name!r} along its dim split over tp "
                              f"(blocks {s0.segments}) other than by whole blocks")
        i, k = edges.index(start), edges.index(end)
        n.args = (n.args[0], n.args[1], start // self.tp, end // self.tp, 1)
        return _Split(s0.dim, s0.segments[i:k])

    def _reduction(self, n: fx.Node, a0: fx.Node, s0: _Split) -> _Split:
        """A reduction along dims other than the one split over tp (QK-norm's mean over each head's
        features): each rank reduces its own blocks."""
        nd = len(_shape(a0) or ())
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        dims = range(nd) if dims in (None, []) else [d % nd for d in ([dims] if isinstance(dims, int) else dims)]
        if s0.dim in dims:
            raise Unsupported(f"op {n.name!r} ({n.target}) reduces {a0.name!r} along its dim split over tp")
        return _Split(s0.dim if keep else s0.dim - sum(d < s0.dim for d in dims), s0.segments)

    def _product(self, n: fx.Node, out: tuple[int, ...] | None) -> _Split:
        """A batched product of two tensors split along the same batch dim (the heads of
        ``q @ k.T`` and ``p @ v``): each rank multiplies its blocks."""
        a, b = n.args[:2]
        sa, sb = self.state.get(a), self.state.get(b)
        nd = len(out or ())
        if not (isinstance(sa, _Split) and isinstance(sb, _Split) and len(_shape(a) or ()) == nd
                and len(_shape(b) or ()) == nd and sa.dim == sb.dim < nd - 2 and sa.segments == sb.segments):
            raise Unsupported(f"op {n.name!r} ({n.target}) multiplies tensors not split alike along a batch dim over "
                              "tp")
        return sa

    def _pointwise(self, n: fx.Node, out: tuple[int, ...] | None) -> _Split:
        nd = len(out or ())
        found: set[tuple[int, tuple[int, ...]]] = set()
        whole: list[fx.Node] = []
        for a in n.all_input_nodes:
            s, shp = self.state.get(a), _shape(a)
            if isinstance(s, _Split):
                found.add((s.dim + nd - len(shp or ()), s.segments))
            elif shp is not None:
                whole.append(a)
        if len(found) != 1:
            raise Unsupported(f"op {n.name!r} ({n.target}) combines tensors split differently over tp")
        (d, segs), = found
        for a in whole:
            shp = _shape(a) or ()
            i = d - (nd - len(shp))
            if 0 <= i < len(shp) and shp[i] != 1:
                raise Unsupported(f"op {n.name!r} ({n.target}) combines a tensor split over tp with the whole "
                                  f"{a.name!r}")
        return _Split(d, segs)


def shard_graph(gm: fx.GraphModule, kinds: dict[str, str], fused: dict[str, tuple[int, ...]], tp: int,
                rank: int = 0, group: str = "tp") -> tuple[dict[str, int], dict[str, tuple[int, tuple[int, ...]]]]:
    """Rewrite ``gm`` for tensor parallelism (module docstring); returns the values left split
    (name -> dim) and the parameters to shard (``get_attr`` target -> (dim, fused blocks))."""
    p = StageTP(kinds, fused, tp, rank, group)
    split = p.rewrite(gm)
    return split, p.params


def shard_parameters(root: nn.Module, params: dict[str, tuple[int, tuple[int, ...]]], mesh: Any) -> None:
    """Replace each parameter named in ``params`` (and its aliases) by a ``DTensor`` parameter sharded
    along its dim on the 1-D ``tp`` mesh, a fused projection's rows regrouped first. Every rank built
    the same initial weights, so each keeps its block without communication."""
    tp, rank = mesh.size(), mesh.get_local_rank()
    by_id: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    for target, (dim, segs) in params.items():
        full = root.get_parameter(target)
        data = full.detach()
        if len(segs) > 1:
            data = data.index_select(dim, torch.tensor(qkv_rows(segs, tp), device=data.device))
        local = data.chunk(tp, dim=dim)[rank].contiguous().to(mesh.device_type)
        dt = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=data.shape, stride=data.stride())
        new = nn.Parameter(dt, requires_grad=full.requires_grad)
        for name in by_id.get(id(full), [target]):
            mod, _, attr = name.rpartition(".")
            setattr(root.get_submodule(mod) if mod else root, attr, new)


def register_group(name: str, group: Any) -> None:
    """Name the process group the graph's collectives called ``name`` run on."""
    _GROUPS[name] = group
