"""SIGTERM ends a run at a step boundary every rank agrees on, after a checkpoint there.

SIGTERM is how jobs are preempted: a scheduler's time limit, a reclaimed spot instance, an evicted
pod. Each gives a grace period (typically 30 s) before SIGKILL, and the elastic agent passes the
signal on to the workers the same way (`paratrain run` killed with SIGTERM, or a node's agent
stopping its workers). Dying at once loses every step since the last `checkpoint.every`; finishing
the step and saving loses none.

The handler only raises a flag: the step in progress runs to its end. The ranks must then stop
at the same step, since a checkpoint is a collective over all of them, but the signal reaches
them at different moments, and on another node perhaps not at all. So they compare flags in an
all-reduce (MAX) on a gloo group of their own (off the strategy's collectives, off the GPU), at
steps they agree on beforehand: not after every step, since one small gloo all-reduce costs
0.3-0.7 ms here, a quarter of a small model's step. The same all-reduce carries the time since
the last check (the slowest rank's), from which every rank works out the same number of steps to
the next check, about CHECK_EVERY_S apart:

    step:   s        s+1  ...  s+k      ...
    check:  flags? --------->  flags?   k = steps in CHECK_EVERY_S, from the time the check carries
                               ^ any rank flagged: all save here and stop

So a run stops within about CHECK_EVERY_S of the signal (or at the end of the step in progress,
where a step takes longer), well inside a scheduler's grace period. Where logged steps
(train.log_every) come at most LOGGED_WITHIN_S apart, a check waits for the first logged step
past that time instead: a logged step syncs the host anyway (it reads the loss), and the steps
between then make no collective a plain loop does not (on a GPU the host runs ahead of the device
there). Only where logged steps are further apart do checks fall between them, and after the
first step, whose time is not yet known.

Once a collective has failed, no step can be agreed on any more (a peer is dead or stuck), and
the agent stopping the group to restart it must not wait on this rank: from then on SIGTERM ends
the process at once, as by default (`on_collective_failure`).

Ranks that do not run in lockstep (asynchronous parameter-server workers) keep the default
SIGTERM: they have nothing to save, and their servers save on their own schedule.
A SIGTERM that comes while a rank sets up (before its first step) stops it at once as before:
there is nothing to save yet.
"""

from __future__ import annotations

import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from paratrain.comm import collectives, grid
from paratrain.runtime import process

CHECK_EVERY_S = 0.5
LOGGED_WITHIN_S = 5.0  # a check waits this long at most for a logged step to land on
_received = 0  # the stop signal this process got (0: none)


def received() -> int:
    """The stop signal this process received, or 0."""
    return _received


def _flag(signum, _frame) -> None:
    global _received
    _received = _received or signum


def catch() -> None:
    """From now on SIGTERM raises the flag (one raised already stays up), until a collective fails."""
    signal.signal(signal.SIGTERM, _flag)
    if on_collective_failure not in collectives.BEFORE_DIAGNOSIS:
        collectives.BEFORE_DIAGNOSIS.append(on_collective_failure)


def release() -> None:
    """SIGTERM gets its default back: once training is over, what follows (the final export) is
    short and has no step boundary to stop at."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def on_collective_failure() -> None:
    """Called where a collective failed, before its diagnosis (which waits up to 10 s on the peers):
    SIGTERM is fatal again, and one received already ends the process now."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _received:
        process.leave(128 + _received)


class StopAgreement:
    """The ranks' stop flags, compared at agreed steps (see the module docstring)."""

    def __init__(self, world_size: int, step: int, timeout: timedelta, log_every: int = 1):
        global _received
        _received = 0
        catch()
        # host_group is collective: every rank builds the trainer, so every rank gets here. Its
        # timeout outlasts a training collective's and that one's diagnosis (collectives.
        # explain_failure waits up to 10 s for the peers' logs): when a rank hangs in training, its
        # peers may already wait here, and the failure to report is the training collective's,
        # which names the rank and operation, not this agreement's bare timeout.
        wait = timeout * 2 + timedelta(seconds=15) if world_size > 1 else timeout
        self.group = grid.host_group(wait) if world_size > 1 else None
        self.next_check, self.last_check, self.log_every = step + 1, step, log_every
        self.since = time.perf_counter()

    def after_step(self, step: int) -> int:
        """Call after every step, on every rank: the signal to stop on now, or 0. The same answer
        on every rank at the same step."""
        if self.group is None:
            return _received
        if step < self.next_check:
            return 0
        now = time.perf_counter()
        shared = torch.tensor([float(_received), now - self.since], dtype=torch.float64)
        dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=self.group)
        signum, elapsed = int(shared[0].item()), shared[1].item()
        if signum:
            return signum
        per_s = (step - self.last_check) / max(elapsed, 1e-6)  # steps a second, the slowest rank's
        every = min(max(round(CHECK_EVERY_S * per_s), 1), 10_000)
        logged = -(-(step + every) // self.log_every) * self.log_every  # the first logged step past it
        self.next_check = logged if logged - step <= max(LOGGED_WITHIN_S * per_s, every) else step + every
        self.last_check, self.since = step, now
        return 0

    def close(self) -> None:
        release()
