"""Which samples each rank reads at each step: a pure function of (seed, stream position).

The stream of samples is the concatenation of epochs; epoch e is a permutation of the dataset
that depends on the seed and e only (identity when shuffle is off). Step i consumes stream
positions i*B .. i*B+B-1, so with shuffle off step i reads samples (i*B + j) mod N, as the
contract says. Rank r of D data-parallel ranks takes the r-th contiguous 1/D of that global batch.
Every checkpoint records the data position (epoch, sample in epoch) of its step; a resume goes on
from that position, so the next sample is the exact next one at any world size, and also where
the batch size changed since.
"""

from __future__ import annotations

import numpy as np
import torch


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch: int, shuffle: bool, seed: int):
        if num_samples <= 0:
            raise ValueError("empty dataset")
        self.n = num_samples
        self.global_batch = global_batch
        self.shuffle = shuffle
        self.seed = seed
        self._origin = (0, 0)  # (step, stream position): where step 0, or the resumed step, starts
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _generator(self, epoch: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm, self._epoch = torch.randperm(self.n, generator=self._generator(epoch)).numpy(), epoch
        return self._perm

    def epoch_ids(self, epoch: int, offsets: np.ndarray) -> np.ndarray:
        """The samples at `offsets` within epoch `epoch`."""
        return self._permutation(epoch)[offsets] if self.shuffle else offsets

    # -- the data position ----------------------------------------------------------------------
    def first_position(self, step: int) -> int:
        origin_step, origin_position = self._origin
        return origin_position + (step - origin_step) * self.global_batch

    def position(self, step: int) -> dict:
        """Where the stream stands before `step` (after `step` steps): what a checkpoint records."""
        epoch, offset = divmod(self.first_position(step), self.n)
        return {"epoch": epoch, "sample_in_epoch": offset}

    def resume_at(self, step: int, position: dict | None) -> None:
        """Go on from a checkpoint of `step` that recorded `position` (None: a checkpoint from
        before positions were recorded, whose step says it)."""
        if position is None:
            self._origin = (0, 0)
            return
        epoch, offset = int(position["epoch"]), int(position["sample_in_epoch"])
        if not 0 <= offset < self.n:
            raise ValueError(
                f"the checkpoint's data position (epoch {epoch}, sample {offset}) is past "
                f"the {self.n} samples of the dataset"
            )
        self._origin = (step, epoch * self.n + offset)

    # -- batches --------------------------------------------------------------------------------
    def global_indices(self, step: int) -> torch.Tensor:
        # NumPy inside: a step's indices take a dozen small operations, cheaper there than in torch.
        first = self.first_position(step)
        epoch, offset = divmod(first, self.n)
        if offset + self.global_batch <= self.n:  # within one epoch, as most batches are: a slice
            return torch.from_numpy(self.epoch_ids(epoch, np.arange(offset, offset + self.global_batch)))
        pos = np.arange(first, first + self.global_batch)
        epochs = pos // self.n
        out = np.empty_like(pos)
        for e in np.unique(epochs).tolist():  # a batch spans at most two epochs unless B > N
            mask = epochs == e
            out[mask] = self.epoch_ids(e, pos[mask] % self.n)
        return torch.from_numpy(out)

    def rank_indices(self, step: int, rank: int, world: int) -> torch.Tensor:
        share = self.global_batch // world
        return self.global_indices(step)[rank * share : (rank + 1) * share]
