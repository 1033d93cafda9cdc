"""Built-in models (mlp, cnn, gpt) and user `module:function` factories."""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable

from torch import nn

from paratrain.config import ArgumentError, Config
from paratrain.errors import ConfigError
from paratrain.models.cnn import cnn
from paratrain.models.gpt import gpt
from paratrain.models.gpt import parameters_at_least as gpt_parameters_at_least
from paratrain.models.hf import hf
from paratrain.models.mlp import mlp
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


def model_kwargs(cfg: Config, dataset) -> dict:
    kwargs = dict(cfg.model.kwargs)
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
        arguments = inspect.signature(gpt).bind(**model_kwargs(cfg, dataset()))
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


def build_model(cfg: Config, dataset) -> nn.Module:
    """The user's model, built on the current default device (use a meta device to only check it)."""
    name = cfg.model.factory
    fn = FACTORIES.get(name) or resolve_callable(name, "model.factory")
    check_kwargs(fn, cfg.model.kwargs, "model", name)
    kwargs = model_kwargs(cfg, dataset)
    try:
        model = fn(**kwargs)
    except ArgumentError as exc:
        raise ConfigError(f"model.{exc.arg}", str(exc)) from None
    except (TypeError, ValueError, ImportError) as exc:
        raise ConfigError("model.factory", f"{name} failed: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError("model.factory", f"{name} returned {type(model).__name__}, not a torch.nn.Module")
    if cfg.train.recompute != "none":
        enable_recompute(model, name, cfg.train.recompute)
    return model
