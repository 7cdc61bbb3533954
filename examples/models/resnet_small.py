"""A small ResNet for 28×28 grey images, written as a user model (``models.resnet_small:resnet``).

Three residual stages (8, 16, 32 channels; the last two halve the resolution), one basic block each
(two 3×3 convs with BatchNorm and an identity or 1×1 projection shortcut), global average pooling and
a linear classifier: about 20k parameters, so five centers train it on a CPU in minutes (``resnet16``: the
same at the CIFAR ResNets' 16, 32 and 64 channels, 78k). Collaborative training exchanges its
``state_dict`` under these names (BatchNorm running statistics included).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetSmall(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (8, 16, 32), num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(BasicBlock(cin, w, 1 if i == 0 else 2))
            cin = w
        self.stages = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.fc(self.stages(self.stem(x)).mean(dim=(2, 3)))


def resnet() -> nn.Module:
    """The collaborative experiments' ResNet: stages of 8, 16 and 32 channels, 10 classes."""
    return ResNetSmall()


def resnet16() -> nn.Module:
    """The same ResNet at the widths of the CIFAR ResNets (stages of 16, 32 and 64 channels, about 78k
    parameters): the size where pruning half of it is removing redundancy rather than capacity."""
    return ResNetSmall((16, 32, 64))
