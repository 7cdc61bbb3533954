"""Expert parallelism on a Mixtral-like MoE: the best plan with ``ep > 1`` against the best dense-equivalent
plan (``ep = 1``, every expert replicated over the data-parallel ranks), as the search prices them.

Rows: the tiny zoo Mixtral (4 experts, hidden 32) and a Mixtral-8x7B-like model (HF ``MixtralConfig``
defaults: 8 experts, top-2, hidden 4096, ffn 14336, 32 layers; ``--layers`` to shorten) built on the
``meta`` device, on ``dgx-a100x8`` (64 A100-80GB) in bf16. The ``ep`` plans are searched with
``placements="any"``: the torch backend does not execute expert parallelism, so they are planning only.

    nice .venv/bin/python benchmarks/moe_ep.py [--layers 32] [--seq 4096] [--batch 256]

Prints a table and writes ``benchmarks/results/moe_ep.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polyparallel.planning.plan_search import search
from tests.zoo import _HFLoss, hf_mixtral, lm_data


def mixtral_8x7b(layers: int) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(num_hidden_layers=layers)  # the 8x7B defaults otherwise
    with torch.device("meta"):
        return _HFLoss(MixtralForCausalLM(cfg), "input_ids")


def mixtral_8x7b_example() -> tuple[torch.nn.Module, tuple]:
    """``polyparallel search benchmarks.moe_ep:mixtral_8x7b_example``: the 32-layer model, one sequence of 4096."""
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    return mixtral_8x7b(32), (ids, ids)


def mixtral_tiny_example() -> tuple[torch.nn.Module, tuple]:
    """``polyparallel search benchmarks.moe_ep:mixtral_tiny_example``: the zoo's tiny Mixtral, one sequence."""
    ids, labels = lm_data(0)
    return hf_mixtral(), (ids[:1], labels[:1])


def row(name: str, model: torch.nn.Module, example: tuple, cluster: str, batch: int, ep: int | None) -> dict:
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = search(model, example, cluster, batch_size=batch,
                   constraints={"placements": "any", "dtype": "bf16", **({"ep": ep} if ep else {})})
    e = s.estimate
    return {"model": name, "cluster": cluster, "pinned_ep": ep, "dp": s.dp, "tp": s.tp, "pp": s.pp, "sp": s.sp,
            "ep": s.ep, "zero": s.zero_stage, "recompute": s.recompute, "microbatches": s.microbatches,
            "step_s": e.step_time_s, "samples_per_s": e.samples_per_s, "memory_gb": e.memory_bytes_max / 1e9,
            "breakdown_s": e.breakdown, "wall_s": time.perf_counter() - t0, "notes": s.search.notes[:2]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--cluster", default="dgx-a100x8")
    a = ap.parse_args()
    ids, labels = lm_data(0)
    tiny = hf_mixtral()
    big = mixtral_8x7b(a.layers)
    big_ex = (torch.zeros(1, a.seq, dtype=torch.long, device="meta"),
              torch.zeros(1, a.seq, dtype=torch.long, device="meta"))
    rows = []
    for name, model, ex, batch in (("mixtral-tiny", tiny, (ids[:1], labels[:1]), 64),
                                   (f"mixtral-8x7b-like L{a.layers} s{a.seq}", big, big_ex, a.batch)):
        for ep in (1, None):  # dense-equivalent best, then the free search (ep chosen)
            rows.append(row(name, model, ex, a.cluster, batch, ep))
            r = rows[-1]
            print(f"{r['model']:<32} {('ep=1 pinned' if ep else 'ep searched'):<12} dp{r['dp']} tp{r['tp']} "
                  f"pp{r['pp']} sp{r['sp']} ep{r['ep']} z{r['zero']} rc={r['recompute']} m={r['microbatches']}  "
                  f"step {r['step_s'] * 1e3:10.3f} ms  mem {r['memory_gb']:7.2f} GB  ({r['wall_s']:.0f} s)",
                  flush=True)
    out = Path(__file__).with_name("results") / "moe_ep.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"load": os.getloadavg(), "args": vars(a), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
