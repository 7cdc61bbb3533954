"""The executability contract: what the search asks of an executor, and what executors register.

The search enumerates and places only the plans an executor runs exactly (``constraints.placements
= "torch"``, the default), and checks the chosen plan against the executor's own pre-launch check.
Planning imports no backend for that: a backend states what it runs as an :class:`Executor` and
registers it here when it is imported (:mod:`polyparallel.backends.torch.executor` registers
``"torch"``; ``import polyparallel`` imports it, so the default executor is always there).

What a collaborative center runs beyond its synchronous executor is data the planner's
collaborative mode searches under (:data:`CENTER_LIMITS`); the collaborative backend reads it from here.

Examples:
    >>> import polyparallel
    >>> from polyparallel.planning.executability import executor
    >>> executor("torch").dtypes
    ('fp32', 'bf16', 'fp16')
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from polyparallel.ir import Graph, Op
from polyparallel.plan import Plan

if TYPE_CHECKING:
    from polyparallel.cluster import Cluster
    from polyparallel.strategy import Strategy

__all__ = ["CENTER_LIMITS", "EdgeRule", "Executor", "Expressible", "NotExecutable", "executor", "register"]

Expressible = Callable[[Op, Any], bool]  # (op, Placement) -> whether the target runs it
EdgeRule = Callable[[Graph, Op, Any, Op, Any, int], "str | None"]  # "free"/"forbid"/"local"/"forward"/None

#: what a collaborative center's round runs beyond the torch backend's own limits (the collaborative
#: backend's ``normalize_plan`` says why): the planner's collaborative mode searches each center's plan
#: under these constraints
CENTER_LIMITS: Mapping[str, Any] = MappingProxyType({"pp": 1, "sp": 1, "cp": 1, "microbatches": 1, "dtype": "fp32"})


class NotExecutable(ValueError):
    """An executor cannot run a strategy exactly; the message says what (the torch backend's
    ``Unsupported`` is one)."""


@dataclass(frozen=True)
class Executor:
    """What one executor runs exactly, as the search asks it (the torch backend's
    :mod:`~polyparallel.backends.torch.capabilities` documents its answers).

    Plan level: ``plan_problems(graph, plan)`` why it cannot run a :class:`~polyparallel.plan.Plan` (a
    cost-model ``ParallelConfig``, a Strategy's ``.plan``) on the model captured as ``graph`` (None:
    not captured), empty when it can; ``dtypes`` the training precisions it runs. Op level, over the ``tp`` axis:
    ``expressible(graph, tp)`` the ``(op, placement) -> bool`` filter of the per-stage solver,
    ``edge_rule`` how neighbouring placements chain, ``chain_problems(graph, placed, mesh)`` why a
    stage's placements do not chain, ``heads_dims(graph, op)`` the dims a product of activations
    or a softmax is computed on locally (empty for other ops). Model level: ``check(strategy, model,
    batch, graph)`` its pre-launch check on the user's module (raises :class:`NotExecutable`);
    ``own_forward_check(strategy, model, args, kwargs, graph)`` the same for a run that calls the
    model's own forward ``model(*args, **kwargs)`` on each rank's shards with no graph rewrite (a
    collaborative center's local steps); ``profile(cluster, graphs, say)`` the cluster with the
    model's ops measured as it runs them.
    ``edge_rule`` is a key of the solver's memo: register one function, not a new closure per call.
    """

    name: str
    dtypes: tuple[str, ...]
    plan_problems: Callable[[Graph | None, Plan], list[str]]
    expressible: Callable[[Graph, int], Expressible]
    edge_rule: EdgeRule
    chain_problems: Callable[[Graph, dict[str, Any], Any], list[str]]
    heads_dims: Callable[[Graph, Op], tuple[str, ...]]
    check: Callable[[Strategy, Any, Any, Graph], None]
    own_forward_check: Callable[[Strategy, Any, tuple[Any, ...], dict[str, Any], Graph], None]
    profile: Callable[[Cluster, Any, Callable[[str], None]], Cluster]


_EXECUTORS: dict[str, Executor] = {}


def register(ex: Executor) -> None:
    """Make ``ex`` the executor named ``ex.name`` (a backend calls it when it is imported)."""
    _EXECUTORS[ex.name] = ex


def executor(name: str) -> Executor:
    """The executor registered as ``name``."""
    try:
        return _EXECUTORS[name]
    except KeyError:
        raise LookupError(f"no executor {name!r} is registered (registered: {', '.join(sorted(_EXECUTORS)) or 'none'});"
                          " `import polyparallel` registers the torch backend") from None
