"""Graph transforms on the built-in example models: time and effect of each step.

For every model: capture (meta device for the large ones), then ``canonicalize``,
``fuse_elementwise``, ``find_repeated_blocks``, ``layer_chain`` and an 8-stage
``balance`` (cost = FLOPs). Reports op counts before and after, views folded and kept,
elementwise ops absorbed, the repeated blocks found (count × ops per instance), and the
wall time of each step. Checks on the way that canonicalisation kept the FLOPs of the
remaining ops and the parameter count.

Run: ``.venv/bin/python benchmarks/transforms.py [MODEL ...]`` (default: gpt-tiny,
hf-gpt2, hf-llama, hf-bert, gpt2-small, llama-1b, resnet50, gpt3-175b). Writes
``benchmarks/results/transforms.json``.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

import polyparallel as pp
from polyparallel.models import load_model
from polyparallel.transforms import balance, canonicalize, find_repeated_blocks, fuse_elementwise, history, layer_chain

RESULTS = Path(__file__).parent / "results" / "transforms.json"
DEFAULT = ["gpt-tiny", "hf-gpt2", "hf-llama", "hf-bert", "gpt2-small", "llama-1b", "resnet50", "gpt3-175b"]


def _timed(fn: Any, *args: Any, **kw: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t


def measure(name: str) -> dict[str, Any]:
    model, args, kwargs = load_model(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g, t_cap = _timed(pp.capture, model, args, kwargs)
    c, t_can = _timed(canonicalize, g)
    rec = history(c)[-1]
    kept_flops = sum(op.flops for op in g.ops if op.name not in set(rec.dropped))
    assert c.flops() == kept_flops, f"{name}: canonicalize changed FLOPs"
    assert c.param_count() == g.param_count(), f"{name}: canonicalize changed parameters"
    f, t_fuse = _timed(fuse_elementwise, c)
    blocks, t_blk = _timed(find_repeated_blocks, f)
    chain, t_chain = _timed(layer_chain, f, blocks=blocks)
    segs, t_bal = _timed(balance, f, min(8, len(f.ops)), lambda op: float(op.flops), blocks=blocks)
    total = sum(s.cost for s in segs)
    return {
        "model": name,
        "ops": len(g.ops),
        "ops_canonical": len(c.ops),
        "ops_fused": len(f.ops),
        "dropped": len(rec.dropped),
        "views_folded": len(rec.folded),
        "views_kept": len(rec.kept),
        "dims_split": rec.split_dims,
        "absorbed": sum(len(a) for _, a in history(f)[-1].fused),
        "blocks": [f"{b.count}x{b.length}" for b in blocks],
        "layers": len(chain),
        "balance_max_over_mean": max(s.cost for s in segs) / (total / len(segs)) if total else 1.0,
        "t_capture_s": t_cap,
        "t_canonicalize_s": t_can,
        "t_fuse_s": t_fuse,
        "t_blocks_s": t_blk,
        "t_layer_chain_s": t_chain,
        "t_balance_s": t_bal,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=DEFAULT)
    rows = [measure(m) for m in ap.parse_args().models]
    cols = ["model", "ops", "ops_canonical", "ops_fused", "views_folded", "views_kept", "absorbed", "blocks",
            "layers", "balance_max_over_mean", "t_canonicalize_s", "t_fuse_s", "t_blocks_s", "t_balance_s"]
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else ",".join(v) if isinstance(v, list) else str(v)  # noqa: E731
    table = [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for t in table:
        print("  ".join(v.rjust(w) for v, w in zip(t, widths)))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
