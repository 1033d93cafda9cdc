"""Sharded checkpoints and the final export: safetensors files and JSON manifests, never a pickle
(a torch DCP directory, whose .metadata torch pickles, only through torch's own DCP API).

    format.py    the layout, the manifest's format, safetensors encoding, durable writes, checksums
    save.py      every rank writes its shard into a hidden folder, renamed into place when all are in
    reader.py    the manifest and checksums verified, a rank's shard read, the newest valid one found
    state.py     a model's and an optimizer's state as flat tensors and back
    resume.py    whether a checkpoint resumes under this run's strategy and optimizer
    export.py    RUN_DIR/final/: the consolidated model
    writer.py    safetensors files written a tensor at a time
    inspect.py   `paratrain inspect`
    weights.py   a model's weights (a final/'s safetensors, a torch DCP directory) read a tensor at a time
    convert.py   `paratrain convert` between DCP, a final/ and Hugging Face's layout

What an engine or the trainer needs is importable from the package itself."""

from paratrain.checkpoint.export import export_final, export_model
from paratrain.checkpoint.format import (
    FORMAT,
    CheckpointError,
    CheckpointMismatch,
    CheckpointWriteFailed,
    rank_file,
    read_header,
    write_failed_exit,
)
from paratrain.checkpoint.reader import CheckpointReader, describe_mismatch, latest_valid
from paratrain.checkpoint.save import save
from paratrain.checkpoint.state import load_model_state, optimizer_from_tensors, optimizer_to_tensors

__all__ = [
    "FORMAT",
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointReader",
    "CheckpointWriteFailed",
    "describe_mismatch",
    "export_final",
    "export_model",
    "latest_valid",
    "load_model_state",
    "optimizer_from_tensors",
    "optimizer_to_tensors",
    "rank_file",
    "read_header",
    "save",
    "write_failed_exit",
]
