"""Spatial parallelism of image models: the ``sp`` axis splitting image rows, priced from the polyhedral model.

Under ``sp`` a token model splits its sequence (Ulysses: :mod:`.megatron_rule`); in a convolution
net without attention (:func:`splits_image_rows`) an op on images (its first activation input has
rank >= 4, ``[B, C, H, W, ...]``) splits its rows instead. Every
such tensor is held **row-split** (``S(2)@sp``), every smaller one (pooled features, a loss)
whole. For an op, the loop dim that indexes row axis 2 of that input is split over ``sp``
(:func:`polyparallel.poly.legal_placements`; none: the op runs whole on every device), and its
collectives come from the model's exact counts on a 1-D mesh of ``sp`` devices:

* **forward**: each activation input resharded from its row-split layout to what the op reads
  (a convolution's or pooling's window rows: a *halo*, a neighbour exchange of exactly the rows
  the neediest device lacks; a flatten before a classifier: an all-gather), the op's own
  collectives (BatchNorm's statistics: an all-reduce of ``2 C`` numbers), and its output brought
  back to the row-split layout (a global pool's partial sums: an all-reduce);
* **backward**: the duals: what the model moves of each input's gradient
  (:func:`polyparallel.poly.grad_held` to the row-split layout), plus, for a halo, the same
  neighbour exchange back (the rows a window read from a neighbour get partial gradients there,
  summed at their owner: the model's ``grad_held`` does not mark overlapping reads Partial), and
  the op's backward collectives. Parameter gradients are summed over ``dp·sp`` by the step model.

An op's work is split ``sp`` ways when its placement splits a dim, else not at all.
"""

from __future__ import annotations

from polyparallel.ir import ANY, Graph, Op, OpKind, TensorKind, element_bytes

from .memo import PRICES

__all__ = ["spatial_plan", "splits_image_rows"]

Events = tuple[tuple[str, float], ...]


def spatial_plan(graph: Graph, op: Op, sp: int, dtype: str) -> tuple[float, Events, Events] | None:
    """``(work split, forward events, backward events)`` of ``op`` with image rows split over ``sp``
    devices, or None when the op is not on images (the caller keeps the sequence rule)."""
    acts = [t for t in op.inputs if graph.tensors[t].kind is not TensorKind.PARAM]
    if not acts or len(graph.tensors[acts[0]].shape) < 4 or not splits_image_rows(graph):
        return None
    # islpy: loaded when a loop nest is read, not with polyparallel (cost_models/__init__)
    from polyparallel.poly import (
        DeviceMesh,
        Placement,
        TensorLayout,
        comm_of_op,
        grad_held,
        legal_placements,
        operand_need,
        output_layout,
        reshard,
    )

    mesh = DeviceMesh.of(sp=sp)
    rows = _row_dim(op, op.inputs.index(acts[0]))
    pl = Placement.parse(f"{rows}:sp") if rows else Placement()
    if pl not in legal_placements(graph, op, mesh):
        pl = Placement()

    def held(t: str) -> TensorLayout:
        shape = graph.shape(t)
        return TensorLayout(shape, tuple(("sp",) if i == 2 and len(shape) >= 4 else () for i in range(len(shape))))

    def events(rs, t: str) -> list[tuple[str, float]]:
        w = element_bytes(graph.tensors[t].dtype, dtype)
        return [_event(s.kind, s.payload * w, s.elements * w) for s in rs.steps]

    fwd: list[tuple[str, float]] = []
    bwd: list[tuple[str, float]] = []
    oc = comm_of_op(graph, op, pl, mesh)
    ow = element_bytes(graph.tensors[op.outputs[0]].dtype, dtype) if op.outputs else 4
    fwd += [_event(c.kind, c.payload * ow, c.elements * ow) for c in oc.forward]
    bwd += [_event(c.kind, c.payload * ow, c.elements * ow) for c in oc.backward]
    for j, t in enumerate(op.inputs):
        if graph.tensors[t].kind is TensorKind.PARAM:
            continue
        into = events(reshard(held(t), operand_need(graph, op, pl, mesh, f"in{j}"), mesh), t)
        fwd += into
        if graph.producer(t) is not None:
            bwd += events(reshard(grad_held(graph, op, pl, mesh, f"in{j}"), held(t), mesh), t)
            # the halo rows' gradients are partial sums on the devices that read them: each goes back to
            # the rows' owner, the same neighbour exchange (grad_held marks no partial axis for overlaps)
            bwd += [e for e in into if e[0] == "halo"]
    for k, t in enumerate(op.outputs):
        fwd += events(reshard(output_layout(graph, op, pl, mesh, k), held(t), mesh), t)
    split = float(sp) if pl.dims else 1.0
    return split, tuple(e for e in fwd if e[1] > 0), tuple(e for e in bwd if e[1] > 0)


def splits_image_rows(graph: Graph) -> bool:
    """Whether ``sp`` splits image rows in ``graph``: a convolution net (convolutions or pooling) without
    attention. A model with attention keeps Ulysses' sequence split (a ViT's rank-4 tensors after its
    patch embedding are ``[B, heads, S, D]``, their axis 2 a sequence)."""
    memo = PRICES.of(graph)
    hit = memo.get(("image_rows",))
    if hit is None:
        kinds = {OpKind(op.kind) for op in graph.ops}
        hit = memo[("image_rows",)] = bool(kinds & {OpKind.CONV, OpKind.POOL}) and OpKind.ATTENTION not in kinds
    return hit


def _row_dim(op: Op, index: int) -> str | None:
    """The loop dim that indexes axis 2 (the rows) of input ``index``: the term with the largest
    coefficient (``h`` of a window ``h*st + r``)."""
    if op.nest is None:
        return None
    for _st, acc, is_write in op.nest.accesses(f"in{index}"):
        if not is_write and len(acc.index) > 2 and acc.index[2] is not ANY and acc.index[2].terms:
            return max(acc.index[2].terms, key=lambda t: abs(t[1]))[0]
    return None


_KINDS = {"all-reduce": "all_reduce", "reduce-scatter": "reduce_scatter", "all-gather": "all_gather",
          "all-to-all": "all_to_all"}


def _event(kind: str, payload: float, received: float) -> tuple[str, float]:
    """A poly collective as the step model's ``(kind, bytes)``: collectives by their buffer, a halo
    by the bytes a device receives (:mod:`.comm`), an irregular exchange as an all-to-all."""
    if kind in _KINDS:
        return (_KINDS[kind], payload)
    if kind == "halo":
        return ("halo", received)
    return ("all_to_all", payload)
