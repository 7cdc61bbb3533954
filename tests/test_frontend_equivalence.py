"""The same model through the torch and the ONNX frontends gives the same FLOPs and parameters.

Each model is captured from its ``nn.Module`` (torch.export) and from its ONNX export,
with both exporters torch ships: the TorchScript one (``dynamo=False``) and the
torch.export-based one (``dynamo=True``). Exporter graph rewrites that change the
computation are switched off (``do_constant_folding=False`` / ``optimize=False``):
they fold BatchNorm into the preceding Conv, which removes parameters and FLOPs from
the ONNX model itself.
"""

from __future__ import annotations

import io
import math
import warnings

import onnx
import pytest
import torch
from torch import nn

from polyparallel.frontends.onnx import capture_onnx
from polyparallel.frontends.torch import capture_torch
from polyparallel.ir import Graph, OpKind

pytest.importorskip("onnxscript")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 16, 3, stride=2, groups=2)
        self.pool, self.gap, self.fc = nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn(self.c1(x))))
        return self.fc(torch.flatten(self.gap(torch.relu(self.c2(x))), 1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        h = self.heads
        q, k, v = (t.view(B, S, h, D // h).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(D, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D // h))
        att = torch.where(self.mask[:S, :S], att, float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, S, D))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT with tied input/output embeddings, attention written out with matmuls."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, seq: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, seq) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("pos", torch.arange(seq))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(self.pos[: idx.shape[1]])
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def _export(model: nn.Module, args: tuple, exporter: str) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            return torch.onnx.export(model, args, dynamo=True, optimize=False, verbose=False).model_proto
        buf = io.BytesIO()
        torch.onnx.export(model, args, buf, dynamo=False, do_constant_folding=False)
        return onnx.load_from_string(buf.getvalue())


def _both(model: nn.Module, args: tuple, exporter: str) -> tuple[Graph, Graph]:
    model.eval()
    torch.manual_seed(0)
    gt = capture_torch(model, args, None)
    go = capture_onnx(_export(model, args, exporter))
    return gt, go


HEAVY = (OpKind.CONTRACTION, OpKind.ATTENTION, OpKind.CONV, OpKind.NORM, OpKind.SOFTMAX)


MODELS = {
    "mlp": (MLP, lambda: (torch.randn(4, 16),)),
    "cnn": (CNN, lambda: (torch.randn(2, 3, 16, 16),)),
    "gpt": (GPT, lambda: (torch.randint(0, 64, (2, 8)),)),
}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_same_flops_and_params(model: str, exporter: str):
    cls, make_args = MODELS[model]
    m = cls()
    gt, go = _both(m, make_args(), exporter)
    trained = {id(p): p.numel() for p in m.parameters()}  # tied weights counted once
    assert gt.param_count() == go.param_count() == sum(trained.values())
    assert go.flops() == gt.flops()
    assert not gt.opaque_ops() and not go.opaque_ops()
    # the expensive ops are recognised on both sides, with equal FLOPs
    for kind in HEAVY:
        assert sum(op.flops for op in gt.ops if op.kind is kind) == sum(op.flops for op in go.ops if op.kind is kind)
    # ... and are attributed to the same modules
    paths = [sorted((str(op.kind), op.module) for op in g.ops if op.kind in HEAVY) for g in (gt, go)]
    assert paths[0] == paths[1]


def _hf_model(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = {"num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 32}
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=16,
                                      use_cache=False)
        return transformers.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_key_value_heads=2, use_cache=False,
                                       **small)
        return transformers.LlamaForCausalLM(cfg)
    return transformers.BertModel(transformers.BertConfig(hidden_size=32, intermediate_size=64, **small))


def _flops_by_kind(g: Graph) -> dict[OpKind, int]:
    out: dict[OpKind, int] = {}
    for op in g.ops:
        out[op.kind] = out.get(op.kind, 0) + op.flops
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hf_models_same_ir_at_opset_23(name: str):
    """transformers models exported at opset 23, where sdpa becomes ONNX ``Attention``.

    Parameters, and the FLOPs and module paths of every matmul, attention and norm
    agree exactly. The totals differ only by the torch-side count of eval-mode dropout
    and of the attention-mask arithmetic on constants that ONNX evaluates at export.
    """
    m = _hf_model(name)
    m.eval()
    args = (torch.randint(0, 100, (2, 8)),)
    gt = capture_torch(m, args, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        go = capture_onnx(torch.onnx.export(m, args, dynamo=True, optimize=False, opset_version=23).model_proto)
    assert gt.param_count() == go.param_count() == sum(p.numel() for p in m.parameters())
    assert not go.opaque_ops()
    kt, ko = _flops_by_kind(gt), _flops_by_kind(go)
    for kind in HEAVY:
        assert kt.get(kind, 0) == ko.get(kind, 0), kind
    assert ko[OpKind.ATTENTION] > 0
    paths = [sorted((str(op.kind), op.module) for op in g.ops if op.kind in HEAVY) for g in (gt, go)]
    assert paths[0] == paths[1]
    assert abs(go.flops() - gt.flops()) <= 0.02 * gt.flops()


@pytest.mark.slow
def test_hf_gpt2_decomposed_attention():
    """At the default opset the exporter writes sdpa out as MatMul / Softmax / mask ops.

    The two attention matmuls of the torch side's ATTENTION op are then ONNX MatMuls:
    all matmul FLOPs still agree exactly; the softmax and masking are spent differently
    (scale multiplications, mask addition, a NaN guard), so totals agree to 2%.
    """
    m = _hf_model("gpt2")
    gt, go = _both(m, (torch.randint(0, 100, (2, 8)),), "dynamo")
    assert gt.param_count() == go.param_count() == sum(p.numel() for p in m.parameters())
    assert not go.opaque_ops()
    sdpa_matmuls = sum(op.nest.points(st) * st.flops_per_point for op in gt.ops if op.kind is OpKind.ATTENTION
                       for st in op.nest.statements if st.name in ("scores", "pv"))
    torch_mm = sum(op.flops for op in gt.ops if op.kind is OpKind.CONTRACTION) + sdpa_matmuls
    onnx_mm = sum(op.flops for op in go.ops if op.kind is OpKind.CONTRACTION)
    assert sdpa_matmuls > 0 and torch_mm == onnx_mm
    assert abs(go.flops() - gt.flops()) <= 0.02 * gt.flops()
