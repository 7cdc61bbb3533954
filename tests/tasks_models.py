"""The task-group tests' user code: a residual CNN and an MLP for scikit-learn's 8×8 digits (given to task
files as ``tests.tasks_models:resnet`` and ``tests.tasks_models:mlp``), a data source, and a helper that
writes a digits task folder (centers' .npz files, an evaluation set, a public set and the task file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch.nn.functional as F
import yaml
from torch import nn


class Block(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResCNN(nn.Module):
    """A stem, one residual block, 2×2 pooling, global average pooling and a linear classifier."""

    def __init__(self, ch: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU())
        self.block = Block(ch)
        self.fc = nn.Linear(ch, classes)

    def forward(self, x):
        return self.fc(F.max_pool2d(self.block(self.stem(x)), 2).mean(dim=(2, 3)))


def resnet() -> nn.Module:
    return ResCNN()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data / 16).reshape(-1, 1, 8, 8).astype(np.float32), d.target.astype(np.int64)


def center_digits(center: str) -> tuple[np.ndarray, np.ndarray]:
    """A data source: center ``c<i>`` gets every 7th of the first 1000 shuffled rows from row ``i``."""
    x, y = digits()
    rows = np.random.default_rng(0).permutation(len(y))[:1000][int(center[1:])::7]
    return x[rows], y[rows]


def write_digits_tasks(folder: Path, centers: int = 4, names: list[str] | None = None, **overrides: Any) -> Path:
    """A digits task folder: rows 0..999 (shuffled) over ``centers`` centers (c0, c1, ...), rows 1000..1299 as
    the public set (labels dropped), 1300..1796 as the evaluation set; two groups, the residual CNN on the first
    half of the centers and the MLP on the second; ``names``: the centers' names (default c0, c1, ...).
    ``overrides`` replace top-level keys (None drops one); returns the task file's path."""
    folder.mkdir(parents=True, exist_ok=True)
    x, y = digits()
    order = np.random.default_rng(0).permutation(len(y))
    for i in range(centers):
        rows = order[:1000][i::centers]
        np.savez(folder / f"c{i}.npz", x=x[rows], y=y[rows])
    np.savez(folder / "public.npz", x=x[order[1000:1300]])
    np.savez(folder / "eval.npz", x=x[order[1300:]], y=y[order[1300:]])
    half = centers // 2
    task = {
        "algorithms": {"resnet": {"model": "tests.tasks_models:resnet", "framework": "torch", "loss": "auto"},
                       "mlp": {"model": "tests.tasks_models:mlp"}},
        "datasets": {f"d{i}": {"path": f"c{i}.npz", "center": (names or [])[i] if names else f"c{i}"}
                     for i in range(centers)},
        "groups": {"cnn": {"algorithm": "resnet", "datasets": [f"d{i}" for i in range(half)]},
                   "dense": {"algorithm": "mlp", "datasets": [f"d{i}" for i in range(half, centers)]}},
        "eval": "eval.npz", "public": "public.npz", "fusion": "auto",
        "training": {"rounds": 3, "local_steps": 15, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
        "distill": {"steps": 200, "check_every": 50},
    }
    task.update(overrides)
    task = {k: v for k, v in task.items() if v is not None}
    path = folder / "tasks.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False))
    return path
