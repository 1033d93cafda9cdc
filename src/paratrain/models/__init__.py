"""Built-in models (mlp, cnn, gpt) and user `module:function` factories."""
from __future__ import annotations

import inspect

from torch import nn

from ..config import Config, ConfigError
from ..resolve import check_kwargs, resolve_callable
from .cnn import cnn
from .gpt import gpt
from .mlp import mlp

BUILTIN = {"mlp": mlp, "cnn": cnn, "gpt": gpt}

# Built-in factory arguments taken from the dataset when the config does not give them.
_FROM_DATASET = {"in_features": "in_features", "out_features": "num_classes", "vocab_size": "vocab_size"}


def model_kwargs(cfg: Config, dataset) -> dict:
    kwargs = dict(cfg.model.kwargs)
    fn = BUILTIN.get(cfg.model.factory)
    if fn is not None:
        params = inspect.signature(fn).parameters
        for arg, attr in _FROM_DATASET.items():
            if arg in params and arg not in kwargs and getattr(dataset, attr, None) is not None:
                kwargs[arg] = getattr(dataset, attr)
        if cfg.model.factory == "gpt" and "block_size" not in kwargs and hasattr(dataset, "block_size"):
            kwargs["block_size"] = dataset.block_size
    return kwargs


def build_model(cfg: Config, dataset) -> nn.Module:
    """The user's model, built on the current default device (use a meta device to only check it)."""
    name = cfg.model.factory
    fn = BUILTIN.get(name) or resolve_callable(name, "model.factory")
    check_kwargs(fn, cfg.model.kwargs, "model", name)
    kwargs = model_kwargs(cfg, dataset)
    try:
        model = fn(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError("model.factory", f"{name} failed: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError("model.factory", f"{name} returned {type(model).__name__}, not a torch.nn.Module")
    return model
