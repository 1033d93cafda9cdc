"""Context parallelism's step time and activation memory: a gpt on long sequences, each split over
every rank (paratrain dp x cp, cp = world), against torch's own `context_parallel` where it runs
and against plain dp that keeps whole sequences on every rank.

The contenders live in the same processes, built from the same seed, and take rounds of K steps in
turn, so machine noise falls on all of them alike. cp is checked against one process (its first
steps' losses) and its per-rank activation memory measured at every cp degree the world allows:
the bytes autograd saves for backward over one training step, which fall about as 1/C.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.distributed as dist

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
from paratrain.bench.context_heads import compare
from paratrain.bench.context_heads import report as heads_report
from paratrain.errors import error
from paratrain.runtime.machine import emit_json

VOCAB = GPT_VOCAB


def add_parser(which) -> None:
    register(
        which,
        "cp",
        "paratrain cp vs torch context_parallel and dp without cp (step time, activation memory)",
        add_options,
        run,
    )


def add_options(p) -> None:
    add_round_options(p, steps=3, rounds=3, warmup=2, steps_help="timed steps per round per contender")
    p.add_argument("--seq", type=COUNT, default=1024, help="tokens per sequence (2 x cp must divide it)")
    p.add_argument("--batch", type=COUNT, default=2, help="sequences per step for each rank (no cp) or ring (cp)")
    p.add_argument("--d-model", type=COUNT, default=64)
    p.add_argument("--layers", type=COUNT, default=2)
    p.add_argument("--heads", type=COUNT, default=4)
    add_json_option(p)


def run(args) -> int:
    if args.seq % (2 * args.nproc):
        error(f"--seq: 2 x cp = {2 * args.nproc} chunks do not divide {args.seq} tokens")
        return 2
    if args.d_model % args.heads:
        error(f"--heads: {args.heads} does not divide --d-model {args.d_model}")
        return 2
    return relaunch("paratrain.bench.context", args, add_options, nproc=args.nproc, run_id="bench-cp")


def build(args):
    return bench_gpt(args)


def engine(args, rt, cp: int):
    """paratrain dp over the world with sequences split over rings of `cp` ranks."""
    return gpt_dp_engine(build(args), rt, args.batch * rt.world_size // cp, 0.1, {"cp": cp})


def sequences(args, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, VOCAB, (args.batch, args.seq), generator=g) for _ in range(2))  # type: ignore[return-value]  # two tensors


def torch_context_parallel_error(world: int) -> str | None:
    """Why torch's context_parallel cannot run causal sdpa here (None: it ran), tried on a tiny
    attention over a DeviceMesh of the world."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,))
    q, k, v = (torch.randn(1, 2, 4 * world, 8) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as exc:  # any failure is the answer: the line names it
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def saved_activation_bytes(strategy, batch) -> int:
    """Bytes autograd keeps for backward over one training step's forward on this rank: each
    storage once, the parameters' own left out (they are weights, not activations)."""
    weights = {p.untyped_storage().data_ptr() for p in strategy.model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        strategy.train_step(batch)
    return sum(kept.values())


def one_process_losses(args, batch, steps: int) -> list[float]:
    """The first `steps` losses of the same gpt trained on the whole sequences in one process."""
    from paratrain.optim import cross_entropy

    model = build(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def worker(argv=None) -> None:
    from paratrain.runtime import process

    p = argparse.ArgumentParser()
    add_options(p)
    args = p.parse_args(argv)
    rt = process.init("cpu")
    world = rt.world_size
    peer_error = torch_context_parallel_error(world)
    ring_batch = sequences(args, seed=1)  # every rank of the ring reads the same sequences
    own_batch = sequences(args, seed=1 + rt.rank)  # without cp each rank reads its own
    contenders = {"cp": engine(args, rt, world), "no_cp": engine(args, rt, 1)}
    batches = {"cp": ring_batch, "no_cp": own_batch}
    steps = {n: functools.partial(e.train_step, batches[n]) for n, e in contenders.items()}

    def agreed_losses(name: str) -> list[float]:  # the first steps' losses: the mean over the ranks
        losses = torch.stack([steps[name]().detach() for _ in range(max(args.warmup, 1))]).double()
        dist.all_reduce(losses)
        return (losses / world).tolist()

    first = {name: agreed_losses(name) for name in steps}
    reference = one_process_losses(args, ring_batch, len(first["cp"])) if rt.is_main else []
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, fn in steps.items():
            times[name] += timed_steps(fn, args.steps)
    names = list(times)
    table = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    memory = activation_memory(args, rt, contenders, ring_batch)
    # the ring against an all-to-all over heads, one attention layer alone (context_heads.py)
    shape = (args.batch, args.heads, args.seq, args.d_model // args.heads)
    heads = compare(*shape, args.steps, args.rounds) if args.heads % world == 0 else None
    if rt.is_main:
        med = {n: statistics.median(row) for n, row in zip(names, table.tolist())}
        report(args, world, med, len(times["cp"]), first, reference, memory, peer_error, heads)
    process.shutdown(together=True)


def activation_memory(args, rt, contenders, batch) -> dict[int, int]:
    """Per-rank saved bytes (the largest rank's) of one step on the ring's sequences, by cp degree:
    every degree from 1 to the world that divides both it and the sequence's 2 x cp chunks."""
    world, found = rt.world_size, {}
    for cp in [c for c in range(1, world + 1) if world % c == 0 and args.seq % (2 * c) == 0]:
        strategy = contenders["no_cp"] if cp == 1 else contenders["cp"] if cp == world else engine(args, rt, cp)
        size = torch.tensor([saved_activation_bytes(strategy, batch)], dtype=torch.float64)
        dist.all_reduce(size, op=dist.ReduceOp.MAX)
        found[cp] = int(size.item())
    return found


def report(args, world, med, timed, first, reference, memory, peer_error, heads) -> None:
    tokens = args.batch * args.seq
    rate = {"cp": tokens / med["cp"], "no_cp": world * tokens / med["no_cp"]}
    drift = max(abs(a - b) for a, b in zip(first["cp"], reference))
    peer = (
        f"does not run on the CPU in torch {torch.__version__} ({peer_error}): no torch contender"
        if peer_error
        else "runs here, but this bench has no contender for it yet"
    )
    result = {
        "benchmark": "cp",
        "world_size": world,
        "model": {"n_layer": args.layers, "d_model": args.d_model, "n_head": args.heads, "seq": args.seq},
        "sequences_per_step": {"cp": args.batch, "no_cp": args.batch * world},
        "timed_steps": timed,
        "torch_context_parallel": peer_error or "runs",
        **{f"{n}_step_ms": m * 1e3 for n, m in med.items()},
        **{f"{n}_tokens_per_s": r for n, r in rate.items()},
        "cp_vs_no_cp_step": med["cp"] / med["no_cp"],
        "first_losses": {**first, "one_process": reference},
        "max_loss_diff_vs_one_process": drift,
        "activation_bytes_per_rank": {str(c): b for c, b in memory.items()},
        "attention_ring_vs_all_to_all_over_heads": heads,
    }
    print(
        f"cp benchmark: gpt {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
        f"{args.seq}-token sequences, world {world}, SGD, median of {timed} interleaved steps each"
    )
    print(f"torch context_parallel: {peer}")
    print(f"{'contender':<34}{'step ms':>10}{'tokens/s':>11}{'sequences/step':>16}")
    for n, label, seqs in (
        ("cp", f"paratrain dp x cp {world} (cp = world)", f"{args.batch}, 1/{world} each"),
        ("no_cp", "paratrain dp, no cp (reference)", f"{args.batch} x {world} ranks"),
    ):
        print(f"{label:<34}{med[n] * 1e3:>10.1f}{rate[n]:>11.0f}{seqs:>16}")
    print(
        f"ratio cp/no-cp step time: {result['cp_vs_no_cp_step']:.3f} (no cp: each rank its own "
        f"{args.batch} whole sequences; cp: the ring shares them)"
    )
    print(
        f"first {len(reference)} losses: cp {' '.join(f'{v:.6f}' for v in first['cp'])}, one process "
        f"{' '.join(f'{v:.6f}' for v in reference)}; max difference {drift:.1e} "
        f"({'equal' if drift <= 1e-4 else 'NOT equal'} within 1e-4)"
    )
    print(f"activation memory per rank, {args.batch} x {args.seq} tokens (saved for backward, largest rank):")
    print(f"{'cp':>4}{'MiB':>10}{'vs cp 1':>10}")
    for cp, size in memory.items():
        print(f"{cp:>4}{size / 2**20:>10.2f}{size / memory[1]:>10.3f}")
    if heads is not None:
        print("\n".join(heads_report(heads, args.batch, args.heads, args.seq, args.d_model // args.heads, world)))
    emit_json(result, args.json)


if __name__ == "__main__":
    from paratrain.runtime import process

    worker()
    process.leave()
