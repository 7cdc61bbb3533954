"""The torch backend's side of the executability contract (:mod:`polyparallel.planning.executability`).

Registers the executor ``"torch"`` when imported (``import polyparallel`` imports this module): the
predicates of :mod:`.capabilities`, the pre-launch check of :func:`~polyparallel.backends.torch.plan_for`
and the op timings of :mod:`.op_timing`. The planner reaches the backend only through it.
"""

from __future__ import annotations

from typing import Any

from polyparallel.backends.torch.capabilities import (
    EXECUTED_DTYPES,
    chain_problems,
    edge_rule,
    expressible,
    local_dims,
    op_role,
    plan_problems,
)
from polyparallel.backends.torch.op_timing import profiled_cluster
from polyparallel.ir import Graph, Op
from polyparallel.planning.executability import Executor, register
from polyparallel.strategy import Strategy

__all__ = ["TORCH"]


def heads_dims(g: Graph, op: Op) -> tuple[str, ...]:
    """The dims a ``heads`` op (:func:`.capabilities.op_role`) is computed on locally; () for another op."""
    return local_dims(op) if op_role(g, op) == "heads" else ()


def check(strategy: Strategy, model: Any, batch: Any, graph: Graph) -> None:
    """:func:`~polyparallel.backends.torch.plan_for` on the user's module given the global batch ``batch``
    as train gives it (:func:`~._plan.checked_batch`; raises ``Unsupported``)."""
    # torch.export and torch.distributed: loaded on the first check, not with the planner
    from polyparallel.backends.torch._plan import checked_batch, plan_for  # loads torch (not with polyparallel)

    plan_for(strategy, model, checked_batch(strategy, batch), graph=graph)


def own_forward_check(strategy: Strategy, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                      graph: Graph) -> None:
    """:func:`~polyparallel.backends.torch.own_forward_plan` on the user's module (raises ``Unsupported``)."""
    from polyparallel.backends.torch._plan import own_forward_plan  # loads torch, as check does

    own_forward_plan(strategy, model, args, kwargs, graph=graph)


TORCH = Executor(name="torch", dtypes=EXECUTED_DTYPES, plan_problems=plan_problems, expressible=expressible,
                 edge_rule=edge_rule, chain_problems=chain_problems, heads_dims=heads_dims, check=check,
                 own_forward_check=own_forward_check, profile=profiled_cluster)
register(TORCH)
