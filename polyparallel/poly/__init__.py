"""The polyhedral model: legal splits and exact communication volumes from integer sets.

Every op's loop nest (:mod:`polyparallel.ir`) becomes isl sets (iteration domains) and
maps (accesses). A :class:`Placement` block-distributes loop dims over the axes of a
:class:`DeviceMesh`; from it the model derives which splits are legal, what each device
computes, holds and must receive, and the collectives that move it — with exact counts,
cached by op signature x placement so repeated layers cost nothing.

Licence: the project is MIT, so it uses plain ``islpy`` (MIT). ``islpy-barvinok``
(GPL, parametric ``card``) is not used: counts are exact for concrete shapes (unions of
boxes and progressions counted in closed form, isl for the rest; see :mod:`._isl`), and
box-shaped footprints also have exact formulas in symbolic shape parameters (products of
piecewise quasi-affine extents; :mod:`._symbolic`).

Communication is computed in four modules, each importing only those before it:
:mod:`._distribution` (what each device holds or needs of a tensor), :mod:`._reshard` (the
route and exact cost between two distributions), :mod:`._op_comm` (an op's own collectives
and the gradients' distributions) and :mod:`._reshard_table` (every placement pair of an
edge priced at once, as arrays).

API:
    ``legal_placements(graph, op, mesh) -> list[Placement]``
    ``comm_of_op(graph, op, placement, mesh) -> OpComm`` (partial-sum reductions inside
    the op, partial outputs, parameter-gradient all-reduces)
    ``output_layout(graph, op, placement, mesh)`` / ``operand_need(graph, op, placement,
    mesh, "in0") -> Distribution``
    ``reshard(have, need, mesh) -> Reshard`` (steps: kind, mesh axes, exact elements)
    ``reshard_edge(graph, tensor, producer_placement, consumer, consumer_placement, mesh)``
    ``edge_costs(graph, tensor, consumer, "in0", mesh) -> EdgeCosts`` (every placement pair,
    forward ``cost(i, j)`` and backward ``backward_cost(i, j)``; ``table``: a
    ``ReshardTable`` with every distinct pair's elements as arrays, see ``reshard_table``)
    ``backward_reshard_edge(...)``: the activation gradient's way back along an edge (a
    column-parallel linear's input gradient is Partial over tp: one all-reduce, the dual of
    the row-parallel forward all-reduce); ``grad_held`` / ``grad_needed`` / ``grad_partial_axes``.
    ``cache_stats()`` hit rates.
    ``symbolic_volume(op, placement, mesh, "in0", params={"b": "B", "s": "S"}, device=p)`` and
    ``symbolic_receive(...)``: footprint / receive volumes as formulas in shape parameters
    (exact where the footprint is a box; :mod:`._symbolic`).

Counting conventions: footprints and receive volumes are exact element counts per
device (``max`` over devices where one number is given, ``total`` summed). A collective's
``elements`` is what one device receives in it: all-gather / all-to-all / halo exactly
``|new block| - |new block ∩ old block|``; reduce-scatter ``(n-1)|shard|``; all-reduce the ring's
``2(n-1)ceil(|block|/n)``. Rules for legality and padding: :mod:`._placement`.
Per-device arrays are computed once per (op signature, placement, operand) and every
reshard once per pair of distributions (layouts are shared across ops).

Examples:
    Megatron's column-then-row-parallel MLP: nothing moves between the two matmuls, and
    the output needs one all-reduce:

    >>> from polyparallel import ops
    >>> from polyparallel.ir import Graph, Op, OpKind, TensorSpec, TensorKind
    >>> from polyparallel.poly import DeviceMesh, Placement, TensorLayout, output_layout, operand_need, reshard
    >>> g = Graph("mlp")
    >>> for name, shape, kind in [("x", (4, 8, 16), "input"), ("w1", (64, 16), "param"),
    ...                           ("h", (4, 8, 64), "activation"), ("w2", (16, 64), "param"),
    ...                           ("y", (4, 8, 16), "activation")]:
    ...     _ = g.add_tensor(TensorSpec(name, shape, kind=TensorKind(kind)))
    >>> fc1 = g.add_op(Op("fc1", OpKind.CONTRACTION, "linear", ("x", "w1"), ("h",),
    ...                   ops.linear((4, 8, 16), (64, 16))))
    >>> fc2 = g.add_op(Op("fc2", OpKind.CONTRACTION, "linear", ("h", "w2"), ("y",),
    ...                   ops.linear((4, 8, 64), (16, 64))))
    >>> mesh = DeviceMesh.of(tp=4)
    >>> col, row = Placement.parse("n:tp"), Placement.parse("k:tp")
    >>> reshard(output_layout(g, fc1, col, mesh), operand_need(g, fc2, row, mesh, "in0"), mesh).kind
    'none'
    >>> r = reshard(output_layout(g, fc2, row, mesh), TensorLayout.replicated((4, 8, 16)), mesh)
    >>> r.kind, r.steps[0].payload       # all-reduce of the whole output activation
    ('all-reduce', 512)
"""

from __future__ import annotations

from ._cache import CACHE, PolyCache, cache_stats, clear_cache
from ._distribution import Distribution, TensorLayout, layout_distribution, operand_need, output_layout
from ._isl import ISL_TIME, access_map, count, domain_set, footprint_set
from ._mesh import DeviceAxis, DeviceMesh
from ._op_comm import Collective, OpComm, backward_reshard_edge, comm_of_op, grad_held, grad_needed, grad_partial_axes
from ._placement import (
    IllegalPlacement,
    Placement,
    carried_dims,
    check_placement,
    dim_split_kind,
    legal_placements,
    padding_of,
)
from ._reshard import Reshard, Step, reshard, reshard_edge
from ._reshard_table import EdgeCosts, ReshardTable, edge_costs, reshard_table
from ._symbolic import NotSymbolic, SymbolicVolume, symbolic_receive, symbolic_volume

__all__ = [
    "CACHE",
    "ISL_TIME",
    "Collective",
    "DeviceAxis",
    "DeviceMesh",
    "Distribution",
    "EdgeCosts",
    "IllegalPlacement",
    "NotSymbolic",
    "OpComm",
    "Placement",
    "PolyCache",
    "Reshard",
    "ReshardTable",
    "Step",
    "SymbolicVolume",
    "TensorLayout",
    "access_map",
    "backward_reshard_edge",
    "cache_stats",
    "carried_dims",
    "check_placement",
    "clear_cache",
    "comm_of_op",
    "count",
    "dim_split_kind",
    "domain_set",
    "edge_costs",
    "footprint_set",
    "grad_held",
    "grad_needed",
    "grad_partial_axes",
    "layout_distribution",
    "legal_placements",
    "operand_need",
    "output_layout",
    "padding_of",
    "reshard",
    "reshard_edge",
    "reshard_table",
    "symbolic_receive",
    "symbolic_volume",
]
