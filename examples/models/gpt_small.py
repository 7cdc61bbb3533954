"""A small PanGu/GPT-shaped decoder as a user model, in PyTorch (``models.gpt_small:gpt``) and in
MindSpore (``models.gpt_small:gpt_mindspore``), the same architecture layer for layer.

Byte-level (vocabulary 256), 64-token context, 2 pre-LayerNorm blocks of width 64 with 4 heads, causal
self-attention written out (``q kᵀ / √d``, mask, softmax), tanh-GELU MLP, an untied output head (tied
embeddings would be one MindSpore parameter against two torch ``state_dict`` entries). ``forward(ids)``
returns the logits ``(B, S, 256)``; the collaborative trainers minimise next-token cross-entropy over
the last dim. About 120k parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, LAYERS, HIDDEN, HEADS = 256, 64, 2, 64, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.ln_2 = nn.LayerNorm(HIDDEN)
        self.fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc_out = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).reshape(b, s, 3, HEADS, h // HEADS).permute(2, 0, 3, 1, 4)
        att = q @ k.transpose(-1, -2) / math.sqrt(h // HEADS)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, -1e9).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, h))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPTSmall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(SEQ, HIDDEN)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.h:
            x = blk(x)
        return self.head(self.ln_f(x))


def gpt() -> nn.Module:
    return GPTSmall()


def gpt_mindspore():
    """The same model as a ``mindspore.nn.Cell`` (imported only on a MindSpore center)."""
    import mindspore as ms
    from mindspore import nn as mnn
    from mindspore import ops

    class MsBlock(mnn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = mnn.LayerNorm((HIDDEN,), epsilon=1e-5)
            self.qkv = mnn.Dense(HIDDEN, 3 * HIDDEN)
            self.proj = mnn.Dense(HIDDEN, HIDDEN)
            self.ln_2 = mnn.LayerNorm((HIDDEN,), epsilon=1e-5)
            self.fc = mnn.Dense(HIDDEN, 4 * HIDDEN)
            self.fc_out = mnn.Dense(4 * HIDDEN, HIDDEN)
            self.gelu = mnn.GELU(approximate=True)

        def construct(self, x):
            b, s, h = x.shape
            q, k, v = ops.transpose(self.qkv(self.ln_1(x)).reshape(b, s, 3, HEADS, h // HEADS), (2, 0, 3, 1, 4))
            att = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) / math.sqrt(h // HEADS)
            mask = ops.triu(ops.ones((s, s), ms.float32), 1).astype(ms.bool_)
            att = ops.softmax(ops.masked_fill(att, mask, -1e9), -1)
            x = x + self.proj(ops.transpose(ops.matmul(att, v), (0, 2, 1, 3)).reshape(b, s, h))
            return x + self.fc_out(self.gelu(self.fc(self.ln_2(x))))

    class MsGPTSmall(mnn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.wte = mnn.Embedding(VOCAB, HIDDEN)
            self.wpe = mnn.Embedding(SEQ, HIDDEN)
            self.h = mnn.CellList([MsBlock() for _ in range(LAYERS)])
            self.ln_f = mnn.LayerNorm((HIDDEN,), epsilon=1e-5)
            self.head = mnn.Dense(HIDDEN, VOCAB, has_bias=False)

        def construct(self, ids):
            x = self.wte(ids) + self.wpe(ops.arange(ids.shape[1]))
            for blk in self.h:
                x = blk(x)
            return self.head(self.ln_f(x))

    return MsGPTSmall()
