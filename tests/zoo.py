"""Models nobody on the project wrote, as a user brings them to ``search`` and ``train``.

Ten architectures at toy sizes: Hugging Face GPT-2 (``Conv1D`` projections), LLaMA, Qwen2, BERT
(sequence classification), T5 (encoder-decoder), ViT, Mixtral (mixture of experts), an HF ResNet
(BatchNorm), a UNet (BatchNorm, ``ConvTranspose2d``, skip concatenation, per-pixel loss) and an MLP.
Each is wrapped the way a user wraps a model for ``polyparallel train``: ``forward(inputs, labels)``
returns the mean loss (the HF models' own ``.loss``). The data functions are deterministic in the
step, so every rank and the single-process reference see the same global batch; the language
models' labels are padded with ``-100`` in some rows, as real batches are.

``ZOO`` maps a name to ``(model function, data function)``; both are module-level so worker
processes import them as ``tests.zoo:NAME``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

BATCH = 8  # the global batch of every data function
SEQ = 16
VOCAB = 96


class _HFLoss(nn.Module):
    """``forward(inputs, labels) -> model(<input key>=inputs, labels=labels).loss``."""

    def __init__(self, model: nn.Module, key: str) -> None:
        super().__init__()
        self.model, self.key = model, key

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.key: inputs}, labels=labels).loss


def _lm_data(step: int, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and the same ids as labels (HF causal LMs shift inside), a ragged tail of ``-100``."""
    g = torch.Generator().manual_seed(3000 + step)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    for row in range(BATCH):
        pad = int(torch.randint(0, SEQ // 2, (1,), generator=g))
        if pad:
            labels[row, -pad:] = -100
    return ids, labels


def _image_data(step: int, classes: int, size: int = 16, channels: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4000 + step)
    return torch.randn(BATCH, channels, size, size, generator=g), torch.randint(0, classes, (BATCH,), generator=g)


# --------------------------------------------------------------------------------------------
# Hugging Face transformers, built from a config (no download)


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return _HFLoss(GPT2LMHeadModel(cfg), "input_ids")


def hf_decoder(family: str, *, vocab: int, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
               seq: int) -> nn.Module:
    """HF's ``llama`` or ``qwen2`` causal LM of the given shape, wrapped as ``forward(ids, labels)``
    (the benchmarks build theirs at other widths with it)."""
    import transformers

    config, causal_lm = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                         "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[family]
    cfg = getattr(transformers, config)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq)
    return _HFLoss(getattr(transformers, causal_lm)(cfg), "input_ids")


def hf_llama() -> nn.Module:
    return hf_decoder("llama", vocab=VOCAB, layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, seq=SEQ)


def hf_bloom() -> nn.Module:
    """BLOOM keeps a key/value cache by default (``use_cache=True``) and adds ALiBi biases sized by
    it: a recomputed layer must not see its first run's cache (not in ``ZOO``: the recomputation
    tests use it)."""
    from transformers import BloomConfig, BloomForCausalLM

    return _HFLoss(BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)), "input_ids")


def hf_qwen2() -> nn.Module:
    return hf_decoder("qwen2", vocab=VOCAB, layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, seq=SEQ)


def hf_mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=SEQ)
    return _HFLoss(MixtralForCausalLM(cfg), "input_ids")


def hf_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=SEQ, num_labels=3, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return _HFLoss(BertForSequenceClassification(cfg), "input_ids")


def hf_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return _HFLoss(T5ForConditionalGeneration(cfg), "input_ids")


def hf_vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    return _HFLoss(ViTForImageClassification(cfg), "pixel_values")


def hf_resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                       num_labels=5)
    return _HFLoss(ResNetForImageClassification(cfg), "pixel_values")


def seq_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and one class per sequence (BERT)."""
    g = torch.Generator().manual_seed(5000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def image_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _image_data(step, classes=5)


lm_data = _lm_data


# --------------------------------------------------------------------------------------------
# plain torch models a user writes


class UNet(nn.Module):
    """Two levels: conv-BN-ReLU blocks, max-pool down, ``ConvTranspose2d`` up, skip concatenation,
    a per-pixel classifier trained with cross entropy over the class dim."""

    def __init__(self, channels: int = 3, classes: int = 4, width: int = 8) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

        self.down1 = block(channels, width)
        self.down2 = block(width, 2 * width)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.fuse = block(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        a = self.down1(x)
        b = self.down2(self.pool(a))
        u = self.fuse(torch.cat([self.up(b), a], dim=1))
        return nn.functional.cross_entropy(self.head(u), labels)


def unet() -> nn.Module:
    return UNet()


def unet_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(6000 + step)
    return torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 4, (BATCH, 16, 16), generator=g)


class MLPClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 6))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), labels)


def mlp() -> nn.Module:
    return MLPClassifier()


def mlp_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + step)
    return torch.randn(BATCH, 20, generator=g), torch.randint(0, 6, (BATCH,), generator=g)


ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[int], tuple[torch.Tensor, torch.Tensor]]]] = {
    "gpt2": (hf_gpt2, lm_data),
    "llama": (hf_llama, lm_data),
    "qwen2": (hf_qwen2, lm_data),
    "bert": (hf_bert, seq_data),
    "t5": (hf_t5, lm_data),
    "vit": (hf_vit, image_data),
    "mixtral": (hf_mixtral, lm_data),
    "resnet": (hf_resnet, image_data),
    "unet": (unet, unet_data),
    "mlp": (mlp, mlp_data),
}
