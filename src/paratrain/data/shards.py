"""Shards that `data prepare` wrote, read from any fsspec URL through a bounded local cache.

The ranks of one node share the cache: a shard is downloaded once, under a file lock beside it,
and the other ranks wait on that lock and then find it there. A download goes to a temporary
name, is checked against the index's sha256 and only then renamed into place, so the cache never
holds a partial or corrupt shard. Transient storage errors are retried with exponential backoff.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from paratrain.data.prepare import INDEX, INDEX_FORMAT

# A URL that does not exist or refuses us will not start working on a retry.
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


class ShardError(RuntimeError):
    """A shard that cannot be read, named."""


class CorruptShard(ShardError):
    """A shard whose bytes are not those the index names, still after the retries: every rank reads the same."""


@dataclass(frozen=True)
class Shard:
    name: str
    samples: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Index:
    url: str
    dtype: str
    block_size: int
    vocab_size: int
    samples: int
    shards: tuple[Shard, ...]
    columns: tuple[str, ...] = ()  # a sample's keys (input_ids, labels, ...); none: token blocks
    tokenizer_files: tuple[str, ...] = ()  # beside the index: a Hugging Face tokenizer's
    splits: tuple[tuple[str, str], ...] = ()  # (split, its folder under url)

    def split_url(self, split: str) -> str | None:
        folder = dict(self.splits).get(split)
        return None if folder is None else f"{self.url.rstrip('/')}/{folder}"


def retrying(fn, what: str, attempts: int = 5, backoff_s: float = 0.1):
    """fn(), tried `attempts` times with doubling waits between on transient errors."""
    for attempt in range(attempts):
        try:
            return fn()
        except PERMANENT:
            raise
        except Exception as exc:  # storage clients raise their own types (aiohttp, botocore) for a 503 or a reset
            if attempt == attempts - 1:
                kind = type(exc) if isinstance(exc, ShardError) else ShardError
                raise kind(f"{what}: {exc} (after {attempts} attempts)") from None
            time.sleep(backoff_s * 2**attempt)


def open_fs(url: str, storage_options: dict | None):
    import fsspec

    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def read_index(url: str, storage_options: dict | None = None) -> Index:
    fs, root = open_fs(url, storage_options)
    where = f"{url.rstrip('/')}/{INDEX}"

    def load():
        with fs.open(f"{root.rstrip('/')}/{INDEX}", "rb") as fh:
            return json.loads(fh.read())

    raw = retrying(load, f"reading {where}")
    if raw.get("format") != INDEX_FORMAT:
        raise ShardError(f"{where} is not an index of `paratrain data prepare` (format {raw.get('format')!r})")
    shards = tuple(Shard(s["name"], int(s["samples"]), int(s["bytes"]), s["sha256"]) for s in raw["shards"])
    return Index(
        url,
        raw["dtype"],
        int(raw["block_size"]),
        int(raw["vocab_size"]),
        int(raw["samples"]),
        shards,
        tuple(raw.get("columns", ())),
        tuple(raw.get("tokenizer_files", ())),
        tuple(sorted(raw.get("splits", {}).items())),
    )


class ShardCache:
    """Local copies of one dataset's shards, at most `limit_bytes` of them (least recently used go
    first; a shard in use is never the one evicted, since every call touches the one it returns)."""

    def __init__(self, index: Index, cache_dir: str, limit_bytes: int, storage_options: dict | None = None):
        self.index = index
        self.fs, self.root = open_fs(index.url, storage_options)
        # One folder per dataset URL: two datasets' shard-00000 must not meet.
        key = hashlib.sha256(index.url.rstrip("/").encode()).hexdigest()[:16]
        self.dir = Path(os.path.expanduser(cache_dir)) / key
        self.dir.mkdir(parents=True, exist_ok=True)
        self.limit_bytes = limit_bytes
        self.downloaded_bytes = 0  # what this process fetched (the benchmark's cold/warm figure)

    def path(self, shard: Shard) -> Path:
        """The local file of `shard`, downloaded and verified if no rank on this node has yet."""
        from filelock import FileLock

        local = self.dir / shard.name
        if not self._present(local, shard):
            with FileLock(str(local) + ".lock"):
                if not self._present(local, shard):
                    retrying(lambda: self._download(shard, local), f"shard {shard.name} of {self.index.url}")
                    self._evict(keep=local)
        os.utime(local)  # most recently used
        return local

    def read_beside(self, name: str) -> bytes:
        """A file beside the index (its tokenizer's), read whole and not cached."""

        def read() -> bytes:
            with self.fs.open(f"{self.root.rstrip('/')}/{name}", "rb") as fh:
                return fh.read()

        return retrying(read, f"reading {name} of {self.index.url}")

    @staticmethod
    def _present(local: Path, shard: Shard) -> bool:
        try:
            return local.stat().st_size == shard.bytes
        except FileNotFoundError:
            return False

    def _download(self, shard: Shard, local: Path) -> None:
        with self.fs.open(f"{self.root.rstrip('/')}/{shard.name}", "rb") as fh:
            data = fh.read()
        digest = hashlib.sha256(data).hexdigest()
        if digest != shard.sha256:
            raise CorruptShard(
                f"sha256 {digest[:12]}... is not the index's {shard.sha256[:12]}... "
                f"({len(data)} bytes, the index says {shard.bytes})"
            )
        partial = local.with_name(f".{local.name}.{os.getpid()}.part")
        partial.write_bytes(data)
        os.replace(partial, local)
        self.downloaded_bytes += len(data)

    def _evict(self, keep: Path) -> None:
        files = [p for p in self.dir.glob("*.safetensors") if p != keep]
        total = sum(p.stat().st_size for p in files) + keep.stat().st_size
        for p in sorted(files, key=lambda p: p.stat().st_mtime):
            if total <= self.limit_bytes:
                break
            total -= p.stat().st_size
            p.unlink(missing_ok=True)
