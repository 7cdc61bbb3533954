"""The layers of an op chain: which numbered layer a module path names, the repeated blocks of ops,
the layer chain, and min-max contiguous cuts of it (pipeline stages, balanced segments).

**Numbered modules** (:data:`LAYER`, :data:`NUMBERED_MODULE`). Two patterns, for two questions:

* :data:`LAYER` (:func:`layer_of`): a layer of the model's layer stack, a numbered child of a list
  named ``layer``/``layers``/``h``/``block``/``blocks`` — ``model.layers.7`` (LLaMA, Qwen2,
  Mixtral), ``transformer.h.3`` (GPT-2), ``encoder.layer.1`` (BERT, ViT), ``encoder.block.0`` (T5),
  ``...stages.0.layers.1`` (HF ResNet, ConvNeXt: the residual block, not the stage). It is the unit
  the cost model segments, recomputes and cuts pipeline chunks at, and the executor reads the same
  pattern (``backends/torch``: FSDP units, recomputed layers, the layers a pipeline chunk holds), so
  the price and the run agree; other numbered children (``features.3``, ``net.0``: one convolution
  or activation of a ``Sequential``) are not layers.
* :data:`NUMBERED_MODULE` (:func:`numbered_prefix`): the first numbered component of any module path
  (``attn.0.c_proj`` -> ``attn.0``, ``net.2`` -> ``net.2``). :func:`find_repeated_blocks` only asks
  whether two neighbouring ops lie in different numbered modules, to phase a repeat it found from the
  op signatures; a hint that any numbering gives (a nanoGPT's ``attn.0``/``mlp.0``, a UNet's
  ``Sequential`` s), where :data:`LAYER` gives none.

On every op of the repository's models and of ``tests/zoo.py`` / ``tests/zoo_recipes.py`` the two
agree except HF ResNet and ConvNeXt (``stages.0.layers.0``: :data:`LAYER` the block,
:data:`NUMBERED_MODULE` the stage), a nanoGPT (``attn.0``: only :data:`NUMBERED_MODULE`) and the
``Sequential`` s of the UNet and MLPs; :func:`find_repeated_blocks` finds the same blocks with either.

**Repeated blocks** (:func:`find_repeated_blocks`): with ``a`` the sequence of op
signatures, a tandem repeat of period ``p`` is a run of ``r`` consecutive positions
``i`` with ``a[i] = a[i + p]``; it covers ``⌊(r + p) / p⌋`` copies. The repeat with the
largest coverage (copies × p; ties: the smaller period) is taken. Its phase (any shift
within the run's slack) is chosen, in order, to agree with numbered-module boundaries
when present, to minimise the activations crossing instance boundaries (layers meet at
narrow cuts: the residual stream), then leftmost; and the search recurses on what lies
left and right of it. One numpy pass per period: O(n²) elementary comparisons, vectorised.

**Balance** (:func:`balance`, :func:`partition`): split costs ``x_1..x_n >= 0`` into
``K`` contiguous non-empty parts minimising the largest part sum (exact DP; proof in
:func:`partition`). The one min-max partitioner: :func:`balance` and :func:`layer_chain`
cut ops with it, the cost model's pipeline chunks (``polyparallel.cost_models.layers``)
cut layer segments with it.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from polyparallel.ir import Graph, Op, OpKind

__all__ = ["LAYER", "NUMBERED_MODULE", "Block", "Layer", "Segment", "balance", "find_repeated_blocks", "layer_chain",
           "layer_of", "numbered_prefix", "partition"]


# -- numbered modules --------------------------------------------------------------------------------

LAYER = re.compile(r"^(.*?\b(?:layers?|h|blocks?|layer)\.\d+)(?:\.|$)")
NUMBERED_MODULE = re.compile(r"^(.*?\.\d+)(\.|$)")


def layer_of(module: str) -> str | None:
    """The layer of the layer stack a module path lies in (``model.layers.7.mlp`` -> ``model.layers.7``;
    :data:`LAYER`), or None."""
    m = LAYER.match(module or "")
    return m.group(1) if m else None


def numbered_prefix(module: str) -> str:
    """The first numbered component of a module path (``transformer.h.3.attn.c_attn`` ->
    ``transformer.h.3``; :data:`NUMBERED_MODULE`), or the path itself when none is numbered."""
    m = NUMBERED_MODULE.match(module)
    return m.group(1) if m else module


def _numbered_prefixes(graph: Graph) -> list[str]:
    """:func:`numbered_prefix` per op; ops without a module path inherit the previous op's."""
    out, last = [], ""
    for op in graph.ops:
        last = numbered_prefix(op.module) if op.module else last
        out.append(last)
    return out


