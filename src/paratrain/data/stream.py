"""`[data] factory = "shards"`: the shards of `data prepare`, streamed during training.

The order of an epoch is a function of (seed, epoch) only: the shards in a seeded order, their
samples laid end to end, then each run of `shuffle_window` consecutive positions permuted with a
seed of its own. A window touches only the few shards it overlaps, so a step reads from a handful
of shards, and the shards the next windows need are known in advance: a background thread pool
fetches them (through the node's shared cache) while the current steps train. With shuffle off the
order is the contract's: step i reads samples (i*B + j) mod N.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import torch
from torch.utils.data import Dataset

from paratrain.config import ArgumentError, require, require_at_least
from paratrain.data.sampler import GlobalBatchSampler
from paratrain.data.shards import CorruptShard, Index, ShardCache, ShardError, read_index
from paratrain.errors import ConfigError, warn


class ShardDataset(Dataset):
    """Token blocks [block_size + 1] from shards; sample i is (block[:-1], block[1:]). Shards of
    named columns (fine-tuning data: data/sft.py) give dict samples, {column: [block_size]}."""

    def __init__(
        self,
        index: Index,
        cache: ShardCache,
        shuffle_window: int,
        skip_corrupt: bool = False,
        prefetch_threads: int = 2,
    ):
        self.index, self.cache = index, cache
        self.skip_corrupt = skip_corrupt
        self._corrupt: set[int] = set()
        self.vocab_size, self.block_size = index.vocab_size, index.block_size
        self.shuffle_window = shuffle_window
        self.shard_sizes = np.array([s.samples for s in index.shards], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(self.shard_sizes)])
        self.columns = index.columns or ("tokens",)
        self._memory: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self._loading: dict[int, Future] = {}
        self._wanted: set[int] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(prefetch_threads, thread_name_prefix="paratrain-shards")

    def __len__(self) -> int:
        return self.index.samples

    def __getitem__(self, i: int):
        x, y = self.load_batch(torch.tensor([i]))
        if y is None:
            return {k: v[0] for k, v in x.items()}
        return x[0], y[0]

    def load_batch(self, ids: torch.Tensor) -> tuple:
        """(inputs, targets) of token blocks; ({column: [n, block_size]}, None) of named columns."""
        # NumPy throughout: a batch is a few small gathers, where torch's per-op dispatch costs more.
        sample_ids = ids.numpy()
        shard_of = np.searchsorted(self.shard_starts, sample_ids, side="right") - 1
        width = self.block_size if self.index.columns else self.block_size + 1
        rows = {k: np.empty((len(sample_ids), width), dtype=np.int64) for k in self.columns}
        for s in np.unique(shard_of).tolist():
            mask = shard_of == s
            shard = self._shard(s)
            at = sample_ids[mask] - self.shard_starts[s]
            for k, block in shard.items():
                rows[k][mask] = block[at % len(block)]  # a stand-in may hold more or fewer
        if self.index.columns:
            return {k: torch.from_numpy(v) for k, v in rows.items()}, None
        tokens = torch.from_numpy(rows["tokens"])
        # Two tensors of their own, as the character corpus gives: views of one buffer would keep
        # it whole for as long as either lives (the planner counts the inputs and targets apart)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer's files that `data prepare --tokenizer DIR` put beside the index, by name."""
        return {name: self.cache.read_beside(name) for name in self.index.tokenizer_files}

    def global_batch_sampler(self, global_batch: int, shuffle: bool, seed: int) -> ShardSampler:
        return ShardSampler(self, global_batch, shuffle, seed)

    # -- the in-memory shards and their prefetch --------------------------------------------------
    def prefetch(self, shards: list[int]) -> None:
        """Start fetching `shards` (in this order) and keep them, and no more than a couple of
        others, in memory."""
        with self._lock:
            self._wanted = set(shards)
            for s in shards:
                if s not in self._memory and s not in self._loading and s not in self._corrupt:
                    self._loading[s] = self._pool.submit(self._load, s)

    def _shard(self, s: int) -> dict[str, np.ndarray]:
        try:
            if s in self._corrupt:
                return self._stand_in(s)
            try:
                return self._rows(s)
            except CorruptShard as exc:
                if not self.skip_corrupt:
                    raise
                self._mark_corrupt(s, exc)
                return self._stand_in(s)
        except ShardError as exc:
            raise ConfigError("data.path", str(exc)) from None
        except OSError as exc:  # missing or forbidden: not retried
            raise ConfigError("data.path", f"shard {self.index.shards[s].name} of {self.index.url}: {exc}") from None

    def _rows(self, s: int) -> dict[str, np.ndarray]:
        with self._lock:
            if s in self._memory:
                self._memory.move_to_end(s)
                return self._memory[s]
            future = self._loading.get(s) or self._loading.setdefault(s, self._pool.submit(self._load, s))
        return future.result()

    def _mark_corrupt(self, s: int, exc: CorruptShard) -> None:
        with self._lock:
            self._loading.pop(s, None)
            self._corrupt.add(s)
        warn(
            f"data.path: {exc}; skipped (data.skip_corrupt): the next shard that "
            f"verifies stands in for its {self.index.shards[s].samples} samples"
        )

    def _stand_in(self, s: int) -> dict[str, np.ndarray]:
        """The rows of the first shard after s (in index order, wrapping) that verifies, which sample
        i of s reads modulo their count. A corrupt shard fails its checksum on every rank alike, so every
        rank picks the same stand-in, and the order, the steps and the data positions stay as they
        were; only the corrupt shard's samples are not seen."""
        n = len(self.index.shards)
        for t in ((s + k) % n for k in range(1, n)):
            if t in self._corrupt:
                continue
            try:
                rows = self._rows(t)
            except CorruptShard as exc:
                self._mark_corrupt(t, exc)
                continue
            return rows
        raise ShardError(f"no shard of {self.index.url} matches its sha256 in the index")

    def _load(self, s: int) -> dict[str, np.ndarray]:
        from safetensors.numpy import load

        shard = self.index.shards[s]
        for attempt in range(2):
            try:  # another rank on this node may evict the file between its download and this read
                data = self.cache.path(shard).read_bytes()
                break
            except FileNotFoundError:
                if attempt:
                    raise
        rows = load(data)
        with self._lock:
            self._memory[s] = rows
            del self._loading[s]
            spare = [k for k in self._memory if k not in self._wanted and k != s]
            for k in spare[: max(len(self._memory) - len(self._wanted) - 2, 0)]:
                del self._memory[k]
        return rows


