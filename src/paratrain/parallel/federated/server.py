"""The server's side of a round: which clients train, and how their updates become the new
global model.

Updates are deltas (client weights after local training minus the global weights they started
from), averaged with weights n_i / sum(n) over the clients that reported (n_i: a client's sample
count). The server then steps:
    fedavg, fedprox  w <- w + server_lr * mean_delta             (server_lr 1: plain FedAvg)
    fedadam          m <- b1 m + (1 - b1) d;  v <- b2 v + (1 - b2) d^2;
                     w <- w + server_lr * m / (sqrt(v) + tau)   (Reddi et al. 2021, "Adaptive
                                                                 Federated Optimization")
"""

from __future__ import annotations

import numpy as np
import torch

FEDADAM_BETAS = (0.9, 0.99)
FEDADAM_TAU = 1e-3  # the paper's adaptivity floor: keeps coordinates with tiny v from exploding


def sample_clients(seed: int, round_index: int, clients: int, per_round: int) -> list[int]:
    """The round's clients, drawn without replacement from a generator seeded by (seed, round)
    alone: every rank draws the same set, and a resumed run the same as an unbroken one."""
    rng = np.random.default_rng([seed, 0x5A3, round_index])
    return sorted(int(c) for c in rng.choice(clients, size=per_round, replace=False))


def owner_of(client: int, workers: list[int]) -> int:
    """The rank that simulates `client`: clients are dealt round-robin over the worker ranks."""
    return workers[client % len(workers)]


class ServerOptimizer:
    """Applies the round's mean delta to the flat global weights; holds fedadam's moments."""

    def __init__(self, algorithm: str, server_lr: float, numel: int):
        self.algorithm, self.server_lr = algorithm, server_lr
        self.m = torch.zeros(numel) if algorithm == "fedadam" else None
        self.v = torch.zeros(numel) if algorithm == "fedadam" else None

    @torch.no_grad()
    def step(self, weights: torch.Tensor, mean_delta: torch.Tensor) -> None:
        if self.algorithm != "fedadam":
            weights.add_(mean_delta, alpha=self.server_lr)
            return
        assert self.m is not None and self.v is not None  # fedadam's moments
        b1, b2 = FEDADAM_BETAS
        self.m.mul_(b1).add_(mean_delta, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(mean_delta, mean_delta, value=1 - b2)
        weights.addcdiv_(self.m, self.v.sqrt().add_(FEDADAM_TAU), value=self.server_lr)

    def state(self) -> dict[str, torch.Tensor]:
        return {} if self.m is None or self.v is None else {"server_opt.m": self.m, "server_opt.v": self.v}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.m is not None and self.v is not None:
            self.m.copy_(tensors["server_opt.m"])
            self.v.copy_(tensors["server_opt.v"])
