"""Every plan written runs: the searched plan and seven pinned recipes on 13 models nobody here wrote.

For each architecture of ``tests/zoo_recipes.py``: the plan ``polyparallel.search`` writes for
``local-cpu:2``, and the recipes a user pins with ``polyparallel.evaluate`` — ``tp2``, ``pp2``
(2 micro-batches), ``dp2·tp2·pp2`` (8 processes), ``sp2``, ``bf16`` (dp2), full and selective
recomputation (dp2) — each trained for 3 SGD steps (lr 0.05) with ``polyparallel.backends.torch.train``
and compared with single-process fp32 training on the same global batches. A model whose single-process
losses move with the thread count alone (:func:`chaos`: MobileNetV2 here) is judged on its first step. A cell is

* ``exact``: fp32 losses within 1e-5 (relative) of one process; ``bf16 ok``: within 2% of the fp32
  losses and further than fp32 round-off (1e-6) from them;
* ``refused``: refused before any process started, with the reason (by ``evaluate``, or by ``train``'s
  checks: ``Unsupported`` / ``ValueError``);
* ``crash``: a worker failed after launch (``TrainError``) or anything else raised — the contract
  says this never happens; ``inexact``: it trained, with other numbers.

Prints a table, writes ``benchmarks/results/recipe_zoo.json`` (rewritten after every cell, so an
interrupted run keeps what it measured).

    .venv/bin/python benchmarks/recipe_zoo.py [--models nanogpt,opt] [--recipes tp2,pp2] [--steps 3]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.zoo import LR, SEED, STEPS  # noqa: E402 - after the path above

EXACT, BF16_TOL, ROUND_OFF = 1e-5, 0.02, 1e-6

# recipe -> (devices, evaluate's keyword arguments); "searched" is polyparallel.search's own plan
RECIPES: dict[str, tuple[int, dict[str, Any]]] = {
    "searched": (2, {}),
    "tp2": (2, {"tp": 2, "dp": 1, "microbatches": 1, "recompute": "none"}),
    "pp2": (2, {"pp": 2, "dp": 1, "microbatches": 2, "recompute": "none"}),
    "dp2tp2pp2": (8, {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2, "recompute": "none"}),
    "sp2": (2, {"sp": 2, "dp": 1, "microbatches": 1, "recompute": "none"}),
    "bf16": (2, {"dp": 2, "microbatches": 1, "recompute": "none", "dtype": "bf16"}),
    "full": (2, {"dp": 2, "microbatches": 1, "recompute": "full"}),
    "selective": (2, {"dp": 2, "microbatches": 1, "recompute": "selective"}),
}


def _summary(s: Any) -> str:
    parts = [f"dp{s.dp}"] + [f"{k}{v}" for k, v in (("tp", s.tp), ("pp", s.pp), ("sp", s.sp)) if v > 1]
    parts += [f"m{s.microbatches}"] if s.microbatches > 1 else []
    parts += [f"zero{s.zero_stage}"] if s.zero_stage else []
    parts += [f"rc-{s.recompute}"] if s.recompute != "none" else []
    parts += [s.dtype] if s.dtype != "fp32" else []
    return " ".join(parts)


@functools.cache
def chaos(name: str, steps: int) -> float:
    """How far single-process training of ``name`` moves when only its thread count changes (the
    order of its float sums): the largest relative loss difference over ``steps`` steps. An untrained
    MobileNetV2 with BatchNorm over 8 images differs by several % by step 3; the other models by 0."""
    import torch

    from polyparallel.backends.torch._examples import single_process_losses
    from tests.zoo_recipes import ZOO

    model_fn, data_fn = ZOO[name]
    threads = torch.get_num_threads()
    a = single_process_losses(model_fn, data_fn, steps=steps, lr=LR, seed=SEED)
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        b = single_process_losses(model_fn, data_fn, steps=steps, lr=LR, seed=SEED)
    finally:
        torch.set_num_threads(threads)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _failed(rec: dict[str, Any], by: str, e: Exception) -> dict[str, Any]:
    """``rec`` for a cell that did not train: refused before launch (a ValueError: evaluate's
    refusal, train's checks) or a crash (a worker failed after launch, TrainError, or anything else)."""
    rec.update(status="refused" if isinstance(e, ValueError) else "crash", by=by,
               error=f"{type(e).__name__}: {e}"[:700])
    return rec


def run_cell(name: str, recipe: str, *, steps: int = STEPS) -> dict[str, Any]:
    import torch

    import polyparallel as pp
    from benchmarks.zoo import against_single_process
    from polyparallel.backends.torch import train
    from tests.zoo import BATCH
    from tests.zoo_recipes import ZOO

    model_fn, data_fn = ZOO[name]
    devices, kw = RECIPES[recipe]
    x, y = data_fn(0)
    rec: dict[str, Any] = {"model": name, "recipe": recipe, "cluster": f"local-cpu:{devices}"}
    torch.manual_seed(SEED)
    t0 = time.perf_counter()
    try:
        if recipe == "searched":
            s = pp.search(model_fn(), (x, y), f"local-cpu:{devices}", batch_size=BATCH)
        else:
            s = pp.evaluate(model_fn(), (x, y), f"local-cpu:{devices}", batch_size=BATCH, **kw)
    except Exception as e:
        return _failed(rec, "evaluate", e)
    rec.update(plan=_summary(s), plan_s=round(time.perf_counter() - t0, 2), notes=list(s.search.notes)[:3])
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pp-recipe-zoo-") as tmp:
        try:
            log = train(s, f"tests.zoo_recipes:{model_fn.__name__}", f"tests.zoo_recipes:{data_fn.__name__}",
                        steps=steps, lr=LR, seed=SEED, run_dir=tmp, timeout_s=400)
        except Exception as e:
            return _failed(rec, "train", e)
    rec["train_s"] = round(time.perf_counter() - t1, 2)
    err = against_single_process(rec, log, model_fn, data_fn, steps)
    if err is None:
        rec.update(status="crash", by="train")
        return rec
    rec["max_rel"] = err
    spread = chaos(name, steps)
    if spread > EXACT:  # one process is not reproducible past step 0: only the first loss is a test
        rec.update(single_process_spread=spread, judged="step 0")
        err = rec["max_rel"] = abs(log[0]["loss"] - rec["reference"][0]) / abs(rec["reference"][0])
    if s.dtype == "fp32":
        rec["status"] = "exact" if err <= EXACT else "inexact"
    else:
        rec["status"] = "bf16 ok" if ROUND_OFF < err <= BF16_TOL else "inexact"
    return rec


def main() -> None:
    from tests.zoo_recipes import ZOO

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "recipe_zoo.json"))
    a = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for name in a.models.split(","):
        for recipe in a.recipes.split(","):
            r = run_cell(name, recipe, steps=a.steps)
            rows.append(r)
            err = f"{r['max_rel']:.1e}" if "max_rel" in r else ""
            print(f"{name:<20} {recipe:<10} {r.get('plan', '-'):<24} {r['status']:<8} {err:<8} "
                  f"{r.get('error', '')[:150]}", flush=True)
            Path(a.out).write_text(json.dumps({"steps": a.steps, "lr": LR, "rows": rows}, indent=1) + "\n")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print("\n" + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + f" of {len(rows)} cells")


if __name__ == "__main__":
    main()
