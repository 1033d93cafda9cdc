"""Strategies, one module each. `build_strategy` is the only place that knows which is which."""
from __future__ import annotations

import importlib

from .base import Strategy

# strategy name -> "module:class" under paratrain.parallel (imported only when used)
STRATEGIES: dict[str, str] = {"dp": "data_parallel:DataParallel",
                              "zero1": "zero:Zero1", "zero2": "zero:Zero2", "zero3": "zero:Zero3",
                              "ps": "parameter_server:ParameterServer"}


def strategy_class(name: str) -> type[Strategy]:
    module, _, cls = STRATEGIES[name].partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def build_strategy(model, loss_fn, cfg, rt) -> Strategy:
    return strategy_class(cfg.parallel.strategy)(model, loss_fn, cfg, rt)
