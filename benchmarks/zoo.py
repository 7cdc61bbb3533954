"""Search ⇒ train on models nobody here wrote: does every plan the search writes train, exactly?

For each architecture of ``tests/zoo.py`` (``--zoo tests.zoo_hf_more``: sixteen more Hugging Face
architectures) and each cluster (``local-cpu:2``, ``local-cpu:4``):
``polyparallel.search`` on the user's model (real weights, as a user has them), then
``polyparallel.backends.torch.train`` for 3 SGD steps on that strategy, and the per-step losses
compared with single-process training of the same model on the same global batches. Prints a
table and writes ``benchmarks/results/zoo.json``.

``--tp N`` prices and trains Megatron's tensor parallelism pinned at ``N`` instead of the search's
choice (``polyparallel.evaluate(model, tp=N)``, what ``polyparallel evaluate --tp N`` gives a user): a
plan the torch backend cannot run is written "planning only", with its reason, and reported so here
(``benchmarks/results/<zoo>_tpN.json``).

    .venv/bin/python benchmarks/zoo.py [--models gpt2,unet] [--clusters 2,4] [--steps 3] [--zoo tests.zoo] [--tp 2]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS, LR, SEED = 3, 0.05, 0


def plan_summary(s: Any) -> str:
    parts = [f"dp{s.dp}"] + [f"{k}{v}" for k, v in (("tp", s.tp), ("pp", s.pp), ("sp", s.sp)) if v > 1]
    if s.microbatches > 1:
        parts.append(f"m{s.microbatches}")
    if s.zero_stage:
        parts.append(f"zero{s.zero_stage}")
    if s.pp > 1:
        parts.append(s.schedule)
    if s.recompute != "none":
        parts.append(f"rc-{s.recompute}")
    return " ".join(parts)


def against_single_process(rec: dict[str, Any], log: list[dict[str, Any]], model_fn: Any, data_fn: Any,
                           steps: int, lr: float = LR) -> float | None:
    """Record the run's and single-process training's losses in ``rec``; the largest relative
    difference, or None (with ``rec["error"]``) when the run logged another number of steps."""
    from polyparallel.backends.torch._examples import single_process_losses

    ref = single_process_losses(model_fn, data_fn, steps=steps, lr=lr, seed=SEED)
    got = [r["loss"] for r in log]
    rec.update(losses=got, reference=ref)
    if len(got) != len(ref):
        rec["error"] = f"{len(got)} steps logged, {len(ref)} expected"
        return None
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref))


def run_one(name: str, n: int, *, steps: int = STEPS, run_dir: Path | None = None,
            zoo: str = "tests.zoo", tp: int = 0) -> dict[str, Any]:
    """Search ``name`` (a model of ``zoo``'s ``ZOO``) on ``local-cpu:n`` (with ``tp``: price Megatron's
    tensor parallelism at that degree instead), train the strategy, compare with one process."""
    import torch

    import polyparallel as pp
    from polyparallel.backends.torch import train

    module = importlib.import_module(zoo)
    model_fn, data_fn = module.ZOO[name]
    x, y = data_fn(0)
    rec: dict[str, Any] = {"model": name, "cluster": f"local-cpu:{n}"}
    t0 = time.perf_counter()
    torch.manual_seed(SEED)
    try:
        if tp:
            s = pp.evaluate(model_fn(), (x,), f"local-cpu:{n}", example_kwargs={"labels": y},
                            batch_size=module.BATCH, tp=tp)
        else:
            s = pp.search(model_fn(), (x,), f"local-cpu:{n}", example_kwargs={"labels": y}, batch_size=module.BATCH)
    except Exception as e:
        rec.update(status="search failed", error=f"{type(e).__name__}: {e}"[:400])
        return rec
    rec.update(plan=plan_summary(s), search_s=round(time.perf_counter() - t0, 2),
               placements=sorted({p.placement for p in s.placements if p.placement}))
    planning_only = [note for note in s.search.notes if note.startswith("planning only")]
    if planning_only:
        rec.update(status="planning only", error=planning_only[0][:600])
        return rec
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pp-zoo-") as tmp:
        try:
            log = train(s, f"{zoo}:{model_fn.__name__}", f"{zoo}:{data_fn.__name__}", steps=steps, lr=LR,
                        seed=SEED, log_dir=run_dir or tmp, timeout_s=300)
        except Exception as e:
            rec.update(status="refused" if isinstance(e, ValueError) else "failed",
                       error=f"{type(e).__name__}: {e}"[:600])
            rec["traceback"] = traceback.format_exc()[-1500:]
            return rec
    rec["train_s"] = round(time.perf_counter() - t1, 2)
    err = against_single_process(rec, log, model_fn, data_fn, steps)
    if err is None:
        rec.update(status="failed")
        return rec
    rec["max_rel"] = err
    rec["status"] = "exact" if rec["max_rel"] <= 1e-5 else "inexact"
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zoo", default="tests.zoo", help="the module whose ZOO maps names to (model, data) functions")
    ap.add_argument("--models", default=None, help="comma-separated names (default: the whole zoo)")
    ap.add_argument("--clusters", default="2,4")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--tp", type=int, default=0, help="price and train Megatron's tp at this degree (not the search)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/<zoo's last name>[_tpN].json")
    a = ap.parse_args()
    models = a.models.split(",") if a.models else list(importlib.import_module(a.zoo).ZOO)
    stem = a.zoo.rsplit(".", 1)[-1] + (f"_tp{a.tp}" if a.tp else "")
    out = a.out or str(ROOT / "benchmarks" / "results" / f"{stem}.json")
    rows = []
    for n in (int(c) for c in a.clusters.split(",")):
        for name in models:
            r = run_one(name, n, steps=a.steps, zoo=a.zoo, tp=a.tp)
            rows.append(r)
            err = f"{r['max_rel']:.1e}" if "max_rel" in r else ""
            print(f"{r['cluster']:<12} {name:<10} {r.get('plan', '-'):<28} {r['status']:<14} {err:<8} "
                  f"{r.get('error', '')[:160]}", flush=True)
    ok = sum(r["status"] == "exact" for r in rows)
    what = f"tp={a.tp} plans" if a.tp else "searched plans"
    print(f"\n{ok} of {len(rows)} {what} trained with losses within 1e-5 of single-process training"
          + (f"; {sum(r['status'] == 'planning only' for r in rows)} written planning only" if a.tp else ""))
    Path(out).write_text(json.dumps({"zoo": a.zoo, "steps": a.steps, "lr": LR, "tp": a.tp, "rows": rows}, indent=1)
                         + "\n")


if __name__ == "__main__":
    main()
