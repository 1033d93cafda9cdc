"""pt.setup_dataloader: the user's DataLoader, its batch_size read as the GLOBAL batch.

Every global batch is the same at any world size: epoch e of the dataset is the permutation
data.sampler.GlobalBatchSampler gives seed and e (the identity without shuffle), cut into batches
of batch_size (the last one short unless drop_last). Data-parallel rank r of D takes the r-th
contiguous share of each (shares differ by at most one sample where D does not divide it: the
API's backward weights each rank's loss by its share, so the gradient is still the global mean).
A batch of fewer samples than D is refused, or with even_batches=False served with the last shares
empty: never padded with repeated samples, so pt.gather_for_metrics gives each sample once.

The loader's position (epoch, batch within it) advances as batches are handed out; each iter()
continues from it: an epoch ends when its last batch has been taken. What pt.save records is the
position of the batches whose backward ran: the handed-out position as of the model's last training
forward before the last pt.backward (see Paratrain.backward). A batch fetched ahead (nanoGPT fetches
the next batch while the forward runs, before the backward and before saving) was not trained on
yet: after pt.load it is served again, so a resumed run takes the same batches as one that went on.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import cast

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from paratrain.data.batch import take
from paratrain.data.sampler import GlobalBatchSampler
from paratrain.parallel.base import refuse, said_by_one


class GlobalBatchLoader:
    def __init__(self, loader: DataLoader, seed: int, place, share, even_batches: bool = True):
        """`place(batch, weight)`: onto the device, this rank's share of the global batch times the
        dp size noted (for the loss's weight); `share()`: (dp rank, dp size, whether this rank reads
        data), asked at each batch (the strategy may be set up after the loader). `even_batches`
        False: a batch smaller than the dp size is served, the last shares empty (a batch of none of
        its samples: a forward that meets the other ranks, zero3's, still runs), where True
        refuses it."""
        if isinstance(loader.dataset, IterableDataset):
            refuse("pt.setup_dataloader: the dataset must be map-style (indexable, with a length)", said_by_one())
        if loader.batch_size is None:
            refuse(
                "pt.setup_dataloader: the loader needs a batch_size (the global batch), not a batch_sampler",
                said_by_one(),
            )
        if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
            # its order would not be the same at every world size: say so rather than drop it
            refuse(
                f"pt.setup_dataloader: the loader's order comes from shuffle=True or False, not a "
                f"{type(loader.sampler).__name__}",
                said_by_one(),
            )
        self.loader, self.place, self.share, self.even_batches = loader, place, share, even_batches
        self.batch_size, self.drop_last = loader.batch_size, loader.drop_last
        self.n = len(cast(Sized, loader.dataset))  # a map-style dataset: checked above
        self.sampler = GlobalBatchSampler(self.n, self.batch_size, isinstance(loader.sampler, RandomSampler), seed)
        self.epoch = self.batch = 0  # the position: the next batch handed out
        self.at_forward = self.trained = (0, 0)  # the position at the last training forward; at its backward

    def __len__(self) -> int:
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)

    def _global_ids(self, batch: int) -> np.ndarray:
        first = batch * self.batch_size
        return self.sampler.epoch_ids(self.epoch, np.arange(first, min(first + self.batch_size, self.n)))

    def _local_batches(self):
        """This rank's (indices to load, samples kept of them, weight) of every batch from the
        position to the epoch's end: an empty share loads the batch's first sample and keeps none
        (a collate cannot make an empty batch)."""
        for batch in range(self.batch, len(self)):
            ids = self._global_ids(batch)
            rank, size, reads = self.share()
            if len(ids) < size and self.even_batches:
                refuse(
                    f"pt.setup_dataloader: a batch of {len(ids)} samples cannot be shared by {size} data-parallel "
                    f"ranks (set drop_last=True, a batch_size of at least {size}, or even_batches=False to "
                    f"leave some ranks' shares empty)",
                    said_by_one(),
                )
            part = np.array_split(ids, size)[rank]
            load = (part if len(part) else ids[:1]).tolist()
            yield (load if reads else None), len(part), len(part) * size / len(ids)

    def __iter__(self):
        if self.batch >= len(self):  # resumed where an epoch ended: the next one starts
            self.epoch, self.batch = self.epoch + 1, 0
        batches = list(self._local_batches())
        # The user's loader does the loading (its workers, collate_fn, pin_memory), on our indices.
        inner = DataLoader(
            self.loader.dataset,
            batch_sampler=[ids for ids, _, _ in batches if ids is not None],
            num_workers=self.loader.num_workers,
            collate_fn=self.loader.collate_fn,
            pin_memory=self.loader.pin_memory,
        )
        loaded = iter(inner)
        for ids, kept, weight in batches:
            self.batch += 1
            yield None if ids is None else self.place(take(next(loaded), kept), weight)
        self.epoch, self.batch = self.epoch + 1, 0

    # -- checkpoints (the same position record as `paratrain run`'s sampler) ------------------------
    def forward_ran(self) -> None:
        """A training forward of the model: what was handed out so far is what it may train on."""
        self.at_forward = (self.epoch, self.batch)

    def backward_ran(self) -> None:
        self.trained = self.at_forward

    def position(self) -> dict:
        epoch, batch = self.trained
        return {"epoch": epoch, "sample_in_epoch": batch * self.batch_size}

    def resume_at(self, position: dict) -> None:
        epoch, sample = int(position["epoch"]), int(position["sample_in_epoch"])
        if sample % self.batch_size:
            refuse(
                f"pt.load: the checkpoint's data position (sample {sample}) is not at a batch of the loader's "
                f"{self.batch_size}",
                said_by_one(),
            )
        self.epoch, self.batch = epoch, sample // self.batch_size
        self.at_forward = self.trained = (self.epoch, self.batch)


def to_device(batch, device: torch.device):
    """Every tensor of a batch of any structure onto `device`."""
    return torch.utils._pytree.tree_map(
        lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch
    )
