"""Check an exported configuration with MindSpore itself, in a fresh process.

What MindSpore 2.10 on CPU allows (measured; docs/mindspore.md):

* ``set_auto_parallel_context(**context)`` is accepted and read back — every key and value checked;
* ``Primitive.shard(in_strategy)`` is accepted for every exported primitive (MindSpore's own format
  checks), ``Cell.pipeline_stage`` / ``pipeline_segment`` for every pipeline cell;
* compiling the *parallel* graph is not: the parallel pass maps the device target to HCCL (Ascend) or
  NCCL (GPU) and stops on CPU ("Invalid communication backend: CPU for semi_auto_parallel/auto_parallel
  mode"); dry-run (``MS_SIMULATION_LEVEL``) is refused in ``init()`` for CPU, and this wheel's Ascend and
  GPU plugins do not load without CANN / CUDA 11. The compile is attempted on a one-MatMul network with
  the first exported MatMul strategy and MindSpore's answer is recorded verbatim (``parallel_compile``);
  on an Ascend or GPU build the same call compiles and saves the strategy checkpoint.
* With a user ``Cell`` (``cell``: ``MODULE:FUNCTION``): the shards are set on the cell's own primitives
  through the inferred map (:mod:`.cell_map`) and the cell is compiled in stand-alone graph mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from polyparallel.references import import_path

from ._export import CONFIG_FILE, REPORT_FILE, report_markdown
from .cell_map import apply_pipeline, apply_shards, build_cell

__all__ = ["validate_export"]

RESULT_FILE = "validation.json"


def validate_export(out: str | Path, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run the checks on ``out/mindspore_parallel.json`` in a new Python process (MindSpore's context is
    global); the results, also written to ``out/validation.json`` and into the report."""

    out = Path(out)
    proc = subprocess.run([sys.executable, "-m", "polyparallel.backends.mindspore._validate", str(out)],
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONPATH": import_path()})
    path = out / RESULT_FILE
    if proc.returncode != 0 or not path.exists():
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip() and "[WARNING]" not in ln]
        errors = [ln for ln in lines if ln.split(":", 1)[0].endswith(("Error", "Exception"))]
        raise RuntimeError(f"the MindSpore check of {out} failed: {(errors or lines or ['(no output)'])[-1].strip()}")
    result: dict[str, Any] = json.loads(path.read_text())

    config = json.loads((out / CONFIG_FILE).read_text())
    config["validation"] = result
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    (out / REPORT_FILE).write_text(report_markdown(config))
    return result


def _tuples(s: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(f) for f in t) for t in s)


def _check(out: Path) -> dict[str, Any]:
    import mindspore as ms
    from mindspore import nn, ops


    config = json.loads((out / CONFIG_FILE).read_text())
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ctx = dict(config["context"])
    ctx["strategy_ckpt_config"] = {**ctx["strategy_ckpt_config"],
                                   "save_file": str(out / ctx["strategy_ckpt_config"]["save_file"])}
    ms.set_auto_parallel_context(**ctx)
    differ, unread = [], []
    for k, v in ctx.items():
        try:
            got = ms.get_auto_parallel_context(k)
        except ValueError:  # set-only keys (parallel_optimizer_config): MindSpore checked them when set
            unread.append(k)
            continue
        if isinstance(v, dict):
            got = {kk: got.get(kk) for kk in v} if isinstance(got, dict) else got
        if got != v:
            differ.append(f"{k}: set {v!r}, read back {got!r}")
    result: dict[str, Any] = {"mindspore": ms.__version__,
                              "context": (f"accepted; {len(ctx) - len(unread)} keys read back equal"
                                          + (f", {', '.join(unread)} set-only (checked when set)" if unread else ""))
                              if not differ else
                              "differs: " + "; ".join(differ)}
    n = 0
    for g in config["shards"]:
        for p in g["primitives"]:
            getattr(ops, p["primitive"])(**p["attrs"]).shard(_tuples(p["in_strategy"]))
            n += 1
    result["shards"] = f"{n} primitive strategies accepted by Primitive.shard"
    for c in config["pipeline"]:
        cell = nn.Cell()
        cell.pipeline_stage = c["pipeline_stage"]
        cell.pipeline_segment = c["pipeline_segment"]
    if config["pipeline"]:
        result["pipeline"] = (f"{len(config['pipeline'])} cells' pipeline_stage/pipeline_segment accepted; "
                              f"micro-batches by nn.PipelineCell(micro_size={config['micro_batches']['micro_size']})")
    result["parallel_compile"] = _parallel_compile(ms, nn, ops, config, ctx)
    if config.get("cell_reference"):

        cell, inputs = build_cell(config["cell_reference"], config.get("cell_inputs"))
        ms.reset_auto_parallel_context()
        applied = apply_shards(cell, config)
        staged = apply_pipeline(cell, config)
        if staged:
            nn.PipelineCell(cell, config["micro_batches"]["micro_size"])  # the wrapper accepts the staged cell
        cell.compile(*[ms.Tensor(x) for x in inputs])
        result["cell"] = (f"{applied} primitives of {config['cell_reference']} sharded"
                          + (f", {staged} of its cells given their pipeline stage" if staged else "")
                          + "; the cell compiled in stand-alone graph mode")
    return result


def _parallel_compile(ms: Any, nn: Any, ops: Any, config: dict[str, Any], ctx: dict[str, Any]) -> str:
    """Compile a one-MatMul network under the exported context with the first MatMul strategy."""
    import numpy as np

    strat = next((p["in_strategy"] for g in config["shards"] for p in g["primitives"] if p["primitive"] == "MatMul"),
                 [[1, 1], [1, 1]])
    (a, k), (n, _) = strat
    m = max(a, 1) * 4

    class One(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.w = ms.Parameter(ms.Tensor(np.ones((n * 4, k * 4), np.float32)), name="w")
            self.mm = ops.MatMul(transpose_b=True).shard(_tuples(strat))

        def construct(self, x: Any) -> Any:
            return self.mm(x, self.w).sum()

    ms.set_auto_parallel_context(**{**ctx, "pipeline_stages": 1, "global_rank": 0})
    try:
        One().compile(ms.Tensor(np.ones((m, k * 4), np.float32)))
    except (RuntimeError, ValueError) as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), str(e))
        return f"refused by MindSpore {ms.__version__} on CPU: {first}"
    return "compiled"


if __name__ == "__main__":
    where = Path(sys.argv[1])
    (where / RESULT_FILE).write_text(json.dumps(_check(where), indent=1) + "\n")
