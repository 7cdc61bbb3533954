"""Frontends: turn a PyTorch module or an ONNX model into the loop-nest Graph IR.

:func:`capture` picks the frontend (``polyparallel.capture`` is this function; modules of the
project import it from here, not from the package's top level, which imports the backends).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polyparallel.ir import Graph

from ._builder import CaptureError, GraphBuilder, OpaqueOpWarning

__all__ = ["CaptureError", "GraphBuilder", "OpaqueOpWarning", "capture"]


def capture(model: Any, example_inputs: Any = None, example_kwargs: dict[str, Any] | None = None,
            **options: Any) -> Graph:
    """Capture a model into the Graph IR.

    Args:
        model: an ``nn.Module`` (parameters may live on the ``meta`` device), a path to an
            ``.onnx`` file, or an ``onnx.ModelProto``.
        example_inputs: positional example inputs (a tensor or a tuple) for a module.
        example_kwargs: keyword example inputs for a module.
        options: passed to the frontend (e.g. ``method="fx"`` for the torch frontend).

    Returns:
        The captured :class:`~polyparallel.ir.Graph`.
    """
    if isinstance(model, str | Path) or type(model).__name__ == "ModelProto":
        from polyparallel.frontends.onnx import capture_onnx

        return capture_onnx(model, **options)
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a hard dependency
        raise TypeError("capturing a module needs torch installed") from e
    if isinstance(model, torch.nn.Module):
        from polyparallel.frontends.torch import capture_torch

        return capture_torch(model, example_inputs, example_kwargs, **options)
    raise TypeError(f"cannot capture a {type(model).__name__}: pass an nn.Module, an .onnx path "
                    "or an onnx.ModelProto")

