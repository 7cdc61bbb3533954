"""A small vision transformer over image patches, written as a user model (``models.vit_patch:vit``).

28×28 grey images cut into 7×7 patches (a 4×4 grid, one strided conv), a learned position embedding,
two pre-LayerNorm blocks of width 48 with 4 heads (attention written out: one ``qkv`` linear, heads
by reshape, ``softmax(q kᵀ · scale) v``, an output projection) and a GELU MLP of 192, mean pooling
over the 16 tokens and a linear classifier: about 60k parameters. The head count is the attribute
``num_heads`` of each attention module and the head width is read from ``qkv``'s output, so a pruner
that removes the same dimensions from every head (as Torch-Pruning does when told the heads) leaves a
model that still runs; ``scale`` is fixed at construction, so removing dimensions that carry zeros
changes nothing the model computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        att = (q @ k.transpose(-2, -1) * self.scale).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViTPatch(nn.Module):
    def __init__(self, dim: int = 48, depth: int = 2, num_heads: int = 4, mlp: int = 192, patch: int = 7,
                 image: int = 28, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Conv2d(in_channels, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2, dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.Sequential(*(Block(dim, num_heads, mlp) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.norm(self.blocks(x)).mean(1))


def vit() -> nn.Module:
    """The pruning benchmark's transformer: width 48, 2 blocks, 4 heads, MLP 192, 10 classes."""
    return ViTPatch()
