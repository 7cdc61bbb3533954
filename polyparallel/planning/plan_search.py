r"""Strategy search: the fastest parallel plan that fits in memory.

The problem
-----------
Given a model (captured per micro-batch of ``b`` samples), a cluster of ``N`` devices and
a global batch ``B``, choose

* mesh degrees ``dp, tp, pp, sp`` with ``dp·tp·pp·sp = n`` devices of the cluster
  (``n = N`` unless a center or a device cap is pinned), laid out tensor-parallel fastest,
  then sequence, data, pipeline — so ``tp`` lives inside a node, ``pp`` crosses nodes
  last (the mapping of each mesh axis onto a topology level follows from this order and
  the sizes; an axis whose group spans two centers is a *WAN axis*);
* the micro-batch size ``b`` and count ``m`` with ``dp·m·b = B``;
* the pipeline schedule ``s ∈ {1F1B, interleaved(v), GPipe}`` (stage boundaries are
  cut over the balanced layer chain by the cost model's min-max partition);
* the memory knobs: ZeRO stage ``z ∈ {0..3}`` and recomputation ``r ∈ {none, selective, full}``;

to solve

.. math::

    \min_{dp,tp,pp,sp,b,m,s,z,r}\; T(\cdot) \quad\text{s.t.}\quad
    M_d(\cdot) \le C_d\ \forall d,\qquad dp·tp·pp·sp = n,\qquad dp·m·b = B,

    tp·sp \le \text{devices per node (unless pinned)},\qquad
    \text{no }tp/sp/dp\text{ group on a WAN link unless allowed},

where ``T`` is the step time of :func:`polyparallel.cost_models.estimate_step` (compute
+ exposed communication + pipeline bubbles, per stage, the slowest stage) and ``M_d``
the per-device memory of the same model (weights, gradients, optimizer state by ZeRO
stage, activations in flight under the schedule). The objective ``throughput`` is
``B / T``; ``memory`` minimises ``max_d M_d`` among plans within 10% of the fastest (its
enumeration tries every micro-batch size and memory rung of each mesh shape, and reuses the
exact memory and step-time bounds of that one enumeration instead of pricing plans twice).

How it is solved
----------------
The outer variables are enumerated over the divisors of ``n`` (a few hundred mesh
shapes at most), pruned by feasibility (``tp·sp`` within a node, ``pp`` at most the
number of layers, ``B`` divisible). For each mesh shape the micro-batch sizes are
every divisor of the per-replica batch up to ``MAX_MICRO`` (re-batched from two captures),
and any size a pinned micro-batch count gives; with a pipeline (unless ``dp``, ``tp`` and ``pp``
are all pinned: one mesh shape, every size), for each ``m = pp, 2pp, 4pp`` the largest size
giving at least ``m`` micro-batches, the smallest size and ``m = 1``.
Schedules: 1F1B, GPipe (same bubble, but its p2p and activation timing differ in the
simulation) and interleaved with 2 or 4 chunks where the layers divide. Memory knobs are
tried cheapest-first along the ladder ``(z, r) = (0, none), (1, none), (2, none),
(1, selective), (3, none), (3, selective), (1, op), (3, op), (1, full), (3, full)``: every *free* rung that fits
(ZeRO 0-2 without recomputation move the same gradient volume but shard the optimizer step
differently) is priced; past them, the first rung that fits is kept (later rungs only add
communication or recomputation). ``exhaustive=True`` drops every pruning
rule and prices every combination: it is the yardstick the planner is tested against.

**Branch and bound.** Enumerating a plan prices its memory exactly and its step time from
below, without simulating the pipeline:

.. math::  T \ge \max_s \Big[\sum_{s'<s} \big(\tfrac{F_{s'} + B_{s'}}{v} + 2 c_{s'}\big) + m (F_s + B_s)\Big]
           + \max_s (E_s + T_{opt,s}) = \underline{T}

(stage ``s`` cannot start before micro-batch 0 reaches it nor end before its last backward
has gone back to stage 0; ``E_s`` and ``T_opt`` are the exposed data-parallel and optimizer
times, computed exactly). The enumeration's own control flow (which rungs and micro-batch
sizes to try) depends only on whether plans fit, so it visits the same plans as pricing each
in full would. The fitting plans are then priced in full in increasing order of
``\underline{T}``, stopping at the first bound above the best step time: no skipped plan can be
faster, so the optimum is the same (checked against ``exhaustive=True``, which prices all).
Stage sums, device groups and collective prices are memoised across plans, so a plan's bound
costs microseconds to milliseconds.

**Capture once per anchor.** A module is captured at the batch sizes ``ANCHORS = (2, 4)``
only; every other micro-batch size is derived from them by :func:`rebatch_graph` (every
integer of the IR that differs between the two is affine in the batch). A strategy whose
micro-batch is 1 is re-captured at 1 before it is written, because a capture at batch 1
names extent-1 dims differently (same prices, different fingerprint).

**Per-op placements.** Every plan with a tensor-parallel axis is offered once per placement
candidate (:mod:`polyparallel.planning.derived`): the exact solver's placements, derived from the
polyhedral model over the whole graph (solved once per ``tp`` degree and target, each repeated block
once), and Megatron's layout as one more candidate; the branch and bound keeps the faster. Plans
with ``sp > 1`` are ranked with Megatron + Ulysses, which the torch backend runs whatever the
placements. The chosen plan's ops are then placed stage by stage
by the exact per-stage solver (:func:`polyparallel.planning.stage_solver.solve_stage`: dynamic programming
along the chain of repeated blocks, MILP for branchy graphs), restricted by default to what the
torch backend executes and always offered the rule's placement, and the plan is re-priced with
the placements it lists; the rule's placements stay where the solver's are not executable,
do not fit or are not faster (:mod:`polyparallel.planning.place_plan`; ``constraints.placements``).

Across centers (a cluster with several centers): a synchronous plan whose dp/tp/sp
groups would cross a WAN link is refused unless ``constraints.allow_wan`` is set; a
pipeline across centers is allowed where the centers let activations leave. The
**collaborative mode** is then priced too: each center trains with its own best
synchronous plan on its own data for ``H`` local steps, then the parameters are fused
over the WAN. With ``T_c`` the slowest center's step time and ``T_f`` the fusion time
(upload + download of the parameters at the WAN bandwidth plus latency),

.. math::  H = \left\lceil \frac{T_f (1 - \phi)}{\phi\, T_c} \right\rceil

keeps communication below the target share ``φ`` (default 20%) of the round, and each
center's share of the data is proportional to its throughput.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, StepEstimate
from polyparallel.cost_models.layers import LAYER, chunk_of_ops, layer_segments
from polyparallel.cost_models.megatron_rule import op_roles, ring_dominated
from polyparallel.cost_models.memo import PRICES
from polyparallel.cost_models.pipeline import order_problem
from polyparallel.ir import Graph, Hint, OpKind
from polyparallel.plan import CHUNKED_SCHEDULES, PIPELINE_SCHEDULES, Plan
from polyparallel.planning.assemble import strategy_of
from polyparallel.planning.branch_bound import Best, brief, least_memory, replicates_over_tp, why_axes
from polyparallel.planning.collab_rounds import collaborative_strategy
from polyparallel.planning.collector import collector_paused, drop_source_caches, young_collected
from polyparallel.planning.constraints import Constraints, DoesNotFit
from polyparallel.planning.derived import variants
from polyparallel.planning.executability import CENTER_LIMITS, executor
from polyparallel.planning.executor_check import center_checked, checked_as_placed, executor_checked, written_estimate
from polyparallel.planning.model_graphs import MAX_MICRO, ModelGraphs, divisors
from polyparallel.planning.model_inputs import model_and_inputs
from polyparallel.strategy import SearchRecord, Strategy

__all__ = ["Constraints", "DoesNotFit", "search"]

MEMORY_LADDER = (("0", "none"), ("1", "none"), ("2", "none"), ("1", "selective"), ("3", "none"), ("3", "selective"),
                 ("1", "op"), ("3", "op"), ("1", "full"), ("3", "full"))


# ----------------------------------------------------------------------------------------
# search


def _default_dtype(cluster: Cluster, devices: Iterable[int]) -> str:
    kinds = {cluster.device(d).type.kind for d in devices}
    return "fp32" if kinds == {"cpu"} else "bf16"


def _pool(cluster: Cluster, c: Constraints) -> list[int]:
    devs = list(range(cluster.num_devices))
    if c.centers:
        names = {ce.name: ce.index for ce in cluster.centers}
        unknown = [n for n in c.centers if n not in names]
        if unknown:
            raise ValueError(f"unknown center(s) {unknown}; the cluster has {', '.join(names)}")
        keep = {names[n] for n in c.centers}
        devs = [d for d in devs if cluster.device(d).center in keep]
    if c.devices is not None:
        if not 1 <= c.devices <= len(devs):
            raise ValueError(f"constraints.devices={c.devices}: the cluster offers {len(devs)}")
        devs = devs[: c.devices]
    return devs


def _node_size(cluster: Cluster, devs: list[int]) -> int:
    return min(len(cluster.nodes[cluster.device(d).node].devices) for d in devs)


def _crosses_wan(cluster: Cluster, cfg: ParallelConfig, devs: list[int]) -> tuple[bool, bool]:
    """(a dp/tp/sp group spans two centers, a pipeline boundary spans two centers)."""
    center = [cluster.device(d).center for d in devs]
    group_wan = any(len({center[cfg.rank(s, d, q, t)] for d in range(cfg.dp) for q in range(cfg.seq)
                         for t in range(cfg.tp)}) > 1 for s in range(cfg.pp))
    stage_centers = [center[cfg.rank(s, 0, 0, 0)] for s in range(cfg.pp)]
    return group_wan, len(set(stage_centers)) > 1


def _wan_problem(cluster: Cluster, cfg: ParallelConfig, devs: list[int], c: Constraints) -> str | None:
    """Why a plan's mesh may not be laid over the WAN links between centers (None: it may)."""
    wan_group, wan_pipe = _crosses_wan(cluster, cfg, devs)
    if wan_group and not c.allow_wan:
        return "a data/tensor group would span the WAN (allow_wan=False)"
    if wan_pipe and not all(ce.activations_may_leave for ce in cluster.centers):
        return "a pipeline would send activations out of a center that keeps them"
    return None


