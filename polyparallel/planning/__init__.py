"""Planning: from a captured model and a cluster to a :class:`~polyparallel.strategy.Strategy`.

The modules, in the order the data flows through them:

* :mod:`.model_graphs`: the graph of the model at every micro-batch size the search tries
  (captured at two anchor sizes, the others derived).
* :mod:`.constraints`: what a user pins of the plan, and the error when no plan fits.
* :mod:`.plan_search`: the search over mesh degrees, micro-batching, schedules and memory knobs
  (restricted to plans the torch backend executes), and ``evaluate`` for a hand-made recipe; also
  the collaborative (multi-center) mode.
* :mod:`.branch_bound`: the ranking of the enumerated plans (branch and bound on the cost model's
  exact memory and step-time bounds) and why each axis of the chosen plan is there.
* :mod:`.executor_check`: the chosen plan against the executor's pre-launch check on the user's
  module (a refused plan gives way to the next fastest).
* :mod:`.stage_solver`: the exact per-stage solver of per-op placements on the polyhedral model.
* :mod:`.place_plan`: applies the stage solver to the chosen plan (or Megatron's rule) and re-prices it.
* :mod:`.assemble`: writes the chosen plan as a Strategy.
* :mod:`.executability`: what the search asks of an executor (which plans and placements it runs),
  registered by the backends: planning imports none.

Examples:
    >>> from polyparallel.planning import Constraints, DoesNotFit, evaluate, search
    >>> Constraints(tp=2).tp
    2
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polyparallel.planning.constraints import Constraints, DoesNotFit
    from polyparallel.planning.evaluate_recipe import evaluate
    from polyparallel.planning.plan_search import search

__all__ = ["Constraints", "DoesNotFit", "evaluate", "search"]


def __getattr__(name: str) -> Any:
    """The search's names, loaded on first use: a backend registering into :mod:`.executability`
    (which ``import polyparallel`` does) loads this package without the search."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = {"Constraints": "constraints", "DoesNotFit": "constraints", "evaluate": "evaluate_recipe"}.get(
        name, "plan_search")
    value = getattr(importlib.import_module(f"polyparallel.planning.{module}"), name)
    globals()[name] = value
    return value