class ShardSampler(GlobalBatchSampler):
    """GlobalBatchSampler's positions and rank slices, with the shard-aware order of this module."""

    def __init__(self, dataset: ShardDataset, global_batch: int, shuffle: bool, seed: int):
        super().__init__(len(dataset), global_batch, shuffle, seed)
        self.dataset = dataset
        # Without shuffle, windows are only the unit of prefetch.
        self.window = min(dataset.shuffle_window, self.n)
        self.lookahead = max(8 * global_batch, 2 * int(dataset.shard_sizes.max()), self.window)
        self._epoch_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._window_perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._prefetched: tuple[int, int] | None = None

    def _shard_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's shard order and where each of them starts in it."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            sizes = self.dataset.shard_sizes
            order = (
                torch.randperm(len(sizes), generator=self._generator(epoch))
                if self.shuffle
                else torch.arange(len(sizes))
            ).numpy()
            starts = np.concatenate([[0], np.cumsum(sizes[order])])
            self._epoch_cache = (epoch, order, starts)
        return self._epoch_cache[1], self._epoch_cache[2]

    def _window_perm(self, epoch: int, w: int) -> np.ndarray:
        key = (epoch, w)
        if key not in self._window_perms:
            size = min(self.window, self.n - w * self.window)
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 1_000_033 + w + 1)
            self._window_perms[key] = torch.randperm(size, generator=g).numpy()
            if len(self._window_perms) > 8:
                self._window_perms.popitem(last=False)
        return self._window_perms[key]

    def epoch_ids(self, epoch: int, offsets: np.ndarray) -> np.ndarray:
        order, starts = self._shard_order(epoch)
        if self.shuffle:
            shuffled = offsets.copy()
            windows = offsets // self.window
            for w in np.unique(windows).tolist():
                mask = windows == w
                shuffled[mask] = w * self.window + self._window_perm(epoch, w)[offsets[mask] - w * self.window]
            offsets = shuffled
        k = np.searchsorted(starts, offsets, side="right") - 1
        return self.dataset.shard_starts[order[k]] + (offsets - starts[k])

    def rank_indices(self, step: int, rank: int, world: int) -> torch.Tensor:
        position = self.first_position(step)
        windows = (position // self.window, (position + self.lookahead - 1) // self.window)
        if windows != self._prefetched:  # the shards ahead change only where a window begins
            self.dataset.prefetch(self.shards_ahead(position))
            self._prefetched = windows
        return super().rank_indices(step, rank, world)

    def shards_ahead(self, position: int) -> list[int]:
        """The shards that stream positions [position, position + lookahead) read, in the order
        they are first needed: those overlapping each window the range touches."""
        out: dict[int, None] = {}
        end = position + self.lookahead
        while position < end:
            epoch, offset = divmod(position, self.n)
            order, starts = self._shard_order(epoch)
            first = offset // self.window * self.window
            last = min(offset + (end - position), self.n)
            last = min(-(-last // self.window) * self.window, self.n)  # the window's end
            k0, k1 = np.searchsorted(starts, [first, last - 1], side="right") - 1
            out.update((int(s), None) for s in order[k0 : k1 + 1])
            position += last - offset
        return list(out)


def shards(
    path: str | None = None,
    cache_dir: str = "~/.cache/paratrain",
    cache_limit_gb: float = 20,
    storage_options: dict | None = None,
    shuffle_window: int = 8192,
    skip_corrupt: bool = False,
    split: str = "train",
) -> ShardDataset:
    """The shards `paratrain data prepare` wrote at `path` (a local folder or an fsspec URL); for
    `split` "val", those of its validation split (none: an empty dataset)."""
    require(bool(path), "path", "required: the folder or URL that `paratrain data prepare` wrote")
    require(cache_limit_gb > 0, "cache_limit_gb", f"must be > 0, got {cache_limit_gb}")
    require_at_least(1, shuffle_window=shuffle_window)
    require(isinstance(storage_options or {}, dict), "storage_options", "must be a table of fsspec options")
    require(isinstance(skip_corrupt, bool), "skip_corrupt", f"must be true or false, got {skip_corrupt!r}")
    assert path is not None  # required, checked above
    try:
        index = read_index(path, storage_options)
        if split != "train":
            split_url = index.split_url(split)
            # no such split: the dataset's shape with no samples
            index = (
                replace(index, samples=0, shards=()) if split_url is None else read_index(split_url, storage_options)
            )
        cache = ShardCache(index, cache_dir, int(cache_limit_gb * 2**30), storage_options)
    except (ShardError, OSError, ValueError, ImportError, KeyError) as exc:
        raise ArgumentError("path", f"cannot read the shards at {path}: {exc}") from None
    return ShardDataset(index, cache, shuffle_window, skip_corrupt)
