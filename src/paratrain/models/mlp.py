"""Multi-layer perceptron, as an nn.Sequential so a pipeline can cut it anywhere."""

from torch import nn

from paratrain.config import require_at_least


def mlp(in_features: int = 64, hidden: int = 256, n_layers: int = 2, out_features: int = 10) -> nn.Sequential:
    require_at_least(1, in_features=in_features, hidden=hidden, out_features=out_features)
    require_at_least(0, n_layers=n_layers)
    layers, width = [], in_features
    for _ in range(n_layers):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)
