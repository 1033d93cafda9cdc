"""Step time of zero2 and zero3 against paratrain dp and PyTorch FSDP2, interleaved in one run.

All four contenders live in the same processes, built from the same seed, and take rounds of K steps in
turn (dp, zero2, zero3, FSDP2, dp, ...), so machine noise falls on all of them alike; the table shows
median step times and the ratios zero2/dp, zero3/dp and zero3/FSDP2 (lower is better).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from paratrain.bench.common import register, relaunch
from paratrain.bench.dp import add_options as dp_options
from paratrain.bench.dp import build, setup, timed_steps
from paratrain.runtime.machine import emit_json


def add_parser(which) -> None:
    register(which, "zero", "zero2/zero3 vs paratrain dp and torch FSDP2 (step time, ratios)", add_options, run)


def add_options(p) -> None:
    dp_options(p)  # the same model and knobs as the dp benchmark, fewer steps (zero3 is slower)
    p.set_defaults(steps=5, warmup=2)


def run(args) -> int:
    return relaunch("paratrain.bench.zero", args, add_options, nproc=args.nproc, run_id="bench-zero")


def worker(argv=None) -> None:
    from torch.distributed.fsdp import fully_shard

    from paratrain.optim import build_optimizer, cross_entropy
    from paratrain.parallel.dp.engine import DataParallel
    from paratrain.parallel.zero.stages import Zero2, Zero3
    from paratrain.runtime import process

    args, rt, cfg, (x, y) = setup(argv, add_options, optimizer="adamw", lr=1e-4)
    world = rt.world_size

    contenders = {
        name: cls(build(args), cross_entropy, cfg, rt)
        for name, cls in (("dp", DataParallel), ("zero2", Zero2), ("zero3", Zero3))
    }
    fsdp_model = build(args)
    for layer in fsdp_model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(fsdp_model)
    fsdp_opt = build_optimizer(fsdp_model.parameters(), cfg.train)  # the same optimizer as ours

    def fsdp_step():
        cross_entropy(fsdp_model(x), y).backward()
        fsdp_opt.step()
        fsdp_opt.zero_grad()

    steps: dict[str, Callable[[], object]] = {
        name: functools.partial(e.train_step, (x, y)) for name, e in contenders.items()
    }
    steps["fsdp2"] = fsdp_step
    for fn in steps.values():
        timed_steps(fn, args.warmup)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, fn in steps.items():
            times[name] += timed_steps(fn, args.steps)

    # Same steps on the same data from the same weights: ours must agree with each other and FSDP2.
    states = {name: e.full_model_state() for name, e in contenders.items()}
    fsdp_state = {k: v.full_tensor() for k, v in fsdp_model.state_dict().items()}
    # The slowest rank sets the pace: take each step's max over ranks.
    names = list(times)
    table = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    if rt.is_main:

        def drift(a, b):
            return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in a)

        med = {n: statistics.median(row) for n, row in zip(names, table.tolist())}
        dp_state = states["dp"]
        assert dp_state is not None  # rank 0 holds the whole model
        params = sum(v.numel() for v in dp_state.values())
        result = {
            "benchmark": "zero",
            "world_size": world,
            "parameters": params,
            "bucket_mb": args.bucket_mb,
            "samples_per_rank": args.batch,
            "timed_steps": len(times["dp"]),
            **{f"{n}_step_ms": med[n] * 1e3 for n in names},
            "zero2_vs_dp": med["zero2"] / med["dp"],
            "zero3_vs_dp": med["zero3"] / med["dp"],
            "zero3_vs_fsdp2": med["zero3"] / med["fsdp2"],
            "rel_weight_diff_vs_dp": {
                "zero2": drift(states["zero2"], states["dp"]),
                "zero3": drift(states["zero3"], states["dp"]),
                "fsdp2": drift(fsdp_state, states["dp"]),
            },
        }
        print(
            f"zero benchmark: {params / 1e6:.1f}M-parameter MLP, AdamW, world {world}, {args.batch} samples/rank, "
            f"bucket {args.bucket_mb:g} MB, median of {len(times['dp'])} interleaved steps each"
        )
        print(f"{'contender':<16}{'step ms':>10}{'samples/s':>12}")
        for n, label in (
            ("dp", "paratrain dp"),
            ("zero2", "paratrain zero2"),
            ("zero3", "paratrain zero3"),
            ("fsdp2", "torch FSDP2"),
        ):
            print(f"{label:<16}{med[n] * 1e3:>10.1f}{args.batch * world / med[n]:>12.1f}")
        print(
            f"ratios: zero2/dp {result['zero2_vs_dp']:.3f}, zero3/dp {result['zero3_vs_dp']:.3f}, "
            f"zero3/FSDP2 {result['zero3_vs_fsdp2']:.3f}"
        )
        print(
            "final weights vs dp (max abs difference / max abs weight): "
            + ", ".join(f"{k} {v:.1e}" for k, v in result["rel_weight_diff_vs_dp"].items())
        )
        emit_json(result, args.json)
    process.shutdown(together=True)


if __name__ == "__main__":
    from paratrain.runtime import process

    worker()
    process.leave()
