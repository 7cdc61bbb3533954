"""Which MindSpore cell of a user's network runs each torch op, inferred and checked; shards applied.

The torch graph's ops carry the module they came from (``h.0.qkv``). The parameter map of the
collaborative backend (:func:`..collab._param_map.infer_map`: names, order, shapes, layouts) pairs the
torch module's weight with one MindSpore parameter; the cell that owns it is the op's cell. The map
is checked: the cell must be MindSpore's layer of the op's family and hold the primitives the export
shards (``nn.Dense``'s ``matmul``/``bias_add``, ``nn.LayerNorm``'s ``layer_norm``, ``nn.Embedding``'s
``gather``), and its weight must have the torch weight's element count. A torch op without weights
(attention) is paired by its module: the torch module's cell on the MindSpore side (the path both
maps' weights below it agree on), whose own primitives of the exported types (``BatchMatMul``,
``Softmax``, ``BatchMatMul``) take the strategies in order; one whose cell holds none (it calls
``ops`` functions instead of primitives) keeps MindSpore's default strategy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["apply_pipeline", "apply_shards", "build_cell", "infer_cell_map", "pipeline_cells_of"]


def build_cell(reference: str, inputs: Sequence[Any] | str | None = None) -> tuple[Any, list[np.ndarray]]:
    """The user's ``Cell`` from ``MODULE:FUNCTION`` and its example inputs (arrays, or an ``.npz`` path)."""
    from polyparallel.backends.collab._models import resolve_reference

    cell = resolve_reference(reference)()
    from mindspore import nn

    if not isinstance(cell, nn.Cell):
        raise ValueError(f"{reference} returned {type(cell).__name__}, not a mindspore.nn.Cell")
    if isinstance(inputs, str):
        with np.load(inputs) as z:
            arrays = [z[k] for k in sorted(z.files, key=lambda k: int(k[1:]))]
    else:
        arrays = [np.asarray(x) for x in inputs or ()]
    return cell, arrays


def _module_cells(mapping: Mapping[str, Any]) -> dict[str, str]:
    """torch module path -> MindSpore cell path, for every module above a mapped weight: the same number of
    path components stripped from both names (``h.0.qkv.weight`` -> ``h.0.qkv.weight`` gives ``h.0`` -> ``h.0``)."""
    out: dict[str, str] = {}
    for m in mapping.values():
        t, o = m.torch_name.split("."), m.ms_name.split(".")
        for k in range(1, min(len(t), len(o))):
            out.setdefault(".".join(t[:-k]), ".".join(o[:-k]))
    return out


def _own_primitives(cell: Any) -> list[tuple[str, str]]:
    """``(attribute, primitive type)`` of the primitives a cell holds itself, in the order it made them."""
    from mindspore.ops import Primitive

    return [(k, type(v).__name__) for k, v in vars(cell).items() if isinstance(v, Primitive)] + [
        (k, type(v).__name__) for k, v in getattr(cell, "_primitives", {}).items() if isinstance(v, Primitive)]


