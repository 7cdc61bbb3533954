"""Pipeline parallelism for the torch backend: the Strategy's stages run with ``torch.distributed.pipelining``.

**Stage split.** The model is captured with ``torch.export`` (as the frontend captured it for the
planner, so the op names are the ones the Strategy's stages name) on one micro-batch. A strategy with
``pp`` stages and ``v`` chunks per stage (``v > 1`` only for the interleaved schedule) cuts the op
sequence into ``K = pp * v`` chunks; chunk ``k`` runs on stage ``k mod pp`` and starts at the first op
its ``Stage.ops`` range names. Every exported op between two cuts belongs to the earlier chunk, so
chunk ``k`` computes exactly the ops ``[cut_k, cut_{k+1})`` of the plan. Chunk ``k`` becomes an
``fx.GraphModule`` whose inputs are the values live across cut ``k`` (produced before it, used at or
after it) and whose outputs are those live across cut ``k + 1``; a value skipping a chunk is passed
through it. Parameters keep their model paths (``h.3.fc.weight``), so checkpoints name them as the
unsplit model does.

**Loss.** ``model(inputs, labels)`` returns the mean loss. The ops that depend on ``labels`` (the
loss) form the *loss tail*, run by the schedule's ``loss_fn`` on the last stage with the labels as
the target. The schedule scales the gradients by ``1/M`` for ``M`` micro-batches, and the ``dp``
replicas average theirs. When the tail is one mean-reduced cross entropy / NLL (ATen's
``cross_entropy_loss``, as export writes ``F.cross_entropy``), micro-batch ``j`` of replica ``r``
counts the targets its loss divided by, ``c_rj`` (not ignored, times the class weight; see
``_loss_weighting``), and ``loss_fn`` returns ``L_rj · c_rj / u`` (``u`` the micro-batch's number
of labels, which keeps the backpropagated values at the mean loss's scale); after the schedule one
all-reduce over all ranks gives ``T = Σ c_rj`` (the non-last stages add 0), and every stage multiplies its
gradients by ``M·dp·u / T`` before the optimiser step, so the step's gradient is
``∇ Σ L_rj c_rj / T``, the gradient of the global batch's mean over its valid targets, which is the
logged loss (``loss_weighting: "tokens"``). Any other loss keeps ``L_rj`` unweighted: the gradient
``∇ 1/(M·dp) Σ L_rj`` and the logged mean of the means are the global batch's for equal micro-batches
of a loss whose mean is over a fixed count (``"mean_of_means"``). BatchNorm would normalise per
micro-batch, which single-process training does not; models with BatchNorm are refused.

**Precision** (``_precision``): the strategy's bf16/fp16 runs under autocast inside each chunk's
forward and the loss tail, with FSDP2's mixed precision where a stage's parameters are sharded;
fp16's loss scale is applied in ``loss_fn``, taken out of the logged losses, and its overflow check
spans every stage.

**Tied weights** (GPT's ``lm_head.weight = wte.weight``): each stage that uses the parameter holds a
copy; after the schedule's backward their gradients are summed over the stages holding it (the
Megatron embedding all-reduce), so every copy takes the same update and stays equal to the others.

**Data parallelism inside a stage** (a 2-D ``("pp", "dp")`` mesh, as the Strategy's mesh lists it):
each chunk is wrapped over the stage's dp group in FSDP2 ``fully_shard`` (``zero_stage >= 1``) or, for
``zero_stage == 0`` (replicated parameters, all-reduced gradients), in FSDP2's ``replicate`` rather
than ``DistributedDataParallel``, whose bucket rebuild fails after a step of several micro-batch
backwards. ``PipelineStage`` reduces the gradients once per step, after the last micro-batch.

**Checkpoints** (``torch.distributed.checkpoint``) keep the model paths as keys (prefixed by the
chunk's position on its rank when a rank holds several chunks) and one optimiser entry per stage.

Refused before launch, with the reason: a model ``torch.export`` cannot capture, a stage boundary
naming an op the model does not have (a strategy for another model), cuts out of order, stage layer
lists that disagree with where the layers sit in the model, a non-tensor value crossing a cut (e.g.
between a ``split`` and its ``getitem``), the model input used after the first stage, parameters in
the loss tail, tensors mutated in forward, BatchNorm (each micro-batch would be normalised alone),
schedules other than GPipe / 1F1B / interleaved 1F1B, ``global_batch`` not divisible by
``dp * microbatches``, and a tensor-parallel placement the stage rewrite cannot run (below).

**Tensor parallelism inside a stage** (``tp > 1``, a ``("pp", "dp", "tp")`` mesh in the Strategy's
order): before the exported graph is cut, :mod:`._stage_tp` rewrites it Megatron-style on local
shards (column/row-parallel Linears with their ``f``/``g`` all-reduces, head-parallel attention over
the regrouped fused ``qkv``, vocabulary-parallel embeddings), and the split parameters become
``DTensor`` parameters on the stage's ``tp`` mesh (FSDP2 over ``dp`` composes with them as in the
unpipelined DP x TP). Class-parallel logits enter the loss tail as ``DTensor`` and the step runs
under ``loss_parallel``; only tensor-parallel rank 0 of the last stage reports the micro-batch
losses. p2p goes between the ranks of equal ``(dp, tp)`` index; a tied weight's gradients are
summed over the stages holding it per ``(dp, tp)`` index.

**Sequence parallelism inside a stage** (``sp > 1``, DeepSpeed-Ulysses, a ``("pp", "dp", "sp")``
mesh in the Strategy's order): the model is exported at the local sequence length ``S/sp`` and
:mod:`._stage_sp` rewrites the graph before it is cut (each attention wrapped in the all-to-alls of
:class:`._sequence_parallel.UlyssesAttention`, positions offset by the shard's first one, a causal mask
built from positions folded into ``is_causal``, an HF label shift fed the next shard's first label).
The first stage reads its sequence shard of the micro-batch, the loss tail its shard of the labels;
every ``(dp, sp)`` replica's micro-batch losses are token-weighted as for ``dp`` alone, and the
gradients are averaged over the ``dp·sp`` ranks of a stage (FSDP2 over the flattened mesh). p2p goes
between the ranks of equal ``(dp, sp)`` index. With ``tp > 1`` the tensor-parallel pass runs first and
the all-to-alls move the rank's ``h/tp`` heads (heads divisible by ``tp·sp``). Context parallelism
(``cp > 1``: ring attention, load-balanced positions) runs the same way, on the same mesh dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from polyparallel.backends.torch._batchnorm import has_batch_statistics
from polyparallel.backends.torch._loss_weighting import TargetCount, weigh_microbatches
from polyparallel.backends.torch._precision import Precision
from polyparallel.backends.torch._recompute import recompute_chunk
from polyparallel.backends.torch._sequence_parallel import shard_along, shard_tables
from polyparallel.backends.torch._stage_sp import label_shard, register_mesh
from polyparallel.backends.torch._stage_sp import rewrite as sp_rewrite
from polyparallel.backends.torch._stage_tp import register_group, shard_graph, shard_parameters
from polyparallel.backends.torch._steps import make_optimizer, scale_gradients
from polyparallel.backends.torch._train_loop import TrainingMode
from polyparallel.backends.torch.capabilities import EXECUTED_SCHEDULES, Unsupported
from polyparallel.cost_models.layers import LAYER  # the planner's own layer pattern
from polyparallel.cost_models.pipeline import order_problem
from polyparallel.frontends._fold import export_folded  # the frontend's three-block trace
from polyparallel.frontends.torch import _export_program  # the frontend's export (no stack traces)
from polyparallel.plan import CHUNKED_SCHEDULES
from polyparallel.references import resolve

__all__ = ["PipelinePlan", "pipeline_mode", "pipeline_plan", "split_model"]


@dataclass(frozen=True)
class PipelinePlan:
    """What the pipeline workers execute.

    ``cuts[k]`` is the exported op that starts chunk ``k + 1``; ``chunk_params[k]`` the parameter
    paths chunk ``k`` holds; ``tied`` lists parameters held by several chunks with those chunks;
    ``pp_major`` says whether ranks are numbered stage-major (the Strategy's mesh lists ``pp`` before
    ``dp``, as the planner writes it) or dp-major; ``axes`` is the order of the ``pp``, ``dp`` and
    ``tp`` mesh dims (ranks numbered row-major over them). With ``tp > 1`` each stage runs
    tensor-parallel over its ``tp`` ranks (:mod:`._stage_tp`; the rewrite is checked before launch
    and redone on every worker from ``ExecPlan.tp_plan`` and ``ExecPlan.fused``).
    """

    stages: int
    virtual: int
    schedule: str
    microbatches: int
    cuts: tuple[str, ...]
    chunk_params: tuple[tuple[str, ...], ...]
    tied: tuple[tuple[str, tuple[int, ...]], ...]
    pp_major: bool = True
    axes: tuple[str, ...] = ("pp", "dp", "tp")
    tp: int = 1
    sp: int = 1  # sequence shards inside the stages (._stage_sp): the model exported at the local sequence length
    ring: bool = False  # the shards run ring attention (context parallelism, cp = sp) rather than Ulysses
    halo: tuple[int, float] | None = None  # the labels' right halo the loss tail's pad needs (._stage_sp)


def _export(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> fx.GraphModule:
    """The model exported as the frontend captured it: a deep stack of alike blocks traced three
    blocks deep and the rest copied (:mod:`polyparallel.frontends._fold`; the same node names, so
    the strategy's cut ops are found), else exported whole."""
    def export(m: nn.Module) -> Any:
        return _export_program(m, (inputs, labels), {})

    try:
        folded = export_folded(model, export)
        gm = folded.module(model) if folded is not None else None
        if gm is None:
            gm = export(model).module()
    except Exception as e:  # any export failure means the model cannot be cut this way
        raise Unsupported(f"pipeline parallelism needs the model captured by torch.export to cut it into stages, "
                           f"and export failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    # export's checks of a cast's input (dtype, device) hold for the fp32 capture only: under FSDP2's
    # bf16 parameters or autocast the same cast sees bf16 inputs. They compute nothing.
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default and not n.users:
            gm.graph.erase_node(n)
    gm.recompile()
    return gm


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    return str(list(stack.values())[-1][0]) if stack else ""


@dataclass
class _Split:
    chunks: list[fx.GraphModule]  # empty, and ``tail`` None, for ``split_model(modules=False)``
    tail: fx.GraphModule | None
    params: list[tuple[str, ...]]
    layers: list[set[int]]
    rewritten: Any = None  # what ``rewrite`` returned


def split_model(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, cuts: Sequence[str],
                counted: set[str] | None = None, rewrite: Callable[[fx.GraphModule], Any] | None = None,
                modules: bool = True) -> _Split:
    """Cut ``model`` (exported on ``(inputs, labels)``, one micro-batch) before each op named in ``cuts``.

    Returns ``len(cuts) + 1`` chunk modules (``chunk_k(*live_in) -> tuple(live_out)``; chunk 0 takes
    ``inputs``) and the loss tail ``tail(*live_out_of_last_chunk, labels) -> loss``. Raises
    :class:`~polyparallel.backends.torch.Unsupported` when the cuts cannot be executed.

    ``counted``: the exported nodes the planner's graph has an op for; only they count when the
    layers of a chunk are listed (casts and checks the frontend drops, such as the ``to`` that opens
    an HF RMSNorm, may sit before the cut op of the next layer).

    ``rewrite`` transforms the exported graph before it is cut (tensor parallelism inside the stages,
    :mod:`._stage_tp`); nodes it inserts for an op (``meta["attached_to"]``) go with that op's chunk.

    ``modules=False`` checks the cuts and lists each chunk's parameters and layers without making
    the modules (``chunks`` is then empty and ``tail`` None): the planner's check of a plan, which
    otherwise spends most of its time and memory generating the chunks' code.
    """
    with _use_lazy_graph_module(not modules):  # a check runs nothing: no code is generated
        gm = _export(model, inputs, labels)
        rewritten = rewrite(gm) if rewrite is not None else None
    nodes = list(gm.graph.nodes)
    user_inputs = [n for n in nodes if n.op == "placeholder"]
    if len(user_inputs) != 2:
        raise Unsupported(f"the exported model takes {len(user_inputs)} inputs; pipeline stages need "
                           "forward(inputs, labels)")
    x_in, y_in = user_inputs
    ops = [n for n in nodes if n.op == "call_function"]
    mutated = _in_place_writes(nodes)
    # the loss tail: everything that depends on the labels
    tail: set[fx.Node] = set()
    for n in ops:
        if any(a is y_in or a in tail for a in n.all_input_nodes):
            tail.add(n)
    starts = _chunk_starts(ops, cuts)
    chunk_of = _chunk_of(gm, ops, starts, tail)
    last = len(starts) - 1  # (the graph is in topological order, so no op is used before its chunk)
    for n, t in mutated:  # an in-place write must stay with its tensor, or it would hit a stage's copy
        if (chunk_of.get(n), n in tail) != (chunk_of.get(t), t in tail):
            raise Unsupported(f"op {n.name!r} writes in place to {t.name!r}, which another pipeline stage made; "
                               "cut at another op")
    live = _live_values(x_in, ops, chunk_of, tail, last)
    chunks, params, layers = [], [], []
    for c in range(last + 1):
        chunk, held, lyr = _chunk_graph(gm, c, [x_in] if c == 0 else live[c], ops, chunk_of, live[c + 1],
                                        c == last, counted)
        if modules:
            chunks.append(fx.GraphModule(gm, chunk, f"PipelineChunk{c}"))
        params.append(held)
        layers.append(lyr)
    loss = _tail_graph(nodes, ops, tail, live[last + 1], y_in)
    return _Split(chunks, fx.GraphModule(gm, loss, "PipelineLoss") if modules else None, params, layers, rewritten)


def _in_place_writes(nodes: list[fx.Node]) -> list[tuple[fx.Node, fx.Node]]:
    """The exported graph's in-place ops with the tensor each writes; refuses module calls and
    writes to a parameter, buffer or input (e.g. BatchNorm's running statistics)."""
    mutated: list[tuple[fx.Node, fx.Node]] = []  # (in-place op, the tensor it writes)
    for n in nodes:
        if n.op == "call_module" and n.target != "_guards_fn":  # export's input-shape guard: not computation
            raise Unsupported(f"exported graph calls module {n.target!r}; cannot split it into stages")
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        for i, a in enumerate(schema.arguments if schema is not None and schema.is_mutable else ()):
            written = a.alias_info is not None and a.alias_info.is_write
            t = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            if written and isinstance(t, fx.Node):
                if t.op in ("get_attr", "placeholder"):
                    raise Unsupported(f"op {n.name!r} ({n.target}) writes to {t.target!r} in forward (e.g. BatchNorm "
                                       "running statistics): each micro-batch would update it; not executed")
                mutated.append((n, t))
    return mutated


def _chunk_starts(ops: list[fx.Node], cuts: Sequence[str]) -> list[int]:
    """The index in ``ops`` at which each chunk starts (0, then one per cut), in model order."""
    pos = {n.name: i for i, n in enumerate(ops)}
    starts = [0]
    for name in cuts:
        if name not in pos:
            raise Unsupported(f"a pipeline stage starts at op {name!r}, which the model's exported graph does not "
                               "have: the strategy's stage boundaries cannot be mapped onto this model (was it "
                               "searched for another model or frontend?)")
        start = pos[name]
        while start > 0 and ops[start - 1].meta.get("attached_to") == name:
            start -= 1  # inserted for the cut op (e.g. its tensor-parallel input copy): cut before it
        if start <= starts[-1]:
            raise Unsupported(f"pipeline chunk starting at op {name!r} does not come after the previous chunk's "
                               "start; stage op ranges must be contiguous and in model order")
        starts.append(start)
    return starts


def _chunk_of(gm: fx.GraphModule, ops: list[fx.Node], starts: list[int], tail: set[fx.Node]) -> dict[fx.Node, int]:
    """The chunk of every op outside the loss tail; refuses a tail op that uses a parameter."""
    chunk_of: dict[fx.Node, int] = {}
    k = 0
    for i, n in enumerate(ops):
        while k + 1 < len(starts) and i >= starts[k + 1]:
            k += 1
        if n not in tail:
            chunk_of[n] = k
        elif any(a.op == "get_attr" and getattr(_attr(gm, str(a.target)), "requires_grad", False)
                 for a in n.all_input_nodes):
            raise Unsupported(f"op {n.name!r} uses the labels and parameters: the loss must be parameter-free to run "
                               "as the pipeline's loss function")
    return chunk_of


def _live_values(x_in: fx.Node, ops: list[fx.Node], chunk_of: dict[fx.Node, int], tail: set[fx.Node],
                 last: int) -> list[list[fx.Node]]:
    """``live[c]``: the values crossing cut ``c`` (c = 1..last) and into the loss tail (c = last + 1)."""
    live: list[list[fx.Node]] = [[] for _ in range(last + 2)]
    for n in [x_in, *ops]:
        src = 0 if n is x_in else chunk_of.get(n)
        if src is None:
            continue
        dsts = [last + 1 if u in tail else chunk_of[u] for u in n.users if u.op == "call_function"]
        far = max(dsts, default=src)
        if far > src:
            if not isinstance(n.meta.get("val"), torch.Tensor):
                raise Unsupported(f"value {n.name!r} ({type(n.meta.get('val')).__name__}) made in pipeline chunk "
                                   f"{src} is used in chunk {far}: only tensors can cross stage boundaries; cut "
                                   "at another op")
            if n is x_in and far <= last:
                raise Unsupported(f"the model input {n.name!r} is used after the first stage (chunk {far}); "
                                   "only activations cross stage boundaries in this backend")
            for c in range(src + 1, far + 1):
                live[c].append(n)
    return live


def _chunk_graph(gm: fx.GraphModule, c: int, inputs: list[fx.Node], ops: list[fx.Node],
                 chunk_of: dict[fx.Node, int], outputs: list[fx.Node], last: bool,
                 counted: set[str] | None) -> tuple[fx.Graph, tuple[str, ...], set[int]]:
    """Chunk ``c`` (the ops ``chunk_of`` gives it) as a graph from ``inputs`` to ``outputs``, with
    the paths of the parameters it holds and the layers of its (``counted``) ops."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {n: g.placeholder(n.name) for n in inputs}

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:  # a parameter or buffer: each chunk that uses it holds it
            assert a.op == "get_attr", a
            env[a] = g.get_attr(a.target)
        return env[a]

    layers: set[int] = set()
    for n in ops:
        if chunk_of.get(n) == c:
            env[n] = g.node_copy(n, arg)
            m = LAYER.match(_module_path(n)) if counted is None or n.name in counted else None
            if m:
                layers.add(int(m.group(1).rsplit(".", 1)[1]))
    # p2p sends and receives whole contiguous buffers (an expanded mask or a transposed view is not)
    g.output(tuple(env[n] if last else g.call_method("contiguous", (env[n],)) for n in outputs))
    params = tuple(sorted(str(n.target) for n in g.nodes if n.op == "get_attr"
                          and isinstance(_attr(gm, str(n.target)), nn.Parameter)))
    return g, params, layers


def _tail_graph(nodes: list[fx.Node], ops: list[fx.Node], tail: set[fx.Node], inputs: list[fx.Node],
                y_in: fx.Node) -> fx.Graph:
    """The loss tail as a graph from ``inputs`` (the last chunk's outputs) and the labels to the loss."""
    tg = fx.Graph()
    tenv = {n: tg.placeholder(n.name) for n in inputs}
    tenv[y_in] = tg.placeholder(y_in.name)
    for n in ops:
        if n in tail:
            tenv[n] = tg.node_copy(n, lambda a: tenv[a])
    out = next(n for n in nodes if n.op == "output").args[0]
    loss = out[0] if isinstance(out, list | tuple) else out
    if loss not in tail:
        raise Unsupported("the model's output does not depend on the labels: forward(inputs, labels) must return "
                           "the loss")
    tg.output(tenv[loss])
    return tg


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _chunks_of(strategy: Any) -> list[tuple[str, str]]:
    """(first op, last op) of every chunk ``k = 0 .. pp*v - 1`` from the Strategy's stages."""
    pp = strategy.pp
    by_stage = {st.index: st for st in strategy.stages}
    if sorted(by_stage) != list(range(pp)):
        raise Unsupported(f"pp={pp}: pipeline parallelism needs one Stage entry per stage 0..{pp - 1}, but the "
                           f"strategy lists stages {sorted(by_stage)}")
    counts = {len(st.ops) for st in strategy.stages}
    if len(counts) != 1 or next(iter(counts)) % 2 or not next(iter(counts)):
        raise Unsupported("every stage must list the (first, last) op of each of its chunks, the same number "
                           f"of chunks per stage; got {[len(st.ops) for st in strategy.stages]} op names")
    v = next(iter(counts)) // 2
    return [tuple(by_stage[k % pp].ops[2 * (k // pp): 2 * (k // pp) + 2]) for k in range(pp * v)]  # type: ignore[misc]


def pipeline_plan(strategy: Any, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                  graph: Any = None, tp_kinds: dict[str, str] | None = None,
                  fused: dict[str, tuple[int, ...]] | None = None) -> PipelinePlan:
    """Check that ``strategy``'s stages can be cut out of ``model`` exactly; return the worker plan.

    ``batch`` is one global batch (``data_fn(0)``); the model is exported on one micro-batch of it.
    ``graph`` is the model's captured graph: a stage boundary names one of its ops, whose
    ``source_node`` is the node of torch.export's graph to cut at (the frontend numbers ops its own
    way); without it the op names are looked up among the exported nodes' names.

    With ``tp > 1``, ``tp_kinds`` and ``fused`` are the plan's tensor-parallel modules (``ExecPlan.tp_plan``,
    ``ExecPlan.fused``): the exported graph is rewritten for them (:mod:`._stage_tp`) as the workers
    will, which refuses a placement the rewrite cannot execute.
    """
    s = strategy
    sched, _, v_txt = s.schedule.partition(":")
    chunks = _chunks_of(s)
    v = len(chunks) // s.pp
    if sched not in EXECUTED_SCHEDULES:
        raise Unsupported(f"pipeline schedule {sched!r}: the torch backend runs {', '.join(EXECUTED_SCHEDULES)}")
    if sched in CHUNKED_SCHEDULES:
        if v_txt and (not v_txt.isdigit() or int(v_txt) != v):
            raise Unsupported(f"schedule {s.schedule!r} but the stages list {v} chunks each")
        if v < 2:
            raise Unsupported(f"the {sched} schedule needs at least 2 chunks per stage")
    elif v != 1:
        raise Unsupported(f"schedule {s.schedule!r} with {v} chunks per stage: several chunks per stage need a "
                          f"chunked schedule ({', '.join(CHUNKED_SCHEDULES)})")
    if why := order_problem(sched, s.pp, s.microbatches, v) or EXECUTED_SCHEDULES[sched].problem(s.pp, s.microbatches):
        raise Unsupported(why)
    n = s.dp * s.microbatches
    if s.global_batch % n:
        raise Unsupported(f"global_batch={s.global_batch} is not divisible by dp*microbatches={n}: pipeline "
                           "micro-batches must be equal for the mean loss to equal the full-batch loss")
    if has_batch_statistics(model):  # even without running statistics (no buffer write to refuse)
        raise Unsupported("the model has BatchNorm: pipeline micro-batches would each be normalised with their own "
                           "statistics, unlike single-process training on the whole batch; search with "
                           "constraints={'pp': 1}")
    inputs, labels = batch
    mb = s.global_batch // n
    nodes = {op.name: op.source_node for op in graph.ops if op.source_node} if graph is not None else {}
    cuts = tuple(nodes.get(first, first) for first, _ in chunks[1:])
    tp_rewrite = _tp_rewrite(tp_kinds or {}, fused or {}, s.tp) if s.tp > 1 else None
    seq_rewrite = None
    plan = s.plan
    seq, ring = plan.seq, plan.cp > 1
    n = inputs.shape[1] // seq if seq > 1 else None
    if seq > 1:
        if inputs.dim() < 2 or labels.dim() < 2 or inputs.shape[1] % plan.seq_chunks or \
                labels.shape[1] != inputs.shape[1]:
            raise Unsupported(f"{plan.seq_axis}={seq} inside pipeline stages needs inputs and labels of shape (batch, "
                              f"seq, ...) with seq divisible by {plan.seq_chunks}; got {tuple(inputs.shape)} and "
                              f"{tuple(labels.shape)}")
        seq_rewrite = _sp_rewrite(seq, 0, n, ring, s.tp)
    x0, y0 = (inputs[:mb], labels[:mb]) if n is None else (inputs[:mb, :n], labels[:mb, :n])
    split = split_model(model, x0, y0, cuts, set(nodes.values()) if nodes else None,
                        rewrite=_stage_rewrite(tp_rewrite, seq_rewrite), modules=False)
    for st in s.stages:
        have = set().union(*(split.layers[k] for k in range(st.index, len(chunks), s.pp)))
        if st.layers and have != set(st.layers):
            raise Unsupported(f"stage {st.index} (ops {', '.join(st.ops)}) holds layers {sorted(have)} of this model "
                               f"but the strategy lists {sorted(st.layers)}: the strategy was made for another model")
    for st in range(s.pp):
        if not any(split.params[k] for k in range(st, len(chunks), s.pp)):
            # torch's optimisers and DCP's state dicts refuse an empty parameter set; such a stage only
            # forwards activations (e.g. the loss alone), which the plan could give to its neighbour
            raise Unsupported(f"pipeline stage {st} holds no parameters (ops "
                               f"{', '.join(by for c in range(st, len(chunks), s.pp) for by in chunks[c])}); "
                               "a parameter-free stage is not executed: search with fewer stages")
    pp_major, axes = _layout(s)
    holders: dict[str, list[int]] = {}
    for k, names in enumerate(split.params):
        for p in names:
            holders.setdefault(p, []).append(k)
    tied = tuple((p, tuple(ks)) for p, ks in sorted(holders.items()) if len(ks) > 1)
    for p, ks in tied:
        stages = [k % s.pp for k in ks]
        if len(set(stages)) != len(stages):
            raise Unsupported(f"parameter {p!r} is used by chunks {list(ks)}, two of them on one stage; not executed")
    return PipelinePlan(stages=s.pp, virtual=v, schedule=sched, microbatches=s.microbatches,
                        cuts=cuts, chunk_params=tuple(split.params), tied=tied,
                        pp_major=pp_major, axes=axes, tp=s.tp, sp=seq, ring=ring,
                        halo=split.rewritten[1].halo if seq > 1 else None)


def _sp_rewrite(sp: int, rank: int, n: int, ring: bool = False, tp: int = 1) -> Callable[[fx.GraphModule], Any]:
    """Ulysses (ring attention with ``ring``) inside the stages (:mod:`._stage_sp`) for sequence
    shard ``rank`` of ``sp``, shards of ``n`` positions (``tp``: the heads are split over it too)."""

    def rewrite(gm: fx.GraphModule) -> Any:
        return sp_rewrite(gm, sp, rank, n, ring=ring, tp=tp)

    return rewrite


def _stage_rewrite(tp_rewrite: Callable[[fx.GraphModule], Any] | None,
                   seq_rewrite: Callable[[fx.GraphModule], Any] | None) -> Callable[[fx.GraphModule], Any]:
    """Both passes over the exported graph: tensor parallelism first (it finds the attention ops
    whose heads it splits), then the sequence split around the attention on the local heads.
    Returns (the tensor-parallel split values, the sequence pass's :class:`._stage_sp.SPRewrite`)."""

    def rewrite(gm: fx.GraphModule) -> tuple[dict[str, int], Any]:
        split = tp_rewrite(gm) if tp_rewrite is not None else {}
        return split, seq_rewrite(gm) if seq_rewrite is not None else None

    return rewrite


def _tp_rewrite(kinds: dict[str, str], fused: dict[str, tuple[int, ...]], tp: int, rank: int = 0,
                mesh: Any = None) -> Callable[[fx.GraphModule], dict[str, int]]:
    """The tensor-parallel rewrite of the exported graph (:mod:`._stage_tp`); with ``mesh`` (the
    workers' 1-D ``tp`` mesh) the split parameters become DTensors too. Returns the split values."""

    def rewrite(gm: fx.GraphModule) -> dict[str, int]:
        split, params = shard_graph(gm, kinds, fused, tp, rank)
        if mesh is not None:
            shard_parameters(gm, params, mesh)
        return split

    return rewrite


def _layout(s: Any) -> tuple[bool, tuple[str, ...]]:
    """Whether the mesh numbers ranks stage-major, and the order of its ``pp``, ``dp``, ``tp`` dims;
    checks the mesh against the degrees and the stages' device lists, since the workers place stage
    ``k``'s chunks on the ranks the mesh gives it."""
    # the sequence split is one mesh dim, "sp", whether Ulysses (sp) or ring attention (cp) runs on it
    sizes = {"sp" if a.name == "cp" else a.name: a.size for a in s.mesh.axes if a.size > 1}
    sp = getattr(s, "sp", 1) * getattr(s, "cp", 1)
    if sizes.get("pp", 1) != s.pp or sizes.get("dp", 1) != s.dp or sizes.get("tp", 1) != s.tp or \
            sizes.get("sp", 1) != sp:
        raise Unsupported(f"the mesh axes {sizes} do not match pp={s.pp}, dp={s.dp}, sp={sp}, tp={s.tp}")
    names = ("pp", "dp", "sp", "tp") if sp > 1 else ("pp", "dp", "tp")
    named = [n for n in ("sp" if a.name == "cp" else a.name for a in s.mesh.axes) if n in names]
    axes = (*named, *(a for a in names if a not in named))
    order = [a for a in sizes if a in names]
    grid = _grid(axes, s.pp, s.dp, s.tp, sp=sp)
    for st in s.stages:
        ranks = grid[st.index].flatten().tolist()
        if st.devices and sorted(st.devices) != sorted(s.mesh.devices[r] for r in ranks):
            raise Unsupported(f"stage {st.index} lists devices {st.devices} but the mesh {order} puts it on "
                               f"{[s.mesh.devices[r] for r in ranks]}")
    return axes.index("pp") < axes.index("dp"), axes


def _grid(axes: tuple[str, ...], pp: int, dp: int, tp: int, ranks: torch.Tensor | None = None,
          sp: int = 1) -> torch.Tensor:
    """``grid[stage][dp index][tp index]``: the rank, for ranks numbered row-major over ``axes``; with
    an ``sp`` axis the last index is ``sp index · tp + tp index``."""
    deg = {"pp": pp, "dp": dp, "sp": sp, "tp": tp}
    r = torch.arange(pp * dp * sp * tp).reshape([deg[a] for a in axes]) if ranks is None else ranks
    return r.permute([axes.index(a) for a in ("pp", "dp", "sp", "tp") if a in axes]).reshape(pp, dp, sp * tp)


@dataclass(frozen=True)
class _Ranks:
    """Where this rank sits in the pipeline's mesh (ranks in the Strategy's mesh order)."""

    mesh: Any
    grid: torch.Tensor  # grid[stage][dp index][sp·tp index] = global rank
    stage: int
    dp: int
    sp: int
    tp: int
    replicas: Any  # the ranks holding replicas of this stage's parameters: dp, times sp (shards see other tokens)


def _ranks(pipe: PipelinePlan, dp: int, device: torch.device) -> _Ranks:
    # ranks follow the Strategy's mesh order: stage-major (pp, dp, tp) as the planner writes it, or another
    deg = {"pp": pipe.stages, "dp": dp, "sp": pipe.sp, "tp": pipe.tp}
    mesh = init_device_mesh(device.type, tuple(deg[a] for a in pipe.axes), mesh_dim_names=pipe.axes)
    grid = _grid(pipe.axes, pipe.stages, dp, pipe.tp, mesh.mesh, pipe.sp)
    stage, dp_rank, tp_rank = (mesh[a].get_local_rank() for a in ("pp", "dp", "tp"))
    sp_rank = mesh["sp"].get_local_rank() if pipe.sp > 1 else 0
    replicas = mesh["dp", "sp"]._flatten("dp_sp") if pipe.sp > 1 else mesh["dp"]
    return _Ranks(mesh, grid, stage, dp_rank, sp_rank, tp_rank, replicas)


def _split_on_rank(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], plan: Any, ranks: _Ranks) -> _Split:
    """``model`` cut into the plan's chunks as this rank runs them: exported on one micro-batch of
    ``batch`` (its sequence shard with ``sp > 1``), rewritten for tensor or sequence parallelism
    inside the stages."""
    pipe = plan.pipeline
    inputs, labels = batch
    mb = plan.global_batch // (plan.dp * pipe.microbatches)
    tp_rewrite = seq_rewrite = None
    if pipe.tp > 1:  # Megatron inside each stage, on local shards (._stage_tp)
        register_group("tp", ranks.mesh["tp"].get_group())
        tp_rewrite = _tp_rewrite(dict(plan.tp_plan), dict(plan.fused), pipe.tp, ranks.tp, ranks.mesh["tp"])
    x0, y0 = inputs[:mb], labels[:mb]
    if pipe.sp > 1:  # Ulysses / ring attention inside each stage (._stage_sp): exported at the local length
        register_mesh("sp", ranks.mesh["sp"])
        # the tables are read from position 0 at the local length
        shard_tables(model, plan.tables, pipe.sp, ranks.sp, pipe.ring)
        n = inputs.shape[1] // pipe.sp
        seq_rewrite = _sp_rewrite(pipe.sp, ranks.sp, n, pipe.ring, pipe.tp)
        x0, y0 = inputs[:mb, :n], labels[:mb, :n]
    return split_model(model, x0, y0, pipe.cuts, rewrite=_stage_rewrite(tp_rewrite, seq_rewrite))


def _stage_module(chunk: fx.GraphModule, plan: Any, replicas: Any, prec: Any, device: torch.device) -> nn.Module:
    """One chunk as its stage runs it: recomputation, its parameters over the stage's replicas,
    autocast inside its forward (the schedule runs backwards between forwards)."""
    mod = recompute_chunk(chunk, plan.recompute, plan.recompute_blocks).to(device)
    if plan.compile == "regional":  # the chunk's graph is the compiled region (its blocks are inlined in it)
        mod.compile()
    has_params = any(p.requires_grad for p in mod.parameters())
    if plan.data_parallel == "ddp" and has_params:
        # ZeRO-0 (replicated parameters, all-reduced gradients) with the FSDP2-based `replicate`,
        # which PipelineStage syncs once per step: DistributedDataParallel's bucket rebuild fails
        # after a step of several micro-batch backwards (reducer.cpp, "rebuilt parameter indices")
        replicate(mod, mesh=replicas)
    elif plan.data_parallel == "fsdp" and has_params:
        fully_shard(mod, mesh=replicas, **prec.fsdp_kwargs())
    return prec.autocast_forward(mod)


class _LossTail:
    """The schedule's ``loss_fn``: the loss tail on the last stage, each micro-batch's loss weighted
    by the targets it counted (``counts``, in call order)."""

    def __init__(self, split: _Split, model: nn.Module, plan: Any, mesh: Any, prec: Any, device: torch.device) -> None:
        self.tail = split.tail.to(device)
        self.mesh, self.tp, self.prec = mesh, plan.pipeline.tp, prec
        # tail inputs split over tp (class-parallel logits) enter the loss as DTensors, under loss_parallel
        tp_split = split.rewritten[0] if self.tp > 1 else {}
        placeholders = [p for p in self.tail.graph.nodes if p.op == "placeholder"][:-1]
        self.split_dims = [tp_split.get(p.name) for p in placeholders]
        self.parallel = any(d is not None for d in self.split_dims)
        # the loss reads one split value, the class-parallel output layer's logits: the whole class count
        # (a vocabulary need not divide by tp; its shards are then torch.chunk's, which DTensor reads
        # right only when told the global shape)
        classes = {getattr(model.get_submodule(path), "out_features", None)
                   for path, kind in plan.tp_plan if kind == "col_to_loss"}
        n_classes = next(iter(classes)) if len(classes) == 1 else None
        self.whole = [None if d is None else n_classes for d in self.split_dims]
        self.counts: list[float | None] = []  # per micro-batch of the step: the targets its loss counted

    def _as_dtensor(self, o: torch.Tensor, d: int, n: int | None) -> Any:
        shape = (*o.shape[:d], n if n is not None else o.shape[d] * self.tp, *o.shape[d + 1:])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(o, self.mesh["tp"], [Shard(d)], run_check=False, shape=shape, stride=stride)

    def __call__(self, out: Any, target: torch.Tensor) -> torch.Tensor:
        counter = TargetCount()
        outs = out if isinstance(out, tuple) else (out,)
        if self.parallel:
            outs = tuple(o if d is None else self._as_dtensor(o, d, n)
                         for o, d, n in zip(outs, self.split_dims, self.whole))
        with counter, self.prec.autocast():
            loss = self.tail(*outs, target)
        self.counts.append(counter.count_for(loss))
        if self.parallel:
            loss = loss.to_local()  # replicated
        # L·c/unit (weigh_microbatches): L·c alone is c times the mean loss, which overflows fp16 gradients
        return self.prec.scale(loss if self.counts[-1] is None else loss * (self.counts[-1] / target.numel()))


def _schedule(pipe: PipelinePlan, modules: list[nn.Module], mine: list[int], device: torch.device, group: Any,
              loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> Any:
    # import cost: torch.distributed.pipelining loads ~290 modules (0.4 s) that only pipelined runs need
    import torch.distributed.pipelining as pipelining

    K = pipe.stages * pipe.virtual
    stages = [pipelining.PipelineStage(mod, k, K, device, group=group) for mod, k in zip(modules, mine)]
    cls = getattr(pipelining, EXECUTED_SCHEDULES[pipe.schedule].cls)
    return cls(stages if pipe.schedule in CHUNKED_SCHEDULES else stages[0], n_microbatches=pipe.microbatches,
               loss_fn=loss_fn)


def _tie_groups(pipe: PipelinePlan, dp: int, ranks: _Ranks) -> list[tuple[str, Any]]:
    """The groups over which this rank sums a tied parameter's gradients, with the parameter: one
    group per (set of stages holding it, dp index, sp·tp index); every rank creates every group in
    the same order, as new_group requires."""
    groups: list[tuple[str, Any]] = []
    for name, ks in pipe.tied:
        holders = sorted({k % pipe.stages for k in ks})
        for d in range(dp):
            for t in range(pipe.sp * pipe.tp):
                g = dist.new_group([int(ranks.grid[s][d][t]) for s in holders])
                if ranks.stage in holders and (d, t) == (ranks.dp, ranks.sp * pipe.tp + ranks.tp):
                    groups.append((name, g))
    return groups


@dataclass
class _PipelineStep:
    """One step of this rank's chunks: its share of the batch through the schedule, the gradients
    weighted by the step's target count and the tied parameters' summed over their stages."""

    plan: Any
    ranks: _Ranks
    schedule: Any
    loss: _LossTail
    modules: list[nn.Module]
    mine: list[int]
    tie_groups: list[tuple[str, Any]]
    device: torch.device

    def __post_init__(self) -> None:
        self.owner = self.modules[0] if len(self.modules) == 1 else nn.ModuleList(self.modules)
        self.named = {n.removeprefix("module."): p for mod in self.modules for n, p in mod.named_parameters()}
        pipe = self.plan.pipeline
        self.first, self.last = 0 in self.mine, (pipe.stages * pipe.virtual - 1) in self.mine

    def share(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pipe, r = self.plan.pipeline, self.ranks
        local = self.plan.global_batch // self.plan.dp
        sl = slice(r.dp * local, (r.dp + 1) * local)
        x, y = inputs[sl].to(self.device), labels[sl].to(self.device)
        if pipe.sp > 1:
            x, y = shard_along(x, 1, pipe.sp, r.sp, pipe.ring), label_shard(y, pipe.sp, r.sp, pipe.halo, pipe.ring)
        return x, y

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, str]:
        pipe = self.plan.pipeline
        losses: list[torch.Tensor] = []
        self.loss.counts.clear()
        args = (x,) if self.first else ()
        with _loss_parallel(self.last and self.loss.parallel):  # the tail's backward runs inside the step too
            self.schedule.step(*args, target=y if self.last else None, losses=losses if self.last else None,
                               return_outputs=False)
        if self.ranks.tp:  # tensor-parallel peers computed copies of tp rank 0's losses
            losses = []
        # the schedule's first step also calls loss_fn once for its shape inference, before the
        # micro-batches: their counts are the last ones
        loss_scale = self.loss.prec.loss_scale  # the schedule's losses are what loss_fn returned: scaled with fp16
        mb = self.plan.global_batch // (self.plan.dp * pipe.microbatches)
        factor, global_loss, weighting = weigh_microbatches(
            [v / loss_scale for v in losses] if loss_scale != 1.0 else losses,
            self.loss.counts[len(self.loss.counts) - len(losses):], pipe.microbatches, self.plan.dp * pipe.sp,
            self.device, unit=y[:mb].numel())
        scale_gradients(self.owner.parameters(), factor)
        for name, g in self.tie_groups:
            grad = self.named[name].grad
            if grad is not None:
                dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=g)
        return global_loss, weighting


def pipeline_mode(job: dict[str, Any], device: torch.device) -> TrainingMode:
    """This rank's pipeline chunks, their schedule and optimiser, as :func:`._train_loop.train` runs
    them; logs and checkpoints as the unpipelined worker does, the optimiser under its stage's key."""
    plan, pipe = job["plan"], job["plan"].pipeline
    ranks = _ranks(pipe, plan.dp, device)
    batch = resolve(job["data_fn"])(0)
    torch.manual_seed(job["seed"])  # every rank builds the same initial weights, then keeps its chunks
    model = resolve(job["model_fn"])()
    split = _split_on_rank(model, batch, plan, ranks)
    prec = Precision(plan.dtype, device)
    mine = list(range(ranks.stage, pipe.stages * pipe.virtual, pipe.stages))
    modules = [_stage_module(split.chunks[k], plan, ranks.replicas, prec, device) for k in mine]
    loss = _LossTail(split, model, plan, ranks.mesh, prec, device)
    schedule = _schedule(pipe, modules, mine, device, ranks.mesh["pp"].get_group(), loss)
    step = _PipelineStep(plan, ranks, schedule, loss, modules, mine, _tie_groups(pipe, plan.dp, ranks), device)
    opt = make_optimizer(job["optimizer"], step.owner.parameters(), job["lr"], device)
    # parameters keep their model paths, but each stage's optimiser has its own param_groups: one
    # optimiser entry per stage, or the stages would overwrite each other's
    return TrainingMode(step.owner, opt, prec, step.share, step.forward_backward, optim_key=f"optim.stage{ranks.stage}")


def _loss_parallel(on: bool) -> Any:
    return loss_parallel() if on else nullcontext()
