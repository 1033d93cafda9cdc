"""`module:function` names, resolved with the working directory and the config's directory on sys.path."""
from __future__ import annotations

import importlib
import os
import sys

from .config import ConfigError

CONFIG_DIR_ENV = "PARATRAIN_CONFIG_DIR"


def _search_path() -> None:
    for entry in (os.environ.get(CONFIG_DIR_ENV), os.getcwd()):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)


def resolve_callable(name: str, key: str):
    if ":" not in name:
        raise ConfigError(key, f"{name!r} is neither a built-in nor of the form module:function")
    module_name, _, attr = name.partition(":")
    _search_path()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the user's config pointing at bad code
        raise ConfigError(key, f"cannot import module {module_name!r}: {exc}") from None
    fn = module
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
