"""Plain single-process PyTorch training: the oracle every strategy is compared with.

It knows nothing of paratrain's internals: batches follow the contract's `shuffle = false` rule,
step i reads samples (i*B + j) mod N, and the model is built with the seed the config names.
"""

from __future__ import annotations

import contextlib

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
    micro: int = 0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """`micro` > 0: each step in micro-batches of that many samples (the mean of their losses),
    micro-batch k of step s on torch's RNG seeded as the contract says (micro_batch_seed(seed, s,
    k)): dropout draws the same for a sample whichever rank computes it. One thread: a tiny model's
    ops on several contend for the cores the test's workers use (measured: 2 s instead of 130)."""
    from paratrain.runtime.process import micro_batch_seed

    loss_fn = loss_fn or (lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)))
    opt = (
        torch.optim.SGD(model.parameters(), lr=lr)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    )
    n = len(inputs)
    with _one_thread():
        for step in range(steps):
            if step in skip_steps:  # a step whose batch had a non-finite value: no update
                continue
            idx = torch.arange(step * batch_size, (step + 1) * batch_size) % n
            opt.zero_grad()
            if micro:
                for k, part in enumerate(idx.split(micro)):
                    torch.manual_seed(micro_batch_seed(seed, step, k))
                    (loss_fn(model(inputs[part]), targets[part]) * len(part) / batch_size).backward()
            else:
                loss_fn(model(inputs[idx]), targets[idx]).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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


def digits_mlp_reference(steps: int = 20, lr: float = 0.1, dropout: float = 0.0, **kwargs) -> dict[str, torch.Tensor]:
    """DIGITS_MLP trained in one plain process (kwargs: optimizer, clip, skip_steps, micro)."""
    from paratrain.data.datasets import digits
    from paratrain.models.mlp import mlp

    x, y = digits("train").tensors
    torch.manual_seed(0)
    return train_reference(
        mlp(64, hidden=32, n_layers=2, out_features=10, dropout=dropout),
        x,
        y,
        steps=steps,
        batch_size=24,
        lr=lr,
        **kwargs,
    )
