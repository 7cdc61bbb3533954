"""Translate a Strategy into what torch.distributed can execute, or refuse it with the reason.

The backend runs a plan exactly or not at all. Which plans and placements it runs is written once,
in :mod:`.capabilities`, which the search enumerates with; this module maps an accepted plan onto
torch's parallel styles:

* data parallelism over the ``dp`` mesh axis: DDP when ``zero_stage == 0``, FSDP2 ``fully_shard``
  over the ``dp`` sub-mesh when ``zero_stage >= 1``: one unit per numbered layer (``layers.<i>``,
  ``h.<i>``, ...), then the root, as the cost model prices ZeRO (``_worker._fully_shard``). ZeRO-3
  reshards each layer after its forward; ZeRO-1/2 keep the weights gathered from the forward to the
  backward and through all micro-batches of a step; ZeRO-2/3 reduce-scatter every micro-batch's
  gradients, ZeRO-1 the accumulated ones in the last backward. Pipeline stages wrap each chunk as
  one unit;
* tensor parallelism over the ``tp`` axis on ``nn.Linear`` modules (and Hugging Face's ``Conv1D``,
  whose weight is stored transposed: it runs as the exported graph rewritten on local shards): a
  placement splitting the output dim ``n`` is ``ColwiseParallel``, one splitting the reduction dim
  ``k`` (or a factor ``k_0`` of it) is ``RowwiseParallel``; a column-parallel linear not followed by
  a row-parallel one feeds the loss, which is then class-parallel (``c:tp`` on cross entropy, run
  under ``loss_parallel``) or gathered to a replicated output when the loss is replicated. With the
  captured graph the pairing is read off it: a column-parallel Linear's partner is the row-parallel
  Linear (or the loss) its shards reach through pointwise ops only (a pointwise epilogue fused into
  another column-parallel Linear, as LLaMA's ``silu(gate(h)) * up(h)``, counts); otherwise its
  output is gathered. A column-parallel Linear wider than its partner's input (a fused
  ``[gate; up]`` projection) has its rows regrouped by the blocks the partner's ranks read
  (``_tensor_parallel.paired_blocks``), as a fused ``qkv`` is;
* DP x TP on a 2-D ``("dp", "tp")`` mesh with FSDP2 (``zero_stage >= 1``);
* pipeline parallelism over the ``pp`` axis (:mod:`._pipeline`): the model exported with
  ``torch.export`` is cut before the first op of each stage's op range, each stage runs with
  ``torch.distributed.pipelining`` (GPipe, 1F1B or interleaved 1F1B, ``microbatches`` micro-batches,
  the loss on the last stage), alone or with DDP / FSDP2 over ``dp`` on a 2-D ``("pp", "dp")`` mesh,
  and with tensor parallelism inside the stages on a ``("pp", "dp", "tp")`` mesh (:mod:`._stage_tp`,
  Megatron on the exported graph's local shards); tied weights used by several stages have their
  gradients summed over those stages.

* head-parallel attention (:mod:`._tensor_parallel`): an attention op split over its heads
  (``h:tp``), or an attention written out (``q @ k.T``, softmax, ``p @ v`` split over their heads
  dim), runs locally on each rank's heads; the Linear(s) producing its ``q, k, v`` are
  column-parallel, a fused ``qkv`` projection with its rows regrouped so every rank owns whole heads
  of ``q``, ``k`` and ``v`` (read off the attention's accesses in the model's captured graph), and
  the output projection is row-parallel;
* the model's own forward runs on each rank's shards only if it sizes its views from the tensors
  (``view(B, S, -1, head_dim)``, as ``polyparallel.models.GPT`` does). Before launch it is tried on
  fake local shards (:func:`._tensor_parallel.eager_tp_problem`); a forward sizing them from its
  configuration (nanoGPT's ``c_attn(x).split(n_embd, dim=2)``) fails there, and then the plan runs as
  the exported graph rewritten on local shards (:mod:`._stage_tp`, the pipeline stages' rewrite, as one
  stage; ``microbatches`` are the schedule's micro-batches), which rewrites every view's sizes;
* vocabulary-parallel embeddings (``v:tp``): ``RowwiseParallel`` on ``nn.Embedding``; a weight tied
  between such an embedding and a column-parallel output head stays tied (both shard the vocabulary);
* sequence parallelism over an ``sp`` axis as the cost model prices it (DeepSpeed-Ulysses, on a
  ``("dp", "sp", "tp")`` mesh): every rank holds ``1/sp`` of each sequence, each
  ``scaled_dot_product_attention`` is wrapped in all-to-alls to whole sequences of ``1/sp`` of the
  heads, position indices are offset, and gradients are averaged over ``dp·sp``. The planner's
  placements do not name the sequence dim; ``sp`` on a placement is accepted and executed this way;
  inside pipeline stages the same exchanges are a pass over the exported graph (:mod:`._stage_sp`);
* before launch the model is captured on one micro-batch and its fingerprint compared with the
  strategy's (``check_fingerprint=False`` skips that for a stand-in model).

Everything else (what :func:`.capabilities.plan_problems` lists, a tp placement on a module that is
not a Linear, Embedding or head-split attention, Megatron-style sequence parallelism, which the
planner never emits) is refused: ``parallelize_module`` would either fail or compute something else
than the plan priced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from polyparallel.backends.torch._expert_parallel import expert_modules
from polyparallel.backends.torch._pipeline import pipeline_plan
from polyparallel.backends.torch._recompute import recompute_blocks
from polyparallel.backends.torch._sequence_parallel import position_embeddings, sequence_tables
from polyparallel.backends.torch._tensor_parallel import (
    eager_tp_problem,
    head_split,
    linear_widths,
    micro_batch,
    paired_blocks,
    reads_head_shards,
    sharded_consumer,
    tied_shards,
    transposed_problem,
    uneven_shards,
)
from polyparallel.backends.torch.capabilities import (
    Unsupported,
    dp_split_ok,
    op_role,
    plan_problems,
    sequence_via_graph,
)
from polyparallel.ir import Graph
from polyparallel.plan import Plan
from polyparallel.strategy import Strategy

__all__ = ["ExecPlan", "Unsupported", "checked_batch", "own_forward_plan", "plan_for"]




@dataclass(frozen=True, kw_only=True)
class ExecPlan(Plan):
    """The strategy's :class:`~polyparallel.plan.Plan` and what each worker applies for it.
    ``tp_plan`` maps module path -> ``"col"`` / ``"row"`` / ``"col_to_loss"`` (column-parallel whose
    output feeds the loss directly) / ``"col_gather"`` / ``"emb_row"`` (vocabulary-parallel
    embedding); ``fused`` gives the head-major blocks of fused projections (regrouped
    column-parallel), ``tied`` the ``module.param`` paths re-tied after sharding, ``positions`` the
    position embeddings offset on sequence shards, ``tables`` the buffers read by position (rotary
    tables) each sequence shard holds its slice of (``._sequence_parallel.sequence_tables``). Of the
    plan: ``microbatches`` with ``pp == 1`` is gradient accumulation, ``zero_stage`` with
    ``data_parallel == "fsdp"`` how FSDP2 reshards and reduces (``._worker._fully_shard``), ``ep``
    splits the experts over the dp ranks (``._expert_parallel``), ``dtype`` is applied by
    ``._precision``, ``recompute`` by ``._recompute``."""

    data_parallel: str  # "none", "ddp" or "fsdp"
    tp_plan: tuple[tuple[str, str], ...]
    loss_parallel: bool
    global_batch: int
    # a ._pipeline.PipelinePlan when pp > 1, and with pp == 1 when tensor parallelism runs as the
    # exported graph rewritten on local shards (the model's forward fails on them)
    pipeline: Any = None
    fused: tuple[tuple[str, tuple[int, ...]], ...] = ()
    tied: tuple[tuple[str, ...], ...] = ()
    positions: tuple[str, ...] = ()
    tables: tuple[tuple[str, int, int], ...] = ()  # (buffer path, dim, sequence length): sharded with the sequence
    recompute_blocks: tuple[str, ...] = ()  # the layers recompute="full" or "op" checkpoints


def _parse(placement: str) -> dict[str, tuple[str, ...]]:
    """``"b:dp,n:tp"`` -> ``{"b": ("dp",), "n": ("tp",)}`` (a dim may be split over ``dp+tp``)."""
    out: dict[str, tuple[str, ...]] = {}
    for part in filter(None, (p.strip() for p in placement.split(","))):
        dim, _, axes = part.partition(":")
        out[dim.strip()] = tuple(a for a in re.split(r"[+*]", axes.strip()) if a)
    return out


def _op_index(name: str) -> int:
    """Capture order of an op from its name (``linear`` -> 0, ``linear_7`` -> 7)."""
    m = re.search(r"_(\d+)$", name)
    return int(m.group(1)) if m else 0


def plan_for(strategy: Strategy, model: nn.Module, batch: Any = None, *, graph: Graph | None = None) -> ExecPlan:
    """Check ``strategy`` against ``model`` (built on this process) and return the worker plan.

    ``graph`` is the model's captured graph (``_tensor_parallel.strategy_graph``); head-parallel
    attention and sequence parallelism are read off it and refused without it.

    With ``pp > 1``, ``batch`` is one global batch ``(inputs, labels)`` (``data_fn(0)``): the model is
    exported on a micro-batch of it to cut it into the strategy's stages.

    Raises :class:`Unsupported` naming the op/module and what to change when any part of the plan
    cannot be expressed with DDP / FSDP2 / ``parallelize_module``.
    """
    s = strategy
    _check_plan(s, graph)
    modules = dict(model.named_modules())
    ops = _tp_ops(s, graph, modules)
    heads = _head_blocks(graph, ops, s.tp)
    seen = _tp_styles(graph, ops, heads, modules, s.tp)
    tied, why = tied_shards(model, seen, {op.module for op in graph.ops if op.module} if graph is not None else None)
    if why:
        raise Unsupported("the torch backend cannot execute this strategy exactly: " + "; ".join(why[:3]))
    if ops.loss_parallel and not any(k == "col_to_loss" for k in seen.values()):
        raise Unsupported("cross entropy is class-parallel over tp but no column-parallel Linear produces its "
                          "logits")
    _check_modules(s, model, graph, modules)
    fused = {p: seg for p, seg in heads.items() if len(seg) > 1}
    return ExecPlan.from_record(
        s, data_parallel="none" if s.dp * s.plan.seq == 1 else ("fsdp" if s.zero_stage >= 1 else "ddp"),
        tp_plan=tuple(sorted(seen.items())), loss_parallel=ops.loss_parallel, global_batch=s.global_batch,
        pipeline=_graph_stages(s, model, batch, graph, seen, fused, ops.graph_only),
        fused=tuple(sorted(fused.items())),
        tied=tuple(tied), positions=tuple(position_embeddings(graph)) if s.plan.seq > 1 and graph else (),
        tables=_sequence_tables(s, model, graph),
        recompute_blocks=tuple(recompute_blocks(graph)) if s.recompute in ("full", "op") and graph else ())


def checked_batch(strategy: Strategy, batch: Any) -> Any:
    """The global batch :func:`plan_for` is given for ``strategy``, as ``train`` gives it: where the model
    may run as its exported graph (pipeline stages; tensor parallelism whose forward fails on a rank's
    shards; a sequence split the eager run cannot shard), None otherwise (nothing to cut or try)."""
    return batch if strategy.pp > 1 or strategy.tp > 1 or strategy.plan.seq > 1 else None


def _sequence_tables(s: Strategy, model: nn.Module, graph: Graph | None) -> tuple[tuple[str, int, int], ...]:
    """The tables a sequence shard holds its slice of; a persistent buffer is refused (each shard's
    checkpoint would hold its slice, not the table)."""
    if s.plan.seq == 1 or graph is None:
        return ()
    out = []
    for t in sequence_tables(graph)[0]:
        owner, _, name = t.path.rpartition(".")
        if name not in model.get_submodule(owner)._non_persistent_buffers_set:
            axis = s.plan.seq_axis
            raise Unsupported(f"{axis}={s.plan.seq}: buffer {t.path!r} is read by sequence position and would be "
                              "sharded with the sequence, but it is persistent (saved in the state dict): register it "
                              f"with persistent=False, or pin {axis}=1")
        out.append((t.path, t.dim, t.length))
    return tuple(out)


def own_forward_plan(strategy: Strategy, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                     *, graph: Graph) -> ExecPlan:
    """:func:`plan_for` of a run that calls the model's own forward on each rank's shards, as a
    collaborative center's local steps do (no exported-graph rewrite, no pipeline): a
    tensor-parallel plan whose forward fails there (nanoGPT's ``split(n_embd)``) or silently
    reshapes the data (OPT's ``view(bsz, -1, num_heads, head_dim)``) is refused, where the torch
    backend's workers would run the rewrite. ``args, kwargs``: how the run calls the model."""
    exec_plan = plan_for(strategy, model, graph=graph)
    if exec_plan.tp > 1:
        why = eager_tp_problem(model, dict(exec_plan.tp_plan), exec_plan.tp, args, kwargs)
        if why:
            raise Unsupported(f"tp={exec_plan.tp}: the model's forward does not run on a rank's shards as written "
                              f"({why}), and this run calls the model's own forward: plan it with tp=1")
    return exec_plan


def _check_plan(s: Strategy, graph: Graph | None) -> None:
    """The plan-level checks: a synchronous strategy over dp/tp/sp/pp axes that the backend's
    predicates accept (:func:`.capabilities.plan_problems`) and whose batch divides as it says."""
    if s.mode != "synchronous":
        raise Unsupported(f"a {s.mode} strategy is run by `polyparallel collab`, not the torch backend")
    for ax in s.mesh.axes:
        if ax.name not in ("dp", "tp", "pp", "sp", "cp") and ax.size > 1:
            raise Unsupported(f"mesh axis {ax.name!r} of size {ax.size}: only 'dp', 'tp', 'sp', 'cp' and 'pp' axes "
                              "are executed")
    why = plan_problems(graph, s.plan)  # the predicates the search enumerates with
    if why:
        raise Unsupported("the torch backend cannot execute this strategy exactly: " + "; ".join(why)
                          + ". Search again (polyparallel search leaves such plans out) or pin other constraints")
    if s.global_batch % s.dp:
        raise Unsupported(f"global_batch={s.global_batch} is not divisible by dp={s.dp}")
    if s.pp == 1 and s.global_batch % (s.dp * s.microbatches):
        raise Unsupported(f"global_batch={s.global_batch} is not divisible by dp*microbatches={s.dp * s.microbatches}: "
                          "accumulated micro-batches must be equal for their mean loss to equal the full batch's")


@dataclass
class _TpOps:
    """What the strategy's placements split over tp, by the module kind that executes it."""

    linears: list[tuple[int, str, str]] = field(default_factory=list)  # (capture index, module path, "col"/"row")
    attention: list[tuple[str, str]] = field(default_factory=list)  # (op, dim) split over tp
    embeddings: list[str] = field(default_factory=list)  # vocabulary-parallel nn.Embedding paths
    loss_parallel: bool = False  # the cross entropy split over its classes
    # why the model's own forward cannot run the split modules (an embedding class with its own forward,
    # a Conv1D): the plan then runs as the exported graph rewritten on local shards
    graph_only: list[str] = field(default_factory=list)


def _tp_ops(s: Strategy, graph: Graph | None, modules: dict[str, nn.Module]) -> _TpOps:
    """Read each placement: the dp splits must be the batch's, and each tp split must be one the
    backend executes (a Linear's columns or rows, an embedding's vocabulary, attention's heads, the
    loss's classes). Raises :class:`Unsupported` listing the first five that are not."""
    out = _TpOps()
    graph_ops = {o.name: o for o in graph.ops} if graph is not None else {}
    problems: list[str] = []
    for pl in s.placements:
        dims = _parse(pl.placement)
        for i, op in enumerate(pl.ops):
            path = pl.modules[i] if i < len(pl.modules) else ""
            where = f"op {op!r}" + (f" (module {path!r})" if path else "")
            gop = graph_ops.get(op)
            problems += _dp_problems(pl.placement, dims, op, gop, where)
            tp_dims = [d for d, axes in dims.items() if "tp" in axes]
            if not tp_dims or s.tp == 1:
                continue
            if len(tp_dims) > 1:
                problems.append(f"{where}: placement {pl.placement!r} splits several dims over tp")
                continue
            why = _tp_op(out, graph, gop, op, path, tp_dims[0], modules.get(path) if path else None)
            if why:
                problems.append(f"{where}: placement {pl.placement!r} {why}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise Unsupported("the torch backend cannot execute this strategy exactly: " + "; ".join(problems[:5]) + more
                          + ". Search with other constraints (e.g. {'tp': 1}) or change the model")
    out.linears.sort()
    return out


def _dp_problems(placement: str, dims: dict[str, tuple[str, ...]], op: str, gop: Any, where: str) -> list[str]:
    """Why one op's placement splits something other than the batch over dp (or uses an unknown axis)."""
    out = []
    for dim, axes in dims.items():
        bad = [a for a in axes if a not in ("dp", "tp", "sp", "cp")]
        if bad:
            out.append(f"{where}: placement {placement!r} uses mesh axis {bad[0]!r}")
            continue
        # without the graph, by the frontend's dim names: the batch 'b'; a loss sees logits
        # flattened to (batch*seq, classes), whose row dim 'n' (or its factor 'n_0') is the batch
        batch_dim = dp_split_ok(gop, dim) if gop is not None else dim in (
            ("b", "n", "n_0") if op.startswith("cross_entropy") else ("b",))
        if "dp" in axes and (not batch_dim or len(axes) > 1):
            out.append(f"{where}: placement {placement!r} splits {dim!r} over dp; only the "
                       "batch dim alone is data-parallel in this backend")
    return out


def _tp_op(out: _TpOps, graph: Graph | None, gop: Any, op: str, path: str, d: str, mod: nn.Module | None) -> str:
    """Record one op split over tp along ``d`` in ``out``; the reason the backend cannot (after
    "placement ..."), or ``""``."""
    if op_role(graph, gop) == "loss" if gop is not None else op.startswith("cross_entropy"):
        if d != "c":
            return f"splits a cross entropy over {d!r}; only the class dim 'c' is executed (loss_parallel)"
        out.loss_parallel = True
        return ""
    if op_role(graph, gop) in ("attention", "heads") if gop is not None else "attention" in op:
        out.attention.append((op, d))  # checked against the graph by _head_blocks
        return ""
    if isinstance(mod, nn.Embedding) and re.fullmatch(r"v(_0)?", d):
        if type(mod).forward is not nn.Embedding.forward:
            # a subclass's own forward (a scaled lookup: BART's, Gemma's) would mix the sharded table
            # with whole tensors in eager mode: the exported graph's lookup runs it instead
            out.graph_only.append(f"vocabulary embedding {path} ({type(mod).__name__}) has its own forward, "
                                  "which would mix the sharded table with whole tensors")
        out.embeddings.append(path)
        return ""
    if linear_widths(mod) is None:
        kind = type(mod).__name__ if mod is not None else "no module"
        return (f"splits {d!r} over tp on a {kind}; only nn.Linear (and HF's Conv1D), nn.Embedding (vocabulary) and "
                "attention (heads) are tensor-parallel in this backend")
    why = transposed_problem(mod, path)
    if why and why not in out.graph_only:
        out.graph_only.append(why)
    if d == "n":
        out.linears.append((_op_index(op), path, "col"))
    elif d == "k" or re.fullmatch(r"k_\d+", d):
        out.linears.append((_op_index(op), path, "row"))
    else:
        return f"splits Linear dim {d!r} over tp; only 'n' (column-parallel) and 'k' (row-parallel) are executed"
    return ""


def _head_blocks(graph: Graph | None, ops: _TpOps, tp: int) -> dict[str, tuple[int, ...]]:
    """Projection module -> the blocks the head-split attention ops read of its output; each such
    projection must be column-parallel in the strategy."""
    heads: dict[str, tuple[int, ...]] = {}
    if not ops.attention:
        return heads
    splits, why = head_split(graph, ops.attention, tp) if graph is not None else (
        [], [f"attention op {ops.attention[0][0]!r} is split over tp but the model could not be captured to check "
             "its inputs"])
    for h in splits:
        if h.module not in {p for _, p, k in ops.linears if k == "col"}:
            why.append(f"attention op(s) {', '.join(op for op, _ in ops.attention[:3])} are head-parallel but their "
                       f"input projection {h.module!r} is not column-parallel in the strategy")
        heads[h.module] = h.segments
    if why:
        raise Unsupported("the torch backend cannot execute this strategy exactly: " + "; ".join(why[:3]))
    return heads


def _tp_styles(graph: Graph | None, ops: _TpOps, heads: dict[str, tuple[int, ...]],
               modules: dict[str, nn.Module], tp: int) -> dict[str, str]:
    """Module path -> its tensor-parallel style (``ExecPlan.tp_plan``): each column-parallel Linear
    paired with the row-parallel one its shards reach (Megatron), else gathered or fed to the
    class-parallel loss; each row-parallel Linear must be such a partner (or read head shards).
    A column-parallel Linear wider than its partner's input (a fused ``[gate; up]`` projection)
    gets its blocks added to ``heads`` (regrouped as a fused ``q|k|v`` is)."""
    seen: dict[str, str] = {}
    partners: set[str] = set()  # row-parallel Linears a column-parallel one feeds
    for j, (_, path, kind) in enumerate(ops.linears):
        dst = None
        if path in seen and seen[path] != kind:
            raise Unsupported(f"module {path!r} is called more than once with different tp placements")
        if kind == "col" and path in heads:
            pass  # its output is consumed sharded, by whole heads, by a head-parallel attention
        elif kind == "col":
            # A column-parallel output is only consumed sharded by a row-parallel linear (Megatron
            # pairing) or by a class-parallel loss; otherwise it must be gathered. With the graph the
            # partner is the row-parallel Linear its shards reach through pointwise ops; without it,
            # the next Linear in op order.
            rows = [p for _, p, k in ops.linears[j + 1:] if k == "row"]
            if graph is None:
                dst = rows[0] if j + 1 < len(ops.linears) and ops.linears[j + 1][2] == "row" else None
                to_loss = ops.loss_parallel
            else:
                cols = frozenset(p for _, p, k in ops.linears if k == "col")
                dst = next((r for r in rows if sharded_consumer(graph, path, r, cols) is None), None)
                to_loss = ops.loss_parallel and sharded_consumer(graph, path, None, cols) is None
            kind = "col" if dst else ("col_to_loss" if to_loss else "col_gather")
            if dst:
                a, b = linear_widths(modules[path]), linear_widths(modules[dst])
                assert a is not None and b is not None  # _tp_ops refused any other module
                if a[1] != b[0]:
                    # a fused [gate; up] projection: rank r must hold the r-th block of each part
                    blocks = paired_blocks(graph, path, dst, tp) if graph is not None else "no captured graph"
                    if isinstance(blocks, str):
                        raise Unsupported(f"column-parallel {path!r} ({a[1]} outputs) feeds "
                                          f"row-parallel {dst!r} ({b[0]} inputs): not a Megatron pair "
                                          f"whose sharded activation passes straight through ({blocks})")
                    if len(blocks) > 1:
                        heads[path] = blocks
        seen[path] = kind
        if kind == "col" and dst:
            partners.add(dst)
    heads_ops = frozenset(op for op, _ in ops.attention)
    for _, path, kind in ops.linears if graph is not None else ():
        if kind == "row" and path not in partners and not reads_head_shards(graph, path, heads_ops):
            raise Unsupported(f"row-parallel Linear {path!r} reads an input that no column-parallel Linear or "
                              "head-parallel attention leaves split over tp in the model's graph: the strategy's "
                              "placements are not a Megatron pairing here")
    for path in ops.embeddings:
        seen[path] = "emb_row"
    return seen


def _check_modules(s: Strategy, model: nn.Module, graph: Graph | None, modules: dict[str, nn.Module]) -> None:
    """The modules the plan's recomputation checkpoints and its expert parallelism splits exist in ``model``."""
    if s.recompute in ("full", "op") and graph is not None:
        absent = [b for b in recompute_blocks(graph) if b not in modules]
        if absent:
            raise Unsupported(f"recompute={s.recompute!r} checkpoints the layer module {absent[0]!r} of the model's "
                              "graph, which the model has no module for; build the model the strategy was searched for")
    if s.ep > 1:
        bad = [p for p, m in expert_modules(model) if m.gate_up_proj.shape[0] % s.ep]
        if not expert_modules(model) or bad:
            raise Unsupported(f"ep={s.ep}: " + (f"experts module {bad[0]!r} has experts not divisible by ep" if bad
                              else "the model has no HF experts module (3-D gate_up_proj / down_proj) to split"))


def _graph_stages(s: Strategy, model: nn.Module, batch: Any, graph: Graph | None, seen: dict[str, str],
                  fused: dict[str, tuple[int, ...]], graph_only: list[str]) -> Any:
    """The exported graph cut into the strategy's pipeline stages (a ``._pipeline.PipelinePlan``);
    with ``pp == 1`` the graph rewritten on local shards as one stage, where the model's own forward
    fails on a rank's shards (its views sized from its configuration) or cannot run the split
    modules (``graph_only``: a vocabulary embedding with its own forward, a Conv1D); None when
    neither is needed."""
    pipe = None
    eager_why = None  # why the model's own forward cannot run on a rank's shards
    if s.pp == 1 and s.tp > 1 and graph_only:
        eager_why = graph_only[0]
        if batch is None or s.plan.seq > 1:
            raise Unsupported(f"tp={s.tp}: {eager_why}; only its exported graph runs it, which needs one global batch "
                              "and no sequence parallelism: pin tp=1 or keep this module replicated")
    elif s.pp == 1 and s.tp > 1 and s.plan.seq == 1 and batch is not None:
        eager_why = eager_tp_problem(model, dict(seen), s.tp, micro_batch(s, batch))
    elif graph is not None and sequence_via_graph(graph, s.plan):
        eager_why = "the model builds tensors from the sequence length (a causal mask, positions) per shard"
    if s.pp > 1 or eager_why:
        if batch is None:
            raise ValueError(f"pp={s.pp}: plan_for needs one global batch (data_fn(0)) to cut the model into stages")
        uneven = uneven_shards(model, seen, s.tp) if s.tp > 1 else []
        try:
            if uneven:  # what the stage rewrite would refuse after exporting the model, said first
                raise Unsupported("tensor parallelism inside pipeline stages: " + "; ".join(uneven[:2]))
            # With pp == 1, the exported graph rewritten on local shards runs as one stage: it
            # computes what the forward computes, with view sizes rewritten to the local ones.
            pipe = pipeline_plan(s, model, batch, graph, tp_kinds=dict(seen), fused=fused)
        except Unsupported as e:
            if not eager_why:
                raise
            raise Unsupported(f"tp={s.tp}: the model's forward fails on a rank's shards ({eager_why}), and its "
                              f"exported graph cannot be rewritten on them either ({e}); search with "
                              "constraints={'tp': 1}") from None
    return pipe
