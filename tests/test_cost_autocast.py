"""Eager ``torch.autocast`` mixed precision as the step model prices it on accelerators
(:func:`polyparallel.cost_models.compute.autocast_seconds`): the tensors' widths as torch holds them
(``activations.sent_widths``), each cast kernel autocast adds, and the wider operands of the ops it leaves
in fp32, checked by hand on captured modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, estimate_step
from polyparallel.cost_models.activations import sent_widths as _sent_widths
from polyparallel.cost_models.compute import (
    BACKWARD_FACTOR,
    DEFAULT_BACKWARD_FACTOR,
    autocast_seconds,
    streaming_bandwidth,
)
from polyparallel.ir import OpKind

GPU = Cluster.preset("dgx-a100").device(0).type
T, H = 262144, 1024  # tokens, width: the kernels outlast their host dispatch (captured on meta)
B = T * H // (4 * 32 * 32)


class _Block(nn.Module):
    """fp32 input -> layer norm -> linear (no bias) -> + residual -> batch norm -> conv -> loss."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.fc = nn.Linear(H, H, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        y = x + self.fc(self.ln(x))
        z = self.conv(self.bn(y.view(B, 4, 32, 32)))
        return nn.functional.cross_entropy(z.flatten(1), labels)


def _graph():
    with torch.device("meta"):
        return pp.capture(_Block(), (torch.zeros(T, H),), {"labels": torch.zeros(B, dtype=torch.long)})


def test_widths_follow_autocast_lists():
    g = _graph()
    w = _sent_widths(g, "bf16", False)
    by_target = {op.target.split(".")[1]: op for op in g.ops}
    width = {name: w[op.outputs[0]] for name, op in by_target.items()}
    assert width["layer_norm"] == 4  # autocast's fp32 list
    assert width["linear"] == 2  # its lower-precision list
    assert width["add"] == 4  # bf16 + fp32 promotes
    assert width["batch_norm"] == 4  # cuDNN keeps its (fp32) input's dtype
    assert width["conv2d"] == 2
    assert width["cross_entropy_loss"] == 4


def test_casts_and_wide_operands_by_hand():
    g = _graph()
    w = _sent_widths(g, "bf16", False)
    bw, launch = streaming_bandwidth(GPU), GPU.launch_overhead
    ops = {op.target.split(".")[1]: op for op in g.ops}

    def cast(n: float) -> float:
        return max(n * 6 / bw, launch)  # one kernel reading fp32 and writing bf16, or the reverse

    # the linear casts its fp32 input (the layer norm's output) and its fp32 weight: each a kernel
    # forward and its gradient's cast back in the backward
    fc = autocast_seconds(g, ops["linear"], GPU, "bf16", w)
    assert fc == pytest.approx((cast(T * H) + cast(H * H),) * 2)
    # the layer norm streams its fp32 input and output: 2 extra bytes each, κ times backward
    ln = autocast_seconds(g, ops["layer_norm"], GPU, "bf16", w)
    kb = BACKWARD_FACTOR.get(OpKind.NORM, DEFAULT_BACKWARD_FACTOR)
    assert ln == pytest.approx((4 * T * H / bw, kb * 4 * T * H / bw))
    # the conv casts its fp32 input (the batch norm kept the residual stream's fp32) and its weight
    conv = autocast_seconds(g, ops["conv2d"], GPU, "bf16", w)
    assert conv == pytest.approx((cast(T * H) + cast(4 * 4 * 9),) * 2)
    # fp32 itself adds nothing
    assert autocast_seconds(g, ops["linear"], GPU, "fp32", _sent_widths(g, "fp32", False)) == (0.0, 0.0)


def test_only_eager_16_bit_accelerator_steps_pay_autocast():
    g = _graph()
    gpu, cpu = Cluster.preset("dgx-a100"), Cluster.preset("local-cpu:1")
    w = _sent_widths(g, "bf16", False)
    want = sum(sum(autocast_seconds(g, op, GPU, "bf16", w)) for op in g.ops)
    assert want > 0

    def compute(cl, **kw):
        return estimate_step(g, cl, ParallelConfig(**kw)).stages[0].part("compute")

    eager = compute(gpu, dtype="bf16", fused_elementwise=False)
    fused = compute(gpu, dtype="bf16", fused_elementwise=True)  # hand-fused 16-bit (Megatron): no autocast
    # (this graph has no fused elementwise chains, so the casts and wide operands are the whole difference;
    # a memo keyed without ``fused_elementwise`` once returned the eager price for both)
    assert eager - fused == pytest.approx(want, rel=1e-9)
    # the same eager step at fp32 has no casts; a CPU step is calibrated or priced as it is
    assert compute(cpu, dtype="bf16", fused_elementwise=False) == compute(cpu, dtype="bf16", fused_elementwise=True)


def test_defaults_price_what_the_torch_backend_runs():
    """ParallelConfig's defaults are the torch backend's execution: on an accelerator eager kernels under
    autocast, scaled_dot_product_attention as torch's fused kernel (its math kernel only when asked);
    on a CPU the calibrated prices, which measured eager steps already."""
    from polyparallel.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=512, seq=2048, layers=2, hidden=1024, heads=8))  # device-bound, not host-bound
        ids = torch.zeros(8, 2048, dtype=torch.long)
        g = pp.capture(model, (ids,), {"labels": ids})
    gpu, cpu = Cluster.preset("dgx-a100"), Cluster.preset("local-cpu:1")

    def step(cl, **kw):
        return estimate_step(g, cl, ParallelConfig(dtype="bf16", **kw)).step_time

    assert step(gpu) == step(gpu, fused_elementwise=False, fused_attention=True)  # every attention op is SDPA
    assert step(gpu, fused_attention=False) > 1.2 * step(gpu)  # the math kernel, in fp32
    assert step(gpu, fused_elementwise=True) < step(gpu)  # no casts, no elementwise kernels of their own
    assert step(cpu) == step(cpu, fused_elementwise=True)


def test_the_search_says_how_it_priced_an_accelerator_step():
    from polyparallel.backends.torch import _examples as ex

    x, y = ex.gpt_data(0)
    notes = {cl: " ".join(pp.search(ex.tiny_gpt(), (x,), cl, example_kwargs={"labels": y}, batch_size=ex.BATCH,
                                    constraints={"dp": 1, "tp": 1, "pp": 1, "sp": 1, "devices": 1}).search.notes)
             for cl in ("dgx-a100x1", "local-cpu:1")}
    assert "torch.autocast" in notes["dgx-a100x1"] and "fused kernel" in notes["dgx-a100x1"]
    assert "torch.autocast" not in notes["local-cpu:1"]
