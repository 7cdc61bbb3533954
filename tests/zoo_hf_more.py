"""Sixteen more Hugging Face architectures, built from configs at toy sizes, as users bring them.

Not used by the tests (CI time): ``benchmarks/zoo.py --zoo tests.zoo_hf_more`` searches and trains each
one and compares the losses with one process, as for ``tests/zoo.py``. Decoders with sliding windows,
QK-norm, soft-capping, fused gate/up projections, parallel blocks, partial rotary, a mixture of experts with
shared experts; encoders with a factorised embedding (ELECTRA) and relative attention with a
data-dependent loss (DeBERTa-v2, which torch.export cannot capture: the capture says where); a windowed
vision transformer (Swin) and a grouped-convolution network (RegNet). Each is wrapped as
``forward(inputs, labels)`` returning the model's own ``.loss`` (``tests/zoo.py``'s wrapper and token data).
"""

from __future__ import annotations

import torch
import transformers as T
from torch import nn

from tests.zoo import BATCH, SEQ, VOCAB, _HFLoss, _lm_data

NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 64, "use_cache": False}


def cls_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def image_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4000 + step)
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def _built(config: str, model: str, key: str, **kw: object) -> nn.Module:
    torch.manual_seed(0)
    return _HFLoss(getattr(T, model)(getattr(T, config)(**kw)), key)


def mistral() -> nn.Module:
    return _built("MistralConfig", "MistralForCausalLM", "input_ids", **SMALL, num_key_value_heads=2)


def qwen3() -> nn.Module:
    return _built("Qwen3Config", "Qwen3ForCausalLM", "input_ids", **SMALL, num_key_value_heads=2, head_dim=8)


def gemma2() -> nn.Module:
    return _built("Gemma2Config", "Gemma2ForCausalLM", "input_ids", **SMALL, num_key_value_heads=2, head_dim=8)


def stablelm() -> nn.Module:
    return _built("StableLmConfig", "StableLmForCausalLM", "input_ids", **SMALL, num_key_value_heads=4)


def olmo() -> nn.Module:
    return _built("OlmoConfig", "OlmoForCausalLM", "input_ids", **SMALL, num_key_value_heads=4)


def phi3() -> nn.Module:
    return _built("Phi3Config", "Phi3ForCausalLM", "input_ids", **SMALL, num_key_value_heads=4, pad_token_id=0)


def starcoder2() -> nn.Module:
    return _built("Starcoder2Config", "Starcoder2ForCausalLM", "input_ids", **SMALL, num_key_value_heads=2,
                  residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0)


def granite() -> nn.Module:
    return _built("GraniteConfig", "GraniteForCausalLM", "input_ids", **SMALL, num_key_value_heads=2)


def gptj() -> nn.Module:
    return _built("GPTJConfig", "GPTJForCausalLM", "input_ids", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                  n_positions=64, rotary_dim=4, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def gpt_neo() -> nn.Module:
    return _built("GPTNeoConfig", "GPTNeoForCausalLM", "input_ids", vocab_size=VOCAB, hidden_size=32, num_layers=2,
                  num_heads=4, attention_types=[[["global", "local"], 1]], max_position_embeddings=64,
                  window_size=8, use_cache=False, resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0)


def qwen2_moe() -> nn.Module:
    return _built("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "input_ids", **SMALL, num_key_value_heads=2,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def roberta() -> nn.Module:
    return _built("RobertaConfig", "RobertaForSequenceClassification", "input_ids", **SMALL, num_labels=3,
                  pad_token_id=1, **NO_DROPOUT)


def electra() -> nn.Module:
    return _built("ElectraConfig", "ElectraForSequenceClassification", "input_ids", vocab_size=VOCAB,
                  embedding_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, num_labels=3, **NO_DROPOUT)


def deberta_v2() -> nn.Module:
    return _built("DebertaV2Config", "DebertaV2ForSequenceClassification", "input_ids", vocab_size=VOCAB,
                  hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, num_labels=3, **NO_DROPOUT)


def swin() -> nn.Module:
    return _built("SwinConfig", "SwinForImageClassification", "pixel_values", image_size=32, patch_size=4,
                  num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=5,
                  drop_path_rate=0.0, **NO_DROPOUT)


def regnet() -> nn.Module:
    return _built("RegNetConfig", "RegNetForImageClassification", "pixel_values", num_channels=3, embedding_size=8,
                  hidden_sizes=[8, 16], depths=[1, 1], groups_width=8, num_labels=5)


ZOO = {f.__name__: (f, data) for f, data in [
    *((f, _lm_data) for f in (mistral, qwen3, gemma2, stablelm, olmo, phi3, starcoder2, granite, gptj, gpt_neo,
                              qwen2_moe)),
    (roberta, cls_data), (electra, cls_data), (deberta_v2, cls_data), (swin, image_data), (regnet, image_data)]}
