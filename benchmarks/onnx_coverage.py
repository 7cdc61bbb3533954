"""ONNX frontend coverage over the ONNX backend node tests.

Captures every node-test model of the installed ``onnx`` package and reports how many
import without error, and per op type how many ops are modelled as loop nests, kept
opaque, or folded into constants at capture time.

The ``onnx`` wheel may ship the models as files
(``onnx/backend/test/data/node/*/model.onnx``); when it does not (recent wheels leave
the data out), the same models are generated in-process from the test-case
definitions in ``onnx.backend.test.case.node``, which is what ``backend-test-tools
generate-data`` writes to those files.

Run: ``.venv/bin/python benchmarks/onnx_coverage.py [--show-failures] [--show-opaque]``.
Writes ``benchmarks/results/onnx_coverage.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import warnings
from pathlib import Path
from typing import Any

import onnx

from polyparallel.frontends import CaptureError
from polyparallel.frontends.onnx import capture_onnx

RESULTS = Path(__file__).parent / "results" / "onnx_coverage.json"


def node_models() -> tuple[str, list[tuple[str, onnx.ModelProto | Path]]]:
    """(source, [(test name, model)]) for every ONNX backend node test."""
    data = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"
    files = sorted(data.glob("*/model.onnx")) if data.is_dir() else []
    if files:
        return str(data), [(f.parent.name, f) for f in files]
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = node.collect_testcases(None)
    return "onnx.backend.test.case.node.collect_testcases()", [(c.name, c.model) for c in cases]


def model_zoo() -> list[Path]:
    """The whole models shipped with onnx's backend tests (CNNs, converted PyTorch modules)."""
    data = Path(onnx.__file__).parent / "backend" / "test" / "data"
    return (sorted(data.glob("light/*.onnx")) + sorted(data.glob("pytorch-converted/*/model.onnx"))
            + sorted(data.glob("pytorch-operator/*/model.onnx")) + sorted(data.glob("simple/*/model.onnx")))


def zoo_report() -> dict[str, Any]:
    rows = []
    for f in model_zoo():
        name = f.stem if f.parent.name in ("light",) else f.parent.name
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                g = capture_onnx(f)
            rows.append({"model": name, "ok": True, "ops": len(g.ops), "params": g.param_count(),
                         "gflops": round(g.flops() / 1e9, 4), "opaque": g.summary()["opaque"],
                         "seconds": round(time.perf_counter() - t0, 3)})
        except CaptureError as e:
            rows.append({"model": name, "ok": False, "error": str(e)})
        except Exception as e:  # a crash is a bug: report it as such
            rows.append({"model": name, "ok": False, "error": f"CRASH {type(e).__name__}: {e}"})
    return {"models": len(rows), "imported": sum(r["ok"] for r in rows),
            "fully_modelled": sum(1 for r in rows if r["ok"] and not r["opaque"]), "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--show-failures", action="store_true", help="print every failing model and its error")
    ap.add_argument("--show-opaque", action="store_true", help="print the reason of each opaque op type")
    args = ap.parse_args(argv)

    source, models = node_models()
    ok, failures = 0, {}
    per_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    opaque_reason: dict[str, str] = {}
    t0 = time.perf_counter()
    for name, model in models:
        # which op types the test exercises (top-level graph nodes)
        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
        node_types = collections.Counter(n.op_type for n in proto.graph.node if n.op_type != "Constant")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                g = capture_onnx(model, name=name)
        except CaptureError as e:
            failures[name] = str(e)
            for t in node_types:
                per_op[t]["failed"] += node_types[t]
            continue
        except Exception as e:  # a crash is a bug: report it as such
            failures[name] = f"CRASH {type(e).__name__}: {e}"
            for t in node_types:
                per_op[t]["crashed"] += node_types[t]
            continue
        ok += 1
        seen: collections.Counter = collections.Counter()
        for op in g.ops:
            if op.target in node_types:
                key = "opaque" if op.is_opaque else "modelled"
                per_op[op.target][key] += 1
                seen[op.target] += 1
                if op.is_opaque:
                    opaque_reason.setdefault(op.target, op.opaque_reason or "")
        for t, cnt in node_types.items():
            if cnt > seen[t]:
                per_op[t]["folded"] += cnt - seen[t]
    elapsed = time.perf_counter() - t0

    crashes = sum(1 for v in failures.values() if v.startswith("CRASH"))
    ops_modelled = sorted(t for t, c in per_op.items() if c["modelled"] and not c["opaque"])
    ops_partial = sorted(t for t, c in per_op.items() if c["modelled"] and c["opaque"])
    ops_opaque = sorted(t for t, c in per_op.items() if c["opaque"] and not c["modelled"])
    total = len(models)
    print(f"source: {source}")
    print(f"{'models':<28}{total:>8}")
    print(f"{'imported without error':<28}{ok:>8}  ({100 * ok / total:.1f}%)")
    print(f"{'failed (CaptureError)':<28}{len(failures) - crashes:>8}")
    print(f"{'crashed (bug)':<28}{crashes:>8}")
    print(f"{'op types seen':<28}{len(per_op):>8}")
    print(f"{'  always modelled':<28}{len(ops_modelled):>8}")
    print(f"{'  sometimes opaque':<28}{len(ops_partial):>8}")
    print(f"{'  always opaque':<28}{len(ops_opaque):>8}")
    print(f"{'time':<28}{elapsed:>7.1f}s")
    print()
    print(f"{'op type':<34}{'modelled':>9}{'opaque':>8}{'folded':>8}{'failed':>8}")
    for t in sorted(per_op, key=lambda t: (-per_op[t]["opaque"], t)):
        c = per_op[t]
        print(f"{t:<34}{c['modelled']:>9}{c['opaque']:>8}{c['folded']:>8}{c['failed'] + c['crashed']:>8}")
    if args.show_opaque:
        print()
        for t, why in sorted(opaque_reason.items()):
            print(f"opaque {t}: {why}")
    if args.show_failures:
        print()
        for name, why in sorted(failures.items()):
            print(f"FAIL {name}: {why}")

    result = {
        "source": source,
        "onnx_version": onnx.__version__,
        "models": total,
        "imported": ok,
        "import_rate": round(ok / total, 4),
        "failed": len(failures) - crashes,
        "crashed": crashes,
        "seconds": round(elapsed, 2),
        "op_types_always_modelled": ops_modelled,
        "op_types_sometimes_opaque": ops_partial,
        "op_types_always_opaque": ops_opaque,
        "per_op": {t: dict(c) for t, c in sorted(per_op.items())},
        "opaque_reasons": dict(sorted(opaque_reason.items())),
        "failures": dict(sorted(failures.items())),
    }
    zoo = zoo_report()
    print(f"\nwhole models shipped with onnx: {zoo['imported']}/{zoo['models']} imported, "
          f"{zoo['fully_modelled']} with no opaque op")
    print(f"{'model':<40}{'ops':>6}{'GFLOPs':>10}{'s':>7}  opaque")
    for r in zoo["rows"]:
        if r["ok"] and (r["ops"] > 20 or r["opaque"]):
            print(f"{r['model']:<40}{r['ops']:>6}{r['gflops']:>10.3f}{r['seconds']:>7.2f}  "
                  f"{', '.join(r['opaque'])}")
    for r in zoo["rows"]:
        if not r["ok"]:
            print(f"{r['model']:<40}  FAILED: {r['error'][:150]}")
    result["model_zoo"] = zoo
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {RESULTS}")
    return result


if __name__ == "__main__":
    main()
