"""The model, optimizer and data of tests/own_loop_script.py, and the plain-PyTorch loop it must equal."""

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BATCH = 12


def build(optimizer: str):
    """A small MLP, its optimizer in two param groups (no weight decay on biases), a shuffled loader."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9) if optimizer == "sgd" else torch.optim.AdamW(groups, lr=0.01)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 5, generator=g), torch.randn(40, 3, generator=g))
    return model, opt, DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)


def reference(optimizer: str, steps: int, clip: float = 0.0) -> dict:
    """One process, plain PyTorch, the batches in the documented order: epoch e is the
    permutation torch.randperm(N) draws from seed 0 * 1_000_003 + e, cut into batches."""
    model, opt, loader = build(optimizer)
    x_all, y_all = loader.dataset.tensors
    n, step, epoch = len(x_all), 0, 0
    while step < steps:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).numpy()
        for b in range(n // BATCH):
            ids = perm[np.arange(b * BATCH, (b + 1) * BATCH)]
            loss = nn.functional.mse_loss(model(x_all[ids]), y_all[ids])
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            step += 1
            if step == steps:
                break
        epoch += 1
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
