"""Strategies, one module each. `build_strategy` is the only place that knows which is which."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing base imports torch; the registry below must not (config reads it)
    from .base import Strategy

# strategy name -> "module:class" under paratrain.parallel (imported only when used)
STRATEGIES: dict[str, str] = {
    "dp": "data_parallel:DataParallel",
    "zero1": "zero:Zero1",
    "zero2": "zero:Zero2",
    "zero3": "zero:Zero3",
    "tp": "hybrid:ModelParallel",
    "pp": "hybrid:ModelParallel",
    "hybrid": "hybrid:ModelParallel",
    "ps": "parameter_server:ParameterServer",
    "federated": "federated.strategy:Federated",
}

# strategy name -> module under paratrain.parallel that checks the strategy's own config keys and
# imports no torch (config.py calls it before any worker starts); it may define
# check_config(cfg), check_world(cfg, world_size), data_parallel_degree(cfg, world_size) and
# role_of(cfg, rank)
CONFIG_CHECKS: dict[str, str] = {"federated": "federated.keys"}


def config_checks(name: str):
    """The module of strategy `name`'s own config checks, or None."""
    path = CONFIG_CHECKS.get(name)
    return importlib.import_module(f"{__name__}.{path}") if path else None


def _module(name: str):
    return importlib.import_module(f"{__name__}.{STRATEGIES[name].partition(':')[0]}")


def strategy_class(name: str) -> type[Strategy]:
    return getattr(_module(name), STRATEGIES[name].partition(":")[2])


def build_strategy(model, loss_fn, cfg, rt) -> Strategy:
    return strategy_class(cfg.parallel.strategy)(model, loss_fn, cfg, rt)


def check_model(cfg, model) -> None:
    """Strategy-specific checks of the (meta-device) model before any worker starts, for the
    strategies whose module defines `check_model(cfg, model)`."""
    module = _module(cfg.parallel.strategy)
    if hasattr(module, "check_model"):
        module.check_model(cfg, model)
