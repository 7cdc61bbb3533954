r"""Head-parallel attention, vocabulary-parallel embeddings and the model fingerprint check of the
torch backend (sequence parallelism: :mod:`._sequence_parallel`).

**Head-parallel attention over a fused projection.** GPT-style blocks compute ``q, k, v`` with one
``nn.Linear`` of ``3H`` outputs. The strategy splits that Linear's output dim ``n`` over ``tp`` and
the attention op's head dim ``h`` over ``tp``, and prices no communication between the two: rank
``r`` must hold exactly the ``q``, ``k`` and ``v`` features of *its* heads. Which features those are
is read off the attention op's affine accesses in the captured graph: operand ``j`` reads feature
``c_j + \sum_i a_i x_i`` of the projection's output, so with ``h`` restricted to its ``r``-th block
``[rE/t, (r+1)E/t)`` (``E`` heads, ``t = tp``) and every other dim full, the footprint

.. math::  F_{j,r} = \{\, c_j + \textstyle\sum_i a_i x_i \;:\; h \in [rE/t, (r+1)E/t) \,\}

is enumerated and must be the contiguous range ``[c_j + r w_j, c_j + (r+1) w_j)`` with
``w_j = W_j / t`` (``W_j`` the operand's width); the operands must tile the output features. When
``q`` or ``k`` reach the attention through pointwise ops (LLaMA's rotary embedding: negate, concat,
multiply by cos/sin) or reductions (Qwen3's QK-norm: each head's vector normalised over its own
features), the footprint is carried back through each op's write and read accesses
(:func:`_back`; per coordinate a set of indices, an over-approximation that can only refuse more)
until a projection is reached (an operand every heads block reads whole and that no projection
produces, as HF LLaMA's rotary ``cos``/``sin`` built from positions, is replicated: not traced);
grouped-query attention's ``q = g + G h`` index is handled the same way. A value another op split
over heads computes (Gemma-2's scores soft-capped by ``tanh`` between ``q @ k.T`` and the softmax) is
the rank's own where the footprint stays within what that op computes on the rank's heads.
Separate projections (one block each) are plain ``ColwiseParallel``, and so is a fused projection
whose heads each hold their own ``q, k, v`` one after another (GPT-NeoX, BLOOM: features
``h·3d + j``), where a rank's operands together read the ``r``-th block of the features, with no
regrouping. A fused ``q|k|v`` projection's weight rows (and bias) are regrouped rank-major,

.. math::  \pi = \big[\, c_j + r w_j + i \;\big|\; r < t,\ j \text{ by offset},\ i < w_j \,\big],

and the regrouped weight is sharded ``Shard(0)`` (:class:`FusedColwiseParallel`, a DTensor
``ColwiseParallel``): rank ``r``'s local output is ``[q_r | k_r | v_r]``, which the module's own
forward splits into equal parts and views with ``-1`` heads of the fixed head size. ``n:tp`` is
thus executed as a permutation of the block split of ``n``: the same share per rank and the same
(zero) communication the cost model priced; a plain ``ColwiseParallel`` would hand rank 0 all of
``q`` and half of ``k``. The parameter's global DTensor view is the regrouped weight (a checkpoint
of this plan resumes under the same plan; :func:`qkv_rows` maps it back). The output projection
(row-parallel over the heads factor ``k_0``) is a plain ``RowwiseParallel``: its input features
``h·d + e`` split in blocks are the same head blocks.

**Megatron pairs** are read off the graph too: a column-parallel Linear's partner is the
row-parallel Linear its output shards reach through pointwise ops only (:func:`sharded_consumer`),
and every row-parallel Linear must have such a partner or read a head-parallel attention's output
(:func:`reads_head_shards`). A column-parallel Linear wider than its partner's input (Phi-3's fused
``[gate; up]`` projection, chunked in two and multiplied) is regrouped like a fused ``q|k|v``, by the
blocks its partner's ranks read, traced back the same way (:func:`paired_blocks`).

**Vocabulary-parallel embedding** (``v:tp``): ``RowwiseParallel`` on ``nn.Embedding`` shards the
table's rows; each rank looks up the ids it owns and the partial rows are all-reduced. An output
head tied to the token embedding is column-parallel over the same vocabulary rows (``Shard(0)`` of
the same table), so the tie is kept: both modules hold one DTensor parameter.

**Fingerprint**: the strategy names its model by :func:`polyparallel.strategy.fingerprint` of the
canonicalised, fused graph the planner priced, captured at one micro-batch ``b = B / (dp·m)``. The
hash covers every extent, the batch included, so the model given to ``train`` is captured at that
same ``b`` (on the meta device) — whatever example batch the search was given — and the two hashes
compared.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from torch.func import functional_call
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.utils._python_dispatch import TorchDispatchMode

from polyparallel import frontends as pp
from polyparallel.backends.torch._context_parallel import RingAttention
from polyparallel.backends.torch._sequence_parallel import UlyssesAttention, offset_positions, shard_tables
from polyparallel.backends.torch.op_roles import chunked_evenly, first_activation, op_role
from polyparallel.frontends.torch import quiet_fake_tensors
from polyparallel.ir import Graph, Op, OpKind, TensorKind
from polyparallel.references import user_frame
from polyparallel.strategy import fingerprint
from polyparallel.transforms import canonicalize, fuse_elementwise

__all__ = [
    "FingerprintMismatch",
    "FusedColwiseParallel",
    "HeadSplit",
    "Region",
    "UncapturedModel",
    "build_mesh",
    "capture_for_strategy",
    "check_fingerprint",
    "eager_tp_problem",
    "forward_problem",
    "head_split",
    "linear_widths",
    "micro_batch",
    "paired_blocks",
    "parallelize",
    "qkv_rows",
    "reads_head_shards",
    "replica_mesh",
    "sharded_consumer",
    "step_context",
    "strategy_graph",
    "tie_groups",
    "tied_shards",
    "transposed_problem",
]


class FingerprintMismatch(ValueError):
    """The model given to ``train`` is not the model the strategy was searched for."""


class UncapturedModel(FingerprintMismatch):
    """The model given to ``train`` could not be captured to compare it with the strategy's."""


