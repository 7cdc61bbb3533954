"""Folded capture (``frontends/_fold.py``): a model whose block stack is traced three blocks deep
and copied must capture to exactly the graph of a full export (ops, tensors, names, order), and
models whose blocks differ in ways the parameters do not show must not be folded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from polyparallel import capture
from polyparallel.frontends import _fold
from polyparallel.models import GPT, GPTConfig, Llama, LlamaConfig
from tests.zoo import _HFLoss

LAYERS = 6
SEQ, VOCAB = 16, 96


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, SEQ))
    return ids, ids.clone()


def _hf(name: str):
    import transformers as tf

    lm = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": LAYERS,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": SEQ}
    if name == "gpt2":
        m = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=LAYERS, n_head=4))
    elif name == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**lm))
    elif name == "qwen2":
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(**lm))
    elif name == "mixtral":
        m = tf.MixtralForCausalLM(tf.MixtralConfig(**{**lm, "intermediate_size": 32}, num_local_experts=4,
                                                   num_experts_per_tok=2))
    elif name == "t5":
        m = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=LAYERS,
                                                      num_decoder_layers=LAYERS, num_heads=4,
                                                      decoder_start_token_id=0, pad_token_id=0))
    elif name == "gemma2":  # alternating sliding-window and global attention: must not fold
        m = tf.Gemma2ForCausalLM(tf.Gemma2Config(**lm, head_dim=8, sliding_window=4))
    elif name == "vit":
        cfg = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=LAYERS,
                           num_attention_heads=4, intermediate_size=64, num_labels=5)
        return _HFLoss(tf.ViTForImageClassification(cfg), "pixel_values"), \
            (torch.randn(2, 3, 16, 16), torch.randint(0, 5, (2,)))
    else:
        raise AssertionError(name)
    return _HFLoss(m, "input_ids"), _ids()


class _Gated(nn.Module):
    """A block whose behaviour depends on an index attribute the parameters do not show."""

    def __init__(self, idx: int) -> None:
        super().__init__()
        self.idx, self.lin = idx, nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y.relu() if self.idx == 4 else y


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], scale_odd: bool = False) -> None:
        super().__init__()
        self.blocks, self.scale_odd = nn.ModuleList(blocks), scale_odd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            x = b(x) * 2 if self.scale_odd and i % 2 else b(x)
        return x.sum()


class _LastTied(_Stack):
    """The head reads the last block's weight (``blocks[-1]``): block N-1's in the full model."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x).tanh()
        return (x @ self.blocks[-1].weight.t()).sum()


def test_a_head_reading_the_last_block_reads_the_last_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    full, folded, did = _both(_LastTied([nn.Linear(8, 8) for _ in range(LAYERS)]), (torch.randn(2, 8),), monkeypatch)
    assert did
    _assert_same(full, folded)
    last = [o for o in full.ops if o.target.startswith("aten.t")][-1]
    assert full.tensors[last.inputs[0]].origin == f"blocks.{LAYERS - 1}.weight"


def _both(model: nn.Module, inputs: tuple, monkeypatch: pytest.MonkeyPatch):
    """(full capture, folded capture, whether folding happened)."""
    seen = []
    real = _fold.export_folded

    def spy(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    monkeypatch.setattr("polyparallel.frontends.torch.export_folded", spy)
    folded = capture(model, inputs)
    monkeypatch.setattr(_fold, "MIN_BLOCKS", 10 ** 9)
    full = capture(model, inputs)
    return full, folded, seen[0] is not None


def _assert_same(full, folded) -> None:
    assert [o.name for o in folded.ops] == [o.name for o in full.ops]
    assert list(folded.tensors) == list(full.tensors)
    assert folded == full


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_own_transformers_fold_to_the_full_graph(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    if kind == "gpt":
        m = GPT(GPTConfig(vocab=VOCAB, seq=SEQ, hidden=32, heads=4, layers=LAYERS))
    else:
        m = Llama(LlamaConfig(vocab=VOCAB, seq=SEQ, hidden=32, heads=4, kv_heads=2, layers=LAYERS))
    full, folded, did = _both(m, (torch.randint(0, VOCAB, (2, SEQ)),), monkeypatch)
    assert did
    _assert_same(full, folded)


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "mixtral", "t5", "vit"])
def test_hugging_face_models_fold_to_the_full_graph(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    m, inputs = _hf(name)
    full, folded, did = _both(m, inputs, monkeypatch)
    assert did, f"{name}: its {LAYERS} alike blocks were not folded"
    _assert_same(full, folded)


def test_per_layer_attention_kinds_are_not_folded(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    m, inputs = _hf("gemma2")
    full, folded, did = _both(m, inputs, monkeypatch)
    assert not did
    _assert_same(full, folded)


@pytest.mark.parametrize("case", ["index attribute", "loop by index", "one block shared"])
def test_blocks_that_differ_are_not_folded(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    if case == "index attribute":
        m = _Stack([_Gated(i) for i in range(LAYERS)])
    elif case == "loop by index":
        m = _Stack([nn.Linear(8, 8) for _ in range(LAYERS)], scale_odd=True)
    else:
        blk = nn.Linear(8, 8)
        m = _Stack([blk] * LAYERS)
    full, folded, did = _both(m, (torch.randn(2, 8),), monkeypatch)
    assert not did
    _assert_same(full, folded)
    if case == "index attribute":  # the one odd block is in the graph
        assert sum(o.target.startswith("aten.relu") for o in full.ops) == 1


def test_folding_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYPARALLEL_FOLD", "0")
    m = Llama(LlamaConfig(vocab=VOCAB, seq=SEQ, hidden=32, heads=4, kv_heads=2, layers=LAYERS))
    assert _fold.export_folded(m, lambda _: pytest.fail("no export expected")) is None
