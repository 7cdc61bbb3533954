"""Regional compilation (``compile="regional"``, issue 40): each repeated block compiled with
``torch.compile`` on its own, opt-in.

* The plan record, the constraints, the Strategy JSON and the CLI take it; a bad value is one line.
* The cost model prices it as fused kernels on accelerators: a plan with ``compile="regional"`` costs
  what the same plan with ``fused_elementwise=True`` costs (an independent route to the same prices),
  less than the eager plan; on CPUs both price the same (their calibrated rates are of one kernel per op).
* The torch backend runs it (slow tier): the searched plan with ``compile="regional"`` under
  FSDP2, TP and pipeline stages trains with the losses of eager single-process training (fp32,
  3 SGD steps, rel <= 1e-5: compiled kernels round differently), and torch.compile built graphs.
"""

from __future__ import annotations

import json

import pytest

import polyparallel as pp
from polyparallel.backends.torch import _examples as ex
from polyparallel.cli import main
from polyparallel.plan import Plan
from polyparallel.strategy import Strategy

STEPS, LR, SEED = 3, 0.1, 0


def _priced(cluster: str, **kw):
    x, y = ex.gpt_data(0)
    return pp.evaluate(ex.tiny_gpt(), (x,), cluster, example_kwargs={"labels": y}, batch_size=8, **kw)


def test_bad_compile_values_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match="compile='max': give one of none, regional"):
        pp.Constraints(compile="max")
    assert Plan(compile="fused").problems() == ["compile='fused': give one of none, regional"]
    # the CLI's one line, exit 2: tests/test_bad_inputs.py's cases


def test_regional_compile_is_priced_as_fused_kernels_on_accelerators():
    eager = _priced("dgx-a100x8", dp=8)
    compiled = _priced("dgx-a100x8", dp=8, compile="regional")
    fused = _priced("dgx-a100x8", dp=8, execution={"fused_elementwise": True})
    assert compiled.compile == "regional" and eager.compile == "none"
    assert compiled.estimate.step_time_s == pytest.approx(fused.estimate.step_time_s, rel=1e-12)
    assert compiled.estimate.step_time_s < eager.estimate.step_time_s
    # an explicit fused_elementwise=False (a recipe measured eager) wins over the plan's compile
    forced = _priced("dgx-a100x8", dp=8, compile="regional", execution={"fused_elementwise": False})
    assert forced.estimate.step_time_s == pytest.approx(eager.estimate.step_time_s, rel=1e-12)
    # CPUs: calibrated per-op rates, one kernel per op either way
    assert _priced("local-cpu:2", dp=2, compile="regional").estimate.step_time_s == pytest.approx(
        _priced("local-cpu:2", dp=2).estimate.step_time_s, rel=1e-12)


def test_strategy_json_keeps_compile_and_old_files_read_as_eager(tmp_path):
    s = _priced("local-cpu:2", dp=2, compile="regional")
    back = Strategy.from_json(s.to_json())
    assert back.compile == "regional" and back.plan.compile == "regional"
    d = json.loads(s.to_json())
    del d["compile"]  # a file written before the field existed
    assert Strategy.model_validate(d).plan.compile == "none"


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    out = capsys.readouterr()
    assert done.value.code == 0, out.err
    return out.out


def test_search_pins_compile_and_the_summary_says_so(capsys):
    assert json.loads(_cli(["search", "gpt-tiny", "--compile", "regional", "--json"], capsys))["compile"] == "regional"
    assert "blocks compiled" in _cli(["evaluate", "gpt-tiny", "--compile", "regional"], capsys)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [dict(dp=2, zero_stage=3), dict(dp=1, tp=2), dict(dp=1, pp=2, microbatches=2)],
                         ids=["fsdp2", "tp2", "pp2"])
def test_compiled_plans_train_as_one_eager_process(recipe, tmp_path):
    s = _priced("local-cpu:2", compile="regional", **recipe)
    assert (s.dp, s.tp, s.pp, s.compile) == (recipe["dp"], recipe.get("tp", 1), recipe.get("pp", 1), "regional")
    fns = "polyparallel.backends.torch._examples:tiny_gpt", "polyparallel.backends.torch._examples:gpt_data"
    log = pp.train(s, *fns, steps=STEPS, lr=LR, seed=SEED, run_dir=tmp_path / "run")
    ref = ex.single_process_losses(ex.tiny_gpt, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED)
    for r, rec in zip(ref, log, strict=True):
        assert abs(rec["loss"] - r) <= 1e-5 * abs(r), (rec["step"], rec["loss"], r)
    assert all(rec["compiled_graphs"] >= 1 for rec in log)
