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

__all__ = ["Cluster", "Graph", "Op", "OpKind", "Strategy", "TensorSpec", "__version__", "capture", "collaborate",
           "evaluate", "search", "train"]


def search(model: Any, example_inputs: Any = None, cluster: Any = "local-cpu:2", **kwargs: Any) -> Strategy:
    """Find the fastest parallel plan that fits; see :func:`polyparallel.planning.plan_search.search`."""
    from .planning import search as _search

    return _search(model, example_inputs, cluster, **kwargs)


def evaluate(model: Any, example_inputs: Any = None, cluster: Any = "local-cpu:2", **kwargs: Any) -> Strategy:
    """Price a hand-made recipe; see :func:`polyparallel.planning.plan_search.evaluate`."""
    from .planning import evaluate as _evaluate

    return _evaluate(model, example_inputs, cluster, **kwargs)


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


def collaborate(*args: Any, **kwargs: Any) -> Any:
    """Train across centers with periodic fusion; see :func:`polyparallel.backends.collab.collaborate`."""
    from .backends.collab import collaborate as _collaborate

    return _collaborate(*args, **kwargs)


def train(*args: Any, **kwargs: Any) -> Any:
    """Execute a Strategy with torch.distributed; see :func:`polyparallel.backends.torch.train`."""
    from .backends.torch import train as _train

    return _train(*args, **kwargs)
