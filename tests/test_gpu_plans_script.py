"""benchmarks/gpu_plans.py, the GPU check prepared for a lent GPU, runs its whole flow on CPU
processes (``--cpu 2``): search eager and compiled, train the written plan with the memory profile,
and the two runs of one plan train the same losses (compiled kernels round differently: 1e-5)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_gpu_plan_check_runs_on_cpu_processes(tmp_path: Path) -> None:
    import gpu_plans

    res = gpu_plans.main(["--cpu", "2", "--seq", "64", "--steps", "2", "--models", "hf_llama",
                          "--out", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text())["rows"] == res["rows"]
    eager, compiled = res["rows"]
    assert (eager["plan"]["compile"], compiled["plan"]["compile"]) == ("none", "regional")
    assert eager["compiled_graphs"] == 0 and compiled["compiled_graphs"] >= 1
    for r in res["rows"]:
        assert r["predicted_step_s"] > 0 and r["measured_step_s"] > 0 and r["measured_memory_bytes"] > 0
        assert all(math.isfinite(x) for x in r["losses"])
    if eager["plan"] | {"compile": ""} == compiled["plan"] | {"compile": ""}:
        for a, b in zip(eager["losses"], compiled["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(a)
