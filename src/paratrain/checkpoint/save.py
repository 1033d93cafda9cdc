"""Writing a checkpoint: every rank its shard into a hidden folder, the digests gathered into the
manifest, the folder synced and renamed into place; older ones pruned."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.checkpoint.format import FORMAT, UNFINISHED, VERIFIED, fsync_dir, rank_file, write_bytes_durably
from paratrain.checkpoint.reader import is_valid, list_checkpoints
from paratrain.checkpoint.writer import layout_of, write_safetensors
from paratrain.comm import collectives
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
    each with its own shard."""
    root = Path(run_dir) / "checkpoints"
    tmp = root / f"{UNFINISHED}step-{step}"
    final = root / f"step-{step}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(world_size, group)
    # a tensor at a time: no copy of the shard is made (dp's rank 0 holds the whole model and optimizer)
    pieces = ({k: v} for k, v in tensors.items())
    digest, size = write_safetensors(tmp / rank_file(rank), layout_of(tensors), pieces, {"json": json.dumps(meta)})
    if fault_points.fires("exit_in_save", rank=rank, step=step):
        os._exit(17)  # a crash between the shards and the manifest
    digests = _gather_digests(digest, size, device, world_size, group)
    if rank == 0:
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
    _barrier(world_size, group)
    return final


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
