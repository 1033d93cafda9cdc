"""The errors a user's input raises and the lines paratrain prints on stderr (notes, warnings,
errors), in a module that imports nothing of paratrain: every layer (config, runtime, the strategies' own checks, the
commands) uses them without importing another."""

from __future__ import annotations

import errno
import sys


class ConfigError(ValueError):
    """An invalid config: `key` is the dotted path of the offending key."""

    def __init__(self, key: str, why: str):
        super().__init__(f"{key}: {why}")
        self.key = key
        self.why = why


def say(line: str) -> None:
    """One line on stderr, at once: a worker's stderr is a pipe, where an unflushed line arrives
    late, out of order with the others' or, when the process is killed, never."""
    print(line, file=sys.stderr, flush=True)


def note(msg: str) -> None:
    say(f"paratrain: {msg}")


def warn(msg: str) -> None:
    say(f"paratrain: warning: {msg}")


def error(msg: str) -> None:
    """The one line every command gives for an error."""
    say(f"paratrain: error: {msg}")


def report(msg: str, code: int) -> int:
    """The error's line, and its exit code to return."""
    error(msg)
    return code


def write_failure(path, exc: OSError) -> str:
    """What a failed write (a full disk, a read-only folder, a quota) says: the path, the system's
    reason, and the room left where it was writing, which is what the user has to change."""
    import shutil
    from pathlib import Path

    where = Path(path)
    while not where.exists() and where != where.parent:  # the nearest folder that is there
        where = where.parent
    try:
        free = f"; {shutil.disk_usage(where).free / 2**20:.1f} MiB free there"
    except OSError:
        free = ""
    return f"cannot write {path}: {exc.strerror or exc}{free}"


# What a write to a full, read-only or over-quota disk fails with: the disk, not the code.
WRITE_FAILURES = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
