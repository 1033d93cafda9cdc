"""Strategies, one module (or folder) each, each with its spec in `registry`: the only place that
knows which is which."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import registry

if TYPE_CHECKING:  # importing base imports torch; the registry must not (config reads it)
    from .base import Strategy


def strategy_class(name: str) -> type[Strategy]:
    return registry.spec(name).engine()


def build_strategy(model, loss_fn, cfg, rt) -> Strategy:
    return strategy_class(cfg.parallel.strategy)(model, loss_fn, cfg, rt)
