"""Torch frontend: shapes, parameters and FLOPs of captured graphs against independent counts."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import polyparallel as pp
from polyparallel.frontends import CaptureError, OpaqueOpWarning
from polyparallel.ir import OpKind, TensorKind
from polyparallel.models import GPT, GPTConfig, Llama, LlamaConfig, SmallCNN


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_mlp_flops_and_params_closed_form():
    B, dims = 16, (32, 64, 10)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    g = pp.capture(m, (torch.randn(B, 32),))
    assert g.param_count() == n_params(m) == 32 * 64 + 64 + 64 * 10 + 10
    mac = sum(2 * B * a * b + B * b for a, b in itertools.pairwise(dims))  # matmul + bias
    relu = B * 64
    assert g.flops() == mac + relu
    assert [op.kind for op in g.ops] == [OpKind.CONTRACTION, OpKind.ELEMENTWISE, OpKind.CONTRACTION]
    assert {t.origin for t in g.params} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert g.tensors[g.inputs[0]].kind is TensorKind.INPUT


def test_cnn_shapes_match_eager_torch():
    m = SmallCNN()
    x = torch.randn(4, 1, 28, 28)
    g = pp.capture(m, (x,))
    convs = [op for op in g.ops if op.kind is OpKind.CONV]
    assert len(convs) == 2
    # independent: FLOPs of each conv from eager output shapes
    out1 = m.conv1(x)
    out2 = m.conv2(F.max_pool2d(F.relu(m.bn1(out1)), 2))
    expect = 2 * out1.numel() * 1 * 9 + out1.numel() + 2 * out2.numel() * 16 * 9 + out2.numel()
    assert sum(op.flops for op in convs) == expect
    assert g.shape(convs[1].outputs[0]) == tuple(out2.shape)
    assert g.param_count() == n_params(m)


def test_gpt_matmul_flops_equal_two_flops_per_weight_per_token():
    c = GPTConfig(vocab=128, seq=32, layers=2, hidden=64, heads=4)
    m = GPT(c)
    B, S = 2, 32
    ids = torch.zeros(B, S, dtype=torch.long)
    g = pp.capture(m, (ids,), {"labels": ids})
    assert g.param_count() == n_params(m)  # lm_head tied to wte: counted once
    per_layer_w = 4 * c.hidden * c.hidden + 2 * c.mlp_ratio * c.hidden * c.hidden
    per_layer_b = 3 * c.hidden + c.hidden + c.mlp_ratio * c.hidden + c.hidden
    mm = sum(op.flops for op in g.ops if op.kind is OpKind.CONTRACTION)
    assert mm == B * S * (c.layers * (2 * per_layer_w + per_layer_b) + 2 * c.hidden * c.vocab)
    att = [op for op in g.ops if op.kind is OpKind.ATTENTION]
    hd, tri = c.hidden // c.heads, S * (S + 1) // 2
    assert len(att) == c.layers
    assert all(op.flops == B * c.heads * tri * (4 * hd + 3) for op in att)
    assert not g.opaque_ops()


def test_meta_device_model_is_captured_without_weights():
    c = GPTConfig(vocab=50257, seq=2048, layers=2, hidden=12288, heads=96)  # two GPT-3 175B layers
    with torch.device("meta"):
        m = GPT(c)
    ids = torch.zeros(1, 2048, dtype=torch.long)  # a CPU tensor: moved to meta by the frontend
    g = pp.capture(m, (ids,), {"labels": ids})
    assert g.param_count() == n_params(m) > 3_600_000_000
    assert g.summary()["opaque"] == []


def test_repeated_layers_share_signatures():
    m = Llama(LlamaConfig(vocab=64, seq=16, layers=3, hidden=32, heads=4, kv_heads=2, ffn=64))
    ids = torch.zeros(2, 16, dtype=torch.long)
    g = pp.capture(m, (ids,))
    by_layer: dict[str, list[str]] = {}
    for op in g.ops:
        if op.module.startswith("layers."):
            by_layer.setdefault(op.module.split(".")[1], []).append(g.signature(op))
    assert len(by_layer) == 3
    sigs = list(by_layer.values())
    assert sigs[0] == sigs[1] == sigs[2]
    q = next(op for op in g.ops if op.kind is OpKind.CONTRACTION)
    emb = next(op for op in g.ops if op.kind is OpKind.EMBEDDING)
    assert g.signature(q) != g.signature(emb)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_hf_transformers_models_capture_with_no_opaque_compute(kind):
    tf = pytest.importorskip("transformers")
    if kind == "gpt2":
        m = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                             use_cache=False))
    elif kind == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                               max_position_embeddings=16, use_cache=False))
    else:
        m = tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                             num_attention_heads=2, vocab_size=64, max_position_embeddings=16))
    ids = torch.zeros(2, 16, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = pp.capture(m, (ids,), {"labels": ids})
    assert g.source == "torch.export"
    assert g.param_count() == n_params(m)
    compute = {"aten.linear", "aten.addmm", "aten.mm", "aten.bmm", "aten.matmul", "aten.scaled_dot_product_attention",
               "aten.layer_norm", "aten.embedding", "aten.cross_entropy_loss"}
    opaque_compute = [op.target for op in g.opaque_ops() if op.target.rsplit(".", 1)[0] in compute]
    assert opaque_compute == []
    kinds = {op.kind for op in g.ops}
    assert {OpKind.CONTRACTION, OpKind.ATTENTION, OpKind.EMBEDDING, OpKind.LOSS} <= kinds


class _Masky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y[y > 0].sum()  # data-dependent shape: export yields an unbacked size, fx runs eagerly


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent Python control flow: no tracer can capture this
            return self.lin(x)
        return x


def test_fx_fallback_and_opaque_ops_are_kept():
    with pytest.warns(OpaqueOpWarning, match="getitem"):
        g = pp.capture(_Masky(), (torch.randn(4, 8),))
    assert g.source == "torch.fx"
    assert g.param_count() == 72
    assert g.ops[0].kind is OpKind.CONTRACTION and g.ops[0].flops == 2 * 4 * 8 * 8 + 32
    assert any(op.is_opaque for op in g.ops)  # kept, not dropped


def test_fx_method_matches_export_on_a_traceable_model():
    m = SmallCNN()
    x = torch.randn(2, 1, 28, 28)
    a, b = pp.capture(m, (x,), method="export"), pp.capture(m, (x,), method="fx")
    assert (a.source, b.source) == ("torch.export", "torch.fx")
    assert a.param_count() == b.param_count()
    # export also sees BatchNorm's `num_batches_tracked += 1` (one FLOP per BN layer); fx keeps BN a leaf
    assert a.flops() - b.flops() == 2
    assert [op.kind for op in a.ops if op.kind is not OpKind.ELEMENTWISE] == \
        [op.kind for op in b.ops if op.kind is not OpKind.ELEMENTWISE]


def test_uncapturable_model_names_the_construct():
    with pytest.raises(CaptureError) as e:
        pp.capture(_Branchy(), (torch.randn(4, 8),))
    msg = str(e.value)
    assert "_Branchy" in msg and "control flow" in msg and "torch.export" in msg and "symbolic_trace" in msg


class _CountsValid(nn.Module):
    """HF's sequence-classification heads branch on how many labels are valid: ``nonzero`` then ``if size > 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lin(x)
        valid = (labels >= 0).nonzero()
        if valid.size(0) > 0:  # data-dependent: export guards on an unbacked size
            return nn.functional.cross_entropy(logits, labels.clamp(min=0))
        return logits.sum() * 0


