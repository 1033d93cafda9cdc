"""Multi-layer perceptron, as an nn.Sequential so a pipeline can cut it anywhere."""

from torch import nn

from paratrain.config import require, require_at_least


def mlp(
    in_features: int = 64, hidden: int = 256, n_layers: int = 2, out_features: int = 10, dropout: float = 0.0
) -> nn.Sequential:
    require_at_least(1, in_features=in_features, hidden=hidden, out_features=out_features)
    require_at_least(0, n_layers=n_layers)
    require(0 <= dropout < 1, "dropout", f"must be in [0, 1), got {dropout}")
    layers, width = [], in_features
    for _ in range(n_layers):
        layers += [nn.Linear(width, hidden), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])
        width = hidden
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)
