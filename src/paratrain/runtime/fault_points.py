"""Named points in the training code where a test can make this process misbehave on purpose.

What happens at a point is installed by the test tools (paratrain/testing/faults.py, through
`paratrain run` when PARATRAIN_FAULTS is set); a normal run installs nothing, and each point costs
one attribute test. Keeping only the points here lets the training code fire them without
importing the test tools."""

from __future__ import annotations

import os
from collections.abc import Callable

_injector: Callable[[str, dict], bool] | None = None


def install(injector: Callable[[str, dict], bool] | None) -> None:
    """`injector(name, context)` answers whether the fault `name` fires here; None removes it."""
    global _injector
    _injector = injector


def fires(name: str, **context) -> bool:
    return _injector is not None and _injector(name, context)


def kill_if(name: str, signum: int = 9, **context) -> None:
    """Send this process `signum` where fault `name` fires; SIGKILL (9): a node lost, with no word
    to anyone."""
    if fires(name, **context):
        os.kill(os.getpid(), signum)


def at_step_start(**context) -> None:
    """The trainer's faults, as a step begins: `kill` (SIGKILL) and `term` (SIGTERM, 15)."""
    kill_if("kill", **context)
    kill_if("term", 15, **context)
