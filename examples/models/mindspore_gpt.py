"""The built-in GPT (``polyparallel.models.GPT``: ``gpt-tiny``, ``gpt2-small``) as a MindSpore Cell, for
``polyparallel export --mindspore-model``: MindSpore's own layers (``nn.Dense``, ``nn.LayerNorm``,
``nn.Embedding``) where the torch model has its Linear, LayerNorm and Embedding, so the export's torch op
-> cell map finds the primitives it shards; attention as BatchMatMul · Softmax · BatchMatMul with a causal
mask, the loss as MindSpore's cross-entropy. ``construct(ids, labels)`` returns the loss, as the torch
model's ``forward(ids, labels)`` does.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def gpt(vocab: int, seq: int, layers: int, hidden: int, heads: int) -> Any:
    """A GPT-2-style decoder Cell of the given shape (names as the torch model's, lm_head untied)."""
    import mindspore as ms
    from mindspore import nn, ops

    class Block(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm((hidden,), epsilon=1e-5)
            self.qkv = nn.Dense(hidden, 3 * hidden)
            self.proj = nn.Dense(hidden, hidden)
            self.ln_2 = nn.LayerNorm((hidden,), epsilon=1e-5)
            self.fc = nn.Dense(hidden, 4 * hidden)
            self.fc_out = nn.Dense(4 * hidden, hidden)
            self.scores = ops.BatchMatMul(transpose_b=True)
            self.softmax = ops.Softmax(-1)
            self.weighted = ops.BatchMatMul()
            self.mask = ms.Tensor(np.triu(np.full((seq, seq), -1e9, np.float32), 1))

        def construct(self, x: Any) -> Any:
            b, s, h = x.shape
            q, k, v = ops.split(self.qkv(self.ln_1(x)), h, -1)
            q, k, v = (t.reshape(b, s, heads, h // heads).transpose(0, 2, 1, 3) for t in (q, k, v))
            p = self.softmax(self.scores(q, k) * (h // heads) ** -0.5 + self.mask[:s, :s])
            a = self.weighted(p, v).transpose(0, 2, 1, 3).reshape(b, s, h)
            x = x + self.proj(a)
            return x + self.fc_out(ops.gelu(self.fc(self.ln_2(x)), approximate="none"))

    class GPT(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(vocab, hidden)
            self.wpe = nn.Embedding(seq, hidden)
            self.h = nn.CellList([Block() for _ in range(layers)])
            self.ln_f = nn.LayerNorm((hidden,), epsilon=1e-5)
            self.lm_head = nn.Dense(hidden, vocab, has_bias=False)
            self.positions = ms.Tensor(np.arange(seq, dtype=np.int32))

        def construct(self, ids: Any, labels: Any) -> Any:
            x = self.wte(ids.astype(ms.int32)) + self.wpe(self.positions[:ids.shape[1]])
            for blk in self.h:
                x = blk(x)
            logits = self.lm_head(self.ln_f(x))
            return ops.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1).astype(ms.int32))

    return GPT()


def gpt_tiny() -> Any:
    """``gpt-tiny``: vocab 512, seq 64, 2 layers, hidden 64, 4 heads."""
    return gpt(512, 64, 2, 64, 4)


def gpt2_small() -> Any:
    """``gpt2-small``: vocab 50257, seq 1024, 12 layers, hidden 768, 12 heads (124M parameters + lm_head)."""
    return gpt(50257, 1024, 12, 768, 12)
