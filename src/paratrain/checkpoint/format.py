"""Sharded checkpoints: safetensors per rank + manifest.json with the sha256 of every file.

Layout:  RUN_DIR/checkpoints/step-N/rank-00000.safetensors ... manifest.json
A save writes into a hidden temporary directory, fsyncs every file, and only then renames it into
place, so a crash mid-save never leaves a directory that looks like a checkpoint. The manifest is
written last, and a checkpoint without a manifest, or whose files do not match their checksums,
is not a checkpoint: `latest_valid` skips it with a warning (and `--resume auto` moves it aside).

A checkpoint may come from an untrusted place (`--resume PATH`): its manifest is checked against
what paratrain writes (the file names of its ranks and no other, inside the directory, no symlinks,
a world size that matches the files), and every file is parsed before it is used, so that a crafted
or corrupt checkpoint is a CheckpointError naming the file, never a traceback or a hang.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as st_load

from paratrain.errors import ConfigError

FORMAT = "paratrain-checkpoint/1"
FINAL_FORMAT = "paratrain-final/1"
STEP_DIR = re.compile(r"^step-(\d+)$")
RANK_FILE = re.compile(r"^rank-\d{5,}\.safetensors$")  # what rank_file writes, and nothing else
FINAL_FILE = "model.safetensors"
# a file beside it in a final export: a name, or one folder down (merged/config.json)
FINAL_EXTRA = re.compile(r"[\w.-]+(/[\w.-]+)?")
UNFINISHED = ".tmp-"  # the prefix of a save or export still being written


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, corrupt, or not matching the model."""


class CheckpointWriteFailed(RuntimeError):
    """A checkpoint that could not be written (a full disk, a read-only folder, a quota), agreed
    by every saving rank: its partial files are gone and the checkpoints before it stand. `why`
    is the line to print, on the lowest rank that failed; "" on the others, which only stop."""

    def __init__(self, why: str):
        super().__init__(why or "another rank could not write its part of the checkpoint")
        self.why = why


def write_failed_exit(exc: BaseException) -> int:
    """A worker's exit code, its line said, after a write that failed: a checkpoint's, agreed by
    every saving rank (the lowest that failed says why; the others stop as with the run, 128 +
    SIGTERM, so the agent names the rank that failed), or any other file of the run (metrics,
    traces): no traceback. Any other error is raised on."""
    import signal

    from paratrain.errors import WRITE_FAILURES, error, write_failure

    if isinstance(exc, CheckpointWriteFailed):
        if not exc.why:
            return 128 + signal.SIGTERM
        error(exc.why)
        return 1
    if not isinstance(exc, OSError) or exc.errno not in WRITE_FAILURES:
        raise exc
    error(write_failure(exc.filename or "a file of the run", exc))
    return 1


class CheckpointMismatch(ConfigError):
    """The model or strategy does not match the checkpoint (an input problem: exit 2)."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


# -- file primitives ------------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def decode(data: bytes, source: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A shard's tensors and its metadata; CheckpointError naming `source` for anything that is not
    a safetensors file paratrain could have written."""
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        meta = _metadata(json.loads(data[8 : 8 + header_len]).get("__metadata__"), source)
    except (SafetensorError, ValueError, RecursionError, AttributeError) as exc:
        raise CheckpointError(f"{source}: not a readable safetensors file: {gist(exc)}") from None
    return tensors, meta


def read_header(path: Path) -> tuple[dict, dict[str, list[int]]]:
    """A shard's metadata and the shape of each of its tensors, from its header alone (no tensor is
    read); CheckpointError naming `path` if it is not a regular, readable safetensors file."""
    regular_file(path)
    try:
        with safe_open(str(path), framework="pt") as fh:
            raw = fh.metadata()
            shapes = {key: list(fh.get_slice(key).get_shape()) for key in fh.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file: {gist(exc)}") from None
    return _metadata(raw, path), shapes


def _metadata(raw, source: Path) -> dict:
    """paratrain's JSON object in a safetensors header's `__metadata__` (an empty one when absent)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not isinstance(raw.get("json", "{}"), str):
        raise CheckpointError(f"{source}: its safetensors metadata is not paratrain's")
    try:
        meta = json.loads(raw.get("json", "{}"))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{source}: unreadable metadata: {gist(exc)}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{source}: its metadata is not a JSON object")
    return meta


def gist(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def regular_file(path: Path) -> os.stat_result:
    """The file's own stat; CheckpointError if it is missing, a symlink, or not a regular file."""
    try:
        st = os.lstat(path)
    except OSError:
        raise CheckpointError(f"{path}: missing") from None
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(f"{path}: is a symlink (a checkpoint's files are its own)")
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: not a regular file")
    return st


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# Checkpoints this process wrote or verified: pruning does not hash them again at every save.
VERIFIED: set[Path] = set()
