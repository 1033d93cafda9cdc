"""The ring of context parallelism: each rank passes a tensor to the next rank of its cp group and
takes one from the previous, both at once (one batch_isend_irecv), while it computes on what it
holds; `shift` starts the exchange and its handle's `wait` returns what arrived.

    rank 0 --> rank 1 --> ... --> rank C-1 --+
      ^                                      |
      +--------------------------------------+
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.comm.grid import DataMesh, Mesh


class Arriving:
    """An exchange under way: `wait()` returns the tensor that came from the previous rank."""

    def __init__(self, works, received: torch.Tensor, sent: torch.Tensor):
        self.works, self.received = works, received
        self.sent: torch.Tensor | None = sent  # kept alive (and unchanged) until the send is done

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.works, self.sent = [], None
        return self.received


class Ring:
    """The cp group as a ring of global ranks (comm/grid.py: the DataMesh of dp and zero, the Mesh of
    tp, pp and hybrid)."""

    def __init__(self, mesh: DataMesh | Mesh):
        self.size, self.rank = mesh.cp, mesh.cp_rank
        self.next, self.prev, self.group = mesh.ring_next, mesh.ring_prev, mesh.cp_group

    def shift(self, tensor: torch.Tensor) -> Arriving:
        """Start sending `tensor` (contiguous, left unchanged until the wait) to the next rank and
        receiving the previous rank's into a new tensor of the same shape."""
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group),
            dist.P2POp(dist.irecv, received, self.prev, self.group),
        ]
        return Arriving(dist.batch_isend_irecv(ops), received, tensor)
