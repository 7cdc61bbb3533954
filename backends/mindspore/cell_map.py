"""Which MindSpore cell of a user's network runs each torch op, inferred and checked; shards applied.

The torch graph's ops carry the module they came from (``h.0.qkv``). The parameter map of the
collaborative backend (:func:`..collab._param_map.infer_map`: names, order, shapes, layouts) pairs the
torch module's weight with one MindSpore parameter; the cell that owns it is the op's cell. The map
is checked: the cell must be MindSpore's layer of the op's family and hold the primitives the export
shards (``nn.Dense``'s ``matmul``/``bias_add``, ``nn.LayerNorm``'s ``layer_norm``, ``nn.Embedding``'s
``gather``), and its weight must have the torch weight's element count. A torch op without weights
(attention, the loss, the residual adds) has no parameter to pair it by: its primitives live in the
cell's own ``construct`` and are listed for the user to set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["apply_shards", "build_cell", "infer_cell_map"]


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


def infer_cell_map(torch_model: Any, cell: Any, shards: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``[{"torch_module", "cell", "layer", "primitives"}]`` for every torch module the shards name that
    has a weight; ValueError naming the first op whose cell does not fit."""
    from polyparallel.backends.collab._foreign import torch_tensors
    from polyparallel.backends.collab._mindspore import mindspore_tensors
    from polyparallel.backends.collab._param_map import infer_map

    mapping = {m.torch_name: m for m in infer_map(torch_tensors(torch_model), mindspore_tensors(cell))}
    cells = dict(cell.cells_and_names())
    ms_params = {p.name: p for p in cell.get_parameters()}
    out: list[dict[str, Any]] = []
    for g in shards:
        attrs = [(p["cell_attr"], p["primitive"]) for p in g["primitives"] if p["cell_attr"]]
        if not attrs:
            continue
        for module, op in zip(g["modules"], g["ops"]):
            m = mapping.get(f"{module}.weight")
            if m is None:
                raise ValueError(f"torch op {op} (module {module!r}) has no weight in the map to the MindSpore cell: "
                                 "give the Cell the same layers as the torch model")
            target = cells.get(m.ms_path)
            kind = type(target).__name__
            for attr, prim in attrs:
                have = type(getattr(target, attr, None)).__name__
                if have != prim:
                    raise ValueError(f"torch op {op} ({g['target']}, module {module!r}) maps to MindSpore cell "
                                     f"{m.ms_path!r} ({kind}) by its weight, but that cell has no {prim} primitive "
                                     f"'{attr}' (found {have}); use MindSpore's own layer there (nn.Dense, "
                                     "nn.LayerNorm, nn.Embedding)")
            torch_n = int(np.prod(dict((t.name, t.shape) for t in torch_tensors(torch_model))[m.torch_name]))
            if int(np.prod(ms_params[m.ms_name].shape)) != torch_n:
                raise ValueError(f"torch op {op}: weight {m.torch_name} has {torch_n} elements, MindSpore "
                                 f"{m.ms_name} {tuple(ms_params[m.ms_name].shape)}")
            out.append({"torch_module": module, "op": op, "cell": m.ms_path, "layer": kind,
                        "primitives": [a for a, _ in attrs]})
    return out


def apply_shards(cell: Any, config: Mapping[str, Any]) -> int:
    """Set the exported ``in_strategy`` on the cell's primitives through ``config["cell_map"]``; the count."""
    cells = dict(cell.cells_and_names())
    by_op = {op: g for g in config["shards"] for op in g["ops"]}
    n = 0
    for entry in config.get("cell_map", []):
        g = by_op[entry["op"]]
        target = cells[entry["cell"]]
        for p in g["primitives"]:
            if p["cell_attr"]:
                getattr(target, p["cell_attr"]).shard(tuple(tuple(t) for t in p["in_strategy"]))
                n += 1
    return n
