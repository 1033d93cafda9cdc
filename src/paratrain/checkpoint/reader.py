"""Reading checkpoints: the manifest checked, every file's checksum verified, one rank's shard
read; the newest valid checkpoint of a run found (corrupt ones moved aside); a checkpoint's
shapes held against the model before any worker starts."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
from pathlib import Path

import torch
from torch import nn

from paratrain.checkpoint.format import (
    FINAL_EXTRA,
    FINAL_FILE,
    FINAL_FORMAT,
    FORMAT,
    RANK_FILE,
    STEP_DIR,
    VERIFIED,
    CheckpointError,
    CheckpointMismatch,
    decode,
    gist,
    rank_file,
    read_header,
    regular_file,
    sha256_file,
)


def is_valid(path: Path) -> bool:
    if path not in VERIFIED:
        try:
            reader = CheckpointReader(path)
            reader.verify()
        except CheckpointError:
            return False
        VERIFIED.add(path)
    return True


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))


# -- reading --------------------------------------------------------------------------------------
def read_manifest(path: Path, formats: tuple[str, ...] = (FORMAT,)) -> dict:
    """The manifest of a checkpoint (or, among `formats`, of a final export) directory, checked to
    be one paratrain writes (check_manifest)."""
    manifest_path = Path(path) / "manifest.json"
    if not os.path.lexists(manifest_path):
        raise CheckpointError(f"{path}: no manifest.json (not a checkpoint, or an unfinished save)")
    regular_file(manifest_path)
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable manifest: {gist(exc)}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{manifest_path}: not a JSON object")
    if manifest.get("format") == FINAL_FORMAT and FINAL_FORMAT not in formats:
        raise CheckpointError(
            f"{path} is a final export (the model alone, without optimizer or data "
            f"position): resume from a checkpoint, e.g. {Path(path).parent / 'checkpoints'}/step-N"
        )
    if manifest.get("format") not in formats:
        raise CheckpointError(f"{manifest_path}: unknown format {str(manifest.get('format'))[:80]!r}")
    check_manifest(manifest, manifest_path)
    return manifest


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_manifest(m: dict, where: Path) -> None:
    """The keys paratrain reads, of the types it writes. A checkpoint lists exactly the files
    rank-00000 .. of its world size (a name is never a path: it stays inside the directory); a
    final export lists model.safetensors and the files beside it, inside its folder."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{where}: {why}")

    if not _is_int(m.get("step")) or m["step"] < 0:
        raise bad("'step' must be an integer >= 0")
    for key in ("time", "parameters"):
        if key in m and not (
            isinstance(m[key], (int, float))
            and not isinstance(m[key], bool)
            and math.isfinite(m[key])
            and 0 <= m[key] < 2**53
        ):
            raise bad(f"'{key}' must be a number >= 0")
    for key in ("strategy",):
        if key in m and not isinstance(m[key], str):
            raise bad(f"'{key}' must be a string")
    if "world_size" in m and (not _is_int(m["world_size"]) or m["world_size"] < 1):
        raise bad("'world_size' must be an integer >= 1")
    config = m.get("config", {})
    # what a resume reads of it: the sections train and parallel
    if not isinstance(config, dict) or not all(isinstance(config.get(k, {}), dict) for k in ("train", "parallel")):
        raise bad("'config' must be an object whose 'train' and 'parallel' are objects")
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        raise bad("'files' must be an object naming the checkpoint's files")
    for name, entry in files.items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])
            and _is_int(entry.get("bytes"))
            and entry["bytes"] >= 0
        ):
            raise bad(f"files[{name[:80]!r}] must hold 'sha256' (64 hex digits) and 'bytes' (an integer >= 0)")
    if m["format"] == FINAL_FORMAT:
        # model.safetensors, and what a Hugging Face model or a LoRA adapter puts beside it
        # (config.json, tokenizer files, adapter_*, merged/...): names inside the folder alone
        if FINAL_FILE not in files:
            raise bad(f"a final export lists {FINAL_FILE}, not only {_names(files)}")
        odd = [name for name in files if not FINAL_EXTRA.fullmatch(name) or ".." in name.split("/")]
        if odd:
            raise bad(f"{_names(odd)}: not a file name paratrain writes in a final export")
        return
    if "world_size" not in m or not isinstance(m.get("strategy"), str):
        raise bad("a checkpoint names its 'world_size' and 'strategy'")
    odd = [name for name in files if not RANK_FILE.match(name)]
    if odd:
        raise bad(f"{_names(odd)}: not a file name paratrain writes (rank-NNNNN.safetensors)")
    if m["world_size"] != len(files) or set(files) != {rank_file(r) for r in range(len(files))}:
        raise bad(f"world_size {m['world_size']} does not match its files ({_names(files)})")
    layout = [config.get("parallel", {}).get(key, 1) for key in ("tp", "pp")]  # how tp/pp shards are laid out
    if not all(_is_int(n) and n >= 1 for n in layout) or m["world_size"] % (layout[0] * layout[1]):
        raise bad(
            f"parallel tp and pp ({', '.join(str(n)[:20] for n in layout)}) do not divide world_size {m['world_size']}"
        )


