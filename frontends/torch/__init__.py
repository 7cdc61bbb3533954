"""PyTorch frontend: ``nn.Module`` -> Graph IR.

Capture goes through ``torch.export.export(strict=False)`` first. Its pre-dispatch ATen
graph keeps the composite ops we model as a whole (``linear``, ``layer_norm``,
``scaled_dot_product_attention``, ``cross_entropy_loss``) and works on Hugging Face
models where ``torch.fx.symbolic_trace`` fails. If export fails, ``torch.fx.symbolic_trace``
with shape propagation is tried; leaf modules and functional calls are then mapped onto
the same handlers. The model may live on the ``meta`` device: shapes come from fake
tensors, so a 175B-parameter model is captured without allocating its weights.

Each ATen op is mapped by its base name (``aten.addmm.default`` -> ``addmm``) to a
handler that reads the op's arguments *by schema name* and calls a loop-nest builder
from :mod:`polyparallel.ops`; unknown ops become opaque ops (see
:class:`~polyparallel.frontends.GraphBuilder`).

Modules, each importing only those before it: :mod:`._registry` (the normalised :class:`Call`
a handler reads, what it returns, and :func:`handles`, which registers it), one module of
handlers per op family (:mod:`._contraction`, :mod:`._normalisation`, :mod:`._reduction`,
:mod:`._views`, and :mod:`._elementwise`, the fallbacks for ops no handler names),
:mod:`._capture` (the walk over an FX graph, and over an exported program),
:mod:`._fx_fallback` (the symbolic_trace fallback), and this module (the entry point, the
export itself, and the switches around it).
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx.config as fx_config

from polyparallel.ir import Graph

from .._builder import CaptureError
from .._fold import export_folded, input_kinds
from ._capture import _walk_export
from ._elementwise import is_pointwise  # noqa: F401  (the handler API stays importable from here)
from ._fx_fallback import _fx
from ._registry import HANDLERS, Call, Handler, Spec, TRef, handles  # noqa: F401  (the same)

__all__ = ["capture_torch", "quiet_fake_tensors"]


def _to_meta_if_needed(model: torch.nn.Module, value: Any) -> Any:
    devs = {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()}
    if devs != {"meta"}:
        return value
    return torch.utils._pytree.tree_map(
        lambda t: t.to("meta") if isinstance(t, torch.Tensor) and t.device.type != "meta" else t, value)


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Tracing without recording each node's Python stack: a quarter of export's time, and the
    frontend never reads ``node.meta["stack_trace"]``."""
    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def quiet_fake_tensors() -> Iterator[None]:
    """torch's fake-tensor dispatch logs each op that fails on meta tensors with its traceback at
    ERROR level (``torch._subclasses.fake_tensor``) before raising: the raised error, which the
    capture reports in one line, says the same; the log lines are held back."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    before = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(before)


@contextlib.contextmanager
def _no_partial_graph_dump() -> Iterator[None]:
    """A failed ``torch.export`` prints the partial graph it traced to stderr before raising (hundreds of
    lines for a model with a data-dependent branch, once per export wrapper it passed); the capture's error
    names the cause in a few lines, so those prints are held back. Anything else written to stderr meanwhile
    (warnings) is passed on, whatever way the export ends."""
    held, graphs = io.StringIO(), []
    try:
        with contextlib.redirect_stderr(held):
            yield
    except Exception as e:
        seen: set[int] = set()
        cause: BaseException | None = e
        while cause is not None and id(cause) not in seen:  # torch may re-raise the traced error wrapped
            seen.add(id(cause))
            graph = getattr(cause, "partial_fx_graph", None)
            if graph is not None:
                graphs.append(f"{graph}\n")
            cause = cause.__cause__ or cause.__context__
        raise
    finally:
        text = held.getvalue()
        for g in graphs:
            text = text.replace(g, "")
        sys.stderr.write(text)


def _export_program(model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    with _no_stack_traces(), quiet_fake_tensors(), _no_partial_graph_dump():
        return torch.export.export(model, args, kwargs=kwargs, strict=False)


def _export(model: torch.nn.Module, args: tuple, kwargs: dict, name: str) -> Graph:
    folded = export_folded(model, lambda m: _export_program(m, args, kwargs))
    if folded is not None:
        return _walk_export(model, folded.graph.nodes, folded.inputs, folded.graph_module, name)
    ep = _export_program(model, args, kwargs)
    return _walk_export(model, ep.graph.nodes, input_kinds(ep), ep.graph_module, name)


@contextlib.contextmanager
def _grouped_experts(model: torch.nn.Module) -> Iterator[None]:
    """HF MoE models set to the per-expert loop (``experts_implementation="eager"``), whose Python loop over
    the experts hit is data-dependent control flow that export cannot trace, are captured through their
    ``grouped_mm`` implementation (the same function, one grouped matmul per projection), then restored."""
    switched = []
    for m in model.modules():
        if getattr(getattr(m, "config", None), "_experts_implementation", None) == "eager" and \
                hasattr(m, "set_experts_implementation"):
            try:
                m.set_experts_implementation("grouped_mm")
            except ValueError:  # a model without experts (T5, ViT: transformers refuses the setting)
                continue
            switched.append(m)
    try:
        yield
    finally:
        for m in switched:
            m.set_experts_implementation("eager")


def capture_torch(model: torch.nn.Module, example_inputs: Any = None, example_kwargs: dict[str, Any] | None = None,
                  *, method: str = "auto", name: str | None = None) -> Graph:
    """Capture an ``nn.Module`` into the Graph IR.

    Args:
        model: the module; parameters may be on the ``meta`` device.
        example_inputs: a tensor or tuple of positional example inputs.
        example_kwargs: keyword example inputs (e.g. ``labels=...`` for a HF model).
        method: ``"export"``, ``"fx"`` or ``"auto"`` (export, then fx on failure).
        name: graph name (default: the module's class name).

    Raises:
        CaptureError: neither method could capture the model; the message names the
            failing construct and what to try.
    """
    if example_inputs is None:
        example_inputs = ()
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    example_inputs = _to_meta_if_needed(model, example_inputs)
    kwargs = _to_meta_if_needed(model, kwargs)
    name = name or type(model).__name__
    if method not in ("auto", "export", "fx"):
        raise ValueError(f"method must be 'auto', 'export' or 'fx', not {method!r}")
    errors: list[str] = []
    if method in ("auto", "export"):
        try:
            with _grouped_experts(model):
                return _export(model, example_inputs, kwargs, name)
        except Exception as e:  # torch raises many exception types from export
            errors.append(f"torch.export.export(strict=False) failed: {_first_lines(e)}")
            if method == "export":
                raise CaptureError(f"could not capture {name}: {errors[0]}\n  try method='fx' (torch.fx."
                                   "symbolic_trace), or make the failing construct traceable") from e
    try:
        return _fx(model, example_inputs, kwargs, name)
    except CaptureError:
        raise
    except Exception as e:
        # ShapeProp wraps the op's own error in one naming the fx node: the op's error says what is wrong
        cause = e.__cause__ if str(e).startswith("ShapeProp error") and e.__cause__ is not None else e
        errors.append(f"torch.fx.symbolic_trace failed: {_first_lines(cause)}")
        raise CaptureError(
            f"could not capture {name}:\n  " + "\n  ".join(errors) +
            "\n  fixes: give example inputs of the right shapes/dtypes; avoid data-dependent Python control flow "
            "(use torch.cond or torch.where); or export the model to ONNX and capture the .onnx file") from e


def _first_lines(e: BaseException, n: int = 3) -> str:
    """The error's first ``n`` lines, and the line that names where in the model's code it arose (torch's
    data-dependent errors say ``Caused by: (file.py:line in function)`` further down)."""
    text = [line.strip() for line in f"{type(e).__name__}: {e}".strip().splitlines() if line.strip()]
    where = [line for line in text[n:] if line.startswith("Caused by:")][:1]
    return " / ".join(text[:n] + where)
