"""The communication of expert parallelism: all_to_all_single over the ep group with uneven split
sizes (each rank sends each other rank the rows routed to its experts), differentiable: the
backward is the same exchange with the splits swapped, gradients going back where their rows
came from."""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Each rank's per-expert row counts (n_experts, laid out rank by rank) to the rank holding
    those experts: returns, rank by rank, how many rows each sends to each of this rank's experts."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], receive: list[int], group):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return back, None, None, None


def all_to_all(rows: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    """`rows` cut by `send` (one count per rank of the group) to those ranks; returns the rows that
    arrived, cut by `receive`, rank by rank."""
    return AllToAll.apply(rows, send, receive, group)
