"""Batches of any structure, as users bring them: a tensor, a tuple or list of tensors, or a dict of
tensors (nested as torch's default collate makes them), and the model called on each.

A batch is always `(inputs, targets)`; a dict sample with no target (Hugging Face style, `labels`
inside) becomes `(sample, None)`. Every helper here maps over the whole structure, so a strategy
moves, cuts and deals a dict of token ids and masks exactly as it does a single tensor."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def tree_map(fn: Callable[[torch.Tensor], object], obj):
    """`obj` with `fn` applied to every tensor inside it (dicts, tuples, lists; other leaves kept)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, tree_map(fn, v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(tree_map(fn, v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(tree_map(fn, v) for v in obj)
    return obj


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor inside `obj`, in order."""
    found: list[torch.Tensor] = []
    tree_map(found.append, obj)
    return found


def to_device(obj, device, non_blocking: bool = False):
    return tree_map(lambda t: t.to(device, non_blocking=non_blocking), obj)


def num_samples(obj) -> int:
    """The batch dimension: the first batched tensor's length (0 for a structure without one)."""
    return next((t.shape[0] for t in tensors_in(obj) if t.dim()), 0)


def rows(t: torch.Tensor, which: slice) -> torch.Tensor:
    """Samples `which` of a batched tensor; a 0-dim tensor is a value of the whole batch (the
    global label-token count of token_mean.py), which every piece of it takes as it is."""
    return t[which] if t.dim() else t


def split(obj, n: int) -> list:
    """`obj` cut along the batch dimension into up to n pieces, as torch.chunk cuts a tensor (every
    tensor inside cut alike: pieces of equal size but the last)."""
    size = num_samples(obj)
    step = -(-size // n) if size else 1
    starts = range(0, max(size, 1), step)
    return [tree_map(functools.partial(rows, which=slice(s, s + step)), obj) for s in starts]


def take(obj, count: int):
    """The first `count` samples of every tensor inside `obj`."""
    return tree_map(functools.partial(rows, which=slice(count)), obj)


def join(parts: list):
    """The inverse of `split`: pieces of one structure joined along the batch dimension (a
    scalar, such as a loss inside a model's output, the pieces' mean)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else torch.stack(parts).mean()
    if isinstance(first, dict):
        return type(first)((k, join([p[k] for p in parts])) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # a namedtuple
        return type(first)(*(join(list(column)) for column in zip(*parts)))
    if isinstance(first, (tuple, list)):
        return type(first)(join(list(column)) for column in zip(*parts))
    return first


def split_batch(batch, n: int) -> list[tuple]:
    """(inputs, targets) cut into up to n micro-batches of (inputs, targets)."""
    inputs, targets = batch
    xs = split(inputs, n)
    ys = split(targets, n) if targets is not None else [None] * len(xs)
    return list(zip(xs, ys))


def as_pair(collated):
    """A collated batch as (inputs, targets): a dict batch (no separate target) is (dict, None)."""
    if isinstance(collated, dict):
        return collated, None
    inputs, targets = collated
    return inputs, targets


def feed(model: Callable, inputs):
    """The model on its inputs: model(**x) for a dict, model(*x) for a tuple or list, else model(x)."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)
