"""The step model against published large-model training runs (``benchmarks/cost_validation.py
--part published``): each row's recipe re-priced on its cluster preset, compared with the per-GPU
throughput its source published. The bounds are issue 21's: every row within ±25%, at least 80% of
the rows within ±15%. No figure of the model is fitted to these rows, so a change to the cost model
that moves one out of bounds shows here, with the row that moved."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cost_validation import PUBLISHED, run_published

pytestmark = pytest.mark.slow  # minutes of pricing: the second tier (make test runs both)


def test_published_runs_within_bounds(capsys):
    rows = run_published()
    capsys.readouterr()
    assert len(rows) == len(PUBLISHED) >= 24
    errors = {r["name"]: round(100 * r["error"], 1) for r in rows}
    assert all(abs(e) <= 25 for e in errors.values()), errors
    assert sum(abs(e) <= 15 for e in errors.values()) >= 0.8 * len(rows), errors


def _sharded(prefix: str) -> dict[str, dict]:
    from benchmarks.published_sharded import sharded_rows

    return {r["name"]: r for r in run_published([c for c in sharded_rows() if c["name"].startswith(prefix)])}


def test_fsdp2_runs_held_out_within_15pct(capsys):
    """torchtitan's FSDP2 recipes on 64 A100 (Llama 2 13B/70B, Llama 3 8B/70B; no recomputation,
    the operator policy, full), held out of every change this table prompted: each within ±15%."""
    rows = _sharded("torchtitan Llama 2") | _sharded("torchtitan Llama 3 ")
    capsys.readouterr()
    a100 = {k: r for k, r in rows.items() if "A100" in k}
    assert len(a100) == 6 and all(r["held_out"] for r in a100.values())
    errors = {k: round(100 * r["error"], 1) for k, r in a100.items()}
    assert all(abs(e) <= 15 for e in errors.values()), errors


def test_fsdp_scaling_and_compilation_priced_as_measured(capsys):
    """What the measurements change between recipes, priced: torch.compile speeds Llama 3.1 8B's FSDP2
    step up 16% on 8 and on 128 H100, and 128 GPUs lose 3% against 8 (torchtitan); MPT-13B holds its
    throughput from 16 to 128 A100 40GB (FSDP1, micro-batches 10-16). Each ratio within 3 points of
    the measured one (the H100 rows' absolute error, +20..+22%, is the platform's: see the README)."""
    tt = _sharded("torchtitan Llama 3.1")
    mpt = _sharded("MPT-13b s2048")
    capsys.readouterr()

    def ratio(a: str, b: str, rows: dict) -> tuple[float, float]:
        ra, rb = rows[a], rows[b]
        return (ra["published_per_gpu"] / rb["published_per_gpu"], ra["predicted_per_gpu"] / rb["predicted_per_gpu"])

    for gpus in (8, 128):
        pub, pred = ratio(f"torchtitan Llama 3.1 8B rc=op compiled ({gpus} H100)",
                          f"torchtitan Llama 3.1 8B rc=op ({gpus} H100)", tt)
        assert abs(pred - pub) <= 0.03, (gpus, pub, pred)
    pub, pred = ratio("torchtitan Llama 3.1 8B rc=op (128 H100)", "torchtitan Llama 3.1 8B rc=op (8 H100)", tt)
    assert abs(pred - pub) <= 0.03, (pub, pred)
    a40 = [r for k, r in mpt.items() if "A100 40GB" in k and r["gpus"] >= 16]
    assert len(a40) == 4
    spread = [max(r[k] for r in a40) / min(r[k] for r in a40) for k in ("published_per_gpu", "predicted_per_gpu")]
    assert spread[0] < 1.03 and spread[1] < 1.03, spread


def test_published_long_sequence_runs_fit_their_memory(capsys):
    """Every MPT-7B run the llm-foundry tables published (sequences 1k-64k, 8 GPUs of 40 or 80 GB)
    ran, so its recipe must fit: priced with the fused cross entropy llm-foundry trains with
    (``fused_loss``), none is over its GPU's memory. torch's upcast loss on the same logits
    (``fused_loss=False``) would not fit at 8k on 80 GB: the workspace of 8 x 8192 x 50432 fp32
    log-probabilities and their gradients (measured fitting; the issue's 81.1 GB)."""
    from benchmarks.published_sharded import sharded_rows

    cases = [c for c in sharded_rows() if c["name"].startswith("MPT-7b") and "(8 " in c["name"]]
    rows = run_published(cases)
    capsys.readouterr()
    assert len(rows) >= 10 and all(not r["does_not_fit"] for r in rows), [r["name"] for r in rows if r["does_not_fit"]]
    s8k = next(c for c in cases if c["name"] == "MPT-7b s8192 (8 H100 80GB)")
    eager = run_published([{**s8k, "config": {**s8k["config"], "fused_loss": False}}])
    capsys.readouterr()
    assert eager[0]["does_not_fit"]


def test_mpt_h100_rows_priced_with_their_2023_attention_kernel(capsys):
    """llm-foundry's H100 table (Oct 2023) ran flash-attn 1.x's Triton kernel (``attn_impl: triton``),
    priced at FlashAttention v1's published H100 rates (``attention_kernel="fa1"``): the 8-GPU rows at
    sequence 2048 (760M-30B) each within ±20% of the published tokens/s/GPU (with the device's own
    attention rows, the H200's torch 2.11 cuDNN kernel, they were priced +18..+50%)."""
    from benchmarks.published_sharded import sharded_rows

    cases = [c for c in sharded_rows() if c["name"].startswith("MPT-") and " s2048 (8 H100" in c["name"]]
    assert len(cases) == 5 and all(c["config"]["attention_kernel"] == "fa1" for c in cases)
    rows = run_published(cases)
    capsys.readouterr()
    errors = {r["name"]: round(100 * r["error"], 1) for r in rows}
    assert all(abs(e) <= 20 for e in errors.values()), errors
