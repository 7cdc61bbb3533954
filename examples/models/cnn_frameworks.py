"""One user CNN for 28x28 one-channel images, written once per framework, for a four-framework federation.

``--model models.cnn_frameworks:torch_cnn --builder mindspore=models.cnn_frameworks:mindspore_cnn
--builder paddle=models.cnn_frameworks:paddle_cnn --builder tensorflow=models.cnn_frameworks:keras_cnn``
(with ``examples/`` on the path). Each framework's version names its layers its own way; the center infers
the map to the torch model's tensors from order, shapes and layouts and checks it before round 1.

conv 3x3 (16) -> BatchNorm -> ReLU -> max-pool 2 -> conv 3x3 (32) -> BatchNorm -> ReLU -> max-pool 2
-> flatten -> Linear 1568 -> 64 -> ReLU -> Linear 64 -> 10   (~106k parameters)
"""

from __future__ import annotations

from typing import Any

C1, C2, HIDDEN, CLASSES = 16, 32, 64, 10
FLAT = C2 * 7 * 7


def torch_cnn() -> Any:
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, C1, 3, padding=1), nn.BatchNorm2d(C1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(C1, C2, 3, padding=1), nn.BatchNorm2d(C2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(FLAT, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def mindspore_cnn() -> Any:
    from mindspore import nn, ops

    class CNN(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.conv_a = nn.Conv2d(1, C1, 3, pad_mode="pad", padding=1, has_bias=True)
            self.norm_a = nn.BatchNorm2d(C1, eps=1e-5, momentum=0.9)  # torch's momentum 0.1
            self.conv_b = nn.Conv2d(C1, C2, 3, pad_mode="pad", padding=1, has_bias=True)
            self.norm_b = nn.BatchNorm2d(C2, eps=1e-5, momentum=0.9)
            self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
            self.hidden = nn.Dense(FLAT, HIDDEN)
            self.out = nn.Dense(HIDDEN, CLASSES)

        def construct(self, x: Any) -> Any:
            x = self.pool(ops.relu(self.norm_a(self.conv_a(x))))
            x = self.pool(ops.relu(self.norm_b(self.conv_b(x))))
            return self.out(ops.relu(self.hidden(x.reshape(x.shape[0], -1))))

    return CNN()


def paddle_cnn() -> Any:
    from paddle import nn
    from paddle.nn import functional as F

    class CNN(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(nn.Conv2D(1, C1, 3, padding=1), nn.BatchNorm2D(C1, momentum=0.9),
                                          nn.ReLU(), nn.MaxPool2D(2), nn.Conv2D(C1, C2, 3, padding=1),
                                          nn.BatchNorm2D(C2, momentum=0.9), nn.ReLU(), nn.MaxPool2D(2))
            self.fc1 = nn.Linear(FLAT, HIDDEN)  # Paddle keeps [in, out]: the map transposes it
            self.fc2 = nn.Linear(HIDDEN, CLASSES)

        def forward(self, x: Any) -> Any:
            return self.fc2(F.relu(self.fc1(self.features(x).flatten(1))))

    return CNN()


def keras_cnn() -> Any:
    import keras
    from keras import layers

    # Keras convolves channels-last: NCHW rows in, NHWC for the convolutions, NCHW again before flattening
    return keras.Sequential([
        keras.Input((1, 28, 28)), layers.Permute((2, 3, 1)),
        layers.Conv2D(C1, 3, padding="same"), layers.BatchNormalization(momentum=0.9, epsilon=1e-5), layers.ReLU(),
        layers.MaxPooling2D(2),
        layers.Conv2D(C2, 3, padding="same"), layers.BatchNormalization(momentum=0.9, epsilon=1e-5), layers.ReLU(),
        layers.MaxPooling2D(2),
        layers.Permute((3, 1, 2)), layers.Flatten(), layers.Dense(HIDDEN, activation="relu"), layers.Dense(CLASSES)])
