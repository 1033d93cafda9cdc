"""Datasets (built-in or `module:function`) and batch loading.

torch is imported where it is used, so that `paratrain data prepare` (paratrain.data.prepare)
starts without it."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sized
from typing import TYPE_CHECKING, Literal, cast, overload

from paratrain.config import ArgumentError, Config
from paratrain.errors import ConfigError
from paratrain.resolve import check_kwargs, resolve_callable

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

__all__ = ["build_dataset", "build_sampler", "load_batch", "tokenizer_files", "GlobalBatchSampler"]


def __getattr__(name: str):
    if name == "GlobalBatchSampler":
        from paratrain.data.sampler import GlobalBatchSampler

        return GlobalBatchSampler
    raise AttributeError(name)


@overload
def build_dataset(cfg: Config, split: Literal["train"] = "train") -> Dataset: ...
@overload
def build_dataset(cfg: Config, split: str) -> Dataset | None: ...
def build_dataset(cfg: Config, split: str = "train") -> Dataset | None:
    """The dataset of `split`; None for a user factory that takes no `split` when asked for "val"."""
    from paratrain.data.datasets import BUILTIN

    name = cfg.data.factory
    fn = BUILTIN.get(name) or resolve_callable(name, "data.factory")
    check_kwargs(fn, cfg.data.kwargs, "data", name)
    kwargs = dict(cfg.data.kwargs)
    takes_split = "split" in inspect.signature(fn).parameters
    if takes_split:
        kwargs["split"] = split
    elif split != "train":
        return None
    try:
        ds = fn(**kwargs)
    except ArgumentError as exc:
        raise ConfigError(f"data.{exc.arg}", str(exc)) from None
    except (TypeError, ValueError, OSError, ImportError) as exc:
        raise ConfigError("data.factory", f"{name} failed: {exc}") from None
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        raise ConfigError("data.factory", f"{name} returned {type(ds).__name__}, not a map-style Dataset")
    return ds


def build_sampler(dataset: Dataset, cfg: Config):
    """The dataset's own sampler where it has one (streamed shards: an order that reads few shards
    at a time), else the global-batch sampler over a permutation of all samples."""
    from paratrain.data.sampler import GlobalBatchSampler

    own = getattr(dataset, "global_batch_sampler", None)
    make = own if callable(own) else functools.partial(GlobalBatchSampler, len(cast(Sized, dataset)))
    return make(cfg.data.batch_size, cfg.data.shuffle, cfg.train.seed)


def load_batch(dataset: Dataset, indices: torch.Tensor):
    """(inputs, targets) for `indices`; tensor datasets are sliced without a per-item loop, and
    a dataset that loads batches itself (streamed shards) does. Samples of any structure go through
    torch's default collate; dict samples (no separate target) give (dict, None): data/batch.py."""
    from torch.utils.data import default_collate

    from paratrain.data.batch import as_pair

    own = getattr(dataset, "load_batch", None)
    if callable(own):
        return own(indices)
    tensors = getattr(dataset, "tensors", None)
    if tensors is not None:
        return tuple(t[indices] for t in tensors)
    return as_pair(default_collate([dataset[i] for i in indices.tolist()]))


def tokenizer_files(dataset: Dataset) -> dict[str, bytes]:
    """The files of the tokenizer the data was prepared with (shards of `data prepare --tokenizer
    DIR`), by name, for final/ to carry beside the model; none for other data."""
    own = getattr(dataset, "tokenizer_files", None)
    return own() if callable(own) else {}
