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
import itertools
import json
import math
import os
import re
import shutil
import stat
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from . import collectives
from .config import ConfigError
from .parallel.registry import checkpoint_family
from .testing import faults

FORMAT = "paratrain-checkpoint/1"
FINAL_FORMAT = "paratrain-final/1"
STEP_DIR = re.compile(r"^step-(\d+)$")
RANK_FILE = re.compile(r"^rank-\d{5,}\.safetensors$")  # what rank_file writes, and nothing else
FINAL_FILE = "model.safetensors"
UNFINISHED = ".tmp-"  # the prefix of a save or export still being written


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, corrupt, or not matching the model."""


class CheckpointMismatch(ConfigError):
    """The model or strategy does not match the checkpoint (an input problem: exit 2)."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


# -- file primitives ------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
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


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses views and tensors that share memory: give each its own storage."""
    seen, out = set(), {}
    for key, t in tensors.items():
        t = t.detach().cpu()
        storage = t.untyped_storage()
        whole = t.is_contiguous() and t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
        if not whole or storage.data_ptr() in seen:
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def encode(tensors: dict[str, torch.Tensor], meta: dict) -> bytes:
    return st_save(_unshared(tensors), metadata={"json": json.dumps(meta)})


def decode(data: bytes, source: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A shard's tensors and its metadata; CheckpointError naming `source` for anything that is not
    a safetensors file paratrain could have written."""
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        meta = _metadata(json.loads(data[8 : 8 + header_len]).get("__metadata__"), source)
    except (SafetensorError, ValueError, RecursionError, AttributeError) as exc:
        raise CheckpointError(f"{source}: not a readable safetensors file: {_gist(exc)}") from None
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
        raise CheckpointError(f"{path}: not a readable safetensors file: {_gist(exc)}") from None
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
        raise CheckpointError(f"{source}: unreadable metadata: {_gist(exc)}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{source}: its metadata is not a JSON object")
    return meta


def _gist(exc: BaseException) -> str:
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
    data = encode(tensors, meta)
    write_bytes_durably(tmp / rank_file(rank), data)
    if faults.active("exit_in_save", rank=rank, step=step):
        os._exit(17)  # a crash between the shards and the manifest
    digests = _gather_digests(hashlib.sha256(data).hexdigest(), len(data), device, world_size, group)
    del data
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
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        _VERIFIED.add(final)
        prune(root, keep, final)
        remove_unfinished(root)
    _barrier(world_size, group)
    return final


# Checkpoints this process wrote or verified: pruning does not hash them again at every save.
_VERIFIED: set[Path] = set()


def is_valid(path: Path) -> bool:
    if path not in _VERIFIED:
        try:
            reader = CheckpointReader(path)
            reader.verify()
        except CheckpointError:
            return False
        _VERIFIED.add(path)
    return True


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
            _VERIFIED.discard(path)
            shutil.rmtree(path, ignore_errors=True)


def remove_unfinished(root: Path) -> None:
    """The temporary directories of saves that crashed before their rename (rank 0 saves one at a time)."""
    for path in root.glob(UNFINISHED + "*"):
        shutil.rmtree(path, ignore_errors=True)


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
        raise CheckpointError(f"{manifest_path}: unreadable manifest: {_gist(exc)}") from None
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
    final export lists model.safetensors alone."""

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
        if set(files) != {FINAL_FILE}:
            raise bad(f"a final export lists {FINAL_FILE} alone, not {_names(files)}")
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


def verify_files(path: Path, manifest: dict) -> None:
    """Every file the manifest lists is there (a regular file, not a symlink), with its size and sha256."""
    for name, entry in manifest["files"].items():
        file = Path(path) / name
        size = regular_file(file).st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{file}: {size} bytes, manifest says {entry['bytes']}")
        if sha256_file(file) != entry["sha256"]:
            raise CheckpointError(f"{file}: sha256 does not match the manifest")


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


def check_resumable(reader: CheckpointReader, strategy: str, optimizer: str, key: str) -> None:
    """A checkpoint resumes only under the strategy that wrote it (its files are that strategy's
    shards; the strategies of one checkpoint family take each other's) and with the same optimizer
    (its state is that optimizer's own: Adam's moments, SGD's momentum). CheckpointMismatch naming
    `key`, or train.optimizer, otherwise."""
    if checkpoint_family(reader.strategy) != checkpoint_family(strategy):
        raise CheckpointMismatch(
            key, f"checkpoint {reader.path} was written by strategy {reader.strategy!r}, this run uses {strategy!r}"
        )
    saved = reader.manifest.get("config", {}).get("train", {}).get("optimizer")
    if saved is not None and saved != optimizer:
        raise CheckpointMismatch(
            "train.optimizer",
            f"checkpoint {reader.path} holds the state of optimizer "
            f"{saved!r}, this run uses {optimizer!r}: resume with "
            f"train.optimizer = {saved!r}",
        )


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


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load with a clear list of what does not match, instead of a traceback."""
    differs = describe_mismatch(
        {k: v.shape for k, v in model.state_dict().items()}, {k: v.shape for k, v in state.items()}
    )
    if differs:
        raise CheckpointMismatch("resume", differs)
    model.load_state_dict(state)


def optimizer_to_tensors(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict, dict]:
    """`names` follows the optimizer's parameters in param_groups order."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, state in sd["state"].items():
        name = names[index]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{name}.{key}"] = value
            else:
                scalars.setdefault(name, {})[key] = value
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


# how an optimizer computes its update, not what it has learnt: never taken from a checkpoint
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def optimizer_from_tensors(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict, meta: dict) -> None:
    current = optimizer.state_dict()
    state: dict[int, dict] = {}
    for index, name in enumerate(names):
        prefix = f"optim.{name}."
        entry = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        entry.update(meta["scalars"].get(name, {}))
        if entry:
            state[index] = entry
    # hyperparameters come from the checkpoint; how the update is computed (fused or not, ...) is
    # this process's choice, so a run saved on one kind of machine resumes on another
    groups = [
        dict(saved, params=cur["params"], **{k: cur[k] for k in _IMPLEMENTATION_KEYS if k in cur})
        for saved, cur in zip(meta["param_groups"], current["param_groups"])
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- the consolidated export ---------------------------------------------------------------------
def export_final(run_dir: Path, state: dict[str, torch.Tensor], *, step: int, config: dict, extra: dict) -> Path:
    """RUN_DIR/final/model.safetensors keyed exactly like the user's model.state_dict()."""
    run_dir = Path(run_dir)
    tmp, final = run_dir / f"{UNFINISHED}final", run_dir / "final"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    data = st_save(_unshared(state), metadata={"format": "pt"})
    write_bytes_durably(tmp / "model.safetensors", data)
    manifest = {
        "format": FINAL_FORMAT,
        "step": step,
        "config": config,
        "files": {"model.safetensors": {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}},
        "tensors": {
            k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in state.items()
        },
        **extra,
    }
    write_bytes_durably(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
    _fsync_dir(tmp)  # the files' names durable before the rename publishes them
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(run_dir)
    remove_unfinished(run_dir / "checkpoints")  # the run is over: no save of it is under way
    return final
