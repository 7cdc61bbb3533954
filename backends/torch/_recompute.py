r"""Activation recomputation, exactly as the cost model prices it (``cost_models/step.py``).

* ``full``: every numbered layer the planner found (a module path ``...layers.<i>``, ``h.<i>``,
  ``blocks.<i>``: the layer segments of :func:`~polyparallel.cost_models.step.layer_segments`) runs
  under ``torch.utils.checkpoint`` (non-reentrant): its forward keeps only the layer's inputs, and
  its backward runs the layer's forward again. Ops outside the layers (embeddings, final norm, the
  head and the loss) keep their activations, as the memory model counts them.
* ``selective``: every ``scaled_dot_product_attention`` call (the ops the capture classifies as
  attention, whose score matrices the memory model drops; Korthikanti et al., 2022) runs under the
  checkpoint and is recomputed in its backward; every other op saves what autograd saves.

Both leave the module tree as it is: the layer's ``forward`` (an instance attribute) is replaced, so
parameter names, state dicts, the tensor-parallel plan's module paths and FSDP2's ``fully_shard``
(applied after, around the module's ``__call__``) see the same model. Dropout draws the same numbers
in the recomputation (the checkpoint restores the RNG state), so the numbers are those of training
without recomputation.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from polyparallel.cost_models.layers import layer_of
from polyparallel.ir import Graph

__all__ = ["apply_recompute", "recompute_blocks", "recompute_problems", "retained_activation_bytes"]


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
    if recompute != "full":
        return []
    if graph is None:
        return ["recompute='full' checkpoints the model's numbered layers, found in its captured graph, but the "
                "model could not be captured"]
    if not recompute_blocks(graph):
        return ["recompute='full': the model has no numbered layers (modules named like 'layers.<i>', 'h.<i>' or "
                "'blocks.<i>'), so the cost model recomputes runs of √n ops, which the backend cannot checkpoint; "
                "search with constraints={'recompute': 'selective'} or 'none', or hold the repeated blocks in an "
                "nn.ModuleList named 'layers'"]
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


def _attention_recomputed(inner: Any, *args: Any, **kwargs: Any) -> Any:
    with _RecomputeAttention():
        return inner(*args, **kwargs)


def apply_recompute(model: nn.Module, recompute: str, blocks: tuple[str, ...] | list[str] = ()) -> nn.Module:
    """Make ``model`` recompute as ``recompute`` says (``none``, ``selective`` or ``full``), in place.

    ``blocks``: the module paths ``full`` checkpoints (:func:`recompute_blocks` of the model's graph).
    Apply it after tensor parallelism and before DDP / FSDP2 wrap the model. Returns ``model``.
    """
    if recompute == "none":
        return model
    if recompute == "selective":
        model.forward = functools.partial(_attention_recomputed, model.forward)  # type: ignore[method-assign]
        return model
    if recompute != "full":
        raise ValueError(f"recompute={recompute!r}: use 'none', 'selective' or 'full'")
    if not blocks:
        raise ValueError("recompute='full' needs the module paths of the model's layers (recompute_blocks(graph))")
    modules = dict(model.named_modules())
    missing = [b for b in blocks if b not in modules]
    if missing:
        raise ValueError(f"recompute='full': the model has no module {missing[0]!r} (a layer of its captured graph); "
                         "build the same model the strategy was searched for")
    for b in blocks:
        mod = modules[b]
        mod.forward = functools.partial(_checkpointed, mod.forward)  # type: ignore[method-assign]
    return model


def retained_activation_bytes(model: nn.Module, *args: Any, **kwargs: Any) -> int:
    """Bytes one forward of ``model(*args, **kwargs)`` leaves alive for its backward, on this process.

    Every storage an ATen op writes during the forward is tracked by a weak reference; after the
    forward, the ones still alive (other than the parameters, the inputs and the returned loss) are
    what autograd's saved tensors, a checkpoint's kept inputs and its cached outputs hold until the
    backward. It counts storages, so views and tensors saved twice count once. The backward is run
    afterwards so no graph is left behind. ``model`` must return a scalar loss.
    """
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

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

    given = [t for t in (*model.parameters(), *model.buffers(), *tree_flatten((args, kwargs))[0])
             if isinstance(t, torch.Tensor)]
    track = Track()
    with track:
        loss = model(*args, **kwargs)
    gc.collect()
    skip = {t.untyped_storage().data_ptr() for t in (*given, loss)}
    total = sum(n for ptr, (ref, n) in track.refs.items() if ptr not in skip and not ref.expired())
    loss.backward()
    return total
