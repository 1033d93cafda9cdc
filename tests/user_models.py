"""User model factories (`module:function`), as a user's own code would define them: built by their
own construction code, not by paratrain's built-ins."""

from torch import nn


def wide_mlp(in_features: int = 1024, hidden: int = 4096, layers: int = 4, classes: int = 10) -> nn.Sequential:
    """A plain nn.Sequential MLP; at the defaults 54.6M parameters (the memory benchmark's size)."""
    widths = [in_features] + [hidden] * layers
    blocks = []
    for a, b in zip(widths, widths[1:]):
        blocks += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(widths[-1], classes))
