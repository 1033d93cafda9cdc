"""Strategies, one module each. `build_strategy` is the only place that knows which is which."""
from __future__ import annotations

import importlib

from .base import Strategy

# strategy name -> "module:class" under paratrain.parallel (imported only when used)
STRATEGIES: dict[str, str] = {"dp": "data_parallel:DataParallel", "tp": "hybrid:ModelParallel",
                              "pp": "hybrid:ModelParallel", "hybrid": "hybrid:ModelParallel"}


def build_strategy(model, loss_fn, cfg, rt) -> Strategy:
    module, _, cls = STRATEGIES[cfg.parallel.strategy].partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(model, loss_fn, cfg, rt)


def check_model(cfg, model) -> None:
    """Strategy-specific checks of the (meta-device) model before any worker starts, for the
    strategies whose module defines `check_model(cfg, model)`."""
    module = importlib.import_module(f"{__name__}.{STRATEGIES[cfg.parallel.strategy].partition(':')[0]}")
    if hasattr(module, "check_model"):
        module.check_model(cfg, model)
