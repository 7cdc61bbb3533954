"""Small models and deterministic data for ``polyparallel train`` and the backend's tests."""

from __future__ import annotations

from collections.abc import Collection

import torch

from polyparallel.models import GPT, MLP, GPTConfig

__all__ = ["gpt_data", "gpt_example", "mlp_data", "single_process_losses", "tiny_gpt", "tiny_gpt_explicit", "tiny_mlp"]

BATCH = 8


def tiny_mlp() -> MLP:
    return MLP((32, 64, 64, 8))


def mlp_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)  # the same batch on every rank
    return torch.randn(BATCH, 32, generator=g), torch.randint(0, 8, (BATCH,), generator=g)


def tiny_gpt() -> GPT:
    return GPT(GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4))


def tiny_gpt_explicit() -> GPT:
    """``tiny_gpt`` with its attention written out (scores, causal mask, softmax, weighted sum), as
    GPT-2's reference code and Megatron-LM before fused kernels compute it."""
    return GPT(GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4, attention="explicit"))


def gpt_example() -> tuple[GPT, tuple[torch.Tensor], dict[str, torch.Tensor]]:
    """``tiny_gpt`` with one global batch, for ``polyparallel search`` (MODEL ``package.module:function``):
    the strategy's fingerprint is then the one ``polyparallel train --model ...:tiny_gpt`` checks."""
    x, y = gpt_data(0)
    return tiny_gpt(), (x,), {"labels": y}


def gpt_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, 64, (BATCH, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


def single_process_losses(model_fn, data_fn, *, steps: int, lr: float, seed: int,
                          optimizer: str = "sgd", skip_steps: Collection[int] = ()) -> list[float]:
    """The reference a distributed run is compared with: one process trains ``model_fn()`` on the
    whole global batch ``data_fn(step)`` with ``optimizer`` (sgd, adam, adamw: torch's, as the
    workers make them), from the same seed; the loss of every step. No optimizer step is taken at
    ``skip_steps`` (those an fp16 run skipped because its scaled gradients overflowed)."""
    torch.set_flush_denormal(True)  # as the ranks run (_entry.py)
    torch.manual_seed(seed)
    m = model_fn()
    opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[optimizer](
        m.parameters(), lr=lr)
    out = []
    for step in range(steps):
        x, y = data_fn(step)
        opt.zero_grad()
        loss = m(x, y)
        loss.backward()
        if step not in skip_steps:
            opt.step()
        out.append(loss.item())
    return out
