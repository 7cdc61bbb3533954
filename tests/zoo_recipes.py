"""A second zoo of models nobody on the project wrote, for pinned recipes (``benchmarks/recipe_zoo.py``).

Thirteen architectures at toy sizes, none of them in ``tests/zoo.py``: Hugging Face GPT-NeoX
(partial rotary, parallel residual), OPT (learned positions, an ``nn.Embedding`` subclass), Phi,
Falcon (multi-query attention), Gemma, GPTBigCode (multi-query, fused ``c_attn``), DistilBERT
(sequence classification), BART (encoder-decoder), ConvNeXt (depthwise convolutions, channels-last
LayerNorm), MobileNetV2 (BatchNorm, depthwise), and three written the way a user writes them: a
nanoGPT (views sized from its configuration), a GRU tagger and an MLP with a custom
``autograd.Function``. Dropout is off (a rank's masks cannot be the single-process run's). Each is wrapped as
``forward(inputs, labels) -> mean loss``; the data
functions are deterministic in the step (every rank and the single-process reference see the same
global batch). ``ZOO`` maps a name to ``(model function, data function)``, both module-level so
worker processes import them as ``tests.zoo_recipes:NAME``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from tests.zoo import BATCH, SEQ, VOCAB, _HFLoss, _image_data, _lm_data

__all__ = ["ZOO"]


def lm_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _lm_data(step + 100)


def seq_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and one of 3 classes per sequence."""
    g = torch.Generator().manual_seed(6000 + step)
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def image_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _image_data(step + 100, classes=5, size=32)


def tag_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and one of 5 tags per token."""
    g = torch.Generator().manual_seed(7000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, 5, (BATCH, SEQ), generator=g)


def vec_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(8000 + step)
    return torch.randn(BATCH, 24, generator=g), torch.randint(0, 6, (BATCH,), generator=g)


# --------------------------------------------------------------------------------------------
# Hugging Face transformers, built from a config (no download)

_SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 64, "max_position_embeddings": 64}


def gpt_neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    return _HFLoss(GPTNeoXForCausalLM(GPTNeoXConfig(**_SMALL, rotary_pct=0.5, use_cache=False)), "input_ids")


def opt() -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    return _HFLoss(OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                            num_attention_heads=4, max_position_embeddings=64,
                                            word_embed_proj_dim=32, use_cache=False, dropout=0.0,
                                            attention_dropout=0.0)), "input_ids")


def phi() -> nn.Module:
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    return _HFLoss(PhiForCausalLM(PhiConfig(**_SMALL, use_cache=False)), "input_ids")


def falcon() -> nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    cfg = FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       multi_query=True, new_decoder_architecture=False, use_cache=False)
    return _HFLoss(FalconForCausalLM(cfg), "input_ids")


def gemma() -> nn.Module:
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    return _HFLoss(GemmaForCausalLM(GemmaConfig(**_SMALL, num_key_value_heads=2, head_dim=8, use_cache=False)),
                   "input_ids")


def gpt_bigcode() -> nn.Module:
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    torch.manual_seed(0)
    return _HFLoss(GPTBigCodeForCausalLM(GPTBigCodeConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                          n_positions=64, multi_query=True, use_cache=False,
                                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                          bos_token_id=0, eos_token_id=0)),
                   "input_ids")


def distilbert() -> nn.Module:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    torch.manual_seed(0)
    cfg = DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, num_labels=3,
                           max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)
    return _HFLoss(DistilBertForSequenceClassification(cfg), "input_ids")


def bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                     use_cache=False, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    return _HFLoss(BartForConditionalGeneration(cfg), "input_ids")


def convnext() -> nn.Module:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(0)
    cfg = ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5,
                         patch_size=2)
    return _HFLoss(ConvNextForImageClassification(cfg), "pixel_values")


def mobilenet_v2() -> nn.Module:
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    torch.manual_seed(0)
    cfg = MobileNetV2Config(num_channels=3, image_size=32, depth_multiplier=0.25, num_labels=5,
                            classifier_dropout_prob=0.0)
    return _HFLoss(MobileNetV2ForImageClassification(cfg), "pixel_values")


# --------------------------------------------------------------------------------------------
# written as users write them


class _NanoAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.width, self.heads = width, heads
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.register_buffer("bias", torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.width, dim=2)
        hd = c // self.heads
        q, k, v = (z.view(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = F.softmax(att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))


class NanoGPT(nn.Module):
    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, width), nn.Embedding(SEQ, width)
        self.attn = nn.ModuleList(_NanoAttention(width, heads) for _ in range(layers))
        self.ln1 = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.ln2 = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.fc = nn.ModuleList(nn.Linear(width, 4 * width) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(4 * width, width) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(width), nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for attn, ln1, ln2, fc, proj in zip(self.attn, self.ln1, self.ln2, self.fc, self.proj):
            x = x + attn(ln1(x))
            x = x + proj(F.gelu(fc(ln2(x))))
        return F.cross_entropy(self.lm_head(self.ln_f(x)).flatten(0, 1), targets.flatten(), ignore_index=-100)


def nanogpt() -> nn.Module:
    torch.manual_seed(0)
    return NanoGPT()


class GRUTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24)
        self.gru = nn.GRU(24, 32, batch_first=True, bidirectional=True)
        self.out = nn.Linear(64, 5)

    def forward(self, ids: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.emb(ids))
        return F.cross_entropy(self.out(h).flatten(0, 1), tags.flatten())


def gru_tagger() -> nn.Module:
    torch.manual_seed(0)
    return GRUTagger()


class _ScaledTanh(torch.autograd.Function):
    """``2 tanh(x)`` with its gradient written by hand."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return 2 * y

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return 2 * g * (1 - y * y)


class CustomFunctionMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(24, 64), nn.Linear(64, 64), nn.Linear(64, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = _ScaledTanh.apply(self.fc1(x))
        h = _ScaledTanh.apply(self.fc2(h))
        return F.cross_entropy(self.fc3(h), y)


def custom_function_mlp() -> nn.Module:
    torch.manual_seed(0)
    return CustomFunctionMLP()


ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[int], tuple[torch.Tensor, torch.Tensor]]]] = {
    "gpt_neox": (gpt_neox, lm_data),
    "opt": (opt, lm_data),
    "phi": (phi, lm_data),
    "falcon": (falcon, lm_data),
    "gemma": (gemma, lm_data),
    "gpt_bigcode": (gpt_bigcode, lm_data),
    "distilbert": (distilbert, seq_data),
    "bart": (bart, lm_data),
    "convnext": (convnext, image_data),
    "mobilenet_v2": (mobilenet_v2, image_data),
    "nanogpt": (nanogpt, lm_data),
    "gru_tagger": (gru_tagger, tag_data),
    "custom_function_mlp": (custom_function_mlp, vec_data),
}
