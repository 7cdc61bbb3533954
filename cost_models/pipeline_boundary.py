"""What crosses a pipeline stage's edges: the activations at the cuts, and the reductions after the flush.

:func:`boundary_bytes` counts the bytes every cut between consecutive chunks carries per
micro-batch (the tensors produced at or before the cut and read after it, at the widths the
executor sends), :func:`stage_p2p` prices one stage's transfers (asynchronous hops, or DeepSpeed's
synchronous sends with the receiver's all-gather, and gloo's on CPU stages) and what the stage holds
of them, :func:`tied_params` finds the weights several stages use, and :func:`flush_reductions`
prices the step's exposed reductions around the flush: the micro-batches' losses and the tied
weights' gradients (:mod:`.step`'s docstring).
"""

from __future__ import annotations

from polyparallel.cluster import Cluster
from polyparallel.ir import Graph

from .activations import crossing, recomputed_segments
from .layers import chunk_ranges, segment_of_op
from .memo import PRICES
from .parallel_config import ParallelConfig
from .stage_layout import StageLayout, StageTerms, group_seconds, p2p_seconds, reduce_over

__all__ = ["boundary_bytes", "flush_reductions", "stage_p2p", "sync_hops", "tied_params"]


def boundary_bytes(graph: Graph, cfg: ParallelConfig, v: int, low_params: bool
                   ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per cut ``g`` between chunk ``g`` and the next of the ``pp·v`` chunks, the bytes one rank sends
    per micro-batch (scattered over ``tp·sp``), in the dtype the executor sends (fp32 residual streams
    under autocast, the compute precision where FSDP2 casts the parameters, ``low_params``); and of
    those, the bytes made by layers full recomputation checkpoints. The same for every plan of one
    cut, dtype and ``tp·sp``: memoised per graph."""
    k = cfg.pp * v
    gmemo = PRICES.of(graph)
    bkey = ("boundary", k, cfg.partition, cfg.dtype, low_params, cfg.tp * cfg.seq)
    hit = gmemo.get(bkey)
    if hit is not None:
        return hit
    n = len(graph.ops)
    ranges = chunk_ranges(graph, k, cfg.partition)
    seg_of_op = segment_of_op(graph)
    boundary = [0.0] * k
    from_rec = [0.0] * k
    rec = recomputed_segments(graph)
    cross = crossing(graph, cfg.dtype, low_params)
    active: list[tuple[int, int, float]] = []
    j = 0
    for g in range(k - 1):
        cut = next((ranges[h][0] for h in range(g + 1, k) if ranges[h][1] > ranges[h][0]), n)
        while j < len(cross) and cross[j][0] < cut:
            active.append(cross[j])
            j += 1
        active = [x for x in active if x[1] >= cut]
        for i, _, nb in active:
            boundary[g] += nb / (cfg.tp * cfg.seq)
            from_rec[g] += nb / (cfg.tp * cfg.seq) if rec[seg_of_op[i]] else 0.0
    hit = gmemo[bkey] = (tuple(boundary), tuple(from_rec))
    return hit


def sync_hops(cluster: Cluster, ccache: dict, cfg: ParallelConfig, layout: tuple[StageLayout, ...], v: int,
              boundary: tuple[float, ...]) -> list[tuple[float, float]]:
    """Per cut, the seconds of a blocking transfer and of the receiver's all-gather over its
    tensor-parallel group; empty where the hops are asynchronous.

    DeepSpeed's engine (pipe_partitioned / grad_partitioned, its defaults under tensor parallelism):
    each tensor-parallel rank sends its 1/tp slice, blocking the stream on both ends, and the
    receiver rebuilds the tensor with an all-gather over its tensor-parallel group (PartitionedTensor.full).
    CPU stages (gloo) block both ends too: a transfer is host work on the threads and cores the
    stages compute on. Measured for the executor benchmark's GPT on 2 ranks (torch's pipelining
    schedules): per micro-batch and stage ~1 ms of posting, waiting and unpacking around each
    65 KB transfer, while the receiver's wait ended 0.02-0.3 ms after the sender posted."""
    p = cfg.pp
    deepspeed = cfg.pipeline_p2p == "deepspeed"
    host_p2p = all(t.kind == "cpu" for lay in layout for t in lay.types)
    if not (deepspeed or host_p2p):
        return []
    return [(max(p2p_seconds(cluster, ccache, a, b, boundary[g]) for a, b in layout[g % p].p2p_pairs),
             max(group_seconds(cluster, ccache, [("all_gather", boundary[g] * cfg.tp)], grp, gid)
                 for grp, gid in layout[(g + 1) % p].tp_groups) if cfg.tp > 1 and deepspeed else 0.0)
            for g in range(p * v - 1)]


