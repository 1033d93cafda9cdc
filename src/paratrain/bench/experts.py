"""Expert parallelism's step time: a gpt whose feed-forwards are mixtures of experts, its experts
split over every rank (paratrain dp with ep = world), against a plain all-to-all MoE written here
with torch.distributed alone, and against the dense-replicated MoE (ep 1: every rank runs every
expert on its own tokens).

The three compute the same function (token-choice top-k, no token dropped, the same weights from
the same seed, the same data), so their first steps' losses agree. They live in the same processes
and take rounds of K steps in turn, so machine noise falls on all of them alike.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from paratrain.bench.common import (
    COUNT,
    GPT_VOCAB,
    add_json_option,
    add_round_options,
    bench_gpt,
    gpt_dp_engine,
    register,
    relaunch,
    timed_steps,
)
from paratrain.errors import error
from paratrain.runtime.machine import emit_json

if TYPE_CHECKING:
    from paratrain.models.moe import MixtureOfExperts

VOCAB = GPT_VOCAB
LR = 0.1


def add_parser(which) -> None:
    register(which, "ep", "paratrain ep vs a plain all-to-all MoE and the replicated MoE (step time)", add_options, run)


def add_options(p) -> None:
    add_round_options(p, steps=3, rounds=3, warmup=2, steps_help="timed steps per round per contender")
    p.add_argument("--seq", type=COUNT, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=COUNT, default=8, help="sequences per rank")
    p.add_argument("--d-model", type=COUNT, default=64)
    p.add_argument("--layers", type=COUNT, default=2)
    p.add_argument("--heads", type=COUNT, default=4)
    p.add_argument("--experts", type=COUNT, default=8, help="experts per layer (the world must divide them)")
    p.add_argument("--top-k", type=COUNT, default=2)
    add_json_option(p)


def run(args) -> int:
    if args.experts % args.nproc:
        error(f"--experts: ep = {args.nproc} ranks do not divide {args.experts} experts")
        return 2
    if args.top_k > args.experts:
        error(f"--top-k: {args.top_k} is more than --experts {args.experts}")
        return 2
    if args.d_model % args.heads:
        error(f"--heads: {args.heads} does not divide --d-model {args.d_model}")
        return 2
    return relaunch("paratrain.bench.experts", args, add_options, nproc=args.nproc, run_id="bench-ep")


def build(args):
    # no load-balancing loss: the plain MoE below has none, and the contenders must compute the same
    return bench_gpt(args, n_experts=args.experts, top_k=args.top_k, moe_aux_loss=0.0)


def engine(args, rt, ep: int):
    """paratrain dp over the world, each MoE layer's experts split over groups of `ep` ranks."""
    return gpt_dp_engine(build(args), rt, args.batch * rt.world_size, LR, {"ep": ep})