def infer_cell_map(torch_model: Any, cell: Any, shards: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``[{"torch_module", "op", "cell", "layer", "shards": [[attribute, primitive index], ...]}]``: for every
    op of the shards, the cell that runs it and which of its primitives takes which exported strategy.

    An op with a weight (Linear, LayerNorm, Embedding) is paired by the weight (ValueError naming the op
    when the cell is not MindSpore's layer of its family); a weightless op (attention) by its module's
    cell, whose own primitives of the exported types are taken in order. A weightless op whose cell holds
    none of them (it calls ``ops`` functions) is left out: it runs MindSpore's default strategy."""
    from polyparallel.backends.collab._foreign import torch_tensors
    from polyparallel.backends.collab._mindspore import mindspore_tensors
    from polyparallel.backends.collab._param_map import infer_map

    torch_side = torch_tensors(torch_model)
    mapping = {m.torch_name: m for m in infer_map(torch_side, mindspore_tensors(cell))}
    module_cells = _module_cells(mapping)
    shapes = {t.name: t.shape for t in torch_side}
    cells = dict(cell.cells_and_names())
    ms_params = {p.name: p for p in cell.get_parameters()}
    out: list[dict[str, Any]] = []
    for g in shards:
        prims = g["primitives"]
        for module, op in zip(g["modules"], g["ops"]):
            if any(p["cell_attr"] for p in prims):
                entry = _weighted(g, module, op, mapping.get(f"{module}.weight"), cells, ms_params, shapes)
            else:
                entry = _by_module(g, module, op, module_cells.get(module), cells)
            if entry is not None:
                out.append(entry)
    return out


def _weighted(g: Mapping[str, Any], module: str, op: str, m: Any, cells: Mapping[str, Any],
              ms_params: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    if m is None:
        raise ValueError(f"torch op {op} (module {module!r}) has no weight in the map to the MindSpore cell: give "
                         "the Cell the same layers as the torch model")
    target = cells.get(m.ms_path)
    kind = type(target).__name__
    pairs = []
    for i, p in enumerate(g["primitives"]):
        if not p["cell_attr"]:
            continue
        have = type(getattr(target, p["cell_attr"], None)).__name__
        if have != p["primitive"]:
            raise ValueError(f"torch op {op} ({g['target']}, module {module!r}) maps to MindSpore cell {m.ms_path!r} "
                             f"({kind}) by its weight, but that cell has no {p['primitive']} primitive "
                             f"'{p['cell_attr']}' (found {have}); use MindSpore's own layer there (nn.Dense, "
                             "nn.LayerNorm, nn.Embedding)")
        pairs.append([p["cell_attr"], i])
    n = int(np.prod(shapes[m.torch_name]))
    if int(np.prod(ms_params[m.ms_name].shape)) != n:
        raise ValueError(f"torch op {op}: weight {m.torch_name} has {n} elements, MindSpore {m.ms_name} "
                         f"{tuple(ms_params[m.ms_name].shape)}")
    return {"torch_module": module, "op": op, "cell": m.ms_path, "layer": kind, "shards": pairs}


def _by_module(g: Mapping[str, Any], module: str, op: str, path: str | None,
               cells: Mapping[str, Any]) -> dict[str, Any] | None:
    target = cells.get(path) if path is not None else None
    if target is None:
        return None
    free = _own_primitives(target)
    pairs = []
    for i, p in enumerate(g["primitives"]):
        k = next((j for j, (_, kind) in enumerate(free) if kind == p["primitive"]), None)
        if k is None:
            return None
        pairs.append([free.pop(k)[0], i])
    return {"torch_module": module, "op": op, "cell": path, "layer": type(target).__name__, "shards": pairs}


def apply_shards(cell: Any, config: Mapping[str, Any]) -> int:
    """Set the exported ``in_strategy`` on the cell's primitives through ``config["cell_map"]``; the count."""
    cells = dict(cell.cells_and_names())
    by_op = {op: g for g in config["shards"] for op in g["ops"]}
    n = 0
    for entry in config.get("cell_map", []):
        prims = by_op[entry["op"]]["primitives"]
        for attr, i in entry["shards"]:
            getattr(cells[entry["cell"]], attr).shard(tuple(tuple(t) for t in prims[i]["in_strategy"]))
            n += 1
    return n


def pipeline_cells_of(torch_model: Any, cell: Any, pipeline: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The pipeline assignment (torch module paths, :func:`.._export.pipeline_cells`) on the user's cells:
    each entry with ``ms_cell``, the MindSpore cell of that module (by the parameter map)."""
    from polyparallel.backends.collab._foreign import torch_tensors
    from polyparallel.backends.collab._mindspore import mindspore_tensors
    from polyparallel.backends.collab._param_map import infer_map

    mapping = {m.torch_name: m for m in infer_map(torch_tensors(torch_model), mindspore_tensors(cell))}
    module_cells = _module_cells(mapping)
    out = []
    for c in pipeline:
        path = module_cells.get(c["cell"])
        if path is None:
            raise ValueError(f"pipeline cell {c['cell']!r} of the torch model has no MindSpore cell in the map: give "
                             "the Cell the same layers as the torch model")
        out.append({**c, "ms_cell": path})
    return out


def apply_pipeline(cell: Any, config: Mapping[str, Any]) -> int:
    """Set ``pipeline_stage`` / ``pipeline_segment`` on the user's cells (``config["cell_pipeline"]``)."""
    cells = dict(cell.cells_and_names())
    for c in config.get("cell_pipeline", []):
        cells[c["ms_cell"]].pipeline_stage = c["pipeline_stage"]
        cells[c["ms_cell"]].pipeline_segment = c["pipeline_segment"]
    return len(config.get("cell_pipeline", []))
