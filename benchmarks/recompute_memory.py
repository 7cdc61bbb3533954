"""Activation memory with recomputation: the memory model's bytes against what torch keeps.

For each model and recomputation mode (``none``, ``selective``, ``full``), one forward of the
micro-batch on this process with the torch backend's recomputation applied
(``backends/torch/_recompute.py``); *measured* is what the forward leaves alive for the backward
(:func:`~polyparallel.backends.torch._recompute.retained_activation_bytes`: every storage an ATen op
wrote that is still referenced, counted once), *predicted* the ``activations`` term the search
prices for the same graph (``ModelGraphs(model, args, kwargs).graph(b)``, ``estimate_step`` on
``local-cpu:1``, fp32, the planner's defaults). ``predicted (fused attention)`` prices the
attention op as torch's fused SDPA kernels run it (``fused_attention=True``: no score matrices),
which the planner does not do. Prints a table and writes ``benchmarks/results/recompute_memory.json``.

    .venv/bin/python benchmarks/recompute_memory.py
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("none", "selective", "full")


def hf_llama_training() -> Any:
    """``tests/zoo.py``'s HF LLaMA without its KV cache (HF keeps one in training unless told, as
    ``gradient_checkpointing_enable`` does; the cache would hold every layer's keys and values)."""
    from tests.zoo import ZOO

    m = ZOO["llama"][0]()
    m.model.config.use_cache = False
    return m


def models() -> dict[str, tuple[Callable[[], Any], Callable[[int], Any]]]:
    from polyparallel.backends.torch import _examples as ex
    from tests.zoo import ZOO

    return {"tiny-gpt": (ex.tiny_gpt, ex.gpt_data), "hf-llama": (hf_llama_training, ZOO["llama"][1])}


def predicted(model: Any, x: Any, y: Any, mode: str, fused_attention: bool = False) -> float:
    """The activation bytes the search prices for one micro-batch ``x`` of ``model`` under ``mode``."""
    from polyparallel.cluster import Cluster
    from polyparallel.cost_models.step import ParallelConfig, estimate_step
    from polyparallel.planning.model_graphs import ModelGraphs

    g = ModelGraphs(model, (x,), {"labels": y}).graph(int(x.shape[0]))
    est = estimate_step(g, Cluster.preset("local-cpu:1"),
                        ParallelConfig(recompute=mode, fused_attention=fused_attention))
    return est.memory[0].term("activations")


def measured(model_fn: Callable[[], Any], x: Any, y: Any, mode: str) -> int:
    """Bytes one forward leaves for the backward with ``mode`` applied as the torch backend applies it."""
    import torch

    import polyparallel as pp
    from polyparallel.backends.torch._recompute import apply_recompute, recompute_blocks, retained_activation_bytes

    torch.manual_seed(0)
    m = model_fn()
    blocks = recompute_blocks(pp.capture(m, (x, y))) if mode == "full" else ()
    apply_recompute(m, mode, blocks)
    return retained_activation_bytes(m, x, y)


def rows() -> list[dict[str, Any]]:
    out = []
    for name, (model_fn, data_fn) in models().items():
        x, y = data_fn(0)
        for mode in MODES:
            pred, meas = predicted(model_fn(), x, y, mode), measured(model_fn, x, y, mode)
            fused = predicted(model_fn(), x, y, mode, fused_attention=True)
            out.append({"model": name, "batch": int(x.shape[0]), "recompute": mode, "measured_bytes": meas,
                        "predicted_bytes": pred, "error": pred / meas - 1, "predicted_fused_attention_bytes": fused,
                        "error_fused_attention": fused / meas - 1})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "recompute_memory.json"))
    a = ap.parse_args()
    rs = rows()
    print(f"{'model':10} {'recompute':10} {'measured':>10} {'predicted':>10} {'error':>8} "
          f"{'pred (fused attn)':>18} {'error':>8}")
    for r in rs:
        print(f"{r['model']:10} {r['recompute']:10} {r['measured_bytes']:10d} {r['predicted_bytes']:10.0f} "
              f"{r['error']:+8.1%} {r['predicted_fused_attention_bytes']:18.0f} {r['error_fused_attention']:+8.1%}")
    Path(a.out).write_text(json.dumps({"device": "cpu", "dtype": "fp32", "rows": rs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
