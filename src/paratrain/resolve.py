"""`module:function` names, resolved with the working directory and the config's directory on sys.path."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from paratrain.errors import ConfigError

CONFIG_DIR_ENV = "PARATRAIN_CONFIG_DIR"


def _search_path() -> None:
    for entry in (os.environ.get(CONFIG_DIR_ENV), os.getcwd()):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)


def resolve_callable(name: str, key: str) -> Callable[..., Any]:
    if ":" not in name:
        raise ConfigError(key, f"{name!r} is neither a built-in nor of the form module:function")
    module_name, _, attr = name.partition(":")
    _search_path()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the user's config pointing at bad code
        raise ConfigError(key, f"cannot import module {module_name!r}: {exc}") from None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(key, f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(key, f"{name} is not callable")
    return fn


def check_kwargs(fn, kwargs: dict, section: str, name: str) -> None:
    """Name the config key that the factory `fn` does not accept."""
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    for key in kwargs:
        if key not in params:
            known = ", ".join(k for k in params if k != "split")
            raise ConfigError(f"{section}.{key}", f"unknown key: {name} takes {known or 'no arguments'}")
    check_types(fn, kwargs, section)


# What a TOML value must be to fill an argument annotated with these types. An int fills a float;
# a bool fills nothing else (TOML's `true` is Python's 1, and "false" as a string is truthy).
_ACCEPTS = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}
_TOML_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def check_types(fn, kwargs: dict, section: str) -> None:
    """Each value against its argument's annotation, where that is int, float, bool or str (or
    one of them | None): a value of another type exits 2 naming the key, before the factory runs
    (a float n_head reached the workers' tensor views; "false" for a bool tied the gpt's weights)."""
    import types
    import typing

    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # annotations that do not resolve (a user's own types): nothing to check
        return
    for key, value in kwargs.items():
        hint = hints.get(key)
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            simple = [a for a in typing.get_args(hint) if a is not type(None)]
            hint = simple[0] if len(simple) == 1 else None
        if not isinstance(hint, type) or hint not in _ACCEPTS:
            continue
        if isinstance(value, bool) and hint is not bool or not isinstance(value, _ACCEPTS[hint]):
            raise ConfigError(f"{section}.{key}", f"expected {_TOML_NAMES[hint]}, got {value!r}")
