"""Tensor-parallel communication: Megatron's paired operators as autograd functions.

    copy_to_tp      forward: identity          backward: all-reduce   (input of a column split)
    reduce_from_tp  forward: all-reduce        backward: identity     (output of a row split)
    gather_from_tp  forward: all-gather (last dim, shards may differ in size by one)
                    backward: keep own slice
    split_to_tp     forward: keep own slice     backward: all-gather (a whole input a row split
                                                takes its slice of: transformers' rowwise_split_input)

Each pair is the other's transpose, so a column-parallel layer followed by a row-parallel one
costs exactly one all-reduce forward and one backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.comm import collectives


def shard_sizes(n: int, parts: int) -> list[int]:
    """`n` split into `parts` contiguous pieces that differ by at most one (the first ones larger)."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def shard_range(n: int, parts: int, rank: int) -> tuple[int, int]:
    sizes = shard_sizes(n, parts)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        collectives.all_reduce(grad, "tp-input-grad", group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        collectives.all_reduce(x, "tp-row-output", group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_gather_dim(x: torch.Tensor, dim: int, full: int, group, world: int | None = None) -> torch.Tensor:
    """The whole dimension `dim` (`full` long) from every rank's contiguous slice of it, over
    `group` of `world` ranks (by default the group's size)."""
    world = world or dist.get_world_size(group)
    sizes = shard_sizes(full, world)
    x = x.movedim(dim, -1)
    padded = torch.zeros(*x.shape[:-1], max(sizes), dtype=x.dtype, device=x.device)
    padded[..., : x.shape[-1]] = x  # equal sizes on the wire: the last shards may be one shorter
    parts = [torch.empty_like(padded) for _ in range(world)]
    collectives.all_gather(parts, padded, "tp-gather", group=group)
    return torch.cat([p[..., :s] for p, s in zip(parts, sizes)], dim=-1).movedim(-1, dim)


def gather_shards(x: torch.Tensor, dim: int, full: int, group, packs: int = 1) -> torch.Tensor:
    """all_gather_dim for a tensor split in `packs` pieces each (a fused gate and up split as gate
    and up: tensor/experts.shard_slice), whole in its own layout."""
    if packs == 1:
        return all_gather_dim(x, dim, full, group)
    piece = full // packs
    return torch.cat([all_gather_dim(c.contiguous(), dim, piece, group) for c in x.chunk(packs, dim)], dim)


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, full: int, place: tuple[int, int] | None):
        rank, world = place or (dist.get_rank(group), dist.get_world_size(group))
        ctx.range = shard_range(full, world, rank)
        return all_gather_dim(x, -1, full, group, world)

    @staticmethod
    def backward(ctx, grad):
        start, end = ctx.range
        return grad[..., start:end].contiguous(), None, None, None


class _SplitToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, place: tuple[int, int] | None):
        rank, world = place or (dist.get_rank(group), dist.get_world_size(group))
        ctx.group, ctx.world, ctx.full = group, world, x.shape[-1]
        start, end = shard_range(x.shape[-1], world, rank)
        return x[..., start:end].contiguous()

    @staticmethod
    def backward(ctx, grad):
        # the input was whole on every rank, its gradient each rank's slice of it: gathered whole
        return all_gather_dim(grad.contiguous(), -1, ctx.full, ctx.group, ctx.world), None, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group, full: int, place: tuple[int, int] | None = None) -> torch.Tensor:
    """The whole last dimension (`full` wide) from every rank's slice of it; `place` (rank, world)
    where the group cannot tell (the planner plays one rank without a group)."""
    return _GatherFromTP.apply(x, group, full, place)


def split_to_tp(x: torch.Tensor, group, place: tuple[int, int] | None = None) -> torch.Tensor:
    """This rank's slice of the last dimension of `x`, whole on every rank; its gradient gathered."""
    return _SplitToTP.apply(x, group, place)
