"""Writing a checkpoint: every rank its shard into a hidden folder, the digests gathered into the
manifest, the folder synced and renamed into place; older ones pruned."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.checkpoint.format import (
    FORMAT,
    UNFINISHED,
    VERIFIED,
    CheckpointWriteFailed,
    fsync_dir,
    rank_file,
    write_bytes_durably,
)
from paratrain.checkpoint.reader import is_valid, list_checkpoints
from paratrain.checkpoint.writer import layout_of, write_safetensors
from paratrain.comm import collectives
from paratrain.errors import write_failure
from paratrain.runtime import fault_points


# -- saving ---------------------------------------------------------------------------------------
def _gather_digests(digest: str, size: int, device: torch.device, world_size: int, group) -> list[tuple[str, int]]:
    """Every saving rank's (sha256, bytes), gathered as tensors (no pickled objects on the wire)."""
    payload = torch.tensor(
        list(bytes.fromhex(digest)) + list(size.to_bytes(8, "little")), dtype=torch.uint8, device=device
    )
    if not dist.is_initialized() or world_size == 1:
        return [(digest, size)]
    out = [torch.empty_like(payload) for _ in range(world_size)]
    collectives.all_gather(out, payload, "checkpoint-digests", group=group)
    return [(bytes(t[:32].tolist()).hex(), int.from_bytes(bytes(t[32:].tolist()), "little")) for t in out]


def _barrier(world_size: int, group) -> None:
    if dist.is_initialized() and world_size > 1:
        collectives.barrier("checkpoint", group=group)


# the size a rank gathers when it could not write its shard: no manifest is written over it
NOT_WRITTEN = 2**64 - 1


def _first_failed(failed: bool, rank: int, world_size: int, device: torch.device, group) -> int | None:
    """The lowest saving rank whose write failed, agreed by all of them (None: every write held)."""
    lowest = torch.tensor([rank if failed else world_size], dtype=torch.int64, device=device)
    if dist.is_initialized() and world_size > 1:
        collectives.all_reduce(lowest, "checkpoint-written", group=group, op=dist.ReduceOp.MIN)
    return int(lowest.item()) if int(lowest.item()) < world_size else None


def save(
    run_dir: Path,
    step: int,
    tensors: dict,
    meta: dict,
    *,
    rank: int,
    world_size: int,
    strategy: str,
    config: dict,
    keep: int,
    device: torch.device,
    group=None,
) -> Path:
    """Collective over the saving ranks 0..world_size-1 (`group`: them; None: the world group),
    each with its own shard. A write that fails on any of them (a full disk, a read-only folder)
    leaves no partial files and the earlier checkpoints as they were, and raises
    CheckpointWriteFailed on every saving rank."""
    root = Path(run_dir) / "checkpoints"
    tmp = root / f"{UNFINISHED}step-{step}"
    final = root / f"step-{step}"
    failure = ""  # this rank's failed write, in one line
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as exc:
            failure = write_failure(exc.filename or tmp, exc)
    _barrier(world_size, group)
    digest, size = "00" * 32, NOT_WRITTEN
    if not failure:
        try:
            if fault_points.fires("disk_full_in_save", rank=rank, step=step):  # where no small disk can be mounted
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / rank_file(rank)))
            # a tensor at a time: no copy of the shard is made (dp's rank 0 holds the whole model and optimizer)
            pieces = ({k: v} for k, v in tensors.items())
            digest, size = write_safetensors(
                tmp / rank_file(rank), layout_of(tensors), pieces, {"json": json.dumps(meta)}
            )
        except OSError as exc:
            failure = write_failure(exc.filename or tmp / rank_file(rank), exc)
    if fault_points.fires("exit_in_save", rank=rank, step=step):
        os._exit(17)  # a crash between the shards and the manifest
    digests = _gather_digests(digest, size, device, world_size, group)
    if rank == 0 and all(n != NOT_WRITTEN for _, n in digests):
        try:
            _publish(root, tmp, final, step, world_size, strategy, config, digests, keep)
        except OSError as exc:
            failure = write_failure(exc.filename or tmp, exc)
    first_failed = _first_failed(bool(failure), rank, world_size, device, group)
    if first_failed is not None:
        if rank == 0:
            remove_unfinished(root)
        raise CheckpointWriteFailed(f"checkpoint {final} not written: {failure}" if rank == first_failed else "")
    return final


def _publish(
    root: Path, tmp: Path, final: Path, step: int, world_size: int, strategy: str, config: dict, digests, keep: int
) -> None:
    """Rank 0, once every shard is written: the manifest, the folder synced and renamed into place,
    older checkpoints pruned."""
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "strategy": strategy,
        "time": time.time(),
        "config": config,
        "files": {rank_file(r): {"sha256": d, "bytes": n} for r, (d, n) in enumerate(digests)},
    }
    write_bytes_durably(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(root)
    VERIFIED.add(final)
    prune(root, keep, final)
    remove_unfinished(root)


def prune(root: Path, keep: int, written: Path) -> None:
    """Keep `written` (the checkpoint just saved) and the newest `keep` - 1 others that verify.
    Checkpoints that do not verify neither count nor go: `--resume auto` moves them aside.
    Counting them let a corrupt checkpoint newer than the one written crowd out every valid one."""
    kept = 1
    for _, path in reversed(list_checkpoints(root)):
        if path == written or not is_valid(path):
            continue
        if kept < keep:
            kept += 1
        else:
            VERIFIED.discard(path)
            shutil.rmtree(path, ignore_errors=True)


def remove_unfinished(root: Path) -> None:
    """The temporary directories of saves that crashed before their rename (rank 0 saves one at a time)."""
    for path in root.glob(UNFINISHED + "*"):
        shutil.rmtree(path, ignore_errors=True)
