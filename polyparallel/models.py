"""Built-in example models and the resolution of a MODEL argument of the CLI.

A MODEL is one of:

* a built-in name (:data:`EXAMPLES`): ``mlp``, ``cnn``, ``resnet50``, ``gpt-tiny``,
  ``gpt2-small``, ``llama-1b``, ``llama-8b``, ``gpt3-175b``, and, when ``transformers`` is
  installed, ``hf-gpt2``, ``hf-llama``, ``hf-bert`` (random weights from a config);
* a path to an ``.onnx`` file;
* ``package.module:function`` returning ``(model, args)`` or ``(model, args, kwargs)``.

Large examples are built on the ``meta`` device, so no weights are allocated.
The GPT and LLaMA models are written here in plain PyTorch (pre-norm decoder blocks,
``scaled_dot_product_attention`` with a causal mask; LLaMA with RMSNorm, SwiGLU,
grouped-query attention and rotary embeddings) so the package needs no model zoo.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from polyparallel.references import call_user, resolve

__all__ = ["EXAMPLES", "GPT", "GPTConfig", "Llama", "LlamaConfig", "ResNet", "example_batch", "example_module",
           "load_model", "trainable_example", "trainable_examples"]


# ----------------------------------------------------------------------------------------
# GPT


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50257
    seq: int = 1024
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    mlp_ratio: int = 4
    # training-time dropout on the hidden states (after the embeddings, the attention projection and
    # the MLP) and on the attention probabilities, as GPT-2/3 and Megatron-LM train (0.1 there)
    dropout: float = 0.0
    # "sdpa": torch's scaled_dot_product_attention (a fused kernel where the device has one);
    # "explicit": scores, causal mask, softmax, dropout and the weighted sum as separate ops, as
    # GPT-2's reference code and Megatron-LM before flash attention computed them
    attention: str = "sdpa"
    # learned absolute positions (GPT-2/3); False for models that encode positions in attention (ALiBi)
    positions: bool = True

    def __post_init__(self) -> None:
        if self.attention not in ("sdpa", "explicit"):
            raise ValueError(f"GPTConfig.attention={self.attention!r}: use 'sdpa' or 'explicit'")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r}: give a probability in [0, 1)")


class GPTBlock(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.dropout = c.dropout
        self.explicit = c.attention == "explicit"
        self.ln_1 = nn.LayerNorm(c.hidden)
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden)
        self.proj = nn.Linear(c.hidden, c.hidden)
        self.ln_2 = nn.LayerNorm(c.hidden)
        self.fc = nn.Linear(c.hidden, c.mlp_ratio * c.hidden)
        self.fc_out = nn.Linear(c.mlp_ratio * c.hidden, c.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        # sizes are read off the projection's output, not the config: under head-parallel tensor
        # parallelism (polyparallel.backends.torch) it holds this rank's heads of q, k and v only
        qkv = self.qkv(self.ln_1(x))
        q, k, v = qkv.split(qkv.shape[-1] // 3, dim=-1)
        q, k, v = (t.view(B, S, -1, H // self.heads).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        if self.explicit:
            scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
            causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
            probs = F.dropout(scores.masked_fill(~causal, float("-inf")).softmax(-1), p, self.training)
            a = probs @ v
        else:
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self._drop(self.proj(a.transpose(1, 2).reshape(B, S, -1)))
        return x + self._drop(self.fc_out(F.gelu(self.fc(self.ln_2(x)))))

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout else x


class GPT(nn.Module):
    """A GPT-2-style decoder; ``forward(ids, labels=None)`` returns the loss when labels are given."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.hidden)
        self.wpe = nn.Embedding(c.seq, c.hidden) if c.positions else None
        self.h = nn.ModuleList(GPTBlock(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2 and GPT-3

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.wte(ids)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        if self.config.dropout:
            x = F.dropout(x, self.config.dropout, self.training)
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


# ----------------------------------------------------------------------------------------
# LLaMA


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 32000
    seq: int = 2048
    layers: int = 16
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 8192
    eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.c = c
        hd = c.hidden // c.heads
        self.attn_norm = RMSNorm(c.hidden, c.eps)
        self.q = nn.Linear(c.hidden, c.heads * hd, bias=False)
        self.k = nn.Linear(c.hidden, c.kv_heads * hd, bias=False)
        self.v = nn.Linear(c.hidden, c.kv_heads * hd, bias=False)
        self.o = nn.Linear(c.heads * hd, c.hidden, bias=False)
        self.mlp_norm = RMSNorm(c.hidden, c.eps)
        self.gate = nn.Linear(c.hidden, c.ffn, bias=False)
        self.up = nn.Linear(c.hidden, c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.c
        B, S, _ = x.shape
        hd = c.hidden // c.heads
        h = self.attn_norm(x)
        # head counts read off the projections' outputs: under head-parallel tensor parallelism
        # (polyparallel.backends.torch) they hold this rank's heads only
        q, k, v = (p(h).view(B, S, -1, hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.kv_heads != c.heads)
        x = x + self.o(a.transpose(1, 2).reshape(B, S, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """A LLaMA-style decoder; ``forward(ids, labels=None)`` returns the loss when labels are given."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden, c.eps)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        hd = c.hidden // c.heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(c.seq, dtype=torch.float32), inv)
        self.register_buffer("cos", torch.cat((ang, ang), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((ang, ang), -1).sin(), persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        S = ids.shape[1]
        cos, sin = self.cos[:S], self.sin[:S]
        x = self.embed(ids)
        for blk in self.layers:
            x = blk(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


# ----------------------------------------------------------------------------------------
# CNNs


class MLP(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (784, 512, 512, 10)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x if labels is None else F.cross_entropy(x, labels)


class SmallCNN(nn.Module):
    """A small CNN for 28x28 grey images (Fashion-MNIST sized)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 7 * 7, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = self.fc(x.flatten(1))
        return x if labels is None else F.cross_entropy(x, labels)


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet with bottleneck blocks; ``(3, 4, 6, 3)`` is ResNet-50 (25.6M parameters)."""

    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for i, n in enumerate(blocks):
            width = 64 * 2**i
            for j in range(n):
                layers.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * 4
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layers(x)
        x = self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))
        return x if labels is None else F.cross_entropy(x, labels)


# ----------------------------------------------------------------------------------------
# registry

Built = tuple[nn.Module, tuple, dict]


Sample = Callable[[int, int | None, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Example:
    name: str
    description: str
    build: Callable[[int, int | None], Built]  # (batch, seq) -> (model, args, kwargs)
    default_batch: int
    default_seq: int | None = None
    sample: Sample | None = None  # (batch, seq, generator) -> a synthetic (inputs, labels) batch
    meta: bool = False  # built on the meta device: for planning only


def _lm(model_cls: Callable[[Any], nn.Module], config: Any, meta: bool) -> Callable[..., Built]:
    """A built-in LM at sequence length ``s`` (default: the config's) and ``layers`` blocks."""

    def build(batch: int, s: int | None, layers: int | None = None) -> Built:
        cfg = replace(config, seq=s or config.seq, layers=layers or config.layers)
        dev = torch.device("meta") if meta else torch.device("cpu")
        with dev:
            model = model_cls(cfg)
        ids = torch.zeros(batch, cfg.seq, dtype=torch.long, device=dev)
        return model, (ids,), {"labels": ids}

    return build


def _tokens(vocab: int, seq: int) -> Sample:
    """Random token ids and the next token of each as its label."""

    def sample(batch: int, s: int | None, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch, (s or seq) + 1), generator=g)
        return ids[:, :-1], ids[:, 1:]

    return sample


def _vision(model_fn: Callable[[], nn.Module], shape: tuple[int, ...], classes: int, meta: bool):
    def build(batch: int, _: int | None) -> Built:
        dev = torch.device("meta") if meta else torch.device("cpu")
        with dev:
            model = model_fn()
        x = torch.zeros(batch, *shape, device=dev)
        y = torch.zeros(batch, dtype=torch.long, device=dev)
        return model, (x,), {"labels": y}

    return build


def _images(shape: tuple[int, ...], classes: int) -> Sample:
    """Gaussian images (or feature rows) and uniformly drawn classes."""

    def sample(batch: int, _: int | None, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g)

    return sample


def _hf(kind: str) -> Callable[[int, int | None], Built]:
    def build(batch: int, s: int | None) -> Built:
        try:
            import transformers as tf
        except ImportError as e:
            raise ValueError(f"example hf-{kind} needs the 'transformers' package (pip install transformers)") from e
        s = s or 128
        if kind == "gpt2":
            model = tf.GPT2LMHeadModel(tf.GPT2Config(use_cache=False))
        elif kind == "llama":
            model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                                       num_attention_heads=8, num_key_value_heads=4, use_cache=False))
        else:
            model = tf.BertForMaskedLM(tf.BertConfig())
        ids = torch.zeros(batch, s, dtype=torch.long)
        return model, (ids,), {"labels": ids}

    return build


_GPT_TINY = GPTConfig(vocab=512, seq=64, layers=2, hidden=64, heads=4)
_GPT2_SMALL = GPTConfig()
_GPT3 = GPTConfig(vocab=50257, seq=2048, layers=96, hidden=12288, heads=96)
_LLAMA_1B = LlamaConfig(vocab=32000, seq=2048, layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192)
_LLAMA_8B = LlamaConfig(vocab=128256, seq=8192, layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336)

EXAMPLES: dict[str, Example] = {
    e.name: e
    for e in [
        Example("mlp", "MLP 784-512-512-10", _vision(MLP, (784,), 10, False), 64, sample=_images((784,), 10)),
        Example("cnn", "small CNN for 28x28 images (2 conv + BN)", _vision(SmallCNN, (1, 28, 28), 10, False), 64,
                sample=_images((1, 28, 28), 10)),
        Example("resnet50", "ResNet-50, 224x224 images, 25.6M params (meta)",
                _vision(ResNet, (3, 224, 224), 1000, True), 32, meta=True),
        Example("gpt-tiny", "2-layer GPT, hidden 64, seq 64", _lm(GPT, _GPT_TINY, False), 8, 64,
                sample=_tokens(_GPT_TINY.vocab, _GPT_TINY.seq)),
        Example("gpt2-small", "GPT-2 small, 124M params, seq 1024 (meta)",
                _lm(GPT, _GPT2_SMALL, True), 8, 1024, meta=True),
        Example("llama-1b", "LLaMA-style 1.2B, 16 layers, GQA (meta)",
                _lm(Llama, _LLAMA_1B, True), 4, 2048, meta=True),
        Example("llama-8b", "LLaMA-3-8B shape, 32 layers, GQA (meta)",
                _lm(Llama, _LLAMA_8B, True), 1, 8192, meta=True),
        Example("gpt3-175b", "GPT-3 175B, 96 layers, hidden 12288, seq 2048 (meta)",
                _lm(GPT, _GPT3, True), 1, 2048, meta=True),
        Example("hf-gpt2", "transformers GPT-2 (124M) from a config", _hf("gpt2"), 2, 128),
        Example("hf-llama", "transformers LLaMA (4 layers, hidden 512) from a config", _hf("llama"), 2, 128),
        Example("hf-bert", "transformers BERT-base MLM from a config", _hf("bert"), 2, 128),
    ]
}


def load_model(spec: str, *, batch_size: int | None = None, seq_len: int | None = None,
               layers: int | None = None) -> Any:
    """Resolve a MODEL argument into something :func:`polyparallel.capture` takes.

    ``batch_size`` (the example batch), ``seq_len`` and ``layers`` size a built-in example; a
    user's model is sized by its own function. Returns either an ``.onnx`` path or a
    ``(module, args, kwargs)`` triple.
    """
    for name, v in (("batch size", batch_size), ("sequence length", seq_len), ("layers", layers)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} {v!r}: give a whole number >= 1")
    if spec in EXAMPLES:
        ex = EXAMPLES[spec]
        if seq_len is not None and ex.default_seq is None:
            raise ValueError(f"example {spec!r} has no sequence; drop --seq")
        if layers is not None:
            if "layers" not in inspect.signature(ex.build).parameters:
                raise ValueError(f"example {spec!r} has a fixed depth; drop --layers")
            return ex.build(batch_size or ex.default_batch, seq_len or ex.default_seq, layers)
        return ex.build(batch_size or ex.default_batch, seq_len or ex.default_seq)
    if seq_len is not None or layers is not None:
        raise ValueError(f"--seq and --layers size the built-in examples; {spec!r} is sized by its own function "
                         "(change the example inputs it returns)")
    if spec.endswith(".onnx"):
        p = Path(spec)
        if not p.exists():
            raise FileNotFoundError(f"ONNX file {spec!r} does not exist")
        return p
    if ":" in spec:
        out = call_user(resolve(spec, "model"), f"the model function {spec}:")
        if not isinstance(out, tuple) or len(out) not in (2, 3):
            raise ValueError(f"{spec} must return (model, args) or (model, args, kwargs), got {type(out).__name__}")
        model, args = out[0], out[1]
        kwargs = out[2] if len(out) == 3 else {}
        return model, args if isinstance(args, tuple) else (args,), kwargs
    names = ", ".join(EXAMPLES)
    raise ValueError(f"unknown model {spec!r}: give an .onnx path, package.module:function, or one of: {names}")


def trainable_example(name: str, synthetic: bool = False) -> Example:
    """The built-in example ``name`` if ``polyparallel train --model NAME`` can train it (on its
    synthetic batches too, with ``synthetic``); otherwise ValueError naming what can be trained."""
    ex = EXAMPLES.get(name)
    if ex is None:
        raise ValueError(f"unknown example {name!r}; trainable examples: {', '.join(trainable_examples())}")
    if ex.meta:
        raise ValueError(f"example {name!r} is built on the meta device, for planning only; train one of "
                         f"{', '.join(trainable_examples())} or your own model (--model package.module:function)")
    if synthetic and ex.sample is None:
        raise ValueError(f"example {name!r} has no synthetic data; give --data package.module:function")
    return ex


def example_module(name: str) -> nn.Module:
    """The built-in example ``name``'s module with real weights, as ``polyparallel train --model NAME``
    builds it on every rank (the torch seed decides the weights)."""
    return trainable_example(name).build(1, None)[0]


def example_batch(name: str, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic global batch ``step`` of the example ``name`` (the same on every rank): what
    ``polyparallel train --model NAME`` trains on when no ``--data`` is given."""
    sample = trainable_example(name, synthetic=True).sample
    assert sample is not None  # trainable_example checked it
    return sample(batch, None, torch.Generator().manual_seed(1000 + step))


def trainable_examples() -> list[str]:
    return [n for n, e in EXAMPLES.items() if not e.meta and e.sample is not None]


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