def test_a_data_dependent_branch_is_reported_in_a_few_lines_with_where_it_is(capfd):
    """torch.export prints the partial graph of a failed export to stderr (once per wrapper it passed)
    before raising; the capture holds it back and names the model's line in its error."""
    with pytest.raises(CaptureError) as e:
        pp.capture(_CountsValid(), (torch.randn(4, 8),), example_kwargs={"labels": torch.tensor([0, 1, 2, -1])})
    msg = str(e.value)
    assert "data-dependent" in msg and "test_torch_frontend.py" in msg, msg  # torch's "Caused by: (file:line ...)"
    assert len(msg.splitlines()) <= 5
    err = capfd.readouterr().err
    assert "def forward" not in err and len(err) < 2000, err[:500]


def test_unknown_op_becomes_opaque_with_one_warning():
    class Sorty(nn.Module):
        def forward(self, x):
            return torch.sort(x, dim=-1).values.cumsum(-1) + torch.fft.fft(x).real

    with pytest.warns(OpaqueOpWarning) as rec:
        g = pp.capture(Sorty(), (torch.randn(3, 5),))
    assert len([w for w in rec if issubclass(w.category, OpaqueOpWarning)]) == 1
    opaque = {op.target.split(".")[1] for op in g.opaque_ops()}
    assert {"sort", "fft_fft"} <= opaque
    assert g.op(next(op.name for op in g.ops if "cumsum" in op.target)).kind is OpKind.REDUCE


def test_cli_graph_json_and_bad_model():
    exe = [sys.executable, "-m", "polyparallel"]
    out = subprocess.run([*exe, "graph", "mlp", "--json", "-b", "8"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["summary"]["params"] == 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    assert d["ops"][0]["nest"]["dims"][-1] == {"name": "k", "extent": 784, "role": "reduction", "hint": "feature"}
    bad = subprocess.run([*exe, "graph", "no-such-model"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown model" in bad.stderr and "Traceback" not in bad.stderr
