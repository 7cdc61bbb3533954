"""The executability contract (polyparallel.planning.executability): the torch backend registers what
it runs when polyparallel is imported, and the search asks the registered executor, not the backend."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

import polyparallel as pp
from polyparallel.backends.torch import capabilities
from polyparallel.planning import executability
from polyparallel.planning.executability import NotExecutable, executor


def test_the_torch_backend_is_registered_by_import_polyparallel() -> None:
    ex = executor("torch")
    assert ex.plan_problems is capabilities.plan_problems and ex.edge_rule is capabilities.edge_rule
    assert ex.dtypes == capabilities.EXECUTED_DTYPES
    assert issubclass(capabilities.Unsupported, NotExecutable) and issubclass(NotExecutable, ValueError)


def test_an_executor_nobody_registered_is_named() -> None:
    with pytest.raises(LookupError, match="no executor 'nope' is registered"):
        executor("nope")


def test_the_search_enumerates_only_what_the_registered_executor_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """An executor that runs no data parallelism: the search writes a plan without it, and counts
    the plans it kept out under the executor's reason."""
    torch = executor("torch")

    def no_dp(graph: Any, plan: Any) -> list[str]:
        return ["dp > 1: not run here"] if plan.dp > 1 else torch.plan_problems(graph, plan)

    assert pp.search("gpt-tiny", cluster="local-cpu:2", batch_size=16).dp == 2
    monkeypatch.setitem(executability._EXECUTORS, "torch", replace(torch, plan_problems=no_dp))
    s = pp.search("gpt-tiny", cluster="local-cpu:2", batch_size=16)
    assert s.dp == 1 and s.tp * s.pp * s.sp == 2
