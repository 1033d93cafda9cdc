"""Point-to-point traffic between pipeline stages: activations forward, their gradients backward.

Everything is asynchronous: receives are posted ahead of the action that needs them (the data
arrives while the stage computes something else), sends return at once and are only waited for at
the end of the step. With gloo a message costs 130-400 us, so the one thing never to do is wait
for a send or post a receive only when its data is needed.

Matching. gloo matches messages by tag (boundary, microbatch, direction). NCCL ignores tags: it
matches a rank pair's sends and receives in the order they were posted. Both work because every
schedule here (interleaved included, as in Megatron) has each rank post the messages for a given
neighbour in the same order as that neighbour posts the matching ones: sends and receives both
follow the action order. PARATRAIN_P2P_TAGS=0 sends every message with tag 0 on gloo too (NCCL's
semantics), which lets the CPU tests check that invariant.

Transport. On CPU, neighbours on the same host exchange messages through shared memory
(shm.py), matched in posting order with each message's size and tag checked; other pairs, and
any message larger than half a channel's ring, go through torch.distributed (gloo or NCCL).
PARATRAIN_P2P_SHM=0 sends everything through torch.distributed.
"""

from __future__ import annotations

import os
from typing import cast

import torch
import torch.distributed as dist

from paratrain.comm import shm


class P2P:
    ACTIVATION, GRADIENT = 0, 1

    def __init__(self, group, n_stages: int, neighbours: set[int], timeout_s: float):
        """Collective over `group`: every member builds its P2P at the same point."""
        self.group = group
        self.n_stages = n_stages
        self.use_tags = os.environ.get("PARATRAIN_P2P_TAGS", "1") != "0"
        self.pending_sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.shm_senders: dict[int, shm.Sender] = {}
        self.shm_receivers: dict[int, shm.Receiver] = {}
        if dist.get_backend(group) == "gloo" and os.environ.get("PARATRAIN_P2P_SHM", "1") != "0":
            self.shm_senders, self.shm_receivers = shm.connect(group, neighbours, timeout_s)

    def _shm(self, channels: dict, t: torch.Tensor, peer: int):
        """The shared-memory channel for this message, or None for torch.distributed. Both ends
        decide alike: same host, and the size (which both know) fits the ring comfortably."""
        channel = channels.get(peer)
        if channel is not None and t.device.type == "cpu" and 2 * t.nbytes <= channel.ring.numel():
            return channel
        return None

    def tag(self, kind: int, boundary: int, mb: int) -> int:
        """`boundary` b lies between virtual stages b and b+1."""
        return (mb * self.n_stages + boundary) * 2 + kind if self.use_tags else 0

    def post(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]) -> list:
        """Start sends (tensor, dst, tag) and receives (buffer, src, tag); returns the receives' work
        handles in order. Sends are remembered until `finish`. (One call per message, not
        batch_isend_irecv: on NCCL that returns a single handle for the whole batch.)"""
        for t, peer, tag in sends:
            if (channel := self._shm(self.shm_senders, t, peer)) is not None:
                channel.send(t, tag)  # in the ring when this returns: nothing to wait for later
            else:
                t = t.detach()  # the engine hands over outputs still attached to autograd
                work = cast(dist.Work, dist.isend(t, peer, group=self.group, tag=tag))  # None only off the group
                self.pending_sends.append((work, t))
        works = []
        for t, peer, tag in recvs:
            if (channel := self._shm(self.shm_receivers, t, peer)) is not None:
                works.append(channel.post(t, tag))
            else:
                works.append(dist.irecv(t, peer, group=self.group, tag=tag))
        return works

    def sends_in_flight(self) -> bool:
        """Whether a torch.distributed send may still be reading its tensor (shared-memory sends
        are complete when post returns)."""
        return bool(self.pending_sends)

    def finish(self) -> None:
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends.clear()
