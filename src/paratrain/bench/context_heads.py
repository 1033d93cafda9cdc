"""`bench cp`'s attention-alone comparison: the ring paratrain runs (keys and values passed around
the cp group, parallel/context/attention.py) against an all-to-all over heads (DeepSpeed-Ulysses'
scheme, written here): the local chunks' q, k, v exchanged so that each rank holds every token of
H/C heads, the whole sequence's causal attention on them, and the output exchanged back.

    ring            C steps, each a (k, v) pass to the next rank overlapped with one block's
                    attention; backward walks the ring again with the key gradients
    all-to-all      4 all-to-alls a forward (q, k, v in, the output back) and 4 in backward, each
                    moving (C - 1) / C of a local tensor; the attention itself one fused kernel

Both compute the same function (checked: their outputs and input gradients agree); the median
forward and backward of one attention layer says which is faster here, at this size."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.bench.common import timed_steps


def heads_all_to_all_attention(q, k, v, group, order: torch.Tensor) -> torch.Tensor:
    """Causal attention of the ring's chunk layout (B, H, T/C, D) on every rank, through an
    all-to-all over heads; `order` puts the gathered ranks' tokens in global order."""
    from paratrain.parallel.expert.all_to_all import all_to_all

    c = dist.get_world_size(group)
    even = [1] * c  # one slab to and from every rank

    def exchange(slabs):  # slab j to rank j; slab i the one rank i sent (differentiable)
        return all_to_all(slabs, even, even, group)

    def to_heads(t):  # (B, H, L, D) -> (B, H/C, C*L, D): heads j*H/C.. go to rank j
        b, h, length, d = t.shape
        parts = t.reshape(b, c, h // c, length, d).transpose(0, 1).contiguous()
        got = exchange(parts)  # [source rank, ...]
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * length, d).index_select(2, order)

    def to_sequence(t, length):  # the inverse: back to this rank's tokens of every head
        b, hc, _, d = t.shape
        t = t.index_select(2, order.argsort()).reshape(b, hc, c, length, d).permute(2, 0, 1, 3, 4).contiguous()
        got = exchange(t)  # [head chunk, B, H/C, L, D]
        return got.transpose(0, 1).reshape(b, c * hc, length, d)

    out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), is_causal=True)
    return to_sequence(out, q.shape[2])


def compare(batch: int, heads: int, seq: int, head_dim: int, steps: int, rounds: int) -> dict:
    """Median ms of one attention layer's forward and backward both ways, at cp = world (every rank
    calls it; rank 0's figures are the slowest rank's), and the largest difference between them."""
    from paratrain.comm.grid import build_data_mesh
    from paratrain.parallel.context.attention import RingAttention, chunk_positions
    from paratrain.parallel.context.ring import Ring

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = build_data_mesh(world)
    ring, group = Ring(mesh), mesh.cp_group
    order = torch.cat([chunk_positions(seq, world, r) for r in range(world)]).argsort()
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(batch, heads, seq // world, head_dim, generator=g) for _ in range(3))
    dout = torch.randn(q.shape, generator=g)
    scale = head_dim**-0.5

    def run(name: str):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        lq, lk, lv = leaves
        if name == "ring":
            out = RingAttention.apply(lq, lk, lv, ring, scale)
        else:
            out = heads_all_to_all_attention(lq, lk, lv, group, order)
        out.backward(dout)
        return out.detach(), [t.grad for t in leaves]

    (ring_out, ring_grads), (a2a_out, a2a_grads) = run("ring"), run("all_to_all")
    diff = max((a - b).abs().max().item() for a, b in zip([ring_out, *ring_grads], [a2a_out, *a2a_grads]))
    times: dict[str, list[float]] = {"ring": [], "all_to_all": []}
    for _ in range(rounds):
        for name in times:
            times[name] += timed_steps(lambda name=name: run(name), steps)
    table = torch.tensor([times["ring"], times["all_to_all"]], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    found = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    ring_ms, a2a_ms = (statistics.median(row) * 1e3 for row in table.tolist())
    return {"ring_ms": ring_ms, "all_to_all_ms": a2a_ms, "max_difference": found.item()}


def report(found: dict, batch: int, heads: int, seq: int, head_dim: int, world: int) -> list[str]:
    faster = "the ring" if found["ring_ms"] <= found["all_to_all_ms"] else "the all-to-all over heads"
    return [
        f"attention alone, forward + backward, {batch} x {heads} heads x {seq} tokens x {head_dim}, cp {world}:",
        f"  ring {found['ring_ms']:.1f} ms, all-to-all over heads {found['all_to_all_ms']:.1f} ms: {faster} "
        f"is faster here (ratio ring / all-to-all {found['ring_ms'] / found['all_to_all_ms']:.3f}); "
        f"outputs and gradients agree within {found['max_difference']:.1e}",
    ]
