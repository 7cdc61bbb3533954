"""Capture time and IR size of large models on the meta device.

Target (issue 2): GPT-3 175B captured in <= 15 s on the 2-core development machine. Each model is
captured twice: as ``pp.capture`` does by default (a stack of alike blocks traced three blocks deep,
``frontends/_fold.py``) and with every block traced (``POLYPARALLEL_FOLD=0``); both graphs must be
equal. Times are CPU seconds of this process (``time.process_time``), so other work on the machine
moves them little.

    .venv/bin/python benchmarks/capture.py            # prints a table, writes results/capture.json
"""

from __future__ import annotations

import json
import os
import platform
import time
import warnings
from pathlib import Path

import torch

import polyparallel as pp
from polyparallel.models import EXAMPLES

CASES = [("gpt2-small", 8, 1024), ("llama-1b", 4, 2048), ("llama-8b", 1, 8192), ("gpt3-175b", 1, 2048),
         ("resnet50", 32, None)]


def main() -> None:
    rows = []
    for name, batch, seq in CASES:
        t0 = time.perf_counter()
        model, args, kwargs = EXAMPLES[name].build(batch, seq)
        t1 = time.perf_counter()
        times, graphs = {}, {}
        for mode in ("0", "1", "0"):  # the first capture of a model pays one-off costs: a warm-up
            os.environ["POLYPARALLEL_FOLD"] = mode
            c = time.process_time()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graphs[mode] = pp.capture(model, args, kwargs)
            times[mode] = time.process_time() - c
        os.environ.pop("POLYPARALLEL_FOLD")
        g = graphs["1"]
        assert g == graphs["0"], f"{name}: the folded capture differs from the full one"
        sigs = {g.signature(op) for op in g.ops}
        s = g.summary()
        rows.append({"model": name, "batch": batch, "seq": seq, "build_s": round(t1 - t0, 3),
                     "capture_cpu_s": round(times["1"], 3), "capture_full_cpu_s": round(times["0"], 3),
                     "ops": s["ops"], "tensors": s["tensors"],
                     "distinct_signatures": len(sigs), "params": s["params"], "forward_flops": s["flops"],
                     "opaque": s["opaque"]})
    hdr = (f"{'model':12s} {'capture s':>9s} {'unfolded':>8s} {'ops':>6s} {'tensors':>8s} {'signatures':>10s} "
           f"{'params':>10s} {'fwd FLOPs':>10s}")
    print(hdr)
    for r in rows:
        print(f"{r['model']:12s} {r['capture_cpu_s']:9.2f} {r['capture_full_cpu_s']:8.2f} {r['ops']:6d} "
              f"{r['tensors']:8d} {r['distinct_signatures']:10d} "
              f"{r['params'] / 1e9:9.3f}B {r['forward_flops'] / 1e12:9.1f}T")
    out = Path(__file__).parent / "results" / "capture.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": {"cpu_count": torch.get_num_threads(), "python": platform.python_version(),
                                           "torch": torch.__version__, "load_average": os.getloadavg()},
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
