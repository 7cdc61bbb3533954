r"""Activation recomputation, exactly as the cost model prices it (``cost_models/step.py``).

* ``full``: every numbered layer the planner found (a module path ``...layers.<i>``, ``h.<i>``,
  ``blocks.<i>``: the layer segments of :func:`~polyparallel.cost_models.step.layer_segments`) runs
  under ``torch.utils.checkpoint`` (non-reentrant): its forward keeps only the layer's inputs, and
  its backward runs the layer's forward again. Ops outside the layers (embeddings, final norm, the
  head and the loss) keep their activations, as the memory model counts them.
* ``selective``: every ``scaled_dot_product_attention`` call (the ops the capture classifies as
  attention; Korthikanti et al., 2022) runs under the checkpoint and is recomputed in its
  backward; every other op saves what autograd saves. SDPA's kernels never store the scores, so
  this drops only its log-sum-exp, as the memory model counts it.
* ``op``: the layers ``full`` checkpoints, under torchtitan's operator policy ("selective op",
  ``torchtitan/models/llama/parallelize_llama.py``): the checkpoint keeps the output of every
  second matrix product of the layer (``aten.mm`` / ``aten.addmm``: the 1st, 3rd, ...) and of its
  fused attention kernels, and recomputes everything else in the backward
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``), as
  :func:`polyparallel.cost_models.activations.op_policy_saved` prices it.

Inside pipeline stages (:func:`recompute_chunk`) the stage is an ``fx.GraphModule`` cut out of
``torch.export``'s graph (``_pipeline.split_model``), whose nodes name their module
(``meta["nn_module_stack"]``). ``full`` outlines each contiguous run of a numbered layer's nodes
into a parameter-free sub-``GraphModule`` (the layer's parameters, buffers and activations are its
arguments) called under the same non-reentrant checkpoint; ``selective`` runs every
``aten.scaled_dot_product_attention`` node under it. The chunk keeps its parameters at their model
paths, so the stage's state dict, FSDP2 and the tied-weight groups see the same chunk.

Both leave the module tree as it is: the layer's ``forward`` (an instance attribute) is replaced, so
parameter names, state dicts, the tensor-parallel plan's module paths and FSDP2's ``fully_shard``
(applied after, around the module's ``__call__``) see the same model. Dropout draws the same numbers
in the recomputation (the checkpoint restores the RNG state), so the numbers are those of training
without recomputation.
"""

from __future__ import annotations

import functools
import gc
import operator
from typing import Any

import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from polyparallel.cost_models.layers import layer_of
from polyparallel.ir import Graph

__all__ = ["apply_recompute", "recompute_blocks", "recompute_chunk", "recompute_problems", "retained_activation_bytes",
           "retained_stage_bytes"]


def recompute_blocks(graph: Graph) -> list[str]:
    """Module paths of the numbered layers of ``graph``, in execution order (what ``full`` checkpoints)."""
    out: dict[str, None] = {}
    for op in graph.ops:
        layer = layer_of(op.module)
        if layer:
            out.setdefault(layer)
    return list(out)


def recompute_problems(graph: Graph | None, recompute: str) -> list[str]:
    """Why ``recompute`` cannot be run exactly as priced on the model captured as ``graph``."""
    if recompute not in ("full", "op"):
        return []
    if graph is None:
        return [f"recompute={recompute!r} checkpoints the model's numbered layers, found in its captured graph, but "
                "the model could not be captured"]
    if not recompute_blocks(graph):
        return [f"recompute={recompute!r}: the model has no numbered layers (modules named like 'layers.<i>', "
                "'h.<i>' or 'blocks.<i>'), so the cost model recomputes runs of √n ops, which the backend cannot "
                "checkpoint; search with constraints={'recompute': 'selective'} or 'none', or hold the repeated "
                "blocks in an nn.ModuleList named 'layers'"]
    return []


