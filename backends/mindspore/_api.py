"""``polyparallel.export``: a Strategy file to another framework's parallel configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from polyparallel.strategy import Strategy

from ._export import ExportResult, export_mindspore
from ._validate import validate_export

__all__ = ["TARGETS", "export"]

#: the frameworks a strategy exports to
TARGETS = ("mindspore",)


def _graph_and_model(model: str, s: Strategy, seq: int | None = None,
                     layers: int | None = None) -> tuple[Any, Any, tuple[Any, ...]]:
    """The graph the search fingerprinted and placed (one replica's micro-batch, re-batched from the
    example as the search does), the torch model and its example inputs."""
    from polyparallel.models import load_model
    from polyparallel.planning.model_graphs import ModelGraphs

    b = max(1, s.global_batch // (s.dp * s.microbatches))
    loaded = load_model(model, batch_size=None, seq_len=seq, layers=layers)
    m, args, kwargs = (loaded, None, None) if isinstance(loaded, Path) else loaded
    mdl = ModelGraphs(m, args, kwargs)
    mdl.graph(b)  # priced first, then the exact graph: the search's order (a batch-1 graph is then re-captured)
    # the Cell takes the torch model's inputs positionally (ids, then labels)
    inputs = (*args, *(kwargs or {}).values()) if args is not None else ()
    return mdl.exact(b), (None if isinstance(loaded, Path) else m), inputs


def export(strategy: Strategy | str | Path, to: str = "mindspore", out: str | Path = "mindspore_config", *,
           model: str | None = None, mindspore_model: str | None = None, validate: bool = True,
           seq: int | None = None, layers: int | None = None) -> ExportResult:
    """Write ``strategy`` as ``to``'s parallel configuration into the folder ``out`` (see
    :mod:`polyparallel.backends.mindspore._export`).

    Args:
        model: the model the strategy was searched for (a built-in name, an ``.onnx`` file or
            ``MODULE:FUNCTION``): its graph gives the per-op shards and pipeline cells.
        mindspore_model: ``MODULE:FUNCTION`` returning the user's ``mindspore.nn.Cell`` of the same
            network: the torch op -> cell map is inferred and checked, and the shards are set on it.
        validate: check the configuration with MindSpore (:mod:`._validate`) and record the result.
        seq, layers: the sequence length and block count of a built-in LM, as the search was given them.
    """
    if to not in TARGETS:
        raise ValueError(f"--to {to!r}: export targets are {', '.join(TARGETS)}")
    s = strategy if isinstance(strategy, Strategy) else Strategy.from_json(strategy)
    if mindspore_model and not model:
        raise ValueError("--mindspore-model needs --model: the op map is inferred between the torch model and the Cell")
    graph, torch_model, args = _graph_and_model(model, s, seq, layers) if model else (None, None, ())
    cell_map: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = {}
    if mindspore_model:
        if torch_model is None:
            raise ValueError("--mindspore-model needs a torch --model (built-in or MODULE:FUNCTION), not an .onnx file")
        from polyparallel.backends.collab._foreign import import_frameworks

        import_frameworks(["mindspore"])
        from ._export import pipeline_cells, shard_groups
        from .cell_map import build_cell, infer_cell_map, pipeline_cells_of

        cell, _ = build_cell(mindspore_model)
        cell_map = infer_cell_map(torch_model, cell, shard_groups(s, graph)[0])
        if s.pp > 1:
            extra["cell_pipeline"] = pipeline_cells_of(torch_model, cell, pipeline_cells(s, graph))
        Path(out).mkdir(parents=True, exist_ok=True)
        inputs = Path(out) / "cell_inputs.npz"
        # a model built on the meta device (the large built-ins) has example inputs without values: zeros
        np.savez(inputs, **{f"a{i}": (np.zeros(tuple(a.shape), str(a.dtype).removeprefix("torch."))
                                      if a.is_meta else a.detach().cpu().numpy()) for i, a in enumerate(args)})
        extra.update(cell_reference=mindspore_model, cell_inputs=str(inputs.resolve()))
    result = export_mindspore(s, out, graph=graph, cell_map=cell_map, extra=extra)
    if validate:

        result.config["validation"] = validate_export(out)
    return result
