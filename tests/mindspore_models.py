"""A small network in torch and as a MindSpore Cell with other layer names (tests of the MindSpore export)."""

from __future__ import annotations

from typing import Any


def torch_mlp() -> tuple[Any, tuple[Any, ...]]:
    """(model, args) for `polyparallel search`: Linear 16->32, LayerNorm, ReLU, Linear 32->8; batch 8."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 8))
    return model, (torch.randn(8, 16),)


def mindspore_mlp() -> Any:
    """The same network as a MindSpore Cell, named its own way."""
    from mindspore import nn, ops

    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Dense(16, 32)
            self.ln = nn.LayerNorm((32,), epsilon=1e-5)
            self.head = nn.Dense(32, 8)

        def construct(self, x: Any) -> Any:
            return self.head(ops.relu(self.ln(self.inp(x))))

    return Net()


def mindspore_wrong() -> Any:
    """A Cell whose first layer is a Conv: the map must refuse it."""
    from mindspore import nn

    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Conv1d(16, 32, 1, has_bias=True)
            self.ln = nn.LayerNorm((32,), epsilon=1e-5)
            self.head = nn.Dense(32, 8)

        def construct(self, x: Any) -> Any:
            return self.head(self.ln(self.inp(x)))

    return Net()
