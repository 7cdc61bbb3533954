"""Strategies the search writes, kept field by field, to show a refactor changes no plan.

    .venv/bin/python benchmarks/strategy_snapshot.py           # search every case, write the snapshot
    .venv/bin/python benchmarks/strategy_snapshot.py --check   # search again, list every field that differs

The cases are ``benchmarks/search.py``'s big cases, small CPU searches with each knob pinned
(tensor, pipeline with interleaving, sequence parallelism, fp16, rule placements, recomputation, a
collaborative search) and the searched plan of every model of both zoos (``tests/zoo.py``,
``tests/zoo_recipes.py``). A strategy is kept whole except the search's own CPU times
(``search.capture_s`` / ``search.search_s``), which change from run to run.
Writes benchmarks/results/strategy_snapshot.json (``--check`` writes nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the zoos are importable as tests.zoo
    sys.path.insert(0, str(ROOT))

import polyparallel as pp  # noqa: E402
from polyparallel.planning import DoesNotFit  # noqa: E402

OUT = Path(__file__).parent / "results" / "strategy_snapshot.json"

BIG = [("gpt2-small", "dgx-a100x1", 64), ("llama-8b", "dgx-a100x8", 512), ("gpt3-175b", "dgx-a100x192", 1536),
       ("resnet50", "dgx-a100x4", 1024), ("gpt2-small", "aisynergy-5", 512)]
# (name, model, cluster, batch, constraints)
PINNED: list[tuple[str, str, str, int, dict[str, Any]]] = [
    ("gpt-tiny cpu", "gpt-tiny", "local-cpu:4", 8, {}),
    ("gpt-tiny tp2 rule", "gpt-tiny", "local-cpu:4", 8, {"tp": 2, "placements": "rule"}),
    ("gpt-tiny tp2 torch", "gpt-tiny", "local-cpu:4", 8, {"tp": 2}),
    ("gpt-tiny pp2 interleaved", "gpt-tiny", "local-cpu:4", 8, {"pp": 2, "chunks": 2, "microbatches": 4}),
    ("gpt-tiny sp2", "gpt-tiny", "local-cpu:4", 8, {"sp": 2}),
    ("gpt-tiny fp16 full", "gpt-tiny", "local-cpu:4", 8, {"dtype": "fp16", "recompute": "full"}),
    ("gpt-tiny dp2 tp2 zero3", "gpt-tiny", "local-cpu:4", 8, {"dp": 2, "tp": 2, "zero_stage": 3,
                                                              "placements": "rule"}),
    ("gpt2-small a100x8 sp", "gpt2-small", "dgx-a100x1", 64, {"tp": 4, "sequence_parallel": True,
                                                              "placements": "rule"}),
    ("llama-8b pinned pp", "llama-8b", "dgx-a100x8", 512, {"tp": 8, "pp": 2, "schedule": "interleaved"}),
    ("gpt2-small collab", "gpt2-small", "aisynergy-5", 512, {"mode": "collaborative"}),
    ("cnn cpu", "cnn", "local-cpu:2", 16, {}),
    ("hf-gpt2 cpu", "hf-gpt2", "local-cpu:4", 8, {}),
    ("llama-1b a100x8 fsdp", "llama-1b", "dgx-a100x1", 64, {"zero_stage": 3, "recompute": "op"}),
]


def _kept(s: pp.Strategy) -> dict[str, Any]:
    d = s.to_dict()
    d["search"].pop("capture_s", None)
    d["search"].pop("search_s", None)
    return d


def _zoo_cases() -> list[tuple[str, Any]]:
    from tests.zoo import ZOO
    from tests.zoo_recipes import ZOO as ZOO2
    return [(f"zoo {n}", fns) for n, fns in ZOO.items()] + [(f"zoo2 {n}", fns) for n, fns in ZOO2.items()]


def run(names: set[str] | None = None) -> dict[str, Any]:
    import torch
    out: dict[str, Any] = {}

    def keep(name: str, fn) -> None:
        if names and name not in names:
            return
        t = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out[name] = _kept(fn())
        except (DoesNotFit, ValueError) as e:
            out[name] = {"refused": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        print(f"{name:34s} {time.perf_counter() - t:6.1f} s", flush=True)

    for model, cluster, batch in BIG:
        keep(f"{model} {cluster}", lambda m=model, c=cluster, b=batch: pp.search(m, cluster=c, batch_size=b))
    for name, model, cluster, batch, cons in PINNED:
        keep(name, lambda m=model, c=cluster, b=batch, k=cons: pp.search(m, cluster=c, batch_size=b, constraints=k))
    for name, (model_fn, data_fn) in _zoo_cases():
        def zoo(model_fn=model_fn, data_fn=data_fn):
            torch.manual_seed(0)
            x, y = data_fn(0)
            return pp.search(model_fn(), (x, y), "local-cpu:4", batch_size=len(x))
        keep(name, zoo)
    return out


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        rows = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                rows.append(f"{path}.{k}: {'missing before' if k not in a else 'missing now'}")
            else:
                rows += _diff(a[k], b[k], f"{path}.{k}")
        return rows
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [r for i, (x, y) in enumerate(zip(a, b, strict=True)) for r in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {json.dumps(a)[:120]} -> {json.dumps(b)[:120]}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the stored snapshot, write nothing")
    ap.add_argument("--case", action="append", help="only this case (repeatable)")
    args = ap.parse_args()
    now = run(set(args.case) if args.case else None)
    if not args.check:
        old = json.loads(OUT.read_text()) if OUT.exists() and args.case else {}
        OUT.write_text(json.dumps({**old, **now}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {OUT} ({len(now)} strategies)")
        return
    before = json.loads(OUT.read_text())
    bad = 0
    for name, s in now.items():
        rows = _diff(before.get(name), s, name) if name in before else [f"{name}: not in the snapshot"]
        bad += bool(rows)
        for r in rows[:20]:
            print("  " + r)
    print(f"{len(now) - bad} of {len(now)} strategies identical field by field")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
