"""Point-to-point traffic between pipeline stages: activations forward, their gradients backward.

Everything is asynchronous: receives are posted ahead of the action that needs them (the data
arrives while the stage computes something else), sends return at once and are only waited for at
the end of the step. With gloo a message costs 130-400 us, so the one thing never to do is wait
for a send or post a receive only when its data is needed. Messages are matched by tag
(boundary, microbatch, direction), so the order in which neighbours post them does not matter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class P2P:
    ACTIVATION, GRADIENT = 0, 1

    def __init__(self, group, n_stages: int):
        self.group = group
        self.n_stages = n_stages
        self.pending_sends: list[tuple[dist.Work, torch.Tensor]] = []

    def tag(self, kind: int, boundary: int, mb: int) -> int:
        """`boundary` b lies between virtual stages b and b+1."""
        return (mb * self.n_stages + boundary) * 2 + kind

    def post(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]) -> list:
        """Start sends (tensor, dst, tag) and receives (buffer, src, tag) in one batch; returns the
        receives' work handles in order. Sends are remembered until `finish`."""
        ops = [dist.P2POp(dist.isend, t, peer, self.group, tag) for t, peer, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, self.group, tag) for t, peer, tag in recvs]
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        self.pending_sends += [(w, t) for w, (t, _, _) in zip(works, sends)]
        return works[len(sends):]

    def finish(self) -> None:
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends.clear()
