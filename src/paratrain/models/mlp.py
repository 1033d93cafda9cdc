"""Multi-layer perceptron, as an nn.Sequential so a pipeline can cut it anywhere."""
from torch import nn

from ..config import require


def mlp(in_features: int = 64, hidden: int = 256, n_layers: int = 2, out_features: int = 10) -> nn.Sequential:
    for arg, value in (("in_features", in_features), ("hidden", hidden), ("out_features", out_features)):
        require(value >= 1, arg, f"must be >= 1, got {value}")
    require(n_layers >= 0, "n_layers", f"must be >= 0 (hidden layers), got {n_layers}")
    layers, width = [], in_features
    for _ in range(n_layers):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)