def _attends(g: Graph) -> bool:
    """Whether the model has an attention op: ring attention (cp) splits the sequence around one."""
    return any(OpKind(op.kind) is OpKind.ATTENTION for op in g.ops)


def _ulysses_or_ring(seq: int, c: Constraints, ring: bool) -> list[tuple[int, int]]:
    """The ``(sp, cp)`` pairs splitting the sequence ``seq`` ways: Ulysses, and ring attention when
    the model has attention (``ring``) or ``cp`` is pinned, each unless the constraints pin the other."""
    if seq == 1:
        return [(1, 1)] if (c.sp or 1) == 1 and (c.cp or 1) == 1 else []
    out = [(seq, 1)] if c.sp in (None, seq) and c.cp in (None, 1) else []
    if (ring or c.cp == seq) and c.cp in (None, seq) and c.sp in (None, 1):  # pinned: the cost model says why not
        out.append((1, seq))
    return out


def _mesh_shapes(n: int, c: Constraints, node: int, layers: int, exhaustive: bool,
                 ring: bool = True) -> list[tuple[int, int, int, int, int]]:
    """The ``(dp, tp, pp, sp, cp)`` splits of ``n`` devices the search tries."""
    out = []
    for tp in divisors(n):
        if c.tp is not None and tp != c.tp:
            continue
        for seq in divisors(n // tp):
            if c.sp is None and c.cp is None and seq > 1 and not exhaustive and seq > 8:
                continue
            if tp * seq > node and not (c.cross_node_tp or exhaustive or c.tp or c.sp or c.cp):
                continue
            for sp, cp in _ulysses_or_ring(seq, c, ring):
                for pp in divisors(n // (tp * seq)):
                    if c.pp is not None and pp != c.pp:
                        continue
                    if pp > max(1, layers):
                        continue
                    dp = n // (tp * seq * pp)
                    if c.dp is not None and dp != c.dp:
                        continue
                    out.append((dp, tp, pp, sp, cp))
    return out


def _no_mesh_shape(n: int, c: Constraints, node: int, layers: int) -> str:
    """Why :func:`_mesh_shapes` gives no shape for these constraints: the first rule that refuses."""
    fixed = [(k, v) for k, v in (("tp", c.tp), ("sp", c.sp), ("cp", c.cp), ("pp", c.pp)) if v is not None]
    prod = math.prod(v for _, v in fixed)
    if n % prod:
        return f"{'*'.join(k for k, _ in fixed)} = {prod} does not divide the {n} devices"
    if c.pp is not None and c.pp > max(1, layers):
        return (f"pp={c.pp} exceeds the model's {layers} repeated layers (a stage would hold no layer); "
                f"use pp <= {max(1, layers)}")
    if c.dp is not None and c.dp * prod != n and not (c.tp and (c.sp or c.cp) and c.pp):
        return f"dp={c.dp} with {' '.join(f'{k}={v}' for k, v in fixed)} does not use the {n} devices"
    seq = (c.sp or 1) * (c.cp or 1)
    if (c.tp or 1) * seq > node and not c.cross_node_tp:
        return (f"tp*{'cp' if c.cp else 'sp'} = {(c.tp or 1) * seq} exceeds a node's {node} devices (pass "
                "cross_node_tp=True)")
    return f"no split of the {n} devices matches dp={c.dp} tp={c.tp} pp={c.pp} sp={c.sp} cp={c.cp}"


def _no_micro_batch(mdl: ModelGraphs, per_replica: int, c: Constraints) -> str:
    """Why a mesh shape has no micro-batch size to try."""
    if c.microbatches is not None and per_replica % c.microbatches:
        return (f"{c.microbatches} micro-batches do not divide the {per_replica} samples per replica; pick a "
                f"count that divides {per_replica}")
    if not mdl.resizable:
        return (f"the model was captured at a fixed batch of {mdl.b0}, which does not divide into the "
                f"{per_replica} samples per replica" + (f" as {c.microbatches} micro-batches" if c.microbatches
                                                        else ""))
    if per_replica > MAX_MICROBATCHES * MAX_MICRO:
        return (f"{per_replica} samples per replica need more than {MAX_MICROBATCHES} micro-batches of at most "
                f"{MAX_MICRO} samples; pin the micro-batch count (--microbatches) or use a smaller global batch")
    return f"no micro-batch size divides the {per_replica} samples per replica"


def _plans(base: ParallelConfig, c: Constraints, layers: int,
           runs: Callable[[ParallelConfig], bool] | None = None) -> Iterable[list[ParallelConfig]]:
    """Per schedule, the memory-knob ladder for one mesh shape and micro-batching, cheapest first;
    with ``runs``, only the rungs it accepts (the plans the torch backend executes), so a refused
    rung (recomputation inside pipeline stages, say) does not end the walk before the next one."""
    scheds = _schedules(base, c, layers)
    ladder = [(int(z), r) for z, r in MEMORY_LADDER if base.ep == 1 or int(z) < 3]  # ZeRO-3 + ep: not modelled
    if base.dp * base.seq == 1:
        ladder = [(z, r) for z, r in ladder if z == 0] + [(0, "selective"), (0, "op"), (0, "full")]
        ladder = list(dict.fromkeys(ladder))
    if c.zero_stage is not None:
        ladder = [(c.zero_stage, r) for r in ("none", "selective", "op", "full")]
    if c.recompute is not None:
        ladder = list(dict.fromkeys((z, c.recompute) for z, _ in ladder))
    for s, v in scheds:
        rungs = [replace(base, schedule=s, chunks=v, zero_stage=z, recompute=r) for z, r in ladder]
        rungs = [cfg for cfg in rungs if runs is None or runs(cfg)]
        if rungs:
            yield rungs


def _schedules(base: ParallelConfig, c: Constraints, layers: int) -> list[tuple[str, int]]:
    """The ``(schedule, chunks per stage)`` pairs tried for one mesh shape and micro-batching: each
    searched schedule of :data:`~polyparallel.plan.PIPELINE_SCHEDULES` (without stages only the
    first), a chunked one with 2 and 4 chunks where the layers divide into them and its task order
    takes the micro-batches; a pinned schedule or depth is priced whatever the layer count (the
    partition may be uneven)."""
    out: list[tuple[str, int]] = []
    for sch in PIPELINE_SCHEDULES.values():
        if not sch.searched or (out and base.pp == 1):
            continue
        for v in (2, 4) if sch.chunked else (1,):
            if v == 1 or (layers % (base.pp * v) == 0 and not order_problem(sch.name, base.pp, base.microbatches, v)):
                out.append((sch.name, v))
    schedule, chunks = c.pinned_schedule()
    if schedule is None and chunks is not None:
        default = next(s for s in PIPELINE_SCHEDULES.values() if s.chunked and s.searched).name
        out = [(default, chunks)] if chunks > 1 else [(s, v) for s, v in out if v == 1]
    elif schedule is not None:
        chunked = schedule in CHUNKED_SCHEDULES
        want = (chunks or 2) if chunked else 1
        out = [(s, v) for s, v in out if s == schedule and (chunks is None or v == want)] or [(schedule, want)]
    return out


@collector_paused
def search(model: Any, example_inputs: Any = None, cluster: Cluster | str | Path = "local-cpu:2", *,
           example_kwargs: dict[str, Any] | None = None, objective: str = "throughput",
           constraints: Constraints | dict[str, Any] | None = None, exhaustive: bool = False,
           batch_size: int | None = None, progress: Callable[[str], None] | None = None,
           profile: bool = False) -> Strategy:
    """Find the fastest plan that fits (see the module docstring for the problem solved).

    Args:
        model: an ``nn.Module`` (meta device allowed), a built-in example's name (``"gpt-tiny"``),
            a ``"package.module:function"`` returning ``(model, args[, kwargs])``, an ONNX
            path/ModelProto, or a Graph.
        example_inputs / example_kwargs: fix the per-sample shapes; their leading dim is the
            example batch (the search re-captures at other micro-batch sizes). A dict as
            ``example_inputs`` is taken as keyword inputs. Left out for a module, they are
            inferred where the model says what it takes (a ``transformers`` model, a first
            ``nn.Linear``; :mod:`polyparallel.planning.model_inputs`) and the notes say so.
        cluster: a :class:`Cluster`, a spec path or a preset name.
        objective: ``throughput`` or ``memory``.
        constraints: pinned choices (:class:`Constraints` or a dict of its fields).
        exhaustive: price every candidate (the planner's yardstick; small problems only).
        batch_size: the global batch (samples per optimizer step); default: the example
            batch times the number of devices.
        progress: called with short status lines.
        profile: measure the module's ops on this machine before pricing (a calibrated
            ``local-cpu:<P>`` only; 10-20 s for a small model): its eager training steps at
            micro-batch sizes 1, 2, 4 and 8, and the slowdown of sharing the machine with ``P`` processes
            (:mod:`polyparallel.cost_models.op_profile`). Without it a CPU plan is priced from the
            calibration's kernel rates, which a training step does not reach.

    Raises:
        DoesNotFit: no plan fits; the message names the smallest shortfall.
    """
    t0 = time.perf_counter()
    if objective not in ("throughput", "memory"):
        raise ValueError(f"objective must be 'throughput' or 'memory', not {objective!r}")
    check_cluster(cluster)
    cl = cluster if isinstance(cluster, Cluster) else Cluster.resolve(str(cluster))
    c = Constraints.of(constraints)
    check_batch_size(batch_size)
    model, example_inputs, example_kwargs, inferred = model_and_inputs(model, example_inputs, example_kwargs)
    mdl = ModelGraphs(model, example_inputs, example_kwargs)
    devs = _pool(cl, c)
    B = batch_size or mdl.b0 * len(devs)
    say = progress or (lambda _: None)
    if profile:
        cl = executor("torch").profile(cl, mdl, say)

    if c.mode == "collaborative" and len(cl.centers) < 2:
        raise ValueError(f"mode='collaborative' trains across compute centers, and {cl.name} has "
                         f"{len(cl.centers)}: give a cluster of several centers (e.g. aisynergy-5, or a spec with "
                         "two 'centers'), or leave the mode 'auto'")
    best, collab = None, None
    notes: list[str] = [inferred] if inferred else []
    if not profile and mdl.resizable and cl.name.startswith("local-cpu:") and cl.calibration is not None:
        notes.append("priced from this machine's calibrated kernel rates, which a CPU training step does not reach "
                     "(benchmarks/executor.py: a median 49-57% too fast); profile=True (--profile) measures this "
                     "model's own ops first")
    if c.placements == "torch" and any(cl.device(d).type.kind != "cpu" for d in devs):
        notes.append("priced as the torch backend runs a step on accelerators: eager PyTorch (each elementwise op "
                     "its own kernel), 16-bit plans under torch.autocast with fp32 weights, "
                     "scaled_dot_product_attention as torch's fused kernel")
    if c.execution:
        notes.append("priced as executed with " + ", ".join(f"{k}={v}" for k, v in c.execution) +
                     " (constraints.execution), which the strategy does not record: the torch backend runs its own")
    if c.mode != "collaborative":
        best = search_sync(mdl, cl, B, c, devs, exhaustive, objective, say)
        best, devs = _on_fewer_devices(best, mdl, cl, B, c, devs, exhaustive, objective, say)
        notes += best.notes
    cores = os.cpu_count() or 1
    if cl.name.startswith("local-cpu:") and cl.num_devices > cores:
        notes.append(f"{cl.name} is {cl.num_devices} processes on this machine's {cores} cores: each is priced at "
                     f"its share, {cores / cl.num_devices:.2g} of a core, and train would run them time-sharing")
    if len(cl.centers) > 1 and c.mode != "synchronous" and not c.centers:
        collab = _search_collab(mdl, cl, B, c, exhaustive, say)
    sync = best if best is not None and best.est is not None else None  # the synchronous plan found
    if sync is not None:
        _release_prices(mdl, sync.b)
        mdl.exact(sync.b)  # the strategy names a captured graph: count its capture as capture time
    notes += _opaque_note(next(iter(mdl.priced.values()), None) or next(iter(mdl.graphs.values()), None))
    search_s = time.perf_counter() - t0 - mdl.capture_s
    cands = (best.candidates if best else 0) + (collab[1] if collab else 0)
    record = SearchRecord(capture_s=round(mdl.capture_s, 3), search_s=round(search_s, 3), candidates=cands,
                          solver="enumeration+min-max-partition" + ("(exhaustive)" if exhaustive else ""), notes=notes)
    sync_est = sync.est if sync is not None else None
    if collab is not None and (sync_est is None or written_estimate(collab[0]).samples_per_s > sync_est.throughput or
                               c.mode == "collaborative"):
        return collab[0].model_copy(update={"search": record.model_copy(update={"notes": record.notes + collab[2]})})
    if sync is None or sync.est is None:
        raise DoesNotFit(_does_not_fit_message(mdl, cl, best))
    t1 = time.perf_counter()
    strat = strategy_of(mdl, cl, sync.est, sync.b, B, devs, record, c.placements, c.memory_cap)
    # the backend's check exports the model to cut a pipeline: a burst of cyclic garbage
    with young_collected():
        if sync.refuse is not None:
            strat = executor_checked(strat, mdl, cl, sync, B, devs, record, c, say)
        elif c.placements != "torch":
            strat = checked_as_placed(strat, mdl, sync, B, c.placements)
    # placing the chosen plan's ops is part of the search (its capture, if any, was counted above)
    return strat.model_copy(update={"search": strat.search.model_copy(update={
        "search_s": round(search_s + time.perf_counter() - t1, 3)})})


def _on_fewer_devices(best: Best, mdl: ModelGraphs, cl: Cluster, B: int, c: Constraints, devs: list[int],
                      exhaustive: bool, objective: str, say: Callable[[str], None]) -> tuple[Best, list[int]]:
    """A plan whose tp splits no op is the same step on ``1/tp`` of the devices with tp=1, which a
    user would rather have (the other devices stay free); the search is run again on the first
    ``len(devs) / tp`` devices and its plan taken when it is no slower. With tp pinned, or
    ``constraints.devices`` given, the user's choice stands."""
    while replicates_over_tp(best.est) and c.tp is None and c.devices is None:
        assert best.est is not None
        tp, fewer = best.est.config.tp, devs[: len(devs) // best.est.config.tp]
        smaller = search_sync(mdl, cl, B, c, fewer, exhaustive, objective, say)
        if smaller.est is None or smaller.est.step_time > best.est.step_time * (1 + 1e-9):
            break
        # what was left out on all the devices stays said (the smaller search may have no such plans)
        smaller.notes[:0] = [n for n in best.notes if n.startswith("left out") and n not in smaller.notes]
        smaller.notes.insert(0, f"uses {len(fewer)} of the cluster's {len(devs)} devices: the fastest plan on all of "
                                f"them ({brief(best.est.config)}) splits no op over tp={tp}, so each tp rank would "
                                f"compute what one process does, and every plan that divides the work priced slower "
                                f"(the model may be too small to gain from more devices); constraints={{'devices': "
                                f"{len(devs)}}} keeps them all")
        best, devs = smaller, fewer
    return best, devs


def _release_prices(mdl: ModelGraphs, b: int) -> None:
    """Free the enumeration's price memos of the graphs but the chosen micro-batch's, and the anchors'
    comparison, once the plan is chosen: the capture and the torch backend's check that follow (which
    exports the whole model) reuse their memory. A plan the backend refuses sends the search to the
    next one, whose prices are memoised again as needed. The example graph's memo is kept: it holds
    the placement solver's results, which the derived placements of every graph are read from."""
    drop_source_caches()
    mdl.drop_rebatcher()
    keep = {id(mdl.graph(mdl.b0)), id(mdl.graph(b))}
    for g in {id(g): g for g in (*mdl.priced.values(), *mdl.graphs.values())}.values():
        if id(g) not in keep:
            PRICES.of(g).clear()


def _verdicts(best: Best, g: Graph) -> Callable[[ParallelConfig], list[str]]:
    """The torch backend's reasons not to run a plan (empty: it runs it), each distinct plan judged
    once, on the example graph ``g`` (what ``plan_problems`` reads of a graph, batch statistics,
    layers and attention, does not depend on the batch size); each reason is counted in
    ``best.refused`` once per plan it keeps out."""
    torch = executor("torch")
    verdicts: dict[ParallelConfig, list[str]] = {}

    def problems(cfg: ParallelConfig) -> list[str]:
        if cfg.op_plans is not None:
            cfg = replace(cfg, op_plans=None)  # a plan's placement candidates count as one plan
        hit = verdicts.get(cfg)
        if hit is None:
            hit = verdicts[cfg] = torch.plan_problems(g, cfg)
            for w in hit:
                best.refused[w] = best.refused.get(w, 0) + 1
        return hit

    return problems


def _hollow_note(hollow: set[tuple[int, int, int]]) -> str:
    """The note on pipelines left out because a stage would hold no parameter: ``(pp, chunks, stage)``."""
    return ("left out pipelines with a stage that would hold no parameter (its ops as the layer partition cuts "
            "them): " + ", ".join(f"pp={p}" + (f" interleaved:{v}" if v > 1 else "") + f" (stage {s})"
                                  for p, v, s in sorted(hollow)))


def _refusal_reasons(best: Best) -> str:
    """The backend's eight commonest reasons to refuse the enumerated plans, with how many each kept out."""
    reasons = sorted(best.refused.items(), key=lambda kv: -kv[1])
    return "; ".join(f"{why} ({n} plan{'s' * (n > 1)})" for why, n in reasons[:8])


def search_sync(mdl: ModelGraphs, cl: Cluster, B: int, c: Constraints, devs: list[int], exhaustive: bool,
                objective: str, say: Callable[[str], None], executable: bool = True,
                rank_by: str | None = None) -> Best:
    """Branch and bound over the plans (module docstring). With ``placements="torch"`` and
    ``executable``, only plans the torch backend executes are candidates (:mod:`polyparallel.backends.torch.
    capabilities`); when none of those fits, the search runs again over every plan and says so.
    Each plan is offered with each of its placement candidates (:func:`.derived.variants`, for the
    target ``rank_by``, default ``c.placements``); it fits when one of them does."""
    dtype = c.dtype or _default_dtype(cl, devs)
    rank_by = rank_by or c.placements
    torch = executor("torch")
    enforce = executable and c.placements == "torch" and dtype in torch.dtypes
    best = Best(cl=cl, cap=c.memory_cap)
    g = mdl.graph(mdl.b0)
    best.refuse = (problems := _verdicts(best, g)) if enforce else None
    if executable and c.placements == "torch" and not enforce:
        best.notes.append(f"the torch backend trains in {', '.join(torch.dtypes)} only: this {dtype} strategy is "
                          f"for planning only (polyparallel train refuses it)")
    # the memory objective looks for the least memory near the fastest plan, so it enumerates
    # every micro-batch size and ladder rung instead of stopping at the first that fits
    wide = exhaustive or objective == "memory"
    n = len(devs)
    layers = _layer_count(g)
    node = _node_size(cl, devs)
    affine = mdl.affine_of if mdl.resizable else None
    hollow: set[tuple[int, int, int]] = set()  # (pp, chunks, stage) of pipelines with a stage holding no parameter

    def offer(graph: Graph, cfg: ParallelConfig, b: int) -> bool:
        """Offer every placement candidate of one plan (all of them: no short cut on the first fit);
        a pipeline with a stage that holds no parameter is not a plan (guard rail, issue 19)."""
        empty = _paramless_stage(graph, cfg)
        if empty is not None:
            hollow.add((cfg.pp, cfg.chunks, empty))
            return False
        fits = [best.offer(graph, replace(cfg, op_plans=v), b) for v in variants(graph, g, cl, cfg, rank_by, affine)]
        return any(fits)

    shapes = [(*sh, ep) for sh in _mesh_shapes(n, c, node, layers, exhaustive, _attends(g))
              for ep in _ep_degrees(g, sh, c)]
    # the exhaustive yardstick walks every rung (`offer` refuses the unexecuted ones); otherwise
    # the ladders hold only executed rungs
    runs = (lambda cfg: not problems(cfg)) if enforce and not wide else None
    say(f"{len(shapes)} mesh shapes over {n} devices")
    if not shapes:
        best.skipped.append(_no_mesh_shape(n, c, node, layers))
    one_mesh = None not in (c.dp, c.tp, c.pp)
    options = c.pricing_options()
    for i, (dp, tp, pp, sp, cp, ep) in enumerate(shapes):
        shape = Plan(dp=dp, tp=tp, pp=pp, sp=sp, cp=cp, ep=ep).degrees_label()
        if B % dp:
            best.skipped.append(f"{shape}: the global batch {B} does not divide over dp={dp}")
            continue
        per_replica = B // dp
        base = ParallelConfig(dp=dp, tp=tp, pp=pp, sp=sp, cp=cp, ep=ep, microbatches=1, dtype=dtype,
                              devices=tuple(devs), sequence_parallel=c.sequence_parallel and tp > 1, **options)
        skip = _shape_skip(g, cl, base, devs, c, torch if runs is not None else None)
        if skip is not None:
            best.skipped += [f"{shape}: {skip}"] if skip else []
            continue
        sizes = mdl.micro_sizes(per_replica, exhaustive, whole=enforce, pinned=c.microbatches)
        # a mesh the user pinned is one shape: every micro-batch size of it is tried
        order = _micro_order(sizes, per_replica, pp, c, wide or one_mesh)
        if not order:
            best.skipped.append(f"{shape}: " + _no_micro_batch(mdl, per_replica, c))
            continue
        # the most memory-frugal plan of this shape (smallest micro-batch, last ladder rung): if even
        # that does not fit, no plan of this shape does (when the backend runs no rung of it, say
        # BatchNorm with micro-batches, the shape's other micro-batch sizes are walked unpruned)
        ladders = [] if exhaustive else list(_plans(replace(base, microbatches=per_replica // min(order)), c,
                                                    layers, runs))
        if ladders:
            frugal = ladders[0][-1]
            try:
                if not offer(mdl.graph(min(order)), frugal, min(order)):
                    continue
            except ValueError as e:
                best.notes.append(f"{frugal}: {e}")
                continue
        for b in order:
            cfg0 = replace(base, microbatches=per_replica // b)
            graph = mdl.graph(b)
            for ladder in _plans(cfg0, c, layers, runs):
                sched_free_fit = False
                for cfg in ladder:
                    try:
                        fits = offer(graph, cfg, b)
                    except ValueError as e:  # a combination the cost model refuses (e.g. sp > heads)
                        best.notes.append(f"{cfg}: {e}")
                        break
                    free = cfg.recompute == "none" and cfg.zero_stage < 3
                    if fits and not wide:
                        # ZeRO 0-2 move the same gradient volume but shard the optimizer step, so
                        # all of them are priced; later rungs only add communication/recomputation
                        sched_free_fit = sched_free_fit or free
                        if not free:
                            break
                    elif sched_free_fit and not free:
                        break
        if (i + 1) % 10 == 0:
            say(f"enumerated {best.candidates} plans ({i + 1}/{len(shapes)} mesh shapes)")
    best.solve(prune=not exhaustive)
    say(f"{best.candidates} plans, {best.priced} priced in full (the others bounded out)")
    if hollow:
        best.notes.append(_hollow_note(hollow))
    if best.refused:
        left = _refusal_reasons(best)
        if best.est is None:
            say("no plan the torch backend executes fits; searching every plan")
            again = search_sync(mdl, cl, B, c, devs, exhaustive, objective, say, executable=False, rank_by=rank_by)
            again.notes.insert(0, "no plan the torch backend executes exactly fits: this strategy is for planning "
                               f"only (polyparallel train refuses it). Left out: {left}")
            return again
        best.notes.append(f"left out {sum(best.refused.values())} plan(s) the torch backend does not execute "
                          f"exactly: {left}")
    if objective == "memory" and best.est is not None:
        least_memory(best)
    if best.est is not None:
        best.notes += why_axes(best, c)
    return best


def _shape_skip(g: Graph, cl: Cluster, cfg: ParallelConfig, devs: list[int], c: Constraints,
                backend: Any) -> str | None:
    """Why the search does not enumerate the mesh shape ``cfg`` (``""``: said nowhere, it cannot win),
    or None: a WAN group it may not have, a ring-attention shape its Ulysses twin dominates."""
    wan = _wan_problem(cl, cfg, devs, c)
    if wan:
        return wan
    if cfg.cp > 1 and c.cp is None and _ulysses_instead(g, cl, cfg, devs, backend):
        return ""
    return None


def _ulysses_instead(g: Graph, cl: Cluster, cfg: ParallelConfig, devs: list[int], backend: Any) -> bool:
    """Whether the ring-attention shape ``cfg`` is dominated by its Ulysses twin (same degrees,
    ``sp = cp``), which the backend runs wherever it runs the ring plan
    (:func:`~polyparallel.cost_models.megatron_rule.ring_dominated`). The twins differ only in the
    sequence split, so the backend is asked about one plan of the shape that no other rule refuses
    (a pipeline's GPipe with a micro-batch per stage); ``backend`` None: every plan counts."""
    if backend is not None:
        probe = replace(cfg, microbatches=cfg.pp, schedule="gpipe")
        if backend.plan_problems(g, replace(probe, sp=cfg.cp, cp=1)) and not backend.plan_problems(g, probe):
            return False
    group = [devs[cfg.rank(0, 0, q, 0)] for q in range(cfg.seq)]
    return ring_dominated(g, cl, cfg, group)


def _ep_degrees(g: Graph, shape: tuple[int, int, int, int, int], c: Constraints) -> list[int]:
    """Expert-parallel degrees of one mesh shape ``(dp, tp, pp, sp, cp)``: 1, and each divisor of
    ``dp·sp·cp`` that divides every MoE layer's expert count (``c.ep`` when pinned)."""
    ranks = shape[0] * shape[3] * shape[4]
    experts = {d.extent for op in g.ops if op.nest is not None for d in op.nest.dims if d.hint is Hint.EXPERT}
    if c.ep is not None and c.ep > 1 and not experts:
        raise ValueError(f"ep={c.ep}: the model has no mixture-of-experts layer (no expert matmul was captured)")
    out = [e for e in divisors(ranks) if all(x % e == 0 for x in experts)] if experts else [1]
    return [e for e in out if e == c.ep] if c.ep is not None else out


MAX_MICROBATCHES = 4096  # micro-batches per step the search considers unless a count is pinned


def _micro_order(sizes: list[int], per_replica: int, pp: int, c: Constraints, exhaustive: bool) -> list[int]:
    """Micro-batch sizes to try for one mesh shape.

    Without a pipeline, every size is tried, largest first (a smaller micro-batch can be faster:
    per-shape GEMM efficiency, memory rungs; the bound keeps the extra plans cheap). With ``pp``
    stages the bubble ``(pp-1)/(m+pp-1)`` favours many micro-batches while efficiency favours large
    ones: for each target ``m = pp, 2pp, 4pp`` the largest size giving at least that many
    micro-batches, the smallest size (the most micro-batches, Megatron's usual micro-batch 1 or 2)
    and the whole batch (``m = 1``). Never more than :data:`MAX_MICROBATCHES` micro-batches, unless
    pinned: a pinned micro-batch count gives its one size.
    """
    if c.microbatches is not None:
        b = per_replica // c.microbatches
        return [b] if per_replica % c.microbatches == 0 and b in sizes else []
    # no recipe runs more micro-batches per step than this (GPT-1T on 3072 GPUs: 512), and pricing a
    # pipeline schedule walks every micro-batch: a batch of 10^12 samples would never finish
    sizes = [b for b in sizes if per_replica // b <= MAX_MICROBATCHES]
    if exhaustive or pp == 1 or not sizes:
        return sorted(sizes, reverse=True)
    # one micro-batch (no pipelining, the stages only split the weights) is kept too: with few
    # samples per replica it can beat a deeper data-parallel group (ViT-B on 64 A100: dp32 pp2 m1)
    want = {min(sizes)} | ({per_replica} & set(sizes))
    for k in (1, 2, 4):
        deep = [b for b in sizes if per_replica // b >= pp * k]
        if deep:
            want.add(max(deep))
    return sorted(want, reverse=True)


def _layer_count(g: Graph) -> int:
    """The repeated blocks a pipeline spreads over its stages (numbered modules, ``h.3``,
    ``layers.7``), which bounds ``pp`` (a 2-layer GPT is not cut into 4 stages, one of them the
    embedding alone) and decides which interleavings divide. A model without numbered modules
    counts its ``⌈√n⌉`` runs of ops."""
    numbered = {m.group(1) for op in g.ops if (m := LAYER.match(op.module or ""))}
    return len(numbered) or len(layer_segments(g))


def _paramless_stage(g: Graph, cfg: ParallelConfig) -> int | None:
    """The first pipeline stage whose ops (as the cost model cuts them) read no parameter, or None."""
    if cfg.pp == 1:
        return None

    v = cfg.virtual
    key = ("paramless_stage", cfg.pp, v, cfg.partition)
    memo = PRICES.of(g)
    if key not in memo:
        held = [False] * cfg.pp
        for chunk, (_, _, has_param) in zip(chunk_of_ops(g, cfg), op_roles(g)):
            held[chunk % cfg.pp] |= has_param
        memo[key] = next((s for s, h in enumerate(held) if not h), None)
    return memo[key]


def _search_collab(mdl: ModelGraphs, cl: Cluster, B: int, c: Constraints, exhaustive: bool,
                   say: Callable[[str], None]) -> tuple[Strategy, int, list[str]] | None:
    """Each center trains locally with its own best plan; fuse every H steps over the WAN. Returns
    the strategy, the candidates priced and the centers' notes (one using fewer of its devices)."""
    say("pricing the collaborative mode: one synchronous plan per center")
    # (center, its best plan's estimate, devices, its synchronous Strategy as placed)
    per_center: list[tuple[Any, StepEstimate, list[int], Strategy]] = []
    cands = 0
    notes: list[str] = []
    for ce in cl.centers:
        devs = cl.devices_of(center=ce.index)
        if not devs:
            continue
        # a center's round runs only the plans a collaborative center executes
        cc = replace(c, centers=(ce.name,), devices=None, mode="synchronous", **CENTER_LIMITS)
        # the center's local batch: its device share of B, in whole example batches
        share = max(mdl.b0, round(B * len(devs) / cl.num_devices / mdl.b0) * mdl.b0)
        best, placed = Best(), None
        refused: list[str] = []
        for local in dict.fromkeys((share, mdl.b0 * len(devs))):
            try:
                best = search_sync(mdl, cl, local, cc, devs, exhaustive, "throughput", lambda _: None)
            except ValueError:
                continue
            cands += best.candidates
            placed, refused = center_checked(mdl, cl, best, local, devs, cc)
            if best.est is not None:
                break
        if best.est is None:  # a center cannot hold the model, or runs none of the plans that fit it
            if c.mode == "collaborative" and refused:
                raise DoesNotFit(f"no plan center {ce.name} runs fits: a collaborative center calls the model's own "
                                 "forward on each device's shards, and refuses " + " | ".join(r[:300] for r in
                                                                                              refused[-2:]))
            return None
        fewer = _on_fewer_devices(best, mdl, cl, local, cc, devs, exhaustive, "throughput", lambda _: None)
        if fewer[1] != devs:
            said = next(n for n in fewer[0].notes if n.startswith("uses "))
            notes.append(f"center {ce.name}: " + said.replace("the cluster's", "its").partition("; constraints=")[0])
            placed, more = center_checked(mdl, cl, fewer[0], local, fewer[1], cc)
            refused += more
        best, devs = fewer
        if best.est is None or placed is None:
            return None
        if refused:
            notes.append(f"center {ce.name}: left out {len(refused)} faster plan(s) its trainer refuses: "
                         + " | ".join(r[:300] for r in refused[-2:]))
        if placed.tp > 1 and not any("tp" in p.placement for p in placed.placements):
            notes.append(f"center {ce.name}: tp={placed.tp}{' as pinned' if c.tp else ''} splits no op: each of its "
                         f"{len(devs)} devices computes what one would (its trainer runs every op replicated)")
        assert best.est is not None
        per_center.append((ce, best.est, devs, placed))
    if len(per_center) < 2:
        return None
    return collaborative_strategy(mdl, cl, B, c, per_center, notes), cands, notes


def _does_not_fit_message(mdl: ModelGraphs, cl: Cluster, best: Best | None) -> str:
    if best is None or best.closest is None:
        notes = best.notes if best else []
        hollow = [n for n in notes if "no parameter" in n]
        # the cost model's refusals ("dp1 tp1 pp1 sp2 ...: why"), each reason once
        refused = dict.fromkeys(n.split(": ", 1)[1] for n in notes if n.startswith("dp") and ": " in n)
        return (f"no parallel plan of {mdl.name} is possible on {cl.name} under the constraints given "
                "(check the pinned degrees against the device count)"
                + "".join(f"; {n}" for n in [*hollow, *list(refused)[:2],
                                             *(dict.fromkeys(best.skipped) if best else [])][:4]))
    worst = max(best.closest.memory, key=lambda r: r.total - r.capacity)
    return (f"{mdl.name} does not fit on {cl.name}: the closest plan ({best.closest.config}) needs "
            f"{worst.total / 1e9:.2f} GB on {worst.label} but {worst.device} has {worst.capacity / 1e9:.2f} GB "
            f"(short by {(worst.total - worst.capacity) / 1e9:.2f} GB). {worst.why()}")


# ----------------------------------------------------------------------------------------
# evaluate a hand-made recipe


def _opaque_note(graph: Graph | None) -> list[str]:
    """Ops the model has no loop nest for: priced at one FLOP per output element and never split."""
    ops = graph.opaque_ops() if graph is not None else []
    if not ops:
        return []
    shown = "; ".join(f"{o.name} ({o.opaque_reason or 'no affine form'})" for o in ops[:3])
    return [f"{len(ops)} op(s) have no loop nest (opaque): priced at one FLOP per output element and replicated, "
            f"so their cost and splits are not modelled: {shown}{' ...' if len(ops) > 3 else ''}"]


def check_cluster(cluster: Any) -> None:
    """Refuse a cluster argument that is not a preset name, a spec path or a Cluster (search and evaluate)."""
    if not isinstance(cluster, Cluster | str | Path):
        raise ValueError(f"cluster (the third argument) must be a preset name, a spec path or a Cluster, not a "
                         f"{type(cluster).__name__}; keyword inputs of the model go in example_kwargs={{...}}")


def check_batch_size(batch_size: Any) -> None:
    """Refuse a global batch that is not unset or a whole number >= 1 (search and evaluate)."""
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size={batch_size!r}: give the global batch as a whole number >= 1 (samples per "
                         "optimizer step), or leave it unset for the example batch times the devices")