def stage_p2p(cluster: Cluster, ccache: dict, lay: StageLayout, s: int, p: int, v: int,
              boundaries: tuple[tuple[float, ...], tuple[float, ...]], sync_hop: list[tuple[float, float]]
              ) -> tuple[float, float, float, tuple[float, float]]:
    """Stage ``s``'s transfers per micro-batch: the longest asynchronous hop it sends, their sum, the
    synchronous transfers it blocks on (forward and backward alike), and the boundary activations it
    holds ``(without full recomputation, with it)``. ``boundaries``: :func:`boundary_bytes`."""
    boundary, from_rec = boundaries
    times = [max(p2p_seconds(cluster, ccache, a, b, boundary[g]) for a, b in lay.p2p_pairs)
             for g in range(s, p * v - 1, p)]
    block = 0.0
    if sync_hop:
        # per micro-batch the forward receives and gathers boundary g − 1 and sends boundary g; the
        # backward receives and gathers g's gradient and sends g − 1's: half the gathers in each
        ends = [sync_hop[g - 1] for g in range(s, p * v, p) if g > 0] + [
            sync_hop[g] for g in range(s, p * v - 1, p)]
        block = sum(x + ag / 2 for x, ag in ends)
        times = []
    # a stage holds, until their gradients pass, what it received (its own buffers) and what it sent
    recv = [g - 1 for g in range(s, p * v, p) if g > 0]
    sent = [g for g in range(s, p * v - 1, p)]
    held = (sum(boundary[g] for g in recv),
            sum(from_rec[g] for g in sent) + sum(boundary[g] - from_rec[g] for g in recv))
    return (max(times) if times else 0.0), sum(times), block, held


def tied_params(held: list[dict[str, float]]) -> list[tuple[tuple[tuple[int, ...], float], ...]]:
    """Per stage, the parameters it shares with other stages, as ``(stages holding them, local
    elements)`` per set of holders; ``held``: per stage, its parameters' local elements by name."""
    holders: dict[str, list[int]] = {}
    for o, h in enumerate(held):
        for t in h:
            holders.setdefault(t, []).append(o)
    out = []
    for h in held:
        by: dict[tuple[int, ...], float] = {}
        for t, numel in h.items():
            hs = holders[t]
            if len(hs) > 1:
                key = tuple(hs)
                by[key] = by.get(key, 0.0) + numel
        out.append(tuple(sorted(by.items())))
    return out


def flush_reductions(cluster: Cluster, ccache: dict, cfg: ParallelConfig, terms: StageTerms, s: int,
                     gb: int) -> tuple[float, ...]:
    """The exposed seconds stage ``s`` spends per step on the reductions around the flush, in the
    order they run: the losses' all-reduce, then one all-reduce per set of stages sharing a weight."""
    out = []
    if cfg.pp > 1:
        # a pipeline combines its micro-batches' losses and target counts with one all-reduce over
        # the whole world after the flush (the torch backend's weigh_microbatches)
        out.append(_loss_reduce(cluster, ccache, terms))
    elif len(terms.dp_groups[s][0][0]) > 1:
        # the step's loss and its target count are all-reduced over the replicas between the
        # forward and the backward, on every rank's critical path (the torch backend's
        # weigh_replicas; Megatron-LM all-reduces the loss every step for its log)
        out.append(group_seconds(cluster, ccache, (("all_reduce", 32.0),), *terms.dp_groups[s][0]))
    for holders, numel in terms.tied[s] if terms.tied else ():
        # a weight several stages use (a tied embedding and output head) gets its gradient
        # summed over them after the flush, before the optimizer: Megatron-LM's
        # _allreduce_word_embedding_grads, DeepSpeed's _exec_reduce_tied_grads, the torch
        # backend's tie groups; every replica's group at once, those on one node sharing its ports
        out.append(reduce_over(cluster, ccache, tuple(terms.devices[h][0] for h in holders),
                               numel * max(gb, 4), _on_first_node(cluster, terms, s)))
    return tuple(out)


def _loss_reduce(cluster: Cluster, ccache: dict, terms: StageTerms) -> float:
    """Seconds of the pipeline's loss all-reduce over every device of the plan: the same for each
    stage and for every plan sharing ``terms`` (kept in its memo: the world is 10^3 devices on a
    big cluster, and its tuple is the collective's key)."""
    hit = terms.memo.get("loss_reduce")
    if hit is None:
        hit = terms.memo["loss_reduce"] = reduce_over(cluster, ccache, tuple(d for ds in terms.devices for d in ds),
                                                      32.0)
    return hit


def _on_first_node(cluster: Cluster, terms: StageTerms, s: int) -> int:
    """Devices of stage ``s`` on its first device's node (the replicas' tied-weight groups sharing
    that node's ports), kept in the memo of ``terms``."""
    key = ("on_first_node", s)
    hit = terms.memo.get(key)
    if hit is None:
        first = terms.devices[s][0]
        hit = terms.memo[key] = sum(cluster.device(d).node == cluster.device(first).node for d in terms.devices[s])
    return hit
