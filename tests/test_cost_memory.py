"""Memory model against configurations computed by hand."""

from __future__ import annotations

import pytest

from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, device_memory, estimate_step
from polyparallel.cost_models.synthetic import mlp_graph

B = 32
PARAMS = (64 * 128 + 128) + (128 * 128 + 128) + (128 * 10 + 10)


def node(p: int, memory: str = "80 GB") -> Cluster:
    return Cluster.from_dict({"name": "n", "device_types": {"chip": {
        "peak": {"fp32": "50 TFLOP/s", "bf16": "400 TFLOP/s"}, "memory": memory, "memory_bandwidth": "2 TB/s"}},
        "centers": [{"name": "c", "nodes": [{"device": "chip", "devices_per_node": p,
                                             "intra": {"bandwidth": "100 GB/s", "latency": "5 us"}}]}]})


def graph():
    return mlp_graph(batch=B, widths=(64, 128, 128), classes=10)


def test_mixed_precision_adam_is_16_bytes_per_param():
    r = device_memory(label="x", device="d", capacity=1e12, params=1e9, dp=4, zero_stage=0, param_dtype="bf16",
                      optimizer="adam", activations=0)
    assert r.total == 16e9
    z = [device_memory(label="x", device="d", capacity=1e12, params=1e9, dp=4, zero_stage=s, param_dtype="bf16",
                       optimizer="adam", activations=0).total for s in (1, 2, 3)]
    assert z == [4e9 + 12e9 / 4, 2e9 + (2e9 + 12e9) / 4, 16e9 / 4]


def test_known_config_by_hand():
    g = graph()
    assert g.param_count() == PARAMS
    e = estimate_step(g, node(2), ParallelConfig(dp=2, zero_stage=1, optimizer="adam", dtype="fp32"))
    m = e.memory[0]
    # fp32 Adam: weights 4 (gathered by FSDP2, whose 4 / dp shards stay allocated: no master copy
    # in fp32), grads 4, two moments 8 sharded over dp=2
    assert m.term("weights") == 4 * PARAMS + 4 * PARAMS / 2 and m.term("gradients") == 4 * PARAMS
    assert m.term("optimizer") == 8 * PARAMS / 2
    # what autograd saves, per row: each relu's output (which the next linear saves as its input;
    # relu's backward needs only its output, so the pre-activations are freed) and the logits the
    # loss keeps (its log-softmax); the returned loss is the caller's
    assert m.term("activations") == 4 * B * (128 * 2 + 10)
    # GPipe over 2 stages with 4 micro-batches keeps all 4 alive on both stages; stage 1 also holds
    # the activation it received (relu_2's output, B x 128) until its gradient is sent back
    e2 = estimate_step(g, node(2), ParallelConfig(pp=2, microbatches=4, schedule="gpipe"))
    assert [r.in_flight for r in e2.memory] == [4, 4]
    total_act = sum(r.term("activations") for r in e2.memory) / 4
    assert total_act == pytest.approx(4 * B * (128 * 2 + 10) + 4 * B * 128)


def test_full_recompute_keeps_layer_inputs():
    e = estimate_step(graph(), node(1), ParallelConfig(recompute="full", fused_elementwise=True))
    m = e.memory[0]
    # layer inputs: x, relu0, relu1 (fp32); the loss is outside the layers, so it keeps the logits
    # it reads from the last, recomputed layer (the labels and the returned loss are the caller's)
    assert m.term("activations") == 4 * (B * 64 + B * 128 + B * 128 + B * 10)
    assert m.term("workspace") == 4 * B * 128  # what one hidden layer saves when recomputed: its relu's output


def test_why_names_the_overflowing_term_and_device():
    e = estimate_step(mlp_graph(batch=4096, widths=(1024, 1024, 1024)), node(2, memory="40 MB"),
                      ParallelConfig(pp=2, microbatches=8, schedule="gpipe"))
    assert not e.fits
    why = e.why_not_fit()
    assert why and "stage 0" in why[0] and "does not fit" in why[0]
    assert "largest term activations" in why[0] and "8 micro-batches in flight" in why[0]


@pytest.mark.parametrize(("fused_loss", "eager", "want"), [
    (None, True, 12 - 2),   # torch's upcast loss: fp32 log-probabilities, their gradient and the logits'
    (True, True, 2),        # flash-attn's fused kernel: the logits' gradient at their width
    (None, False, 0),       # Megatron's in-place vocabulary-parallel loss (fused_elementwise)
    (False, False, 12 - 2),
])
def test_loss_workspace_by_kernel(fused_loss, eager, want):
    """The cross entropy's backward peak beyond the 16-bit logits the activations count, in bytes per
    logit, by hand: N = 4 x 32 x 1000 logits of a captured Linear + cross entropy."""
    import torch

    from polyparallel.cost_models.activations import loss_transient
    from polyparallel.frontends.torch import capture_torch

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = torch.nn.Linear(16, 1000)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.out(x).flatten(0, 1), y.flatten())

    g = capture_torch(Head(), (torch.zeros(4, 32, 16), torch.zeros(4, 32, dtype=torch.long)))
    cfg = ParallelConfig(dtype="bf16", fused_loss=fused_loss)
    n = 4 * 32 * 1000
    assert loss_transient(g, cfg, 1, eager).get(0, 0.0) == want * n


@pytest.mark.parametrize(("cluster", "dtype", "per_element"), [("dgx-a100", "bf16", 1), ("local-cpu:1", "fp32", 4)])
def test_a_dropout_keeps_its_mask(cluster, dtype, per_element):
    """Linear -> dropout -> Linear: the dropout adds its mask to what the backward keeps, one byte per
    element on an accelerator (native_dropout's boolean mask), the compute width on a CPU (torch's
    CPU dropout multiplies by a float noise tensor); a dropout with p=0 is no op at all."""
    import torch

    from polyparallel.frontends.torch import capture_torch
    from polyparallel.transforms import canonicalize, fuse_elementwise

    class Net(torch.nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.a, self.b, self.p = torch.nn.Linear(16, 64), torch.nn.Linear(64, 8), p

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.nn.functional.dropout(self.a(x), self.p, True))

    def activations(p: float) -> float:
        g = fuse_elementwise(canonicalize(capture_torch(Net(p), (torch.zeros(32, 16),))))
        est = estimate_step(g, Cluster.preset(cluster), ParallelConfig(dtype=dtype))
        return est.memory[0].term("activations")

    assert activations(0.1) - activations(0.0) == 32 * 64 * per_element
