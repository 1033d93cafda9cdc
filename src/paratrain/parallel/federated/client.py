"""One simulated client's local training: start from the global weights, take `local_steps`
optimizer steps on its own batches, and return its update (delta = local - global).

A worker rank simulates its clients one after another in ONE model and one optimizer, reloaded
per client, so its memory does not grow with the number of clients. Clients keep no state across
rounds (the optimizer's state is cleared per client), as in FedAvg and FedProx.

fedprox adds mu/2 |w - w_global|^2 to the local loss (Li et al. 2020), i.e. mu (w - w_global) to
each gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from paratrain.data import load_batch
from paratrain.data.batch import feed, to_device
from paratrain.optim import build_optimizer
from paratrain.parallel.base import unique_parameters


class LocalTrainer:
    def __init__(self, model: nn.Module, loss_fn: Callable, cfg, device: torch.device):
        self.model, self.loss_fn, self.device = model, loss_fn, device
        self.params = [p for _, p in unique_parameters(model)]
        self.optimizer = build_optimizer(self.params, cfg.train)
        self.mu = cfg.federated.mu if cfg.federated.algorithm == "fedprox" else 0.0

    def train(
        self, global_flat: torch.Tensor, dataset, batches: list[np.ndarray], profiler
    ) -> tuple[torch.Tensor, float]:
        """(delta, mean local loss) of one client from `global_flat` over its `batches`."""
        start = global_flat.to(self.device)
        copy_into(self.params, start)
        self.optimizer.state.clear()
        anchors = [p.detach().clone() for p in self.params] if self.mu else None
        total = 0.0
        for idx in batches:
            x, y = to_device(load_batch(dataset, torch.from_numpy(idx)), self.device)
            self.optimizer.zero_grad(set_to_none=False)
            with profiler.phase("forward"):
                loss = self.loss_fn(feed(self.model, x), y)
            with profiler.phase("backward"):
                loss.backward()
            if anchors is not None:
                grads = [cast(torch.Tensor, p.grad) for p in self.params]  # set by the backward above
                torch._foreach_add_(
                    grads, torch._foreach_sub([p.detach() for p in self.params], anchors), alpha=self.mu
                )
            with profiler.phase("optimizer"):
                self.optimizer.step()
            total += float(loss.detach())
        with torch.no_grad():
            delta = parameters_to_vector(self.params).sub_(start)
        return delta.cpu(), total / max(len(batches), 1)


@torch.no_grad()
def copy_into(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat vector into the parameters (torch's vector_to_parameters would make them views
    of it, and training would then write into the global weights)."""
    offset = 0
    for p in params:
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