class Exchange(torch.autograd.Function):
    """all_to_all_single that carries gradients back: the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        ctx.send, ctx.receive = send, receive
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), receive, send)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive)
        return back, None, None


class PlainMoE(nn.Module):
    """A minimal expert-parallel MoE layer: rank r holds experts r*n/W .. (r+1)*n/W - 1 only; each
    token's top-k rows go to their experts' ranks by one all_to_all_single and come back by
    another, weighted and summed where they started."""

    def __init__(self, dense: MixtureOfExperts, world: int, rank: int):
        super().__init__()
        self.world: int = world
        self.top_k: int = dense.top_k
        self.n_experts: int = dense.n_experts
        self.local: int = dense.n_experts // world
        self.router = dense.router  # the same weights as the dense layer's (same seed)
        self.experts = nn.ModuleList(dense.experts[rank * self.local : (rank + 1) * self.local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        tokens = x.reshape(-1, D)
        weights, chosen = self.router(tokens).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)  # the chosen experts' weights sum to 1
        by_expert = chosen.reshape(-1).argsort(stable=True)  # routing slots, expert by expert
        counts = torch.bincount(chosen.reshape(-1), minlength=self.n_experts)
        incoming = torch.empty_like(counts)  # per source rank, rows for each of my experts
        dist.all_to_all_single(incoming, counts)
        incoming = incoming.view(self.world, self.local)
        send = counts.view(self.world, self.local).sum(1).tolist()
        receive = incoming.sum(1).tolist()
        rows = Exchange.apply(tokens[by_expert // self.top_k], send, receive)
        # arrived source by source; my experts want their rows together
        expert_of_row = torch.arange(self.local).repeat(self.world).repeat_interleave(incoming.reshape(-1))
        gather = expert_of_row.argsort(stable=True)
        parts = rows[gather].split(incoming.sum(0).tolist())
        done = torch.cat([expert(part) for expert, part in zip(self.experts, parts)])
        done = done[gather.argsort()]  # back to arrival order
        back = Exchange.apply(done, receive, send)
        back = back * weights.reshape(-1)[by_expert].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, by_expert // self.top_k, back).view(B, T, D)


def plain_contender(args, rt, batch):
    """The gpt with each MoE layer a PlainMoE, trained by hand: experts' gradients are already the
    sums over every rank's tokens (divided by the world, as dp's mean would); the replicated
    weights' gradients averaged by one all_reduce after backward. Returns (step, model)."""
    from paratrain.optim import cross_entropy

    model = build(args)
    for block in model.blocks:
        block.mlp = PlainMoE(block.mlp, rt.world_size, rt.rank)
    experts = {id(p) for block in model.blocks for p in block.mlp.experts.parameters()}
    replicated = [p for p in model.parameters() if id(p) not in experts]
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        grads = [p.grad for p in replicated if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(rt.world_size)
        opt.step()
        return loss.detach()

    return step, model


def worker(argv=None) -> None:
    from paratrain.runtime import process

    p = argparse.ArgumentParser()
    add_options(p)
    args = p.parse_args(argv)
    rt = process.init("cpu")
    world = rt.world_size
    g = torch.Generator().manual_seed(1 + rt.rank)  # each rank its own sequences, as dp reads them
    batch = tuple(torch.randint(0, VOCAB, (args.batch, args.seq), generator=g) for _ in range(2))
    ours = {"ep": engine(args, rt, world), "dense": engine(args, rt, 1)}
    steps = {n: functools.partial(e.train_step, batch) for n, e in ours.items()}
    steps["plain"], _ = plain_contender(args, rt, batch)

    def agreed_losses(name: str) -> list[float]:  # the first steps' losses: the mean over the ranks
        losses = torch.stack([steps[name]().detach() for _ in range(max(args.warmup, 1))]).double()
        dist.all_reduce(losses)
        return (losses / world).tolist()

    first = {name: agreed_losses(name) for name in steps}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, fn in steps.items():
            times[name] += timed_steps(fn, args.steps)
    names = list(times)
    table = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    if rt.is_main:
        med = {n: statistics.median(row) for n, row in zip(names, table.tolist())}
        report(args, world, med, len(times["ep"]), first)
    process.shutdown(together=True)


def report(args, world, med, timed, first) -> None:
    tokens = args.batch * args.seq * world
    drift = max(abs(a - b) for name in ("plain", "dense") for a, b in zip(first[name], first["ep"]))
    result = {
        "benchmark": "ep",
        "world_size": world,
        "model": {"n_layer": args.layers, "d_model": args.d_model, "n_head": args.heads, "seq": args.seq},
        "experts": args.experts,
        "top_k": args.top_k,
        "sequences_per_rank": args.batch,
        "timed_steps": timed,
        **{f"{n}_step_ms": m * 1e3 for n, m in med.items()},
        **{f"{n}_tokens_per_s": tokens / m for n, m in med.items()},
        "ep_vs_plain_step": med["ep"] / med["plain"],
        "ep_vs_dense_step": med["ep"] / med["dense"],
        "first_losses": first,
        "max_loss_diff": drift,
    }
    print(
        f"ep benchmark: gpt {args.layers} layers, d_model {args.d_model}, {args.experts} experts top-{args.top_k}, "
        f"{args.batch} x {args.seq} tokens per rank, world {world}, SGD, median of {timed} interleaved steps each"
    )
    print(f"{'contender':<36}{'step ms':>10}{'tokens/s':>11}")
    for n, label in (
        ("ep", f"paratrain dp, ep {world}"),
        ("plain", f"plain all-to-all MoE, ep {world}"),
        ("dense", "paratrain dp, ep 1 (replicated)"),
    ):
        print(f"{label:<36}{med[n] * 1e3:>10.1f}{tokens / med[n]:>11.0f}")
    print(f"ratios: ep/plain {result['ep_vs_plain_step']:.3f}, ep/replicated {result['ep_vs_dense_step']:.3f}")
    print(
        f"first {len(first['ep'])} losses: "
        + "; ".join(f"{n} {' '.join(f'{v:.6f}' for v in first[n])}" for n in first)
        + f"; max difference {drift:.1e} ({'equal' if drift <= 1e-4 else 'NOT equal'} within 1e-4)"
    )
    emit_json(result, args.json)


if __name__ == "__main__":
    from paratrain.runtime import process

    worker()
    process.leave()
