"""`[model] pretrained = "DIR"`: a Hugging Face directory (hf reads it) or, for any other factory,
a directory of safetensors keyed like the model's state_dict (a paratrain final/), whose weights
replace the built model's (build_model; checked from the files' headers before any worker starts).

Under a sharding strategy no rank holds the whole model while loading. The model's construction
(hf's from the directory's config, without weights) is recorded on the meta device and
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

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.models.materialize import read_on_materialize, record_on_meta, tensor_names
from paratrain.resolve import CONFIG_DIR_ENV

# set while a factory builds the model whose weights materialize reads (pretrained_on_meta): the
# construction from the directory's config alone, the same whether recorded on meta or replayed
_WITHOUT_WEIGHTS: ContextVar[bool] = ContextVar("without_weights", default=False)


def shapes_only() -> bool:
    """Whether the model is built for its shapes alone: on the meta device (the checks before any
    worker starts, a sharding strategy's meta build) or in fake tensors (`plan`)."""
    from torch._guards import detect_fake_mode

    return torch.get_default_device().type == "meta" or detect_fake_mode() is not None


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


def pretrained_files(pretrained: str) -> list[Path]:
    """The weight files of `pretrained` for a factory other than hf: a directory whose safetensors
    are keyed like the model's state_dict (a paratrain final/); ConfigError where it has none."""
    files = weight_files(pretrained_dir(pretrained))
    if not files:
        raise ConfigError("model.pretrained", f"{pretrained_dir(pretrained)} holds no model.safetensors")
    return files


def check_weights(model: nn.Module, files: list[Path]) -> None:
    """The files hold every tensor of the model's state_dict, of its shape, and no other
    (ConfigError naming the first that differs); from their headers, on a meta model too."""
    from safetensors import safe_open

    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found: dict[str, tuple] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            found.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    for name in sorted(expected.keys() | found.keys()):
        if expected.get(name) != found.get(name):
            what = (
                "is missing"
                if name not in found
                else "is no tensor of the model"
                if name not in expected
                else f"is {list(found[name])}, the model's {list(expected[name])}"
            )
            raise ConfigError("model.pretrained", f"{files[0].parent} does not fit the model: {name} {what}")


def load_weights(model: nn.Module, files: list[Path]) -> None:
    """The files' tensors (check_weights passed) into the model."""
    from safetensors.torch import load_file

    model.load_state_dict({k: v for file in files for k, v in load_file(str(file)).items()})


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
