"""Regional compilation (``compile="regional"``): what it changes, measured on this machine's CPU and
priced on GPUs.

1. **Measured (CPU).** The project's LLaMA at small width (``context_parallel.SHAPE``: 2 layers,
   hidden 64, 4 heads) at sequence ``--seq`` (default 2048), global batch 2, SGD, fp32, one process
   and dp=2 (DDP) on ``local-cpu``, eager and with each block compiled: the first step (which
   carries the compilation), the median step after ``--warm`` steps, the losses against one eager
   process, and the price ``pp.evaluate`` gives both (the same on CPUs: their calibrated rates are
   per op either way, ``cost_models/step.py:_eager``).
2. **Priced (GPU).** What the cost model says compiling saves for the usual recipes of the
   published-run presets: ``pp.evaluate`` with ``compile="regional"`` against eager (bf16).

    .venv/bin/python benchmarks/regional_compile.py          # ~5 min on 2 idle cores
    .venv/bin/python benchmarks/regional_compile.py --seq 512 --steps 4

Writes ``benchmarks/results/regional_compile.json``; the machine's load is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the workers import context_parallel by name to build the model
    sys.path.insert(0, str(HERE))

import polyparallel as pp  # noqa: E402
from polyparallel.backends.torch._examples import single_process_losses  # noqa: E402
from polyparallel.models import load_model  # noqa: E402

GPU_RECIPES = [("llama-8b", "dgx-a100x8", 64, dict(dp=8)), ("llama-8b", "dgx-a100x8", 64, dict(dp=2, tp=4)),
               ("gpt3-175b", "dgx-a100x192", 1536, dict(dp=12, tp=8, pp=16, microbatches=128))]


def _cpu_rows(seq: int, steps: int, warm: int) -> list[dict[str, Any]]:
    import functools

    import context_parallel as cpb

    # partials of the importable module's functions: the workers rebuild them by name
    model_fn = functools.partial(cpb.model, seq=seq)
    data_fn = functools.partial(cpb.data, seq=seq, batch=2)
    ref = single_process_losses(model_fn, data_fn, steps=steps, lr=0.1, seed=0)
    x, y = data_fn(0)
    rows = []
    for devices, recipe in ((1, dict(dp=1)), (2, dict(dp=2))):
        for compile in ("none", "regional"):
            s = pp.evaluate(model_fn(), (x, y), f"local-cpu:{devices}", batch_size=2, compile=compile, **recipe)
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                log = pp.train(s, model_fn, data_fn, steps=steps, lr=0.1, seed=0, run_dir=d)
            times = [r["step_time_s"] for r in log]
            rows.append({"recipe": f"dp={recipe['dp']}", "compile": compile, "seq": seq,
                         "predicted_step_s": s.estimate.step_time_s, "first_step_s": times[0],
                         "measured_step_s": statistics.median(times[warm:]),
                         "max_rel_loss_diff": max(abs(r["loss"] - f) / abs(f) for r, f in zip(log, ref, strict=True)),
                         "compiled_graphs": log[-1].get("compiled_graphs", 0),
                         "seconds": round(time.perf_counter() - t0, 1)})
            print(rows[-1], flush=True)
    return rows


def _gpu_rows() -> list[dict[str, Any]]:
    rows = []
    for name, cluster, batch, recipe in GPU_RECIPES:
        m, args, kwargs = load_model(name, batch_size=None, seq_len=None, layers=None)
        prices = {c: pp.evaluate(m, args, cluster, example_kwargs=kwargs, batch_size=batch, dtype="bf16", compile=c,
                                 **recipe).estimate for c in ("none", "regional")}
        rows.append({"model": name, "cluster": cluster, "batch": batch, **recipe,
                     "eager_step_s": prices["none"].step_time_s, "compiled_step_s": prices["regional"].step_time_s,
                     "eager_breakdown": prices["none"].breakdown, "compiled_breakdown": prices["regional"].breakdown})
        print({k: v for k, v in rows[-1].items() if "breakdown" not in k}, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warm", type=int, default=2, help="steps left out of the median (the first compiles)")
    ap.add_argument("--calibration", type=Path, default=Path("/tmp/polyparallel_cp_calibration.json"),
                    help="this machine's calibration (measured first when the file is absent)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "regional_compile.json")
    a = ap.parse_args()
    import context_parallel as cpb

    gpu = _gpu_rows()  # catalog GPUs: no calibration of this machine involved
    cpb._calibrated(a.calibration)
    load = os.getloadavg()[0]
    cpu = _cpu_rows(a.seq, a.steps, a.warm)
    print(f"\nCPU (load {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; 2 cores)")
    print(f"{'recipe':8} {'compile':9} {'first step':>11} {'step':>9} {'predicted':>10} {'loss diff':>10}")
    for r in cpu:
        print(f"{r['recipe']:8} {r['compile']:9} {r['first_step_s']:10.2f}s {r['measured_step_s']:8.3f}s "
              f"{r['predicted_step_s']:9.3f}s {r['max_rel_loss_diff']:10.1e}")
    print("\nGPU prices (bf16), eager -> compiled")
    for r in gpu:
        print(f"{r['model']:10} {r['cluster']:13} {json.dumps({k: r[k] for k in ('dp', 'tp', 'pp') if k in r}):28} "
              f"{r['eager_step_s']:.3f}s -> {r['compiled_step_s']:.3f}s "
              f"({(r['compiled_step_s'] / r['eager_step_s'] - 1) * 100:+.1f}%)")
    a.out.write_text(json.dumps({"machine_load_1min": load, "seq": a.seq, "steps": a.steps, "cpu": cpu, "gpu": gpu},
                                indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
