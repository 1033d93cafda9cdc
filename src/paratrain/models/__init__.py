"""Built-in models (mlp, cnn, gpt) and user `module:function` factories."""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable

import torch
from torch import nn

from paratrain.config import ArgumentError, Config
from paratrain.errors import ConfigError
from paratrain.models.cnn import cnn
from paratrain.models.gpt import gpt
from paratrain.models.gpt import parameters_at_least as gpt_parameters_at_least
from paratrain.models.hf import hf
from paratrain.models.materialize import record_on_meta
from paratrain.models.mlp import mlp
from paratrain.models.pretrained import (
    check_weights,
    load_weights,
    pretrained_on_meta,
    pretrained_weights,
    shapes_only,
    without_weights,
)
from paratrain.models.recompute import enable_recompute
from paratrain.resolve import check_kwargs, resolve_callable

BUILTIN: dict[str, Callable[..., nn.Module]] = {"mlp": mlp, "cnn": cnn, "gpt": gpt}
# hf is named like a built-in, but its construction is transformers' own: a sharding strategy
# records and replays it as it does a user's factory (models/materialize.py), so it is not in BUILTIN.
FACTORIES = {**BUILTIN, "hf": hf}

# Built-in factory arguments taken from the dataset when the config does not give them, and how a
# value the config gives must compare with the data's: (the dataset's attribute, the test, the rule).
_FROM_DATASET = {
    "in_features": ("in_features", operator.eq, "the data's inputs have {} features"),
    "out_features": ("num_classes", operator.ge, "the data has {} classes"),
    "vocab_size": ("vocab_size", operator.ge, "the data has {} symbols"),
    "block_size": ("block_size", operator.ge, "the data's blocks are {} long"),
}


def model_kwargs(cfg: Config, dataset, given: dict) -> dict:
    """The factory's arguments: `given` (the config's), and a built-in's from the dataset."""
    kwargs = dict(given)
    fn = BUILTIN.get(cfg.model.factory)
    if fn is not None:
        params = inspect.signature(fn).parameters
        for arg, (attr, fits, what) in _FROM_DATASET.items():
            data = getattr(dataset, attr, None)
            if arg not in params or data is None:
                continue
            if arg not in kwargs:
                kwargs[arg] = data
            elif isinstance(kwargs[arg], int) and not fits(kwargs[arg], data):
                raise ConfigError(f"model.{arg}", f"{kwargs[arg]}, but {what.format(data)} ({cfg.data.factory})")
    return kwargs


def parameters_at_least(cfg: Config, dataset: Callable[[], object]) -> dict[str, int]:
    """A lower bound of the model's parameters by the `[model]` key that multiplies them, from the
    config alone (and `dataset()`, for what the model takes from it), for the built-in gpt; {} for
    a model whose size shows only once built, and for arguments the build itself will refuse."""
    if cfg.model.factory != "gpt":
        return {}
    try:
        given = {k: v for k, v in cfg.model.kwargs.items() if k != "pretrained"}  # build_model's own
        arguments = inspect.signature(gpt).bind(**model_kwargs(cfg, dataset(), given))
    except TypeError:
        return {}
    arguments.apply_defaults()
    if not all(
        isinstance(v, int)
        for k, v in arguments.arguments.items()
        if k in ("vocab_size", "n_layer", "d_model", "n_experts")
    ):
        return {}
    return gpt_parameters_at_least(arguments.arguments)


def worker_preload(cfg: Config) -> tuple[str, ...]:
    """What a worker will import to build the config's model beyond the trainer's own imports, for
    the worker server to import once for all of them (a transformers model's modules); a user's
    own factory module is left to the worker, since its import may do anything (start CUDA, threads)."""
    if cfg.model.factory == "hf":
        from paratrain.models.hf import worker_modules

        return worker_modules(**cfg.model.kwargs)
    return ()


def build_model_to_place(cfg: Config, dataset, materializes: bool) -> nn.Module:
    """The model a strategy takes: built whole, or, for a sharding strategy (`materializes`), on
    the meta device, to be materialised shard by shard: a built-in's initialisation is replayed,
    a user factory's construction recorded to be replayed (a built-in's too under LoRA: peft
    initialises its adapters its own way), a pretrained model's weights read a tensor at a time
    (or, where they are not, loaded whole)."""
    build = functools.partial(build_model, cfg, dataset)
    pretrained = cfg.model.kwargs.get("pretrained")
    if not materializes:
        return build()
    if pretrained:
        return pretrained_on_meta(build, pretrained) or build()
    if cfg.model.factory in BUILTIN and not cfg.model.lora:
        with torch.device("meta"):
            return build()
    return record_on_meta(build)


def build_model(cfg: Config, dataset) -> nn.Module:
    """The user's model, built on the current default device (use a meta device to only check it).
    `pretrained` is hf's own argument; for any other factory, the model it builds is given the
    weights of that directory's safetensors (a paratrain final/, say) or DCP unless only its shapes are
    wanted (models/pretrained.py)."""
    name = cfg.model.factory
    fn = FACTORIES.get(name) or resolve_callable(name, "model.factory")
    given = dict(cfg.model.kwargs)
    pretrained = given.pop("pretrained", None) if fn is not hf else None
    check_kwargs(fn, given, "model", name)
    weights = pretrained_weights(pretrained) if pretrained is not None else None
    kwargs = model_kwargs(cfg, dataset, given)
    try:
        model = fn(**kwargs)
    except ArgumentError as exc:
        raise ConfigError(f"model.{exc.arg}", str(exc)) from None
    except ConfigError:
        raise  # a factory's own check, naming its key (hf's: DCP weights that do not fit the model)
    except (TypeError, ValueError, ImportError) as exc:
        raise ConfigError("model.factory", f"{name} failed: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError("model.factory", f"{name} returned {type(model).__name__}, not a torch.nn.Module")
    if weights is not None:
        check_weights(model, weights)
        if not (shapes_only() or without_weights()):
            load_weights(model, weights)
    if cfg.train.recompute != "none":
        enable_recompute(model, name, cfg.train.recompute)
    if cfg.model.lora:  # (last: peft wraps the model as it will train)
        from paratrain.models.lora import with_lora

        model = with_lora(model, cfg.model.lora)
    return model