@dataclass(frozen=True)
class HeadSplit:
    """How an attention op split over heads reads one projection's output: ``segments`` are the
    widths of the blocks of output features it reads (by offset: ``q, k, v`` for a fused
    projection, one block for a separate one); ``fused`` is True when rows must be regrouped."""

    producer: str  # op name of the projection
    module: str  # its module path
    segments: tuple[int, ...]

    @property
    def fused(self) -> bool:
        return len(self.segments) > 1


def qkv_rows(segments: tuple[int, ...], parts: int) -> list[int]:
    """The permutation ``pi`` of the module docstring: output rows regrouped rank-major."""
    offsets = list(itertools.accumulate((0, *segments[:-1])))
    rows: list[int] = []
    for r in range(parts):
        for c, w in zip(offsets, segments):
            rows += range(c + r * w // parts, c + (r + 1) * w // parts)
    return rows


Region = tuple[frozenset[int] | None, ...]  # per coordinate: the indices needed, None for all of them
_MAX_POINTS = 1 << 20


class _NotHeadLocal(Exception):
    """The heads of an attention cannot be traced to column blocks of projections."""


def _values(e: Any, ext: dict[str, int], cons: dict[str, frozenset[int]]) -> frozenset[int] | None:
    """Values of index expression ``e`` with the constrained loop dims in their sets (None: every
    value; an over-approximation when ``e`` uses no constrained dim, which can only refuse more)."""
    dims = [d for d, _ in e.terms]
    if not any(d in cons for d in dims):
        return None
    ranges = [sorted(cons[d]) if d in cons else range(ext[d]) for d in dims]
    if math.prod(len(r) for r in ranges) > _MAX_POINTS:
        raise _NotHeadLocal(f"index {e} spans too many points to enumerate")
    # the sums over the product of the ranges, one axis at a time (an attention's heads block is ~10^4 points)
    vals = np.array([e.const], dtype=np.int64)
    for (_, c), r in zip(e.terms, ranges):
        vals = (vals[:, None] + c * np.asarray(r, dtype=np.int64)[None, :]).ravel()
    return frozenset(np.unique(vals).tolist())


def _constraints(write: Any, region: Region, ext: dict[str, int]) -> dict[str, frozenset[int]] | None:
    """Loop-dim values whose write lands in ``region``; None when the statement writes nothing there."""
    cons: dict[str, frozenset[int]] = {}
    for e, allowed in zip(write.index, region):
        if allowed is None:
            continue
        if not e.terms:
            if e.const not in allowed:
                return None
            continue
        if len(e.terms) != 1:
            raise _NotHeadLocal(f"write index {e} mixes loop dims")
        ((x, c),) = e.terms
        vals = frozenset(v for v in range(ext[x]) if c * v + e.const in allowed)
        cons[x] = cons.get(x, vals) & vals
        if not cons[x]:
            return None
    return cons


def _is_projection(graph: Graph, op: Op | None) -> bool:
    return op is not None and OpKind(op.kind) is OpKind.CONTRACTION and any(
        graph.tensors[t].kind is TensorKind.PARAM for t in op.inputs)


def _reads_under(graph: Graph, op: Op, cons: dict[str, frozenset[int]], found: dict[str, list[Region]],
                 statements: Any, held: Mapping[str, Region]) -> None:
    """Trace every activation that ``statements`` of ``op`` read under ``cons`` back to projections."""
    assert op.nest is not None
    ext = op.nest.extents
    temps: set[str] = set()
    for st in statements:
        for a in st.reads:
            if a.operand.startswith("in") and a.operand[2:].isdigit():
                t = op.inputs[int(a.operand[2:])]
                if graph.tensors[t].kind is TensorKind.ACTIVATION:
                    _back(graph, t, tuple(_values(e, ext, cons) for e in a.index), found, held)
            elif not a.operand.startswith("out"):
                temps.add(a.operand)
    if temps:  # an op-internal temporary (a fused chain): its writers run over the same loop dims
        _reads_under(graph, op, cons, found, [st for st in op.nest.statements
                                              if any(w.operand in temps for w in st.writes)], held)


def _from_projection(graph: Graph, tensor: str) -> bool:
    """Whether any projection (a contraction with a parameter) is among ``tensor``'s producers."""
    frontier = [tensor]
    for t in _each_once(frontier):
        prod = graph.producer(t)
        if _is_projection(graph, prod):
            return True
        if prod is not None:
            frontier.extend(i for i in prod.inputs if graph.tensors[i].kind is TensorKind.ACTIVATION)
    return False


def _back(graph: Graph, tensor: str, region: Region, found: dict[str, list[Region]],
          held: Mapping[str, Region] | None = None) -> None:
    """Follow ``region`` of ``tensor`` back through pointwise ops (elementwise, concat, views) and
    reductions to the projections producing it; record the region of each projection output reached
    in ``found``. ``held``: tensors the rank computes itself (the outputs of other head-split ops,
    Gemma-2's soft-capped scores between ``q @ k.T`` and the softmax) and the region it holds of
    each; a read inside it is local, one outside it is refused."""
    held = held or {}
    if tensor in held:
        if any(h is not None and (r is None or not r <= h) for r, h in zip(region, held[tensor])):
            raise _NotHeadLocal(f"{tensor!r}, the output of another op split over heads, is read outside the rank's "
                                "heads")
        return
    prod = graph.producer(tensor)
    if _is_projection(graph, prod):
        found.setdefault(tensor, []).append(region)
        return
    if all(r is None for r in region) and not _from_projection(graph, tensor):
        return  # read whole by every heads block and computed without parameters (rotary tables): replicated
    # a reduction's footprint is exact too: the dims it reduces are in no write index, so the region
    # constrains none of them and all are read (QK-norm: each head's vector normalised over its own
    # features stays within the head's block; a norm over every head's features reads all of them)
    if prod is None or prod.nest is None or OpKind(prod.kind) not in (OpKind.ELEMENTWISE, OpKind.CONCAT,
                                                                        OpKind.VIEW, OpKind.REDUCE):
        what = f"op {prod.name!r} ({prod.kind})" if prod is not None else "no op"
        raise _NotHeadLocal(f"{tensor!r} comes from {what}, not from projections through pointwise ops")
    out = f"out{prod.outputs.index(tensor)}"
    for st in prod.nest.statements:
        for w in st.writes:
            if w.operand == out:
                cons = _constraints(w, region, prod.nest.extents)
                if cons is not None:
                    _reads_under(graph, prod, cons, found, [st], held)


def _held(ops: Mapping[str, Op], split: Sequence[tuple[str, str]], r: int, parts: int) -> dict[str, Region]:
    """The region of each output of the ops ``split`` over heads that rank ``r`` computes: its write
    index under the ``r``-th block of the split dim."""
    held: dict[str, Region] = {}
    for name, dim in split:
        op = ops.get(name)
        if op is None or op.nest is None or dim not in op.nest.extents:
            continue
        ext = op.nest.extents
        step = ext[dim] // parts
        cons = {dim: frozenset(range(r * step, (r + 1) * step))}
        for st in op.nest.statements:
            for w in st.writes:
                if w.operand.startswith("out") and w.operand[3:].isdigit():
                    held[op.outputs[int(w.operand[3:])]] = tuple(_values(e, ext, cons) for e in w.index)
    return held


def head_split(graph: Graph, split: Sequence[tuple[str, str]], parts: int) -> tuple[list[HeadSplit], list[str]]:
    """Check that the ops ``split`` over heads (``(op name, dim)`` pairs: attention ops, or the
    products and softmax of an attention written out) read, together, contiguous feature blocks of
    projection outputs (module docstring), directly or through pointwise ops (e.g. rotary
    embeddings); return the projections, or the reasons it does not. An input another op of
    ``split`` produces is that op's local shard (``p`` of ``p @ v`` from the softmax), not traced:
    every rank computes the chain from its projection shards to the output projection on local
    tensors, whatever shapes they have."""
    ops = {o.name: o for o in graph.ops}
    local = {t for name, _ in split if name in ops for t in ops[name].outputs}
    # per projection output: per (op, operand): the features each rank's heads need
    need: dict[str, dict[tuple[str, int], list[set[int]]]] = {}
    for op_name, dim in split:
        op = ops.get(op_name)
        if op is None or op.nest is None or op_role(graph, op) not in ("attention", "heads"):
            return [], [f"op {op_name!r} is not an attention op (or a product or softmax of one) of the model's "
                        "captured graph"]
        ext = op.nest.extents
        if dim not in ext:
            return [], [f"attention op {op_name!r} has no dim {dim!r}"]
        if ext[dim] % parts:
            return [], [f"attention op {op_name!r}: {ext[dim]} heads ({dim!r}) do not split into {parts} equal "
                        "blocks"]
        step = ext[dim] // parts
        try:
            for j, t in enumerate(op.inputs):
                if graph.tensors[t].kind is not TensorKind.ACTIVATION or t in local:
                    continue
                for r in range(parts):
                    found: dict[str, list[Region]] = {}
                    cons = {dim: frozenset(range(r * step, (r + 1) * step))}
                    for a in (a for st in op.nest.statements for a in st.reads if a.operand == f"in{j}"):
                        _back(graph, t, tuple(_values(e, ext, cons) for e in a.index), found,
                              _held(ops, split, r, parts))
                    for lt, regions in found.items():
                        feats: set[int] = set()
                        for reg in regions:
                            if reg[-1] is None or any(c is not None for c in reg[:-1]):
                                raise _NotHeadLocal(f"its heads block reads {lt!r} along other axes than a block "
                                                    "of its features")
                            feats |= reg[-1]
                        need.setdefault(lt, {}).setdefault((op_name, j), []).append(feats)
        except _NotHeadLocal as e:
            return [], [f"attention op {op_name!r} split over {dim!r}: {e}"]
    out: list[HeadSplit] = []
    problems: list[str] = []
    for lt, by_operand in need.items():
        prod = graph.producer(lt)
        assert prod is not None
        width = graph.tensors[lt].shape[-1]
        segments, scattered, untiled = _regrouping(width, parts, by_operand)
        problems += [f"attention op {op_name!r}: the heads blocks of in{j} are not consecutive ranges of {lt!r}'s "
                     "features" for op_name, j in scattered]
        if untiled:
            names = ", ".join(sorted({n for n, _ in by_operand}))
            problems.append(f"attention op(s) {names} read {lt!r} in blocks {untiled} that do not tile its "
                            f"{width} features")
        out.append(HeadSplit(producer=prod.name, module=prod.module, segments=segments))
    return (out, []) if not problems else ([], problems)


def _regrouping(width: int, parts: int, reads: Mapping[Any, Sequence[set[int] | frozenset[int]]]
                ) -> tuple[tuple[int, ...], list[Any], list[tuple[int, int]]]:
    """How a projection's ``width`` output features are split so that rank ``r`` holds what it reads:
    ``reads[key][r]``, the features read ``key`` takes on rank ``r``. Returns the widths of the blocks to
    regroup rank-major (:func:`qkv_rows`), the reads whose features are no consecutive block per rank,
    and the ``(offset, width)`` blocks when they do not tile the features (else empty). One block,
    ``(width,)``, is the plain column split: the reads of rank ``r`` together are its ``r``-th block
    (heads laid out one after another, each with its own ``q, k, v``: GPT-NeoX's and BLOOM's fused
    projection, features ``h·3d + j``; a GLU over interleaved features)."""
    union = [set().union(*(blocks[r] for blocks in reads.values())) for r in range(parts)]
    if width % parts == 0 and all(len(b) == parts for b in reads.values()) and all(
            union[r] == set(range(r * width // parts, (r + 1) * width // parts)) for r in range(parts)):
        return (width,), [], []
    segs: set[tuple[int, int]] = set()  # (offset, width); an operand read by two ops counts once
    scattered = []
    for key, blocks in reads.items():
        w, c = len(blocks[0]), min(blocks[0])
        if len(blocks) != parts or any(b != set(range(c + r * w, c + (r + 1) * w)) for r, b in enumerate(blocks)):
            scattered.append(key)
        segs.add((c, w * parts))
    order = sorted(segs)
    ends = [c + w for c, w in order]
    tiles = order[0][0] == 0 and ends[-1] == width and all(order[i + 1][0] == ends[i] for i in range(len(order) - 1))
    return tuple(w for _, w in order), scattered, [] if tiles else order


def paired_blocks(graph: Graph, src: str, dst: str, parts: int) -> tuple[int, ...] | str:
    """The blocks of the column-parallel Linear ``src``'s output features that the row-parallel
    Linear ``dst`` reads, when ``src`` is wider than ``dst``'s input: a fused ``[gate; up]``
    projection (Phi-3's ``gate_up_proj`` chunked in two and multiplied) or a GLU over interleaved
    features. Rank ``r`` of ``dst`` reads the ``r``-th block of its input features; that region is
    followed back through the pointwise ops to ``src``'s output (:func:`_back`, as for attention
    heads). Returns the widths of the blocks to regroup rank-major (:func:`qkv_rows`): one block when
    rank ``r`` reads the ``r``-th block of ``src``'s features (no regrouping), several when each
    read takes the ``r``-th block of one segment (``(I, I)`` for ``gate | up``); else the reason."""
    dst_op = next((op for op in graph.ops if op.module == dst and OpKind(op.kind) is OpKind.CONTRACTION), None)
    src_out = {t for op in graph.ops if op.module == src and OpKind(op.kind) is OpKind.CONTRACTION for t in op.outputs}
    if dst_op is None or len(src_out) != 1:
        return f"no single Linear op of {src!r} feeding one of {dst!r} in the captured graph"
    (y,) = src_out
    x = dst_op.inputs[first_activation(graph, dst_op)]
    shape, width = graph.tensors[x].shape, graph.tensors[y].shape[-1]
    if shape[-1] % parts or width % parts:
        return f"{shape[-1]} and {width} features do not split into {parts} equal blocks"
    step = shape[-1] // parts
    reads: list[list[frozenset[int]]] = []  # per rank: the features of each read of src's output
    try:
        for r in range(parts):
            found: dict[str, list[Region]] = {}
            _back(graph, x, (*(None,) * (len(shape) - 1), frozenset(range(r * step, (r + 1) * step))), found)
            if set(found) - {y}:
                return f"{dst!r} also reads {sorted(set(found) - {y})[0]!r} through pointwise ops"
            if any(reg[-1] is None or any(c is not None for c in reg[:-1]) for reg in found.get(y, ())):
                return f"{dst!r}'s blocks read {y!r} along other axes than a block of its features"
            reads.append([reg[-1] for reg in found.get(y, []) if reg[-1] is not None])
    except _NotHeadLocal as e:
        return str(e)
    if not reads[0] or any(len(rs) != len(reads[0]) for rs in reads):
        return f"the blocks of {dst!r}'s input do not each read {y!r} alike"
    segments, scattered, untiled = _regrouping(width, parts, {j: [rs[j] for rs in reads] for j in range(len(reads[0]))})
    if scattered:
        return f"the blocks of {dst!r}'s input read {y!r}'s features in no consecutive blocks per rank"
    if untiled:
        return f"{dst!r} reads {y!r} in blocks {untiled} that do not tile its {width} features"
    return segments


class FusedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` over a projection whose output holds several head-major blocks (fused
    ``q|k|v``): the weight rows and bias are regrouped by :func:`qkv_rows` before ``Shard(0)``, so
    rank ``r`` owns rows ``[q_r | k_r | v_r]`` — whole heads of every block."""

    def __init__(self, segments: tuple[int, ...], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.segments = tuple(segments)

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        rows = torch.tensor(qkv_rows(self.segments, device_mesh.size()))
        for pname, param in module.named_parameters(recurse=False):
            if param.shape[0] != sum(self.segments):
                raise ValueError(f"{name}.{pname}: {param.shape[0]} rows, but the attention reads "
                                 f"{sum(self.segments)} features in blocks {self.segments}")
            regrouped = param.detach().index_select(0, rows.to(param.device))
            dist = nn.Parameter(distribute_tensor(regrouped, device_mesh, [Shard(0)],
                                                  src_data_rank=self.src_data_rank),
                                requires_grad=param.requires_grad)
            module.register_parameter(pname, dist)

    def __repr__(self) -> str:
        return f"FusedColwiseParallel(segments={self.segments})"


def tie_groups(model: nn.Module) -> list[list[str]]:
    """Parameters shared by several modules (e.g. an output head tied to the token embedding), as
    lists of ``module.param`` paths."""
    owners: dict[int, list[str]] = {}
    for name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    return [paths for paths in owners.values() if len(paths) > 1]


def _each_once(frontier: list[str]) -> Iterator[str]:
    """Tensors popped off ``frontier`` (which the caller extends while walking) until it is empty,
    each tensor once."""
    seen: set[str] = set()
    while frontier:
        t = frontier.pop()
        if t not in seen:
            seen.add(t)
            yield t


def sharded_consumer(graph: Graph, src: str, dst: str | None, columns: frozenset[str] = frozenset()) -> str | None:
    """Check that every use of the output of the Linear at module ``src`` reaches the row-parallel
    Linear at module ``dst`` (or, with ``dst=None``, the loss) through pointwise ops only, so its
    column shards may flow there unreduced. A pointwise epilogue fused into another column-parallel
    Linear (``columns``; e.g. ``silu(gate(h)) * up(h)`` fused into ``gate``) is such a pointwise op:
    it combines equal column blocks. Returns None if so, else the op where a shard would be
    consumed as if it were the whole tensor."""
    frontier = [t for op in graph.ops if op.module == src and OpKind(op.kind) is OpKind.CONTRACTION
                for t in op.outputs]
    if not frontier:
        return f"(no Linear op of module {src!r} in the captured graph)"
    for t in _each_once(frontier):
        users = graph.consumers(t)
        if not users and t in graph.outputs:
            return "(the graph's output)"
        for op in users:
            kind = OpKind(op.kind)
            if kind is OpKind.CONTRACTION and dst is not None and op.module == dst:
                continue
            if kind is OpKind.LOSS and dst is None:
                continue
            if kind in (OpKind.ELEMENTWISE, OpKind.VIEW) or (kind is OpKind.CONTRACTION and op.module in columns
                                                              and op.inputs[first_activation(graph, op)] != t):
                frontier.extend(op.outputs)
                continue
            return f"{op.name!r} ({op.target})"
    return None


def reads_head_shards(graph: Graph, module: str, attention: frozenset[str]) -> bool:
    """Whether the Linear at ``module`` reads (through pointwise ops) the output of one of the
    head-parallel ``attention`` ops, i.e. an input already split by heads over ``tp``."""
    frontier = [op.inputs[first_activation(graph, op)] for op in graph.ops
                if op.module == module and OpKind(op.kind) is OpKind.CONTRACTION]
    for t in _each_once(frontier):
        prod = graph.producer(t)
        if prod is None:
            continue
        if prod.name in attention:
            return True
        if OpKind(prod.kind) in (OpKind.ELEMENTWISE, OpKind.VIEW):
            frontier.extend(i for i in prod.inputs if graph.tensors[i].kind is TensorKind.ACTIVATION)
    return False


# dim of the weight each tp kind shards: Linear weights are (out, in), embedding tables (vocab, dim)
_WEIGHT_SHARD = {"col": 0, "col_fused": None, "col_gather": 0, "col_to_loss": 0, "row": 1, "emb_row": 0}


def linear_widths(module: nn.Module | None) -> tuple[int, int, bool] | None:
    """``(inputs, outputs, transposed)`` of a module tensor parallelism splits as a Linear: an
    ``nn.Linear`` (weight ``(outputs, inputs)``), or Hugging Face's ``Conv1D`` (GPT-2's projections:
    ``addmm(bias, x, weight)`` with the weight stored ``(inputs, outputs)``, ``transposed``); None
    for any other module."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    w = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2:
        return int(w.shape[0]), int(w.shape[1]), True
    return None


def transposed_problem(module: nn.Module | None, path: str) -> str | None:
    """Why torch's parallel styles cannot run ``module`` split over tp in the model's own forward (a
    ``Conv1D``, whose weight they would cut along the wrong dim), or None."""
    widths = linear_widths(module)
    if widths is None or not widths[2]:
        return None
    return (f"{path!r} is Hugging Face's Conv1D, whose weight is stored (inputs, outputs): torch's parallel styles "
            "shard an nn.Linear's (outputs, inputs)")


# tp kinds whose sharded dim is a vocabulary (an embedding table's rows, an output layer's classes):
# inside pipeline stages these are cut unevenly where the vocabulary does not divide by tp
VOCAB_KINDS = frozenset({"emb_row", "col_to_loss"})


def uneven_shards(model: nn.Module, kinds: dict[str, str], tp: int) -> list[str]:
    """The tensor-parallel modules inside pipeline stages whose weight's sharded dim ``tp`` cannot
    cut: any dim that does not divide, except a vocabulary (:data:`VOCAB_KINDS`) that ``torch.chunk``
    still gives every rank rows of. Checked before the model is exported to cut it."""
    modules = dict(model.named_modules())
    out = []
    for path, kind in sorted(kinds.items()):
        dim = _WEIGHT_SHARD.get(kind)
        widths = linear_widths(modules.get(path))
        if dim is not None and widths is not None and widths[2]:
            dim = 1 - dim  # Conv1D's weight is (inputs, outputs)
        w = getattr(modules.get(path), "weight", None)
        if dim is None or w is None or w.dim() <= dim or not w.shape[dim] % tp:
            continue
        if kind in VOCAB_KINDS and chunked_evenly(w.shape[dim], tp):
            continue
        out.append(f"parameter {path + '.weight'!r} ({tuple(w.shape)}) does not split over tp={tp} (dim {dim}); "
                   f"make it a multiple of {tp} or keep the module whole")
    return out


def tied_shards(model: nn.Module, kinds: dict[str, str], called: set[str] | None = None
                ) -> tuple[list[tuple[str, ...]], list[str]]:
    """The tied parameter groups touched by tensor parallelism, and why a group cannot be kept tied.

    A tie survives sharding only when every module sharing the parameter shards the same dim of it
    (a vocabulary-parallel embedding and a column-parallel output head both shard the vocabulary
    rows); the group is then re-tied to one DTensor parameter after ``parallelize_module``.
    ``called``: the module paths the forward runs (the captured graph's); a module holding the
    table that the forward never calls (BART's ``shared``, whose weight the encoder's and decoder's
    embeddings use) has no split of its own.
    """
    groups, problems = [], []
    for group in tie_groups(model):
        mods = [p.rsplit(".", 1)[0] if "." in p else "" for p in group]
        dims = {kinds.get(m, "none") for m in mods if called is None or m in kinds or m in called}
        if dims == {"none"}:
            continue
        shard = {_WEIGHT_SHARD.get(k, "none") if k != "none" else "none" for k in dims}
        if len(shard) != 1 or None in shard or "none" in shard or not all(p.endswith(".weight") for p in group):
            problems.append(f"parameter shared by {', '.join(group)} is split as {sorted(dims)}: a tied weight "
                            "stays tied only when every module using it shards the same dim")
            continue
        groups.append(tuple(group))
    return groups, problems


# ---------------------------------------------------------------------------------------------
# the model fingerprint


def _captures(model_fn: Callable[[], nn.Module], example: tuple[Any, ...]) -> Iterator[Graph | str]:
    """The graph the planner would price for ``model_fn()`` on ``example`` (captured, canonicalised,
    fused), built on the meta device and then on the CPU; a capture that fails yields its error."""
    for device in ("meta", None):
        try:
            if device is None:
                model = model_fn()
            else:
                with torch.device(device):
                    model = model_fn()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield fuse_elementwise(canonicalize(pp.capture(model, example)))
        except Exception as e:  # the meta attempt fails for models that build real tensors: try the CPU
            yield f"{device or 'cpu'}: {type(e).__name__}: {e}"


def capture_for_strategy(model_fn: Callable[[], nn.Module], example: tuple[Any, ...]) -> Graph:
    """The graph the planner would price for ``model_fn()`` on ``example`` (one micro-batch):
    captured (on the meta device when the model builds there), canonicalised, fused."""
    errors = []
    for g in _captures(model_fn, example):
        if isinstance(g, Graph):
            return g
        errors.append(g)
    raise ValueError("cannot capture the model to compare it with the strategy's: " + "; ".join(errors))


def micro_batch(strategy: Any, batch: tuple[Any, ...]) -> tuple[Any, ...]:
    """The first micro-batch of one global ``batch``: the ``B / (dp·m)`` rows a rank computes on,
    at which the planner captured (and fingerprinted) the model."""
    b = strategy.global_batch // (strategy.dp * strategy.microbatches)
    return tuple(t[:b] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in batch)


def strategy_graph(strategy: Any, model_fn: Callable[[], nn.Module], batch: tuple[Any, ...],
                   check: bool) -> Graph | None:
    """Capture ``model_fn()`` on one micro-batch of ``batch`` (``B / (dp·m)`` rows, the size the
    planner fingerprinted) and, with ``check``, refuse it unless it is the strategy's model.

    A model whose code branches on the device its tensors live on (HF Mixtral's expert counts, T5's
    label shift) captures differently on the meta device and on the CPU; the planner captured it
    where the user built it. So the meta capture (no weights allocated) is tried first and the CPU
    capture when the meta one does not match.

    Returns None when the capture fails and ``check`` is off (plans that need the graph are then
    refused by :func:`~polyparallel.backends.torch.plan_for`).
    """
    example = micro_batch(strategy, batch)
    graphs: list[Graph] = []
    errors: list[str] = []
    for g in _captures(model_fn, example):
        if isinstance(g, str):
            errors.append(g)
            continue
        if not check or fingerprint(g) == strategy.model.fingerprint:
            return g
        graphs.append(g)
    if graphs:
        check_fingerprint(strategy, graphs[0])  # raises, naming the first capture's fingerprint
    e = ValueError("cannot capture the model to compare it with the strategy's: " + "; ".join(errors))
    if check:
        raise UncapturedModel(f"{e}. Pass check_fingerprint=False (CLI: --no-fingerprint-check) to run "
                                  "without comparing the model with the strategy's") from e
    return None


def check_fingerprint(strategy: Any, graph: Graph) -> None:
    """Refuse a model that is not the one the strategy was searched for (module docstring)."""
    got = fingerprint(graph)
    want = strategy.model.fingerprint
    if got == want:
        return
    raise FingerprintMismatch(
        f"the model given to train is not the model this strategy was made for: its fingerprint is {got} "
        f"({graph.param_count():,} parameters, {len(graph.ops)} ops at micro-batch "
        f"{graph.tensors[graph.inputs[0]].shape[0] if graph.inputs else '?'}), the strategy's is {want} "
        f"({strategy.model.name}, {strategy.model.params:,} parameters). Search again for this model, or pass "
        "check_fingerprint=False (CLI: --no-fingerprint-check) to run a smaller stand-in with the same module "
        "paths")


# ---------------------------------------------------------------------------------------------
# on the workers


def build_mesh(device_type: str, plan: Any) -> Any:
    """The ``("dp", "sp", "tp")`` mesh, tensor-parallel fastest as in the strategy's device order;
    its ``"sp"`` dim is the sequence split, by Ulysses (``sp``) or ring attention (``cp``)."""
    return init_device_mesh(device_type, (plan.dp, plan.seq, plan.tp), mesh_dim_names=("dp", "sp", "tp"))


def replica_mesh(mesh: Any, plan: Any) -> Any:
    """The ranks holding replicas of the same parameters, over which gradients are averaged: ``dp``,
    times ``sp`` (sequence shards hold the full parameters and see different tokens)."""
    return mesh["dp", "sp"]._flatten("dp_sp") if plan.seq > 1 else mesh["dp"]


def parallelize(model: nn.Module, plan: Any, mesh: Any) -> None:
    """Apply the plan's tensor-parallel styles on ``mesh["tp"]``, re-tie shared weights, and offset
    position indices on sequence shards."""
    if plan.tp > 1 and plan.tp_plan:
        fused = dict(plan.fused)
        styles = {"col": ColwiseParallel, "row": RowwiseParallel,
                  "col_gather": lambda: ColwiseParallel(output_layouts=Replicate()),
                  "col_to_loss": lambda: ColwiseParallel(use_local_output=False),
                  "emb_row": lambda: RowwiseParallel(input_layouts=Replicate())}
        parallelize_module(model, mesh["tp"], {
            path: FusedColwiseParallel(fused[path]) if path in fused else styles[kind]()
            for path, kind in plan.tp_plan})
        for path, kind in plan.tp_plan:
            if kind != "col_to_loss":  # the others return DTensor.to_local()'s view of the result
                model.get_submodule(path).register_forward_hook(_own_output)
        for group in plan.tied:
            param = model.get_parameter(group[0])
            for other in group[1:]:
                path, _, name = other.rpartition(".")
                setattr(model.get_submodule(path), name, param)
    if plan.seq > 1:
        rank = mesh["sp"].get_local_rank()
        for path in plan.positions:
            offset_positions(model.get_submodule(path), plan.seq, rank, plan.cp > 1)
        shard_tables(model, plan.tables, plan.seq, rank, plan.cp > 1)


def _own_output(module: nn.Module, args: Any, output: Any) -> Any:
    """A tensor-parallel module's local output as a tensor of its own: ``to_local()`` returns a view
    made inside a custom autograd Function, which autograd refuses to see modified in place, and
    models do that (HF Falcon's ``mlp_output += attention_output`` on the row-parallel MLP's
    output). One copy of the module's output per call."""
    return output.clone() if isinstance(output, torch.Tensor) else output


def _local_rows(n: int, tp: int, rank: int) -> int:
    """How many of ``n`` rows ``torch.chunk`` (DTensor's ``Shard``) gives ``rank`` of ``tp``."""
    size = -(-n // tp)
    return max(0, min(size, n - rank * size))


def forward_problem(model: nn.Module, batch: tuple[Any, ...], shapes: dict[str, tuple[int, ...]] | None = None,
                    kwargs: dict[str, Any] | None = None) -> str | None:
    """Why ``model(*batch)`` fails, in one line naming the user's line, or None when it runs. It runs
    on fake tensors (no memory, no compute), with the parameters and buffers named in ``shapes``
    replaced by tensors of those shapes."""
    with quiet_fake_tensors(), FakeTensorMode() as mode:
        args = tuple(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in batch)
        kw = {k: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for k, t in (kwargs or {}).items()}
        try:
            _fake_call(model, shapes or {}, args, kw)
        except Exception as e:  # any failure of the user's forward is the answer
            frame = user_frame(e)
            where = f" (at {frame.filename}:{frame.lineno}: {frame.line})" if frame else ""
            return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}{where}"
    return None


def _fake_call(model: nn.Module, shapes: dict[str, tuple[int, ...]], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
    """``model(*args, **kwargs)`` under the caller's fake tensor mode on fake parameters and buffers of their own shapes
    (static ones, under a symbolic mode too), those named in ``shapes`` of those shapes.

    The fakes are made from the tensors' metadata, not with ``mode.from_tensor``: its memo keeps
    weak references to the module's own tensors, and a planning process that also exported the
    module (the collaborative search checks each center's plan so) crashed freeing a parameter later
    (a dangling weak reference in ``PyObject_ClearWeakRefs``)."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    state = {n: torch.empty(shapes[n], dtype=t.dtype) if n in shapes else
             torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=t.device)
             for n, t in tensors}
    return functional_call(model, state, args, kwargs, tie_weights=False)


def eager_tp_problem(model: nn.Module, tp_plan: dict[str, str], tp: int, batch: tuple[Any, ...],
                     kwargs: dict[str, Any] | None = None) -> str | None:
    """Why ``model``'s own forward fails on the local shards :func:`parallelize` gives a rank, or
    None when it runs (:func:`forward_problem`), with every column-parallel Linear's weight and bias
    cut to the rank's rows and every row-parallel weight to its columns, as ``parallelize_module``'s
    local outputs are. The other styles (gathered columns, vocabulary-parallel embeddings,
    class-parallel logits) leave the module's output whole.

    A forward that sizes views from its configuration rather than from the tensors (nanoGPT's
    ``c_attn(x).split(n_embd, dim=2)``) fails here, where the exported-graph rewrite of
    :mod:`._stage_tp`, which rewrites view sizes to the local ones, runs it. ``batch`` is one
    rank's ``(inputs, labels)``; ranks 0 and ``tp - 1`` are tried (uneven splits differ only there). A
    forward that runs on the shards but reshapes the data instead of the features is caught by
    :func:`_sized_from_config`."""
    for path in tp_plan:
        why = transposed_problem(model.get_submodule(path), path)
        if why:
            return why
    locals_: list[dict[str, tuple[int, ...]]] = []
    for rank in sorted({0, tp - 1}):
        shapes: dict[str, tuple[int, ...]] = {}
        for path, kind in tp_plan.items():
            mod = model.get_submodule(path)
            if not isinstance(mod, nn.Linear) or kind not in ("col", "row"):
                continue
            if kind == "col":
                rows = _local_rows(mod.out_features, tp, rank)
                shapes[path + ".weight"] = (rows, mod.in_features)
                if mod.bias is not None:
                    shapes[path + ".bias"] = (rows,)
            else:
                shapes[path + ".weight"] = (mod.out_features, _local_rows(mod.in_features, tp, rank))
        why = forward_problem(model, batch, shapes, kwargs)
        if why:
            return why
        locals_.append(shapes)
    return _sized_from_config(model, batch, locals_, kwargs)


class _ShapeLog(TorchDispatchMode):
    """The symbolic sizes (expressions of the inputs' sizes) of every tensor an op outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.sizes.update(str(d) for d in t.shape if isinstance(d, torch.SymInt))
        return out


def _sized_from_config(model: nn.Module, batch: tuple[Any, ...], local: list[dict[str, tuple[int, ...]]],
                       kwargs: dict[str, Any] | None = None) -> str | None:
    """Why the forward on a rank's shards reshapes a data dimension, or None. The model runs on fake
    inputs whose sizes are symbols, once whole and once per shard layout in ``local``: a forward that
    runs on the shards but sizes a view from its configuration (OPT's ``view(bsz, -1, num_heads,
    head_dim)`` on ``1/tp`` of the features puts half the sequence where the heads were) makes sizes
    such as ``seq // 2`` that the whole model never makes; a forward that follows its tensors splits
    only the features, whose sizes are numbers. A forward that cannot run on symbolic sizes is not
    judged here (None)."""
    seen: list[set[str]] = []
    with quiet_fake_tensors(), FakeTensorMode(shape_env=ShapeEnv()) as mode:
        def symbolic(t: Any) -> Any:
            return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC] * t.dim())) if isinstance(t, torch.Tensor) else t

        args = tuple(symbolic(t) for t in batch)
        kw = {k: symbolic(t) for k, t in (kwargs or {}).items()}
        for shapes in ({}, *local):
            try:
                with _ShapeLog() as log:
                    _fake_call(model, shapes, args, kw)
            except Exception:  # symbolic sizes the forward cannot take (data-dependent guards, ...)
                return None
            seen.append(log.sizes)
    # a shard's sizes may multiply a data size by fewer features (a flatten), but a size divided
    # (seq // 2) means a view cut the data where the whole model does not
    new = sorted(e for e in set().union(*seen[1:]) - seen[0] if any(op in e for op in ("/", "%", "Mod", "floor")))
    if not new:
        return None
    return (f"on a rank's shards the forward makes tensors sized {', '.join(new[:3])} (in the inputs' sizes), "
            "which the whole model never makes: a view sized from the model's configuration (e.g. view(batch, -1, "
            "num_heads, head_dim) on 1/tp of the features) reshapes the sequence or batch instead of the features")


def step_context(plan: Any, mesh: Any) -> Any:
    """What a forward and backward run under: ``loss_parallel`` for a class-parallel loss, the
    Ulysses attention mode with ``sp > 1``, ring attention with ``cp > 1``."""
    stack = ExitStack()
    if plan.loss_parallel:
        stack.enter_context(loss_parallel())
    if plan.sp > 1:
        stack.enter_context(UlyssesAttention(mesh["sp"]))
    elif plan.cp > 1:
        stack.enter_context(RingAttention(mesh["sp"]))
    return stack
