"""Built-in datasets: only what installed packages ship, or synthetic. Nothing is downloaded.

Each factory takes `split` ("train" or "val") and returns a map-style dataset of (input, target).
The attributes `in_features`, `num_classes` and `vocab_size` let the built-in models size
themselves from the data.
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from paratrain.config import ArgumentError, require, require_at_least
from paratrain.data.stream import shards
from paratrain.errors import ConfigError


class ArrayDataset(TensorDataset):
    """A TensorDataset that also says what a model needs to know about it."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, num_classes: int | None = None):
        super().__init__(inputs, targets)
        self.in_features = math.prod(inputs.shape[1:])  # also for an empty split
        self.num_classes = num_classes


def _split_indices(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    require(0 <= val_fraction < 1, "val_fraction", f"must be in [0, 1) (0: no validation), got {val_fraction}")
    order = np.random.default_rng(seed).permutation(n)
    n_val = int(round(n * val_fraction))
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits.csv.gz, read directly: importing sklearn costs a second per process."""
    import gzip
    import importlib.util

    from paratrain.extras import require

    require("sklearn", "data.factory 'digits'")
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt") as fh:
                table = np.loadtxt(fh, delimiter=",", dtype=np.float32)
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.data.astype(np.float32), bunch.target.astype(np.int64)


def digits(split: str = "train", val_fraction: float = 0.2, split_seed: int = 0) -> ArrayDataset:
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images), scaled to [0, 1]."""
    data, target = _digits_arrays()
    x = torch.from_numpy(data) / 16.0
    y = torch.from_numpy(target)
    train_idx, val_idx = _split_indices(len(x), val_fraction, split_seed)
    idx = torch.from_numpy(train_idx if split == "train" else val_idx)
    return ArrayDataset(x[idx], y[idx], num_classes=10)


def synthetic(
    split: str = "train",
    n_samples: int = 2048,
    in_features: int = 32,
    num_classes: int = 10,
    seed: int = 1234,
    task: str = "classification",
) -> ArrayDataset:
    """Inputs from N(0, 1) labelled by a fixed random linear teacher (classification or regression)."""
    require_at_least(1, n_samples=n_samples, in_features=in_features, num_classes=num_classes)
    require(task in ("classification", "regression"), "task", f"must be classification or regression, got {task!r}")
    g = torch.Generator().manual_seed(seed + (0 if split == "train" else 1))
    teacher = torch.randn(in_features, num_classes, generator=torch.Generator().manual_seed(seed))
    x = torch.randn(n_samples if split == "train" else max(n_samples // 4, 1), in_features, generator=g)
    logits = x @ teacher
    if task == "regression":
        return ArrayDataset(x, logits, num_classes=None)
    return ArrayDataset(x, logits.argmax(dim=1), num_classes=num_classes)


def _sorted_sources(folder: str):
    """The .py files under `folder` in sorted order of their paths, walked lazily (a sort of every
    path first listed the whole standard library, site-packages too, to read its first few files:
    about 1 s of the 1.5 s each process spent on a small corpus here). Entries sort as their
    paths do: a folder's name as if followed by "/", since every path inside it is."""
    with os.scandir(folder) as it:
        entries = sorted(it, key=lambda e: e.name + "/" if e.is_dir(follow_symlinks=False) else e.name)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            if entry.name != "site-packages":
                yield from _sorted_sources(entry.path)
        elif entry.name.endswith(".py"):
            yield Path(entry.path)


@functools.lru_cache(maxsize=2)
def stdlib_text(max_chars: int) -> str:
    """The running Python's standard-library .py files, concatenated in sorted path order."""
    chunks, total = [], 0
    for path in _sorted_sources(sysconfig.get_paths()["stdlib"]):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        chunks.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(chunks)[:max_chars]


class CharCorpus(Dataset):
    """Non-overlapping blocks of characters; the target is the input shifted by one character."""

    def __init__(self, tokens: torch.Tensor, block_size: int, vocab: list[str]):
        self.tokens = tokens
        self.block_size = block_size
        self.vocab = vocab
        self.vocab_size = len(vocab)

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.block_size

    def __getitem__(self, i: int):
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def read_text(url: str, max_chars: int) -> str:
    """A text file from any fsspec URL (local path, file://, s3://, gs://, http://, memory://...)."""
    import fsspec

    with fsspec.open(url, "rt", encoding="utf-8") as fh:
        return fh.read(max_chars)


def corpus(
    split: str = "train",
    block_size: int = 64,
    max_chars: int = 2_000_000,
    val_fraction: float = 0.1,
    path: str | None = None,
    tokenizer: str = "chars",
    cache_dir: str = "~/.cache/paratrain",
) -> Dataset:
    """The standard library's own source text, or the text at `path`, as characters (`chars`), or
    as `bytes` or `bpe:VOCAB` tokens prepared once into shards under `cache_dir` and streamed from
    there as `factory = "shards"` streams them."""
    from paratrain.data.prepare import prepare_text_once
    from paratrain.data.tokenizing import parse_tokenizer

    require_at_least(1, block_size=block_size, max_chars=max_chars)
    require(0 <= val_fraction < 1, "val_fraction", f"must be in [0, 1) (0: no validation), got {val_fraction}")
    if tokenizer != "chars":
        try:
            parse_tokenizer(tokenizer)
        except ConfigError as exc:
            raise ArgumentError("tokenizer", f"expected chars, bytes or bpe:VOCAB: {exc.why}") from None
    try:
        if tokenizer == "chars":
            vocab, tokens = _encoded(path, max_chars)
        else:
            root = prepare_text_once(_text(path, max_chars), tokenizer, block_size, val_fraction, cache_dir)
    except OSError as exc:
        why = exc.strerror or ("no such file" if isinstance(exc, FileNotFoundError) else exc)
        raise ArgumentError("path", f"cannot read {path}: {why}") from None
    except UnicodeDecodeError as exc:
        raise ArgumentError("path", f"{path} is not UTF-8 text: {exc}") from None
    except ConfigError as exc:  # prepare's own: the text is too short for one block
        raise ArgumentError("max_chars", f"the corpus cannot be prepared as {tokenizer} tokens: {exc.why}") from None
    except (ImportError, ValueError) as exc:  # fsspec: a scheme it does not know, or whose package is missing
        raise ArgumentError("path", f"cannot read {path}: {exc}") from None
    if tokenizer == "chars":
        n_train = int(len(tokens) * (1 - val_fraction))
        part = tokens[:n_train] if split == "train" else tokens[n_train:]
        return CharCorpus(part, block_size, list(vocab))
    if not (root / split).is_dir():  # val_fraction = 0
        return TensorDataset(torch.zeros(0, block_size, dtype=torch.long), torch.zeros(0, block_size, dtype=torch.long))
    return shards(str(root / split), cache_dir=cache_dir)


def _text(path: str | None, max_chars: int) -> str:
    return read_text(path, max_chars) if path else stdlib_text(max_chars)


@functools.lru_cache(maxsize=2)
def _encoded(path: str | None, max_chars: int) -> tuple[tuple[str, ...], torch.Tensor]:
    """The text's alphabet and its characters as indices into it (read-only, shared by the splits:
    a process builds both, often more than once, and sorting 2M characters takes 0.2 s)."""
    codes = np.frombuffer(_text(path, max_chars).encode("utf-32-le"), dtype=np.uint32)
    alphabet, tokens = np.unique(codes, return_inverse=True)
    return tuple(chr(c) for c in alphabet), torch.from_numpy(tokens.astype(np.int64))


BUILTIN: dict[str, Callable[..., Dataset]] = {
    "digits": digits,
    "corpus": corpus,
    "synthetic": synthetic,
    "shards": shards,
}
