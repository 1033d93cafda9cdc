"""The errors a user's input raises and the one line a command prints for one, in a module that
imports nothing of paratrain: every layer (config, runtime, the strategies' own checks, the
commands) uses them without importing another."""

from __future__ import annotations

import sys


class ConfigError(ValueError):
    """An invalid config: `key` is the dotted path of the offending key."""

    def __init__(self, key: str, why: str):
        super().__init__(f"{key}: {why}")
        self.key = key
        self.why = why


def report(msg: str, code: int) -> int:
    """Print the one line every command gives for an error, and return its exit code."""
    print(f"paratrain: error: {msg}", file=sys.stderr, flush=True)
    return code