def _names(names) -> str:
    names = sorted(names)
    return ", ".join(repr(n[:80]) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_files_present(path: Path, manifest: dict) -> None:
    """Every file the manifest lists is there (a regular file, not a symlink), with its size: a
    checkpoint that can be read completely, as far as can be told without reading it."""
    for name, entry in manifest["files"].items():
        file = Path(path) / name
        size = regular_file(file).st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{file}: {size} bytes, manifest says {entry['bytes']}")


def verify_files(path: Path, manifest: dict) -> None:
    """check_files_present, and every file's sha256."""
    check_files_present(path, manifest)
    for name, entry in manifest["files"].items():
        if sha256_file(Path(path) / name) != entry["sha256"]:
            raise CheckpointError(f"{Path(path) / name}: sha256 does not match the manifest")


class CheckpointReader:
    """A checkpoint directory: its manifest, checksum verification, and each rank's shard."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.step = self.manifest["step"]
        self.world_size = self.manifest["world_size"]
        self.strategy = self.manifest["strategy"]

    def verify(self) -> None:
        """Checksums, and every shard's header: readable, with the trainer's step of the manifest."""
        verify_files(self.path, self.manifest)
        for rank in range(self.world_size):
            meta, _ = read_header(self.path / rank_file(rank))
            trainer = meta.get("trainer")
            if not isinstance(trainer, dict) or trainer.get("step") != self.step:
                raise CheckpointError(
                    f"{self.path / rank_file(rank)}: its metadata does not hold the manifest's step {self.step}"
                )

    def load(self, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
        if not 0 <= rank < self.world_size:
            raise CheckpointError(f"{self.path}: has no shard of rank {rank} (world size {self.world_size})")
        path = self.path / rank_file(rank)
        regular_file(path)
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != self.manifest["files"][path.name]["sha256"]:
            raise CheckpointError(f"{path}: sha256 does not match the manifest")
        return decode(data, path)


def saved_model_shapes(reader: CheckpointReader) -> dict[str, list[int]]:
    """The whole shape of each `model.` tensor in a checkpoint, from the files' headers alone (no
    tensor is read): a tensor saved as tp shards (hybrid: its split dimension in the `shard_dims`
    metadata) is the sum of its shards along that dimension."""
    shapes: dict[str, list[int]] = {}
    for rank in range(reader.world_size):
        path = reader.path / rank_file(rank)
        if not path.is_file():
            continue
        meta, tensors = read_header(path)
        dims = meta.get("shard_dims", {})
        if not isinstance(dims, dict):
            raise CheckpointError(f"{path}: 'shard_dims' is not an object")
        for key, shape in tensors.items():
            if not key.startswith("model."):
                continue
            name = key[len("model.") :]
            if name in shapes and name in dims:
                dim = dims[name]
                if not _is_int(dim) or not 0 <= dim < len(shape) or len(shape) != len(shapes[name]):
                    raise CheckpointError(
                        f"{path}: shard_dims[{name!r}] = {str(dim)[:20]} is not a dimension of its shape {shape}"
                    )
                shapes[name][dim] += shape[dim]
            else:
                shapes.setdefault(name, shape)
    return shapes


def check_model_shapes(reader: CheckpointReader, model: nn.Module, key: str) -> None:
    """Before any worker starts (`model` on meta): the checkpoint's parameter names and whole
    shapes must be the model's. CheckpointMismatch naming `key` otherwise. Every parameter must be
    saved; buffers may be absent (a parameter server saves parameters only)."""
    differs = describe_mismatch(
        {k: v.shape for k, v in model.state_dict().items()},
        saved_model_shapes(reader),
        required=[n for n, _ in model.named_parameters()],
    )
    if differs:
        raise CheckpointMismatch(key, f"{reader.path}: {differs}")


def latest_valid(run_dir: Path, log=print) -> CheckpointReader | None:
    """The newest checkpoint whose manifest, checksums and headers hold. Corrupt ones newer than it
    are reported and moved aside (RUN_DIR/checkpoints.invalid/): left in place, a later save's
    pruning would count them, and the next resume would try them again."""
    for step, path in reversed(list_checkpoints(Path(run_dir) / "checkpoints")):
        try:
            reader = CheckpointReader(path)
            reader.verify()
            return reader
        except CheckpointError as exc:
            log(f"warning: skipping checkpoint step {step}: {exc}; moved to {move_invalid_aside(path)}")
    return None


def move_invalid_aside(path: Path) -> Path:
    """RUN_DIR/checkpoints.invalid/step-N (-2, -3, ... when taken): out of the checkpoints' way, kept to look at."""
    aside_root = path.parent.parent / "checkpoints.invalid"
    aside_root.mkdir(exist_ok=True)
    aside = next(
        candidate
        for n in itertools.count(1)
        if not os.path.lexists(candidate := aside_root / (path.name + (f"-{n}" if n > 1 else "")))
    )
    path.rename(aside)
    return aside


# -- model and optimizer state as flat tensors ---------------------------------------------------
def describe_mismatch(own: dict, saved: dict, required=None) -> str:
    """ "" when a checkpoint's names and shapes (`saved`, name -> shape) are the model's (`own`),
    else one line: the names of `required` (default: all of `own`) it lacks, the names the model
    lacks, and the shapes that differ, the first few of each and how many more."""
    own = {k: tuple(v) for k, v in own.items()}
    # a crafted checkpoint's shape may be anything: one that is not a list of sizes differs
    saved = {k: tuple(v) if isinstance(v, (list, tuple)) else (str(v)[:20],) for k, v in saved.items()}
    missing = sorted(set(own if required is None else required) - set(saved))
    unexpected = sorted(set(saved) - set(own))
    shapes = sorted(k for k in set(own) & set(saved) if own[k] != saved[k])

    def listed(items: list[str], most: int = 4) -> str:
        return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")

    parts = []
    if missing:
        parts.append("missing from checkpoint: " + listed(missing))
    if unexpected:
        parts.append("not in the model: " + listed(unexpected))
    if shapes:
        parts.append("shape differs: " + listed([f"{k} {saved[k]} vs {own[k]}" for k in shapes]))
    return "checkpoint does not match the model: " + "; ".join(parts) if parts else ""
