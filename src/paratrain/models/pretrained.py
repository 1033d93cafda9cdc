"""`[model] pretrained = "DIR"`: a Hugging Face directory (hf reads it) or, for any other factory,
a directory of safetensors keyed like the model's state_dict (a paratrain final/) or a torch DCP
directory of it (checkpoint/weights.py), whose weights replace the built model's (build_model;
checked from the files' headers or the DCP metadata before any worker starts).

Under a sharding strategy no rank holds the whole model while loading. The model's construction
(hf's from the directory's config, without weights) is recorded on the meta device and
replayed a tensor at a time (models/materialize.py), which gives every tensor the directory lacks
(a rotary embedding's non-persistent buffers, say) its value; each tensor the directory holds is
then read alone (safetensors memory-mapped, DCP by a dcp.load of that tensor) and handed to the strategy, which keeps its
shard of it before the next one is read.

Where the files name tensors the model does not have (transformers renames or fuses some as it
loads: older checkpoints, MoE experts), the model is loaded whole by the factory instead."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from pathlib import Path

import torch
from torch import nn

from paratrain.checkpoint.format import CheckpointError
from paratrain.checkpoint.weights import Weights, weights_in
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


def pretrained_weights(pretrained: str) -> Weights:
    """The weights of `pretrained` for a factory other than hf: a directory whose safetensors are
    keyed like the model's state_dict (a paratrain final/), or a torch DCP directory of the model's
    state_dict; ConfigError where it is neither."""
    directory = pretrained_dir(pretrained)
    try:
        weights = weights_in(directory)
    except CheckpointError as exc:  # a damaged DCP .metadata
        raise ConfigError("model.pretrained", str(exc)) from None
    if weights is None:
        raise ConfigError("model.pretrained", f"{directory} holds no model.safetensors and no DCP .metadata")
    return weights


def check_weights(model: nn.Module, weights: Weights) -> None:
    """The weights hold every tensor of the model's state_dict, of its shape, and no other
    (ConfigError naming the first that differs); from their headers, on a meta model too."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k: tuple(shape) for k, (_, shape) in weights.layout().items()}
    found.update({name: found[held] for name, held in _tied_stand_ins(model, found).items()})
    for name in sorted(expected.keys() | found.keys()):
        if expected.get(name) != found.get(name):
            what = (
                "is missing"
                if name not in found
                else "is no tensor of the model"
                if name not in expected
                else f"is {list(found[name])}, the model's {list(expected[name])}"
            )
            raise ConfigError("model.pretrained", f"{weights.where} does not fit the model: {name} {what}")


def load_weights(model: nn.Module, weights: Weights) -> None:
    """The weights' tensors (check_weights passed) into the model."""
    state = dict(weights.tensors())
    state.update({name: state[held] for name, held in _tied_stand_ins(model, state).items()})
    model.load_state_dict(state)


def _tied_stand_ins(model: nn.Module, found: Iterable[str]) -> dict[str, str]:
    """Each state_dict name the weights lack whose tensor is tied to one they hold, and that one:
    save_pretrained keeps one of tied embeddings, and a DCP converted from its directory too."""
    names_of: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names_of.setdefault(id(tensor), []).append(name)
    held = set(found)
    return {
        name: next(n for n in names if n in held)
        for names in names_of.values()
        if held.intersection(names)
        for name in names
        if name not in held
    }


def pretrained_on_meta(build: Callable[[], nn.Module], pretrained: str) -> nn.Module | None:
    """The model of `build` (a factory given `pretrained`) on the meta device, materialised later
    with the directory's weights read a tensor at a time; None where its files are not read so
    (see the module's docstring)."""
    weights = weights_in(pretrained_dir(pretrained))
    if weights is None:
        return None

    def architecture() -> nn.Module:
        with _building_without_weights():
            return build()

    model = record_on_meta(architecture)
    if not set(weights.layout()) <= tensor_names(model).keys():
        return None
    read_on_materialize(model, weights)
    return model
