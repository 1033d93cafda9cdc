"""A failed launch explained: which worker to blame (WorkerFailure), what it died of, and its own
traceback with the frames of how it was started dropped, naming the innermost frame of the user's
code (FILE:LINE), as `python script.py` would show it."""

from __future__ import annotations

import os
import re
import signal
import sysconfig
from dataclasses import dataclass
from pathlib import Path


@dataclass
class WorkerFailure(Exception):
    rank: int
    exitcode: int
    cause: str
    own_exitcodes: set  # of the workers that failed by themselves (not those the agent then stopped)
    where: str = ""  # FILE:LINE, the innermost frame of the user's code in the worker's traceback
    traceback: str = ""  # the worker's, from its own code down ("" where it left none)
    agent_log: str = ""  # where the agent's own report of it went

    def __str__(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"rank {self.rank} failed (exit code {self.exitcode}){at}: {self.cause}"


# A worker's exit code when it stopped on a signal it was sent (trainer.run_worker), not by failing.
STOPPED_EXITS = {128 + signal.SIGINT, 128 + signal.SIGTERM}


def blame(failures: dict, agent_log: Path | None = None) -> WorkerFailure:
    """The worker to name for a failed group (rank -> the agent's ProcessFailure), and where the
    agent logged it (`agent_log`, where it wrote one).

    The agent stops the other workers once one fails: blame a worker that failed by itself (an
    exit code > 0, with an error report), not one that was stopped (by the agent or a signal
    sent to it); and among those, one whose error is its own rather than a peer's going away
    (the peers' connections break within the same second, and the timestamps count whole
    seconds), the earliest."""
    own = [
        (_lost_a_peer(_cause(f)), f.timestamp, r)
        for r, f in failures.items()
        if f.exitcode > 0 and f.exitcode not in STOPPED_EXITS
    ]
    rank = min(own)[2] if own else min(failures, key=lambda r: (failures[r].timestamp, r))
    stack = _callstack(failures[rank])
    return WorkerFailure(
        rank,
        failures[rank].exitcode,
        _cause(failures[rank]),
        {f.exitcode for f in failures.values() if f.exitcode > 0},
        where=_users_frame(stack),
        traceback=_without_startup_frames(stack),
        agent_log=str(agent_log) if agent_log is not None and agent_log.exists() else "",
    )


# What a worker's collective or message says when the process at the other end has died.
_PEER_GONE = re.compile(
    r"closed by peer|reset by peer|broken pipe|connection refused|peer .*(gone|died|exited)", re.IGNORECASE
)


def _lost_a_peer(cause: str) -> bool:
    return bool(_PEER_GONE.search(cause))


def _cause(failure) -> str:
    """The last line of a failed worker's error report, or what became of it."""
    cause = failure.message
    if isinstance(cause, dict):
        cause = cause.get("message", "<unknown>")
    if failure.exitcode < 0:
        cause = f"killed by signal {failure.signal_name()}"
    elif not cause or cause.startswith("To enable traceback"):
        cause = f"exited with code {failure.exitcode} (see its output above)"
    return str(cause).strip().splitlines()[-1]


def _callstack(failure) -> str:
    """The traceback a failed worker's error report holds ("" where it wrote none)."""
    if not isinstance(failure.message, dict):
        return ""
    return str(failure.message.get("extraInfo", {}).get("py_callstack", ""))


_FRAME = re.compile(r'^  File "(.+)", line (\d+), in ', re.MULTILINE)

# The frames above a worker's own code: torch's process wrappers, runpy (a script's start) and
# paratrain's entry points (call_preloaded here, run_script in api/script.py).
_STARTUP_FRAMES = (
    "/torch/multiprocessing/",
    "/torch/distributed/elastic/",
    "<frozen runpy>",
    "/runpy.py",
    "/paratrain/runtime/launch.py",
    "/paratrain/api/script.py",
)


def _without_startup_frames(stack: str) -> str:
    """The traceback from the worker's own code down, as `python script.py` shows it: the frames of
    how the worker was started dropped from the top of each traceback in the chain."""
    kept, skipping = [], False
    for line in stack.rstrip().splitlines():
        if line == "Traceback (most recent call last):":
            skipping = True
        elif frame := _FRAME.match(line):
            skipping = skipping and any(part in frame.group(1) for part in _STARTUP_FRAMES)
        elif not line.startswith("    "):  # a frame's source lines are indented; the exception's are not
            skipping = False
        if not skipping or line == "Traceback (most recent call last):":
            kept.append(line)
    trimmed = "\n".join(kept)
    return trimmed if _FRAME.search(trimmed) else stack.rstrip()  # it failed while starting: all of it


def _users_frame(stack: str) -> str:
    """FILE:LINE of the innermost frame of the user's code in the last traceback of `stack` (the
    exception raised), FILE relative to the working directory where it is under it; "" if none.
    The user's code is what neither Python, an installed package nor paratrain holds."""
    last = stack.rpartition("Traceback (most recent call last):")[2]
    theirs = [(file, line) for file, line in _FRAME.findall(last) if _is_users(file)]
    if not theirs:
        return ""
    file, line = theirs[-1]
    relative = os.path.relpath(file)
    return f"{file if relative.startswith('..') else relative}:{line}"


def _is_users(file: str) -> bool:
    if file.startswith("<"):  # <frozen ...>, <string>: no file of theirs
        return False
    paths = sysconfig.get_paths()
    not_theirs = {os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    not_theirs.add(str(Path(__file__).resolve().parents[1]))  # paratrain's own
    file = os.path.realpath(file)
    return not any(os.path.commonpath([file, path]) == path for path in not_theirs)
