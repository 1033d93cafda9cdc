"""Strategies, one module each. `build_strategy` is the only place that knows which is which."""
from __future__ import annotations

from .base import Strategy
from .data_parallel import DataParallel

STRATEGIES: dict[str, type[Strategy]] = {"dp": DataParallel}


def build_strategy(model, loss_fn, cfg, rt) -> Strategy:
    return STRATEGIES[cfg.parallel.strategy](model, loss_fn, cfg, rt)
