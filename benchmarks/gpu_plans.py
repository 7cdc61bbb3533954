"""Searched plans trained on this machine's GPUs: step time and peak memory against the prediction
(issue 40's GPU check).

For three models at a long sequence — the project's LLaMA (rotary tables as buffers), the project's
GPT (learned positions) and HF's LLaMA (positions and the causal mask from aranges) — ``pp.search``
plans on a cluster of this machine's GPUs (their data-sheet type, or the ``--calibration`` of
``polyparallel calibrate --device cuda``), each model searched twice: eager and with its blocks
compiled (``compile="regional"``). ``pp.train`` then runs the written plan for ``--steps`` steps
with ``profile_memory=True`` (CUDA's allocator peak on rank 0): the median step after the first
against the estimate, the peak against the memory model, and the losses.

    python benchmarks/gpu_plans.py                               # every visible CUDA GPU
    python benchmarks/gpu_plans.py --calibration cal.json        # priced with a GPU calibration
    python benchmarks/gpu_plans.py --cpu 2 --seq 256 --steps 3   # the same flow on local-cpu:2

``--cpu P`` runs the same flow on ``P`` CPU processes at a small width (what the tests run, so the
script is known to work before a GPU is lent). Writes ``benchmarks/results/gpu_plans.json``
(``--out``); prints a table with the device and the machine's load.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # the workers import this module by name; HF models wrap as tests/zoo.py does
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

import polyparallel as pp  # noqa: E402
from polyparallel import models  # noqa: E402

MODELS = ("llama", "gpt", "hf_llama")
# (vocab, layers, hidden, heads, K/V heads, FFN) on GPUs (a ~300M-parameter LLaMA) and on CPUs
WIDTH = {"gpu": (32000, 8, 1024, 16, 8, 2816), "cpu": (256, 2, 64, 4, 2, 128)}


def model(name: str, seq: int, size: str) -> torch.nn.Module:
    vocab, layers, hidden, heads, kv, ffn = WIDTH[size]
    if name == "llama":
        return models.Llama(models.LlamaConfig(vocab=vocab, seq=seq, layers=layers, hidden=hidden, heads=heads,
                                               kv_heads=kv, ffn=ffn))
    if name == "gpt":
        return models.GPT(models.GPTConfig(vocab=vocab, seq=seq, layers=layers, hidden=hidden, heads=heads))
    from tests.zoo import hf_decoder

    return hf_decoder("llama", vocab=vocab, layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn, seq=seq)


def data(step: int, seq: int, batch: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 + step)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def gpu_cluster(n: int, calibration: str | None) -> pp.Cluster:
    """``n`` GPUs of this machine's type on one node (NVLink-class links, the catalog's)."""
    from gpu_validation import catalog_type, one_gpu_cluster

    return one_gpu_cluster(catalog_type(torch.cuda.get_device_name(0)), calibration, n)


def run_model(name: str, cluster: Any, seq: int, batch: int, steps: int, size: str, compile: str) -> dict[str, Any]:
    me = sys.modules.get("gpu_plans") or __import__("gpu_plans")  # by its importable name: workers rebuild partials
    model_fn = functools.partial(me.model, name, seq, size)
    data_fn = functools.partial(me.data, seq=seq, batch=batch, vocab=WIDTH[size][0])
    t0 = time.time()
    s = pp.search(model_fn(), data_fn(0), cluster, batch_size=batch, constraints={"compile": compile})
    plan = {k: getattr(s, k) for k in ("dp", "tp", "pp", "sp", "cp", "microbatches", "zero_stage", "recompute",
                                       "dtype", "compile")}
    row: dict[str, Any] = {"model": name, "seq": seq, "batch": batch, "plan": plan,
                           "predicted_step_s": s.estimate.step_time_s,
                           "predicted_memory_bytes": s.estimate.memory_bytes_max}
    train = functools.partial(pp.train, s, model_fn, data_fn, lr=1e-4, optimizer="adam", timeout_s=1800)
    # CUDA's allocator peak costs nothing; the CPU's MemTracker is a dispatch mode, under which
    # torch.compile falls back to eager and each step slows: there the memory is a run of its own
    gpu = size == "gpu"
    log = train(steps=steps, profile_memory=gpu)
    mem = log if gpu else []
    if not gpu:
        try:
            mem = train(steps=2, profile_memory=True)
        except ValueError as e:  # MemTracker cannot follow a pipeline schedule's backward
            if "MemTracker" not in str(e):
                raise
    times = [r["step_time_s"] for r in log[1:]] or [log[0]["step_time_s"]]
    peaks = [r["peak_memory_bytes"] for r in mem if "peak_memory_bytes" in r]
    row.update(measured_step_s=statistics.median(times), first_step_s=log[0]["step_time_s"],
               measured_memory_bytes=max(peaks) if peaks else None, losses=[r["loss"] for r in log],
               compiled_graphs=log[-1].get("compiled_graphs", 0),
               seconds=round(time.time() - t0, 1))
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", type=int, help="run on this many CPU processes (local-cpu:P) at a small width")
    ap.add_argument("--devices", type=int, help="GPUs to plan over (default: every visible one)")
    ap.add_argument("--calibration", help="a `polyparallel calibrate --device cuda` JSON (default: data sheet)")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, help="global batch (default: the devices)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", type=Path, default=HERE / "results" / "gpu_plans.json")
    a = ap.parse_args(argv)
    if a.cpu:
        cluster, size, n, device = f"local-cpu:{a.cpu}", "cpu", a.cpu, "cpu"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU here: run with --cpu P to check the script on CPU processes")
        n = a.devices or torch.cuda.device_count()
        cluster, size, device = gpu_cluster(n, a.calibration), "gpu", torch.cuda.get_device_name(0)
    load = os.getloadavg()[0]
    rows = [run_model(m, cluster, a.seq, a.batch or n, a.steps, size, c)
            for m in a.models.split(",") for c in ("none", "regional")]
    print(f"\n{device} x{n} (load {load:.1f}), sequence {a.seq}")
    print(f"{'model':9} {'plan':44} {'step pred':>9} {'meas':>8} {'err':>6} {'mem pred':>9} {'meas':>9}")
    for r in rows:
        p = r["plan"]
        plan = (f"dp{p['dp']} tp{p['tp']} pp{p['pp']} sp{p['sp']} cp{p['cp']} m{p['microbatches']} "
                f"z{p['zero_stage']} {p['recompute']} {p['dtype']} {p['compile']}")
        mem = "-" if r["measured_memory_bytes"] is None else f"{r['measured_memory_bytes'] / 2**30:.2f}G"
        print(f"{r['model']:9} {plan:44} {r['predicted_step_s']:9.3f} {r['measured_step_s']:8.3f} "
              f"{r['predicted_step_s'] / r['measured_step_s'] - 1:+6.0%} {r['predicted_memory_bytes'] / 2**30:8.2f}G "
              f"{mem:>9}")
    res = {"device": device, "devices": n, "machine_load_1min": load, "seq": a.seq, "rows": rows,
           "calibration": a.calibration, "torch": torch.__version__}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
