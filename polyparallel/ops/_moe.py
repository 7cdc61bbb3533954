"""Mixture-of-experts: the grouped matmul of the routed tokens with the experts' weights.

HF Mixtral/Qwen-MoE (``experts_implementation="grouped_mm"``, the default) and ``torch._grouped_mm``
sort the ``T = tokens · top_k`` routed rows by expert and multiply each expert's rows by its own
weight: ``y[r, n] = Σ_k x[r, k] · w[e(r), k, n]`` with ``e(r)`` the expert of row ``r`` (``offs``:
the cumulative row counts). Which rows go to which expert is data, not an affine function; the
loop nest takes the balanced routing the router's load-balancing loss trains for, ``c = T / E``
rows per expert, so the sorted rows are ``r = e·c + t``:

    y[s·T + e·c + t, n] += x[s·T + e·c + t, k] · w[e, k, n]      (s < sources, e < E, t < c)

with the expert dim ``e`` (:attr:`~polyparallel.ir.Hint.EXPERT`) parallel. ``sources`` is 1 in a
captured graph; the cost model builds the nest with ``sources = ep`` (the ``ep`` members' routed
rows side by side, each block sorted by expert) so that a placement ``e:ep`` gives each device
the rows of its experts from every member: the footprint minus the member's own block is the
all-to-all dispatch (and, for the output, the combine), counted exactly by :mod:`polyparallel.poly`.

FLOPs: ``2·T·K·N`` per grouped matmul, exactly the dense work of the routed rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from polyparallel.ir import Access, Dim, E, Hint, LoopNest, Role, Statement

from ._common import NotModelled

__all__ = ["grouped_mm"]


def grouped_mm(x: Sequence[int], w: Sequence[int], offs: Sequence[int] | None = None, *,
               sources: int = 1) -> LoopNest:
    """Loop nest of ``grouped_mm(x (S·T, K), w (E, K, N), offs (E,))`` with operands (x, w, offs).

    Raises :class:`NotModelled` unless ``x`` is 2-D, ``w`` 3-D with matching ``K``, and the
    ``T`` rows of each of the ``sources`` blocks divide evenly over the ``E`` experts.
    """
    if len(x) != 2 or len(w) != 3 or x[1] != w[1]:
        raise NotModelled(f"grouped_mm of x{list(x)} and w{list(w)}: expected x (T, K), w (E, K, N)")
    n_exp, k_in, n_out = (int(v) for v in w)
    rows = int(x[0])
    if sources < 1 or rows % (sources * n_exp):
        raise NotModelled(f"grouped_mm: {rows} routed rows do not split evenly over {sources} x {n_exp} experts")
    per_source = rows // sources
    c = per_source // n_exp
    dims = [Dim("e", n_exp, Role.PARALLEL, Hint.EXPERT), Dim("t", c, Role.PARALLEL, Hint.BATCH),
            Dim("n", n_out, Role.PARALLEL, Hint.FEATURE), Dim("k", k_in, Role.REDUCTION, Hint.FEATURE)]
    row = E("e") * c + E("t")
    if sources > 1:
        dims.insert(0, Dim("src", sources, Role.PARALLEL))
        row = E("src") * per_source + row
    reads = [Access("in0", (row, E("k"))), Access("in1", (E("e"), E("k"), E("n")))]
    if offs is not None:
        reads.append(Access("in2", (E("e"),)))
    st = Statement("mac", tuple(d.name for d in dims), reads=tuple(reads), writes=(Access("out0", (row, E("n"))),),
                   flops_per_point=2)
    return LoopNest(tuple(dims), (st,))
