"""Plain single-process PyTorch training: the oracle every strategy is compared with.

It knows nothing of paratrain's internals: batches follow the contract's `shuffle = false` rule,
step i reads samples (i*B + j) mod N, and the model is built with the seed the config names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def train_reference(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    optimizer: str = "sgd",
    clip: float = 0.0,
    loss_fn=None,
    skip_steps=(),
) -> dict[str, torch.Tensor]:
    loss_fn = loss_fn or (lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)))
    opt = (
        torch.optim.SGD(model.parameters(), lr=lr)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    )
    n = len(inputs)
    for step in range(steps):
        if step in skip_steps:  # a step whose batch had a non-finite value: no update
            continue
        idx = torch.arange(step * batch_size, (step + 1) * batch_size) % n
        opt.zero_grad()
        loss_fn(model(inputs[idx]), targets[idx]).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# The job most equivalence tests share: a small MLP on digits, the contract's unshuffled batches.
DIGITS_MLP = """
name = "equiv"
[model]
factory = "mlp"
hidden = 32
[data]
factory = "digits"
batch_size = 24
shuffle = false
[train]
steps = 20
optimizer = "sgd"
lr = 0.1
log_every = 10
"""


def digits_mlp_reference(steps: int = 20, lr: float = 0.1, **kwargs) -> dict[str, torch.Tensor]:
    """DIGITS_MLP trained in one plain process (kwargs: optimizer, clip, skip_steps)."""
    from paratrain.data.datasets import digits
    from paratrain.models.mlp import mlp

    x, y = digits("train").tensors
    torch.manual_seed(0)
    return train_reference(
        mlp(64, hidden=32, n_layers=2, out_features=10), x, y, steps=steps, batch_size=24, lr=lr, **kwargs
    )
