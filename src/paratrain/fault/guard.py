"""Keep one crashing worker from ending the whole job, where the strategy can do without it.

The elastic agent treats any worker that exits non-zero as the failure of the whole group: it
stops every rank (and restarts them all with --max-restarts). An async parameter-server worker,
though, is expendable: the servers drop it and the others train on. So such a rank forks the real
worker as a child process and only watches it:

    elastic agent ── guard (this module, no torch.distributed) ── worker (the trainer, same argv/env)

When the child dies (a crash, an OOM kill, SIGKILL), the guard says so and exits 0, which the agent
takes as "this rank is done"; the servers see the broken connection and drop the rank. When the
guard itself is stopped (the agent tearing the group down), the child dies with it (PDEATHSIG), so
nothing is left behind. A child that exits 2 (bad input) passes its code through, and so does one
that fails because the run itself is broken (its server is gone: `FailsRun`), which must not look
like a worker that merely died.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable

from paratrain.errors import note, say


def drop_worker(live: set[int], worker: int, line) -> None:
    """The one rule for a worker that is gone (a parameter server's or a federated server's):
    take it out of `live`, say `line(workers left)`, and end the run when none is left."""
    live.discard(worker)
    say(line(len(live)))
    if not live:
        raise RuntimeError(line(0).split(":")[0] + ": every worker is gone")


GUARDED = "PARATRAIN_GUARDED"  # set in the child: run the trainer itself, not another guard
FAILS_RUN_EXIT = 3  # the child's exit code for FailsRun


class FailsRun(RuntimeError):
    """An error on an expendable rank that is not its own fault (e.g. its parameter server is gone):
    the run must fail rather than go on without this rank."""


def is_guarded_child() -> bool:
    return os.environ.get(GUARDED) == "1"


def run_guarded(run_worker: Callable[[], int], what: str) -> int:
    """Run `run_worker()` (the trainer, which then trains: GUARDED is set) in a child; a death of it
    is reported, not propagated. The child is forked, not started afresh: this process has torch and
    the trainer imported and no thread or process group yet, and a fresh interpreter spent about
    5 s of CPU importing them again, for each expendable rank of each run."""
    from paratrain.runtime.launch import die_with_parent

    parent = os.getpid()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.environ[GUARDED] = "1"
            die_with_parent(signal.SIGTERM, parent)
            code = run_worker()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException:  # what `python -m paratrain.trainer` would print, then exit 1
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def forward(signum, _frame):  # the agent stopping this rank stops the worker first
        try:
            os.kill(child, signum)
            os.waitpid(child, 0)
        except (ProcessLookupError, ChildProcessError):  # gone, or already reaped
            pass
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if code in (0, 2):
        return code
    if code == FAILS_RUN_EXIT:
        return 1
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    note(f"{what} died ({how}); the run goes on without it")
    return 0
