"""The check that every rank runs the same model call (a forward, a backward, a state_dict or
load_state_dict of the model) before that call's collectives, for strategies whose model calls meet
the other ranks: zero3 (each call gathers parameters from every rank), tp (a split layer all-reduces
its output) and pp (the state dict joins the stages). Were one rank to run a call alone (the
habit of evaluating on rank 0 only), its gathers would pair with whatever collective the others
issue next: gloo aborts the process on the mismatched sizes (SIGABRT), or the values come out
wrong. So each call first exchanges (sequence number, kind of call) with every rank, on a process
group of its own that carries nothing else (a call one rank runs alone cannot pair with anything
but the same check), under parallel.timeout_s; a difference, or a peer that does not come within
the time, stops every rank that sees it with one line naming the call and the ranks that ran it
(exit 2). A peer whose process died breaks the check at once: that is its failure, not a lone
call, and the transport's error goes on to the launcher, which names the dead rank.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist

from paratrain.errors import error
from paratrain.runtime import process

KINDS = (
    "a training forward",
    "a forward under no_grad",
    "a backward",
    "model.state_dict()",
    "model.load_state_dict()",
    "the end of the script",
    "pt.save",
    "pt.load",
    "pt.export",
    "pt.log",
)
FORWARD, FORWARD_NO_GRAD, BACKWARD, STATE_DICT, LOAD_STATE_DICT, END, SAVE, LOAD, EXPORT, LOG = range(len(KINDS))
API_CALLS = (SAVE, LOAD, EXPORT, LOG)  # the Python API's collective calls (api/handle.py checks them)


class LockstepCheck:
    def __init__(self, strategy: str, timeout_s: float, why: str = "its parameters are gathered from all of them"):
        """Collective (every rank of the world, in the same order: it makes a process group). `why`:
        what makes a model call meet the other ranks, for the refusal's advice."""
        self.strategy, self.timeout_s, self.why = strategy, timeout_s, why
        self.world = dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if self.world > 1 else None
        self.seq = 0
        if self.group is not None:
            # a peer left inside a call it ran alone (state_dict on rank 0 only) is named when the
            # others end, not after parallel.timeout_s: their end is one more checked call
            process.check_at_end(self.check_at_end)

    @contextlib.contextmanager
    def trusted(self):
        """Calls of paratrain's own training step, which every rank runs by construction: not
        checked, so that a step makes no collective (nor host sync) beyond its gathers and
        reductions. The user's own calls (pt.setup's model in the user's loop) are all checked."""
        group, self.group = self.group, None
        try:
            yield
        finally:
            self.group = group

    def check(self, kind: int) -> None:
        """Before a call of `kind`: every rank is at the same call, or this rank stops (exit 1)."""
        if self.group is None:
            return
        mine, every = self._exchange(kind)
        try:
            dist.all_gather(every, mine, group=self.group)
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():  # a peer died: its failure, for the launcher to name
                raise
            self._stop(
                f"{self.strategy}: {KINDS[kind]} of the model (call #{self.seq}) ran on rank {dist.get_rank()}, and not "
                f"every other rank ran it within parallel.timeout_s = {self.timeout_s:g} s: {self._advice({kind})}"
            )
        self._compare(every)

    def check_at_end(self) -> None:
        """At a clean exit (runtime/process.py): the end is checked as a call. Waited for through
        the exit's own wait, which gives up on a peer that failed instead of waiting out the time."""
        if self.group is None:
            return
        mine, every = self._exchange(END)
        work = dist.all_gather(every, mine, group=self.group, async_op=True)
        assert work is not None  # async_op
        process.wait_for_peers(work.is_completed, "not every rank reached its end")
        work.wait()
        self._compare(every)

    def _exchange(self, kind: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self.seq += 1
        mine = torch.tensor([self.seq, kind], dtype=torch.int64)
        return mine, [torch.empty_like(mine) for _ in range(self.world)]

    def _compare(self, every: list[torch.Tensor]) -> None:
        calls = [tuple(t.tolist()) for t in every]
        if len(set(calls)) > 1:
            ran: dict[tuple, list[str]] = {}
            for r, (seq, k) in enumerate(calls):
                ran.setdefault((seq, k), []).append(str(r))
            said = "; ".join(f"{KINDS[k]} (call #{seq}) on rank {', '.join(rs)}" for (seq, k), rs in ran.items())
            advice = self._advice({k for _, k in ran})
            # every rank saw the same calls: rank 0 says so
            self._stop(f"{self.strategy}: the ranks ran different model calls: {said}: {advice}", dist.get_rank() == 0)

    @staticmethod
    def _stop(line: str, said_here: bool = True):
        """As a strategy's refusal (parallel/base.py: refuse): one line, exit 2, no traceback."""
        if said_here:
            error(line)
        process.mark_failing()
        raise SystemExit(2)

    def _advice(self, kinds: set[int]) -> str:
        if kinds - {END} <= set(API_CALLS):  # the API's own calls (under dp too, whose model calls meet no one)
            return "call pt.save, pt.load, pt.export and pt.log (with tensors) on every rank: each meets the others"
        return (
            f"under {self.strategy} every rank must run each forward, backward and state_dict of the model "
            f"({self.why}): evaluate on every rank, save from rank 0"
        )
