"""Stage 3's check that every rank runs the same model call (a forward, a backward, a state_dict or
load_state_dict of the model) before that call's collectives.

Each of these calls gathers parameters from every rank. Were one rank to run a call alone (the
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

from datetime import timedelta

import torch
import torch.distributed as dist

from paratrain.parallel.base import refuse

KINDS = ("a training forward", "a forward under no_grad", "a backward", "model.state_dict()", "model.load_state_dict()")
FORWARD, FORWARD_NO_GRAD, BACKWARD, STATE_DICT, LOAD_STATE_DICT = range(len(KINDS))


class LockstepCheck:
    def __init__(self, strategy: str, timeout_s: float):
        """Collective (every rank of the world, in the same order: it makes a process group)."""
        self.strategy, self.timeout_s = strategy, timeout_s
        self.world = dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if self.world > 1 else None
        self.seq = 0

    def check(self, kind: int) -> None:
        """Before a call of `kind`: every rank is at the same call, or this rank stops (exit 1)."""
        if self.group is None:
            return
        self.seq += 1
        mine = torch.tensor([self.seq, kind], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        rank = dist.get_rank()
        try:
            dist.all_gather(every, mine, group=self.group)
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():  # a peer died: its failure, for the launcher to name
                raise
            refuse(
                f"{self.strategy}: {KINDS[kind]} of the model (call #{self.seq}) ran on rank {rank}, and not every "
                f"other rank ran it within parallel.timeout_s = {self.timeout_s:g} s: {self._advice()}"
            )
        calls = [tuple(t.tolist()) for t in every]
        if len(set(calls)) > 1:
            ran: dict[tuple, list[str]] = {}
            for r, (seq, k) in enumerate(calls):
                ran.setdefault((seq, k), []).append(str(r))
            said = "; ".join(f"{KINDS[k]} (call #{seq}) on rank {', '.join(rs)}" for (seq, k), rs in ran.items())
            # every rank saw the same calls: rank 0 says so
            refuse(f"{self.strategy}: the ranks ran different model calls: {said}: {self._advice()}", rank == 0)

    def _advice(self) -> str:
        return (
            f"under {self.strategy} every rank must run each forward, backward and state_dict of the model "
            f"(its parameters are gathered from all of them): evaluate on every rank, save from rank 0"
        )