# -- repeated blocks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """``count`` consecutive copies of the same op sequence (identical signatures).

    Instance ``m`` spans ops ``start + m*length`` to ``start + (m+1)*length`` (exclusive)
    of the graph's op list; ``key`` is a hash of the signature sequence, equal for blocks
    with identical contents, so later stages price one instance per key.
    """

    start: int
    length: int
    count: int
    key: str

    @property
    def stop(self) -> int:
        return self.start + self.length * self.count

    @property
    def instances(self) -> tuple[range, ...]:
        return tuple(range(self.start + m * self.length, self.start + (m + 1) * self.length)
                     for m in range(self.count))

    @property
    def representative(self) -> range:
        return self.instances[0]

    def ops(self, graph: Graph, instance: int = 0) -> list[Op]:
        return [graph.ops[i] for i in self.instances[instance]]

    def __str__(self) -> str:
        return f"Block(ops {self.start}..{self.stop}: {self.count} x {self.length} ops, key {self.key[:8]})"



def _cut_widths(graph: Graph, *, nbytes: bool = False) -> np.ndarray:
    """``width[b]``: activations (their count, or bytes) produced before op ``b`` and read at or after it."""
    width = np.zeros(len(graph.ops) + 2, dtype=np.int64)
    made = {t: i for i, op in enumerate(graph.ops) for t in op.outputs}
    last: dict[str, int] = {}
    for j, op in enumerate(graph.ops):
        for t in op.inputs:
            if t in made:
                last[t] = j
    for t, j in last.items():
        w = graph.tensors[t].nbytes if nbytes else 1
        width[made[t] + 1] += w
        width[j + 1] -= w
    return np.cumsum(width)


def _seq_key(sigs: Sequence[str]) -> str:
    return hashlib.blake2b("\n".join(sigs).encode(), digest_size=12).hexdigest()


def _best_repeat(a: np.ndarray, lo: int, hi: int, min_length: int,
                 min_count: int) -> tuple[int, int, int, int] | None:
    """(start, period, run, coverage) of the largest-coverage tandem repeat inside ``a[lo:hi]``."""
    best: tuple[int, int, int, int] | None = None
    n = hi - lo
    for p in range(max(1, min_length), n // min_count + 1):
        eq = a[lo:hi - p] == a[lo + p:hi]
        edges = np.diff(np.concatenate(([0], eq.astype(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        if not len(starts):
            continue
        runs = ends - starts
        cover = ((runs + p) // p) * p
        cover[(runs + p) // p < min_count] = 0
        j = int(np.argmax(cover))
        if cover[j] and (best is None or cover[j] > best[3]):
            best = (lo + int(starts[j]), p, int(runs[j]), int(cover[j]))
    return best


_ANCHORS = frozenset({OpKind.CONTRACTION, OpKind.CONV, OpKind.ATTENTION, OpKind.NORM, OpKind.EMBEDDING,
                      OpKind.POOL, OpKind.SOFTMAX, OpKind.LOSS, OpKind.OPAQUE})


def find_repeated_blocks(graph: Graph, *, min_length: int = 2, min_count: int = 2,
                         anchors: Iterable[OpKind] = _ANCHORS) -> list[Block]:
    """Maximal runs of identical consecutive op sequences (e.g. the N decoder layers of a GPT).

    Signature-sequence repetition (module docstring) finds the blocks without module
    paths; where ops carry them (``transformer.h.3.attn``), the phase of a repeat is the
    one whose instance boundaries coincide with changes of :func:`numbered_prefix`.
    Blocks shorter than ``min_length`` ops or with fewer than ``min_count`` copies are not
    reported, nor blocks without an op of a kind in ``anchors`` (repeats of shape
    plumbing, e.g. the mask-building ops of a GPT prologue, are not layers). Returned
    sorted by start; blocks never overlap.

    Examples:
        Four identical linear-relu layers (the first reads the graph input, which
        makes its signature differ, so a negation comes first):

        >>> from polyparallel import ops
        >>> from polyparallel.frontends import GraphBuilder
        >>> from polyparallel.ir import TensorKind
        >>> b = GraphBuilder("mlp", "doc")
        >>> x = b.tensor("x", (2, 8), kind=TensorKind.INPUT); b.graph.inputs.append(x)
        >>> ew = lambda: ops.elementwise((2, 8), [(2, 8)])
        >>> _ = b.op("neg", OpKind.ELEMENTWISE, "aten.neg", [x], [b.tensor("x1", (2, 8))], ew)
        >>> x = "x1"
        >>> for i in range(4):
        ...     w = b.tensor(f"w{i}", (8, 8), kind=TensorKind.PARAM)
        ...     h, y = b.tensor(f"h{i}", (2, 8)), b.tensor(f"y{i}", (2, 8))
        ...     _ = b.op("fc", OpKind.CONTRACTION, "aten.linear", [x, w], [h], lambda: ops.linear((2, 8), (8, 8)))
        ...     _ = b.op("relu", OpKind.ELEMENTWISE, "aten.relu", [h], [y], ew)
        ...     x = y
        >>> b.graph.outputs.append(x)
        >>> [(blk.start, blk.length, blk.count) for blk in find_repeated_blocks(b.finish())]
        [(1, 2, 4)]
    """
    sigs = [graph.signature(op) for op in graph.ops]
    codes: dict[str, int] = {}
    a = np.array([codes.setdefault(s, len(codes)) for s in sigs], dtype=np.int64)
    anchors = frozenset(anchors)
    prefixes = _numbered_prefixes(graph)
    width = _cut_widths(graph)
    has_modules = any(op.module for op in graph.ops)
    blocks: list[Block] = []
    todo = [(0, len(a))]
    while todo:
        lo, hi = todo.pop()
        found = _best_repeat(a, lo, hi, min_length, min_count) if hi - lo >= min_length * min_count else None
        if found is None:
            continue
        s0, p, run, cover = found
        count = cover // p
        slack = run + p - cover

        def score(o: int, s0: int = s0, p: int = p, count: int = count) -> tuple[int, int, int]:
            bounds = [b for b in (s0 + o + m * p for m in range(count + 1)) if 0 < b < len(a)]
            agree = sum(1 for b in bounds if prefixes[b - 1] != prefixes[b]) if has_modules else 0
            return agree, -sum(int(width[b]) for b in bounds), -o

        o = max(range(slack + 1), key=score)
        start = s0 + o
        if any(graph.ops[i].kind in anchors for i in range(start, start + p)):
            blocks.append(Block(start, p, count, _seq_key(sigs[start:start + p])))
        todo += [(lo, start), (start + cover, hi)]
    return sorted(blocks, key=lambda b: b.start)


# -- balancing ---------------------------------------------------------------------------------------


def partition(costs: Sequence[float], k: int, *,
              ties: Literal["backtrack", "first_fit"] = "backtrack") -> tuple[tuple[int, ...], float]:
    """Split ``costs`` into ``k`` contiguous non-empty parts minimising the largest part sum.

    Returns the ``k + 1`` boundaries ``0 = c_0 < c_1 < ... < c_k = n`` and the optimum.

    Exact dynamic programme. With prefix sums ``S_i`` and ``F_j(i)`` the optimum for the
    first ``i`` items in ``j`` parts,

        ``F_1(i) = S_i``,  ``F_j(i) = min_{j-1 <= t <= i-1} max(F_{j-1}(t), S_i - S_t)``.

    Optimality of the recursion: the last part of an optimal ``j``-partition of the
    first ``i`` items is some ``(t, i]``; the remaining items are ``j - 1`` parts whose
    largest sum is at least ``F_{j-1}(t)``, and any optimal ``(j-1)``-partition of them
    can be substituted, so the minimum over ``t`` is attained.

    Speed: costs are >= 0, so ``F_{j-1}`` is non-decreasing in ``t >= j - 1``: from an
    optimal partition of ``t + 1`` items drop the last item, or, if it is alone in its
    part, split some other part of two or more items in two — neither raises the largest
    part sum. And ``S_i - S_t`` is
    non-increasing. ``max`` of the two is therefore minimised where they cross: at the
    first ``t*`` with ``F_{j-1}(t*) + S_{t*} >= S_i`` — found by binary search because
    ``F_{j-1}(t) + S_t`` is non-decreasing — or at ``t* - 1``; clipping ``t*`` to the
    feasible range keeps this true (the function is monotone on either side). Every
    ``i`` is solved at once with ``numpy.searchsorted``: O(k · n log n). Whole-number costs
    (FLOPs, bytes; total below 2**61) are summed in integers, so equal parts tie exactly also
    where float64 would round (a LLaMA-8B micro-batch's forward FLOPs sum past 2**53);
    other costs in float64.

    Which optimal partition (there are often many: the parts off the bottleneck have slack),
    as ``ties`` says:

    * ``"backtrack"``: the recursion's own, read back from ``i = n``: the last part of the
      first ``i`` items starts at the crossing ``t*`` unless ``t* - 1`` is strictly better.
      :func:`balance` and :func:`layer_chain` cut this way.
    * ``"first_fit"``: left to right, every part takes as many items as the optimum ``B``
      allows. That is feasible: its ``j``-th cut is at or after that of any partition whose
      parts sum to at most ``B`` (induction on ``j``: ``S_i - S_t`` does not grow with
      ``t``, also in floating point), so it makes at most ``k`` parts; while they are fewer,
      the part of most items (the later on ties) is halved, which never raises the largest
      sum. The cost model's pipeline chunks cut this way (early chunks full).

    Examples:
        >>> partition([1, 2, 3, 4, 5], 2)
        ((0, 3, 5), 9.0)
        >>> partition([4, 1, 1, 1, 1], 3), partition([4, 1, 1, 1, 1], 3, ties="first_fit")
        (((0, 1, 2, 5), 4.0), ((0, 1, 3, 5), 4.0))
    """
    if ties not in ("backtrack", "first_fit"):
        raise ValueError(f"ties={ties!r}: give 'backtrack' or 'first_fit'")
    x = np.asarray(costs, dtype=np.float64)
    n = len(x)
    if k < 1 or k > n:
        raise ValueError(f"cannot split {n} item(s) into {k} non-empty part(s); use 1 <= parts <= {n}")
    if not np.all(np.isfinite(x)) or (n and x.min() < 0):
        raise ValueError("costs must be finite and non-negative")
    # whole costs (FLOPs, bytes) are summed in integers: equal parts tie exactly, also past 2**53
    exact = n > 0 and float(x.sum()) < 2.0**61 and bool(np.all(x == np.floor(x)))
    S = np.concatenate(([0], np.cumsum(x.astype(np.int64)))) if exact else np.concatenate(([0.0], np.cumsum(x)))
    inf = 2**62 if exact else np.inf  # above every sum
    F = S.copy()  # F_1(i) = S_i
    arg = np.zeros((k + 1, n + 1), dtype=np.int64)
    i = np.arange(n + 1)
    for j in range(2, k + 1):
        h = F + S  # non-decreasing in t on the feasible range t >= j - 1
        h[: j - 1] = -inf  # infeasible t: keep h sorted; they are clipped away below
        t = np.searchsorted(h, S, side="left")
        lo, hi = j - 1, np.maximum(i - 1, j - 1)
        best_val = np.full(n + 1, inf, dtype=S.dtype)
        best_t = np.zeros(n + 1, dtype=np.int64)
        for cand in (np.clip(t, lo, hi), np.clip(t - 1, lo, hi)):
            val = np.maximum(F[cand], S - S[cand])
            better = val < best_val
            best_val = np.where(better, val, best_val)
            best_t = np.where(better, cand, best_t)
        best_val[:j] = inf  # fewer items than parts
        F, arg[j] = best_val, best_t
    if ties == "first_fit":
        return _first_fit(S.tolist(), k, F[n].item()), float(F[n])
    cuts = [n]
    for j in range(k, 1, -1):
        cuts.append(int(arg[j][cuts[-1]]))
    cuts.append(0)
    return tuple(reversed(cuts)), float(F[n])


def _first_fit(S: list[int] | list[float], k: int, limit: float) -> tuple[int, ...]:
    """Boundaries of :func:`partition`'s ``"first_fit"`` cut of the items with prefix sums ``S``."""
    n = len(S) - 1
    starts = [0]
    for i in range(1, n):
        if S[i + 1] - S[starts[-1]] > limit:
            starts.append(i)
    while len(starts) < k:
        bounds = [*starts, n]
        size, j = max((bounds[j + 1] - bounds[j], j) for j in range(len(starts)))
        starts.insert(j + 1, bounds[j] + size // 2)
    return (*starts, n)


@dataclass(frozen=True)
class Segment:
    """Ops ``start..stop`` (exclusive) of the graph's op list, and their total cost.

    ``out_bytes``: bytes of the activations made before ``stop`` and read at or after it
    — what a pipeline stage ending here sends forward (and receives as gradients).
    """

    start: int
    stop: int
    cost: float
    out_bytes: int = 0

    def ops(self, graph: Graph) -> list[Op]:
        return graph.ops[self.start:self.stop]


def _block_cuts(n: int, blocks: Iterable[Block]) -> list[int]:
    """Cut positions that do not split a block instance: 0..n minus the insides of instances."""
    inside = set()
    for b in blocks:
        for r in b.instances:
            inside.update(range(r.start + 1, r.stop))
    return [i for i in range(n + 1) if i not in inside]


def _costs(graph: Graph, cost: Callable[[Op], float]) -> np.ndarray:
    out = np.empty(len(graph.ops))
    for i, op in enumerate(graph.ops):
        c = float(cost(op))
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"cost of op {op.name!r} is {c}; costs must be finite and >= 0")
        out[i] = c
    return out


def balance(graph: Graph, num_segments: int, cost: Callable[[Op], float], *,
            blocks: Sequence[Block] | None = None, tolerance: float = 0.05) -> list[Segment]:
    """Split the op chain into ``num_segments`` contiguous segments of near-equal cost.

    Two exact min-max partitions (:func:`partition`) are computed: over single ops, with
    optimum ``B_op``, and over *atoms* — whole block instances and the single ops outside
    blocks — with optimum ``B_blk >= B_op``. Cuts at block boundaries are preferred: the
    atom partition is returned when ``B_blk <= (1 + tolerance)·B_op``, else the op one.
    Either way the result is optimal for its granularity; ``tolerance=0`` returns an
    op-level optimum, preferring block cuts only on ties.

    Args:
        graph: ops in topological order.
        num_segments: pipeline stages, ``1 <= num_segments <= len(graph.ops)``.
        cost: cost of one op (seconds, FLOPs...), finite and >= 0.
        blocks: repeated blocks (default :func:`find_repeated_blocks`).
        tolerance: how much worse than the op-level optimum block cuts may be.
    """
    n = len(graph.ops)
    if not 1 <= num_segments <= n:
        raise ValueError(f"cannot balance {n} op(s) of {graph.name!r} into {num_segments} segment(s); "
                         f"use between 1 and {n}")
    x = _costs(graph, cost)
    S = np.concatenate(([0.0], np.cumsum(x)))
    cuts, best = partition(x, num_segments)
    if blocks is None:
        blocks = find_repeated_blocks(graph)
    atoms = _block_cuts(n, blocks)
    if blocks and len(atoms) - 1 >= num_segments:
        acuts, abest = partition(np.diff(S[atoms]), num_segments)
        if abest <= best * (1 + tolerance):
            cuts = tuple(atoms[c] for c in acuts)
    cut = _cut_widths(graph, nbytes=True)
    return [Segment(a, b, float(S[b] - S[a]), int(cut[b])) for a, b in itertools.pairwise(cuts)]


@dataclass(frozen=True)
class Layer:
    """One link of the layer chain: ops ``start..stop`` (exclusive).

    ``key`` hashes the link's signature sequence: links with equal keys compute the same
    thing on the same shapes (the instances of a repeated block), so a planner prices one
    per key. ``block``/``instance`` locate a block instance in the blocks list used.
    ``out_bytes``: bytes of the activations crossing the boundary after the link (as in
    :class:`Segment`), the point-to-point volume if a pipeline cut is placed there.
    """

    start: int
    stop: int
    key: str
    cost: float
    out_bytes: int = 0
    block: int | None = None
    instance: int | None = None

    def ops(self, graph: Graph) -> list[Op]:
        return graph.ops[self.start:self.stop]


def layer_chain(graph: Graph, cost: Callable[[Op], float] | None = None, *,
                blocks: Sequence[Block] | None = None, target_layers: int = 16) -> list[Layer]:
    """The op chain as a sequence of layers for pipeline and per-layer search.

    Each instance of a repeated block is one layer; the ops between blocks (embedding,
    head) form layers too, split by :func:`partition` into pieces of about one block
    instance's cost (the median), or of ``total / target_layers`` when the graph has no
    repeated blocks, so no link dwarfs the others. ``cost`` defaults to FLOPs plus bytes
    moved (bytes keep zero-FLOP ops from being free).
    """
    n = len(graph.ops)
    if n == 0:
        return []
    cost = cost or (lambda op: float(op.flops + graph.op_bytes(op)))
    x = _costs(graph, cost)
    S = np.concatenate(([0.0], np.cumsum(x)))
    sigs = [graph.signature(op) for op in graph.ops]
    if blocks is None:
        blocks = find_repeated_blocks(graph)
    inst = sorted(((r.start, r.stop, bi, m) for bi, b in enumerate(blocks) for m, r in enumerate(b.instances)))
    unit = (float(np.median([S[b] - S[a] for a, b, _, _ in inst])) if inst
            else float(S[n]) / max(1, min(target_layers, n)))
    cut = _cut_widths(graph, nbytes=True)
    out: list[Layer] = []

    def gap(a: int, b: int) -> None:
        if a >= b:
            return
        pieces = 1 if unit <= 0 else min(b - a, max(1, round(float(S[b] - S[a]) / unit)))
        cuts, _ = partition(x[a:b], pieces)
        for u, v in itertools.pairwise(cuts):
            out.append(Layer(a + u, a + v, _seq_key(sigs[a + u:a + v]), float(S[a + v] - S[a + u]),
                             int(cut[a + v])))

    pos = 0
    for a, b, bi, m in inst:
        gap(pos, a)
        out.append(Layer(a, b, blocks[bi].key, float(S[b] - S[a]), int(cut[b]), bi, m))
        pos = b
    gap(pos, n)
    return out