class _RecomputeAttention(TorchFunctionMode):
    """Every ``scaled_dot_product_attention`` inside runs under a non-reentrant checkpoint."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        # Inside a mode's handler the mode is off, so the call below (and its recomputation in
        # the backward) reaches the modes outside it, e.g. Ulysses attention under sp.
        return checkpoint(func, *args, use_reentrant=False, **kwargs)


def _checkpointed(inner: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    return checkpoint(inner, *args, use_reentrant=False, **kwargs)


_aten = torch.ops.aten
# the matrix products the operator policy keeps every second output of, and the attention kernels
# whose outputs it always keeps (those this build has)
_POLICY_MM = frozenset({_aten.mm.default, _aten.addmm.default})
_POLICY_ATTENTION = frozenset(getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(_aten, name))


def _operator_policy() -> tuple[Any, Any]:
    """A fresh pair of selective-checkpoint contexts for one layer call: the forward and its
    recomputation count the layer's matrix products apart, so both keep the same ones."""
    count = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in _POLICY_MM:
            count[ctx.is_recompute] += 1
            keep = count[ctx.is_recompute] % 2 == 1
        else:
            keep = func in _POLICY_ATTENTION
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _operator_checkpointed(inner: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    return checkpoint(inner, *args, use_reentrant=False, context_fn=_operator_policy, **kwargs)


def _attention_recomputed(inner: Any, *args: Any, **kwargs: Any) -> Any:
    with _RecomputeAttention():
        return inner(*args, **kwargs)


def apply_recompute(model: nn.Module, recompute: str, blocks: tuple[str, ...] | list[str] = ()) -> nn.Module:
    """Make ``model`` recompute as ``recompute`` says (``none``, ``selective``, ``op`` or ``full``), in place.

    ``blocks``: the module paths ``full`` and ``op`` checkpoint (:func:`recompute_blocks` of the model's graph).
    Apply it after tensor parallelism and before DDP / FSDP2 wrap the model. Returns ``model``.
    """
    if recompute == "none":
        return model
    if recompute == "selective":
        model.forward = functools.partial(_attention_recomputed, model.forward)  # type: ignore[method-assign]
        return model
    if recompute not in ("full", "op"):
        raise ValueError(f"recompute={recompute!r}: use 'none', 'selective', 'op' or 'full'")
    if not blocks:
        raise ValueError(f"recompute={recompute!r} needs the module paths of the model's layers "
                         "(recompute_blocks(graph))")
    modules = dict(model.named_modules())
    missing = [b for b in blocks if b not in modules]
    if missing:
        raise ValueError(f"recompute={recompute!r}: the model has no module {missing[0]!r} (a layer of its captured "
                         "graph); build the same model the strategy was searched for")
    _no_cache(model)
    wrap = _checkpointed if recompute == "full" else _operator_checkpointed
    for b in blocks:
        mod = modules[b]
        mod.forward = functools.partial(wrap, mod.forward)  # type: ignore[method-assign]
    return model


def _no_cache(model: nn.Module) -> None:
    """Turn off an HF model's key/value cache (``config.use_cache``), as HF's own gradient
    checkpointing does: a checkpointed layer's recomputation would append to the cache its first
    run filled (BLOOM's alibi then broadcasts against twice the length) or save another number of
    tensors (CheckpointError). Training never reads the cache, so the loss is unchanged."""
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if getattr(cfg, "use_cache", False) is True:
            cfg.use_cache = False


class _Checkpointed(nn.Module):
    """Runs ``inner`` (a parameter-free GraphModule: what it reads comes in as arguments) under a
    non-reentrant checkpoint while gradients are recorded (the operator policy's, ``by_operator``)."""

    def __init__(self, inner: fx.GraphModule, by_operator: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.by_operator = by_operator

    def forward(self, *args: Any) -> Any:
        return (_operator_checkpointed if self.by_operator else _checkpointed)(self.inner, *args)


def _sdpa_recomputed(*args: Any, **kwargs: Any) -> Any:
    """``aten.scaled_dot_product_attention`` under a non-reentrant checkpoint (a pipeline chunk's
    attention node under ``selective``)."""
    return _checkpointed(torch.ops.aten.scaled_dot_product_attention.default, *args, **kwargs)


def _layer_runs(gm: fx.GraphModule, blocks: set[str]) -> list[list[fx.Node]]:
    """Maximal runs of consecutive ``call_function`` nodes of one layer in ``blocks``. A node without
    a module path takes the previous node's layer; ``get_attr`` nodes (parameters, read by the run)
    neither join nor break a run; any other node ends it."""
    runs: list[list[fx.Node]] = []
    cur: list[fx.Node] = []
    cur_layer: str | None = None
    prev: str | None = None
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            continue
        if n.op != "call_function":
            cur, cur_layer, prev = [], None, None
            continue
        stack = n.meta.get("nn_module_stack")
        layer = layer_of(str(list(stack.values())[-1][0])) if stack else prev
        prev = layer
        if layer in blocks:
            if layer != cur_layer:
                cur, cur_layer = [], layer
                runs.append(cur)
            cur.append(n)
        else:
            cur, cur_layer = [], None
    return runs


def _outline(gm: fx.GraphModule, run: list[fx.Node], name: str, by_operator: bool = False) -> None:
    """Replace ``run`` by one call of a checkpointed sub-GraphModule computing it."""
    g = gm.graph
    inside = set(run)
    ins: dict[fx.Node, None] = {}
    for n in run:
        for a in n.all_input_nodes:
            if a not in inside:
                ins.setdefault(a)
    outs = [n for n in run if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env = {a: sub.placeholder(a.name) for a in ins}
    for n in run:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(tuple(env[n] for n in outs))
    gm.add_submodule(name, _Checkpointed(fx.GraphModule({}, sub, f"Recomputed_{name}"), by_operator))
    with g.inserting_after(run[-1]):
        call = g.call_module(name, tuple(ins))
    last = call
    for i, n in enumerate(outs):
        with g.inserting_after(last):
            last = g.call_function(operator.getitem, (call, i))
        last.meta = dict(n.meta)
        n.replace_all_uses_with(last, delete_user_cb=lambda u: u not in inside)
    for n in reversed(run):
        g.erase_node(n)


def recompute_chunk(gm: fx.GraphModule, recompute: str, blocks: tuple[str, ...] | list[str] = ()) -> fx.GraphModule:
    """Make a pipeline chunk (``_pipeline.split_model``) recompute as ``recompute`` says, in place.

    ``full``: every run of nodes of a layer in ``blocks`` (:func:`recompute_blocks` of the model's
    graph: the layers the memory model counts as recomputed) becomes one checkpointed call, which
    keeps the run's inputs and recomputes the rest in the backward; nodes outside those layers
    (embeddings, final norm, head) keep their activations; ``op`` likewise, under the operator
    policy. ``selective``: every ``aten.scaled_dot_product_attention`` node runs under the
    checkpoint. Returns ``gm``.
    """
    if recompute == "none":
        return gm
    if recompute == "selective":
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is torch.ops.aten.scaled_dot_product_attention.default:
                n.target = _sdpa_recomputed
    elif recompute in ("full", "op"):
        if not blocks:
            raise ValueError(f"recompute={recompute!r} needs the module paths of the model's layers "
                             "(recompute_blocks(graph))")
        for i, run in enumerate(_layer_runs(gm, set(blocks))):
            _outline(gm, run, f"recompute_{i}", by_operator=recompute == "op")
    else:
        raise ValueError(f"recompute={recompute!r}: use 'none', 'selective', 'op' or 'full'")
    gm.graph.lint()
    gm.recompile()
    return gm


def retained_activation_bytes(model: nn.Module, *args: Any, **kwargs: Any) -> int:
    """Bytes one forward of ``model(*args, **kwargs)`` leaves alive for its backward, on this process.

    Every storage an ATen op writes during the forward is tracked by a weak reference; after the
    forward, the ones still alive (other than the parameters, the inputs and the returned loss) are
    what autograd's saved tensors, a checkpoint's kept inputs and its cached outputs hold until the
    backward. It counts storages, so views and tensors saved twice count once. The backward is run
    afterwards so no graph is left behind. ``model`` must return a scalar loss.
    """
    given = [*model.parameters(), *model.buffers(), *tree_flatten((args, kwargs))[0]]
    total, loss = _alive_after(lambda: model(*args, **kwargs), given)
    loss.backward()
    return total


def retained_stage_bytes(chunk: nn.Module, *inputs: torch.Tensor, tail: nn.Module | None = None,
                         labels: torch.Tensor | None = None) -> int:
    """Bytes a pipeline stage holds for its backward after one micro-batch's forward of ``chunk``
    (``_pipeline.split_model``), on this process: what :func:`retained_activation_bytes` counts, plus
    the chunk's outputs, which the stage keeps until their gradients come back, and the received
    ``inputs`` (the stage's own buffers of another stage's outputs, held until their gradients are
    sent back; made here with ``requires_grad``).
    ``tail``: the loss tail, run on the last chunk's outputs with ``labels`` as the schedule's loss
    function does. The backward is run afterwards (ones for the outputs' gradients)."""
    outs: list[Any] = []

    def forward() -> Any:
        out = chunk(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        if tail is not None:
            return tail(*out, labels)
        outs.extend(out)
        return None

    given = [*chunk.parameters(), *chunk.buffers(), *inputs, *([labels] if labels is not None else [])]
    total, loss = _alive_after(forward, given)
    total += sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in inputs}.values())
    if loss is not None:
        loss.backward()
    else:
        diff = [o for o in outs if o.requires_grad]
        torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
    return total


def _alive_after(fn: Any, given: list[Any]) -> tuple[int, Any]:
    """Run ``fn()``; the bytes of the storages its ATen ops wrote that are still alive after it
    (``given`` and the returned tensor aside), and what it returned."""
    class Track(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.refs: dict[int, tuple[Any, int]] = {}

        def __torch_dispatch__(self, func: Any, types: Any, a: tuple[Any, ...] = (), kw: Any = None) -> Any:
            out = func(*a, **(kw or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    old = self.refs.get(s.data_ptr())
                    if old is None or old[0].expired():  # a freed storage's address reused
                        self.refs[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
            return out

    track = Track()
    with track:
        result = fn()
    gc.collect()
    skip = {t.untyped_storage().data_ptr() for t in (*given, result) if isinstance(t, torch.Tensor)}
    return sum(n for ptr, (ref, n) in track.refs.items() if ptr not in skip and not ref.expired()), result
