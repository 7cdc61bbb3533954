"""Fused attention on an uncalibrated H100/H200: priced by the H200's measured flash-attention rows
(``HOPPER_ATTENTION_ROWS``), read back from the calibration file they were copied from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyparallel import ops
from polyparallel.cluster import Cluster
from polyparallel.cost_models.compute import COMPUTE_EFFICIENCY, op_cost
from polyparallel.ir import Graph, Op, OpKind, TensorKind, TensorSpec

CAL = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/calibration_h200-sxm.json").read_text())


def _causal_attention(b: int, h: int, s: int, d: int) -> tuple[Graph, Op]:
    g = Graph("att")
    for n in ("q", "k", "v"):
        g.add_tensor(TensorSpec(n, (b, h, s, d), "bfloat16", TensorKind.INPUT))
    g.add_tensor(TensorSpec("o", (b, h, s, d), "bfloat16"))
    op = g.add_op(Op("att", OpKind.ATTENTION, "sdpa", ("q", "k", "v"), ("o",),
                     ops.attention((b, h, s, d), (b, h, s, d), (b, h, s, d), causal=True)))
    return g, op


@pytest.mark.parametrize("row", CAL["attention"]["bf16"][-2:], ids=lambda r: "x".join(map(str, r["shape"])))
def test_uncalibrated_h100_prices_fused_attention_by_the_h200_rows(row):
    g, op = _causal_attention(*row["shape"])
    # the IR counts the unmasked half as calibrate did (plus the softmax's few FLOPs per score)
    assert op.flops == pytest.approx(row["flops"], rel=1e-2)
    for preset in ("dgx-h100", "dgx-h200"):
        c = op_cost(g, op, Cluster.preset(preset).device(0).type, "bf16", fused=True)
        assert c.forward == pytest.approx(row["forward_s"], rel=2e-2)
        assert c.backward == pytest.approx(row["backward_s"], rel=2e-2)


def test_other_gpus_keep_the_flat_attention_figure():
    g, op = _causal_attention(2, 32, 8192, 128)
    a100 = Cluster.preset("dgx-a100").device(0).type
    c = op_cost(g, op, a100, "bf16", fused=True)
    assert c.forward == pytest.approx(op.flops / (a100.peak_flops("bf16") * COMPUTE_EFFICIENCY[OpKind.ATTENTION]))
