"""A small convolutional net for 8x8 single-channel images given as flat 64-vectors (digits)."""

from torch import nn

from paratrain.config import require, require_at_least


def cnn(in_features: int = 64, channels: int = 32, hidden: int = 128, out_features: int = 10) -> nn.Sequential:
    require_at_least(1, channels=channels, hidden=hidden, out_features=out_features)
    side = int(round(max(in_features, 0) ** 0.5))
    require(
        side * side == in_features and side > 0 and side % 2 == 0,
        "in_features",
        f"cnn expects square images of even side, got {in_features} features",
    )
    return nn.Sequential(
        nn.Unflatten(1, (1, side, side)),
        nn.Conv2d(1, channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * channels * (side // 2) ** 2, hidden),
        nn.ReLU(),
        nn.Linear(hidden, out_features),
    )
