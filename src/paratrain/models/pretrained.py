"""`[model] pretrained = "DIR"` under a sharding strategy: no rank holds the whole model while
loading. The model's construction from the directory's config is recorded on the meta device and
replayed a tensor at a time (models/materialize.py), which gives every tensor the directory lacks
(a rotary embedding's non-persistent buffers, say) its value; each tensor the directory's
safetensors hold is then read alone (memory-mapped) and handed to the strategy, which keeps its
shard of it before the next one is read.

Where the files name tensors the model does not have (transformers renames or fuses some as it
loads: older checkpoints, MoE experts), the model is loaded whole by the factory instead."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path

from torch import nn

from paratrain.models.materialize import read_on_materialize, record_on_meta, tensor_names
from paratrain.resolve import CONFIG_DIR_ENV

# set while a factory builds the model whose weights materialize reads (pretrained_on_meta): the
# construction from the directory's config alone, the same whether recorded on meta or replayed
_WITHOUT_WEIGHTS: ContextVar[bool] = ContextVar("without_weights", default=False)


def without_weights() -> bool:
    """Whether a factory given `pretrained` is to build the model from its config alone."""
    return _WITHOUT_WEIGHTS.get()


@contextlib.contextmanager
def _building_without_weights() -> Iterator[None]:
    token = _WITHOUT_WEIGHTS.set(True)
    try:
        yield
    finally:
        _WITHOUT_WEIGHTS.reset(token)


def pretrained_dir(pretrained: str) -> Path:
    """`pretrained` as a path: relative to the config file's directory, where there is one."""
    path = Path(pretrained)
    if not path.is_absolute() and os.environ.get(CONFIG_DIR_ENV):
        path = Path(os.environ[CONFIG_DIR_ENV]) / path
    return path


def weight_files(directory: Path) -> list[Path]:
    """The directory's safetensors, as save_pretrained writes them: one model.safetensors, or the
    shards its model.safetensors.index.json maps; none otherwise."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else []


def pretrained_on_meta(build: Callable[[], nn.Module], pretrained: str) -> nn.Module | None:
    """The model of `build` (a factory given `pretrained`) on the meta device, materialised later
    with the directory's weights read a tensor at a time; None where its files are not read so
    (see the module's docstring)."""
    from safetensors import safe_open

    files = weight_files(pretrained_dir(pretrained))
    if not files:
        return None

    def architecture() -> nn.Module:
        with _building_without_weights():
            return build()

    model = record_on_meta(architecture)
    names = tensor_names(model)
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            if not set(f.keys()) <= names.keys():
                return None
    read_on_materialize(model, files)
    return model
