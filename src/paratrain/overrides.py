"""`--set KEY=VALUE`: the value in TOML syntax (a bare word a string), refused in one line naming
the --set where no TOML file could hold it (control characters, unbalanced quotes)."""

from __future__ import annotations

import unicodedata
from typing import Any

import tomllib

from paratrain.errors import ConfigError


def control_characters(text: str) -> str:
    """The control characters of `text`, as repr shows them ("" if none): a line break or an escape
    sequence in a name or a value ends up in file names, TOML and log lines."""
    return "".join(sorted({repr(c)[1:-1] for c in text if unicodedata.category(c) == "Cc"}))


def _strings_in(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [s for item in items for s in _strings_in(item)]


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=VALUE` with VALUE in TOML syntax; a bare word is taken as a string. ConfigError naming
    `--set KEY` for a value with control characters or an unbalanced quote, which a bare word would
    otherwise keep verbatim."""
    if "=" not in item:
        raise ConfigError(item, "--set expects KEY=VALUE")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(key or item, "--set expects a dotted KEY=VALUE")
    where = f"--set {key}"
    refuse_control_characters(where, text)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as exc:
        if text.strip()[:1] in ('"', "'", "[", "{"):  # meant as TOML, not a bare word
            raise ConfigError(where, f"{text!r} is not a TOML value ({exc}): unbalanced quotes or brackets?") from None
        value = text
    for string in _strings_in(value):  # TOML's escapes ("\n") make them too
        refuse_control_characters(where, string)
    return key.split("."), value


def refuse_control_characters(key: str, text: str) -> None:
    if bad := control_characters(text):
        raise ConfigError(key, f"control characters ({bad}) are not allowed in a value, got {text!r}")


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = parse_override(item)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(".".join(path), f"{part!r} is not a table")
        node[path[-1]] = value
    return raw
