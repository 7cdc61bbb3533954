"""A small MLP for 28×28 grey images, written as a user model (``models.mlp_small:mlp``).

Flatten, two hidden layers of 128 and 64 with ReLU, a linear classifier: about 109k parameters. The task-group
benchmark (``benchmarks/tasks_fusion.py``) trains it beside the residual ``models.resnet_small:resnet`` and fuses
the two.
"""

from __future__ import annotations

from torch import nn


def mlp() -> nn.Module:
    """784 → 128 → 64 → 10 with ReLU."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                         nn.Linear(64, 10))
