"""polyparallel: find how to parallelise deep-learning training, and run it.

Examples:
    >>> import torch, polyparallel as pp
    >>> g = pp.capture(torch.nn.Linear(8, 4), (torch.randn(2, 8),))
    >>> g.param_count(), g.flops()
    (36, 136)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cluster import Cluster
from .ir import Graph, Op, OpKind, TensorSpec
from .strategy import Strategy

__version__ = "0.1.0"

__all__ = ["Cluster", "Constraints", "DoesNotFit", "Graph", "Op", "OpKind", "Strategy", "TensorSpec", "__version__",
           "capture", "collaborate", "evaluate", "search", "simulate", "train"]


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


# The executors and the search import torch and the solvers; they load on first use, and
# ``pp.train`` / ``pp.collaborate`` / ``pp.search`` are then the functions themselves (real
# signatures and docstrings in ``help``).
_LAZY = {
    "search": ("polyparallel.planning", "search"),
    "evaluate": ("polyparallel.planning", "evaluate"),
    "Constraints": ("polyparallel.planning", "Constraints"),
    "DoesNotFit": ("polyparallel.planning", "DoesNotFit"),
    "train": ("polyparallel.backends.torch", "train"),
    "collaborate": ("polyparallel.backends.collab", "collaborate"),
    "simulate": ("polyparallel.cost_models.collab_simulator", "simulate"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'polyparallel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
