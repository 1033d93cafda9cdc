"""Which samples each rank reads at each step: a pure function of (seed, step), never of state.

The stream of samples is the concatenation of epochs; epoch e is a permutation of the dataset
that depends on the seed and e only (identity when shuffle is off). Step i consumes stream
positions i*B .. i*B+B-1, so with shuffle off step i reads samples (i*B + j) mod N, as the
contract says. Rank r of D data-parallel ranks takes the r-th contiguous 1/D of that global batch.
Because nothing but the step number is needed, resuming mid-epoch is exact by construction.
"""
from __future__ import annotations

import torch


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch: int, shuffle: bool, seed: int):
        if num_samples <= 0:
            raise ValueError("empty dataset")
        self.n = num_samples
        self.global_batch = global_batch
        self.shuffle = shuffle
        self.seed = seed
        self._epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._epoch = torch.randperm(self.n, generator=g), epoch
        return self._perm

    def global_indices(self, step: int) -> torch.Tensor:
        pos = torch.arange(step * self.global_batch, (step + 1) * self.global_batch)
        if not self.shuffle:
            return pos % self.n
        epochs = pos // self.n
        out = torch.empty_like(pos)
        for e in epochs.unique().tolist():  # a batch spans at most two epochs unless B > N
            mask = epochs == e
            out[mask] = self._permutation(e)[pos[mask] % self.n]
        return out

    def rank_indices(self, step: int, rank: int, world: int) -> torch.Tensor:
        share = self.global_batch // world
        return self.global_indices(step)[rank * share:(rank + 1) * share]
