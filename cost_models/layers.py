"""Layer segments and pipeline chunks as the cost model prices them: ops grouped into the layers of
the layer stack (:data:`~polyparallel.layers.LAYER`, re-exported here with :func:`layer_of` for the
cost model and the executor) and cut into pipeline chunks at layer boundaries (balanced forward FLOPs,
:func:`polyparallel.layers.partition`'s ``"first_fit"`` cut, or equal layer counts)."""

from __future__ import annotations

import math

from polyparallel.ir import Graph
from polyparallel.layers import LAYER, layer_of
from polyparallel.layers import partition as min_max_partition

from .memo import PRICES
from .parallel_config import ParallelConfig

__all__ = ["LAYER", "chunk_of_ops", "chunk_ranges", "chunks", "layer_of", "layer_segments", "segment_of_op", "segments"]


def segments(graph: Graph) -> list[list[int]]:
    cache = PRICES.of(graph)
    segs = cache.get(("segments",))
    if segs is None:
        segs = cache[("segments",)] = _layer_segments(graph)
    return segs


def segment_of_op(graph: Graph) -> list[int]:
    """The index in :func:`segments` of every op's layer segment, in op order."""
    cache = PRICES.of(graph)
    seg_of_op = cache.get(("seg_of_op",))
    if seg_of_op is None:
        seg_of_op = cache[("seg_of_op",)] = [0] * len(graph.ops)
        for j, sg in enumerate(segments(graph)):
            for i in sg:
                seg_of_op[i] = j
    return seg_of_op


def layer_segments(graph: Graph) -> list[list[int]]:
    """Consecutive op indices grouped into layers by module path (``...layers.<i>...``).

    Ops outside any numbered layer join the neighbouring run of such ops; a graph without
    numbered modules falls back to ``⌈√n⌉`` equal runs (Chen et al.'s √n checkpointing).
    """
    return [list(sg) for sg in segments(graph)]


def _layer_segments(graph: Graph) -> list[list[int]]:
    keys = []
    for op in graph.ops:
        m = LAYER.match(op.module or "")
        keys.append(m.group(1) if m else (op.module.split(".")[0] if op.module else ""))
    if not any(LAYER.match(op.module or "") for op in graph.ops):
        n = len(graph.ops)
        size = max(1, math.ceil(math.sqrt(n)))
        return [list(range(i, min(n, i + size))) for i in range(0, n, size)]
    segs: list[list[int]] = []
    for i, k in enumerate(keys):
        if segs and keys[segs[-1][0]] == k:
            segs[-1].append(i)
        else:
            segs.append([i])
    return segs


def chunk_of_ops(graph: Graph, cfg: ParallelConfig) -> list[int]:
    """The pipeline chunk (``0 .. pp·v − 1``; chunk ``g`` runs on stage ``g mod pp``) of every op,
    cut at layer boundaries as ``cfg.partition`` says — the one place that decides it."""
    v = cfg.virtual
    return list(chunks(graph, cfg.pp * v, cfg.partition))


def chunks(graph: Graph, k: int, partition: str) -> list[int]:
    cache = PRICES.of(graph)
    key = ("chunks", k, partition)
    out = cache.get(key)
    if out is not None:
        return out
    segs = segments(graph)
    if partition == "layers":
        starts = _uniform_layers(graph, segs, k)
    else:
        sf = cache.get(("seg_flops",))
        if sf is None:
            sf = cache[("seg_flops",)] = [float(sum(graph.ops[i].flops for i in s)) + 1.0 for s in segs]
        if k > len(sf):
            raise ValueError(f"cannot cut {len(sf)} layers into {k} pipeline chunks: use fewer stages/chunks")
        starts = min_max_partition(sf, k, ties="first_fit")[0][:-1]
    out = [0] * len(graph.ops)
    for g, (a, b) in enumerate(zip(starts, [*starts[1:], len(segs)])):
        for sg in segs[a:b]:
            for i in sg:
                out[i] = g
    cache[key] = out
    return out


def _uniform_layers(graph: Graph, segs: list[list[int]], k: int) -> list[int]:
    """Megatron / DeepSpeed ``uniform`` partition: equal numbers of numbered layers per chunk (the
    first ``L mod k`` chunks take one more); embedding and head stay on the first and last chunk."""
    layer_idx = [j for j, sg in enumerate(segs) if LAYER.match(graph.ops[sg[0]].module or "")]
    n = len(layer_idx)
    if k > n:
        raise ValueError(f"cannot cut {n} layers into {k} pipeline chunks: use fewer stages/chunks")
    starts, pos = [0], 0
    for g in range(k - 1):
        pos += n // k + (1 if g < n % k else 0)
        starts.append(layer_idx[pos])
    return starts


def chunk_ranges(graph: Graph, k: int, partition: str) -> list[tuple[int, int]]:
    """Op index range ``[a, z)`` of every chunk (chunks are contiguous and in op order; empty: ``(0, 0)``)."""
    key = ("chunk_ranges", k, partition)
    cache = PRICES.of(graph)
    if key not in cache:
        n = len(graph.ops)
        ranges = [(n, n)] * k
        for i, g in enumerate(chunks(graph, k, partition)):
            ranges[g] = (min(ranges[g][0], i), i + 1)
        cache[key] = [(a, z) if a < z else (0, 0) for a, z in ranges]
    return cache[key]
