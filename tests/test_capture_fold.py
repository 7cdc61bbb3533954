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


def _pipeline_pair(model: nn.Module, x: torch.Tensor, y: torch.Tensor, monkeypatch: pytest.MonkeyPatch):
    """The pipeline's export of ``model`` folded and whole (folding switched off)."""
    from polyparallel.backends.torch._pipeline import _export

    seen = []

    def spy(*a, **k):
        seen.append(_fold.export_folded(*a, **k))
        return seen[-1]

    with monkeypatch.context() as m:
        m.setattr("polyparallel.backends.torch._pipeline.export_folded", spy)
        folded = _export(model, x, y)
    assert seen and seen[0] is not None and seen[0].outputs == ("USER_OUTPUT",)  # folded, not exported whole
    with monkeypatch.context() as m:
        m.setattr(_fold, "MIN_BLOCKS", 10 ** 9)
        full = _export(model, x, y)
    return folded, full


def _nodes(gm: torch.fx.GraphModule) -> list[tuple[str, str, str]]:
    return [(n.op, n.name, str(n.target)) for n in gm.graph.nodes if n.op in ("call_function", "output")] + \
        sorted((n.op, "", str(n.target)) for n in gm.graph.nodes if n.op == "get_attr")


@pytest.mark.parametrize("name", ["gpt", pytest.param("llama", marks=pytest.mark.slow),
                                  pytest.param("mixtral", marks=pytest.mark.slow)])
def test_the_pipeline_export_folds_to_the_full_program(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline cuts the model on a folded export (the frontend's three-block trace, run as a
    module over the model's own parameters): the same ops by the same names as the whole export,
    reading the same parameters, and the same loss and gradients."""
    torch.manual_seed(0)
    if name == "gpt":
        model: nn.Module = GPT(GPTConfig(vocab=VOCAB, seq=SEQ, hidden=32, heads=4, layers=LAYERS))
        x, y = _ids()
    else:
        model, (x, y) = _hf(name)
    folded, full = _pipeline_pair(model, x, y, monkeypatch)
    assert _nodes(folded) == _nodes(full)
    grads = []
    for gm in (folded, full):
        model.zero_grad()
        loss = gm(x, y)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert torch.equal(grads[0][0], grads[1][0])
    assert grads[0][1].keys() == grads[1][1].keys() and len(grads[0][1]) == len(list(model.parameters()))
    assert all(torch.equal(grads[0][1][k], grads[1][1][k]) for k in grads[0][1])


def test_a_folded_model_cut_into_stages_chains_back_to_its_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut inside the copied blocks (block 4 of 6 is never traced), the chunks chain back to the
    model's loss and gradients; the planner's check (``modules=False``) lists the same parameters
    and layers per chunk without making the modules."""
    from polyparallel.backends.torch._pipeline import _export, split_model

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab=VOCAB, seq=SEQ, hidden=32, heads=4, kv_heads=2, layers=LAYERS))
    x, y = _ids()
    loss = model(x, y)
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    cuts = [n.name for n in _export(model, x, y).graph.nodes if n.op == "call_function" and
            str(list((n.meta.get("nn_module_stack") or {0: ("",)}).values())[-1][0]).startswith("layers.4.")][:1]
    assert cuts
    split = split_model(model, x, y, cuts)
    acts: tuple[torch.Tensor, ...] = (x,)
    for chunk in split.chunks:
        acts = chunk(*acts)
    got = split.tail(*acts, y)
    got.backward()
    assert torch.equal(got, loss)
    for n, g in {n: p.grad for c in split.chunks for n, p in c.named_parameters()}.items():
        torch.testing.assert_close(g, want[n], rtol=1e-5, atol=1e-6)
    check = split_model(model, x, y, cuts, modules=False)
    assert (check.chunks, check.tail) == ([], None)
    assert check.params == split.params and check.layers == split.layers
    assert [sorted(lyr) for lyr in split.layers] == [[0, 1, 2, 3], [4, 5]]
