"""A model's weights on disk, keyed like its state_dict, read a tensor at a time: the safetensors of a
paratrain final/ (or of save_pretrained), a torch DCP directory, or the model tensors of a paratrain
checkpoint step-N that holds them whole.

A DCP directory is known by its `.metadata` file. It holds the model either as `{"model": state_dict}`
(FSDP2's get_model_state_dict saved by dcp.save, a paratrain dcp checkpoint) or as a flat state_dict
(torchtitan's weights-only export). Its names, dtypes and shapes come from that metadata; its tensors
are read through torch's own `torch.distributed.checkpoint.load` in this process alone (no process
group), one tensor per call, so that a rank that keeps a shard of each never holds the whole model.
"""

from __future__ import annotations

import abc
import contextlib
import json
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from paratrain.checkpoint.format import CheckpointError, rank_file, read_header
from paratrain.checkpoint.writer import DTYPE_NAMES, Layout

DCP_METADATA = ".metadata"
DCP_MODEL_KEY = "model"  # where {"model": state_dict} keeps the model
_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@contextlib.contextmanager
def _in_this_process_alone() -> Iterator[None]:
    """dcp.save/load with no_dist=True, without torch's warning that it assumes so on every call,
    and raising the error itself (an OSError on a full disk) rather than torch's wrapping of it, a
    BaseException whose text is a traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            yield
        except CheckpointException as exc:
            raise next(iter(exc.failures.values()))[0] from None


class Weights(abc.ABC):
    """The tensors of a model in `where`: their layout, and their values one at a time."""

    where: Path

    @abc.abstractmethod
    def layout(self) -> Layout: ...

    @abc.abstractmethod
    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, value) of every tensor, in the dtype it was saved in, one read per tensor."""


class SafetensorsWeights(Weights):
    """safetensors files, read memory-mapped."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.where = files[0].parent

    def layout(self) -> Layout:
        from safetensors import safe_open

        found = {}
        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    found[name] = (_DTYPES[piece.get_dtype()], tuple(piece.get_shape()))
        return found

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)


class DcpWeights(Weights):
    """A torch DCP directory: `{"model": state_dict}` or a flat state_dict (module docstring)."""

    def __init__(self, directory: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.where = directory
        try:
            metadata = FileSystemReader(str(directory)).read_metadata()
        except Exception as exc:  # noqa: BLE001  torch's reader raises whatever a damaged file makes it
            raise CheckpointError(f"{directory / DCP_METADATA}: unreadable DCP metadata ({exc})") from None
        paths = metadata.planner_data or {}
        tensors = {
            key: paths.get(key, (key,))
            for key, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
        }
        # {"model": ...} where the model is kept so; a flat state_dict's tensors otherwise
        self.nested = any(len(path) == 2 and path[0] == DCP_MODEL_KEY for path in tensors.values())
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for key, path in tensors.items():
            if (path[0] == DCP_MODEL_KEY and len(path) == 2) if self.nested else len(path) == 1:
                entry = metadata.state_dict_metadata[key]
                assert isinstance(entry, TensorStorageMetadata)
                self._layout[path[-1]] = (entry.properties.dtype, tuple(entry.size))

    def layout(self) -> Layout:
        return self._layout

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        import torch.distributed.checkpoint as dcp

        for name, (dtype, shape) in self._layout.items():
            value = torch.empty(shape, dtype=dtype)
            state = {DCP_MODEL_KEY: {name: value}} if self.nested else {name: value}
            with _in_this_process_alone():
                dcp.load(state, checkpoint_id=str(self.where), no_dist=True)
            yield name, value


class CheckpointModelWeights(Weights):
    """The model in a paratrain checkpoint step-N whose rank files hold it as whole tensors
    (`model.NAME`): dp's (rank 0's copy), a pipeline's (each stage its own); CheckpointError for one
    whose model is split (zero's flat shards, tp's slices), which only its strategy puts together."""

    PREFIX = "model."

    def __init__(self, path: Path, world_size: int, strategy: str):
        self.where = path
        self._layout: dict[str, tuple[torch.dtype, Sequence[int]]] = {}
        self._file: dict[str, Path] = {}  # the first rank file holding each tensor
        for rank in range(world_size):
            file = path / rank_file(rank)
            if read_header(file)[0].get("shard_dims"):
                raise CheckpointError(f"{path}: its model is saved in {strategy}'s tensor-parallel slices")
            for key, entry in SafetensorsWeights([file]).layout().items():
                name = key.removeprefix(self.PREFIX)
                if key.startswith(self.PREFIX) and name not in self._file:
                    self._layout[name] = entry
                    self._file[name] = file
        if not self._layout:
            raise CheckpointError(f"{path}: its model is saved in {strategy}'s flat shards")

    def layout(self) -> Layout:
        return self._layout

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for name, file in self._file.items():
            with safe_open(str(file), framework="pt") as f:
                yield name, f.get_tensor(self.PREFIX + name)


def is_dcp(directory: Path) -> bool:
    return (directory / DCP_METADATA).is_file()


def weight_files(directory: Path) -> list[Path]:
    """The directory's safetensors, as save_pretrained writes them: one model.safetensors, or the
    shards its model.safetensors.index.json maps; none otherwise."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else []


def weights_in(directory: Path) -> Weights | None:
    """The model weights the directory holds (a DCP directory's first); None where it holds none."""
    if is_dcp(directory):
        return DcpWeights(directory)
    files = weight_files(directory)
    return SafetensorsWeights(files) if files else None


def save_dcp(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """`{"model": tensors}` as a DCP directory, readable by plain dcp.load at any world size."""
    import torch.distributed.checkpoint as dcp

    with _in_this_process_alone():
        dcp.save({DCP_MODEL_KEY: tensors}, checkpoint_id=str(directory), no_dist=True)
