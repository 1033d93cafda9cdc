"""Datasets (built-in or `module:function`) and batch loading."""
from __future__ import annotations

import inspect

import torch
from torch.utils.data import Dataset, default_collate

from ..config import ArgumentError, Config, ConfigError
from ..resolve import check_kwargs, resolve_callable
from .datasets import BUILTIN
from .sampler import GlobalBatchSampler

__all__ = ["build_dataset", "load_batch", "GlobalBatchSampler"]


def build_dataset(cfg: Config, split: str = "train") -> Dataset | None:
    """The dataset of `split`; None for a user factory that takes no `split` when asked for "val"."""
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


def load_batch(dataset: Dataset, indices: torch.Tensor):
    """(inputs, targets) for `indices`; tensor datasets are sliced without a per-item loop."""
    tensors = getattr(dataset, "tensors", None)
    if tensors is not None:
        return tuple(t[indices] for t in tensors)
    return default_collate([dataset[i] for i in indices.tolist()])
