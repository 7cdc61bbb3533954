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
    heavy = (OpKind.CONTRACTION, OpKind.CONV, OpKind.NORM, OpKind.SOFTMAX)
    for kind in heavy:
        assert sum(op.flops for op in gt.ops if op.kind is kind) == sum(op.flops for op in go.ops if op.kind is kind)


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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hf_models_through_both_frontends(name: str):
    """transformers models: same parameters and matmul FLOPs; the attention differs by design.

    torch.export keeps ``scaled_dot_product_attention`` whole (one ATTENTION op whose
    loop nest holds the two matmuls and a fused masked softmax); the ONNX exporter
    writes it out as scale multiplications, two MatMuls, a mask addition, Softmax and a
    NaN guard (IsNaN/Where). The matmuls must agree exactly; the totals only up to the
    few elementwise FLOPs per score that each decomposition spends differently.
    """
    m = _hf_model(name)
    gt, go = _both(m, (torch.randint(0, 100, (2, 8)),), "dynamo")
    assert gt.param_count() == go.param_count() == sum(p.numel() for p in m.parameters())
    assert not go.opaque_ops()
    sdpa_matmuls = sum(op.nest.points(st) * st.flops_per_point for op in gt.ops if op.kind is OpKind.ATTENTION
                       for st in op.nest.statements if st.name in ("scores", "pv"))
    torch_mm = sum(op.flops for op in gt.ops if op.kind is OpKind.CONTRACTION) + sdpa_matmuls
    onnx_mm = sum(op.flops for op in go.ops if op.kind is OpKind.CONTRACTION)
    assert sdpa_matmuls > 0 and torch_mm == onnx_mm
    assert abs(go.flops() - gt.flops()) <= 0.02 * gt.flops()
