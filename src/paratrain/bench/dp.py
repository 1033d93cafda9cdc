"""paratrain dp against torch DDP: same model, data, bucket size and optimizer, interleaved in one run.

Rounds alternate K steps of ours with K steps of DDP so both see the same machine noise; the table
shows the median step time of each and the ratio (ours / DDP, lower is better).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch import nn

from paratrain.bench.common import COUNT, POSITIVE, add_json_option, add_round_options, register, relaunch, timed_steps
from paratrain.runtime.machine import emit_json


def add_parser(which) -> None:
    register(which, "dp", "paratrain dp vs torch DDP (step time, samples/s, ratio)", add_options, run)


def add_options(p) -> None:
    add_round_options(p, steps=10, rounds=4, warmup=3, steps_help="timed steps per round per contender")
    p.add_argument("--batch", type=COUNT, default=32, help="samples per rank")
    p.add_argument("--hidden", type=COUNT, default=2048)
    p.add_argument("--layers", type=COUNT, default=3)
    p.add_argument("--in-features", type=COUNT, default=512)
    p.add_argument("--bucket-mb", type=POSITIVE, default=25.0)
    p.add_argument(
        "--own-loop",
        action="store_true",
        help="ours through the Python API (pt.setup, pt.backward, the optimizer's own step) on DDP's loop",
    )
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: both under autocast")
    p.add_argument("--compile", action="store_true", help="train.compile = true against torch.compile(DDP)")
    add_json_option(p)


def run(args) -> int:
    return relaunch("paratrain.bench.dp", args, add_options, nproc=args.nproc, run_id="bench-dp")


def build(args) -> nn.Sequential:
    from paratrain.models.mlp import mlp

    torch.manual_seed(0)
    return mlp(in_features=args.in_features, hidden=args.hidden, n_layers=args.layers, out_features=10)


def setup(argv, add_options, optimizer: str, lr: float):
    """A benchmark worker's start: its options, the runtime, the dp config for this MLP and one
    batch of random data per rank. Returns (args, rt, cfg, (x, y))."""
    from paratrain import config as config_mod
    from paratrain.runtime import process

    p = argparse.ArgumentParser()
    add_options(p)
    args = p.parse_args(argv)
    rt = process.init("cpu")
    cfg = config_mod.from_dict(
        {
            "data": {"batch_size": args.batch * rt.world_size},
            "train": {"optimizer": optimizer, "lr": lr, "precision": args.precision, "compile": args.compile},
            "parallel": {"bucket_mb": args.bucket_mb},
        }
    )
    g = torch.Generator().manual_seed(1 + rt.rank)
    x = torch.randn(args.batch, args.in_features, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    return args, rt, cfg, (x, y)


def worker(argv=None) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paratrain.optim import build_optimizer, cross_entropy
    from paratrain.parallel.registry import build_for_training
    from paratrain.runtime import process

    args, rt, cfg, (x, y) = setup(argv, add_options, optimizer="sgd", lr=0.01)
    world = rt.world_size

    if args.own_loop:
        ours_step, ours_model = own_loop_contender(args, cfg, x, y)
    else:
        ours = build_for_training(build(args), cross_entropy, cfg, rt)  # dp, compiled by train.compile
        ours_step, ours_model = lambda: ours.train_step((x, y)), ours.model
    ddp_model = DDP(build(args), bucket_cap_mb=args.bucket_mb)
    ddp_opt = build_optimizer(ddp_model.parameters(), cfg.train)  # the same optimizer as ours
    ddp_forward = torch.compile(ddp_model) if args.compile else ddp_model

    def ddp_step():
        ddp_opt.zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = cross_entropy(ddp_forward(x), y)
        loss.backward()
        ddp_opt.step()

    timed_steps(ours_step, args.warmup)
    timed_steps(ddp_step, args.warmup)
    t_ours, t_ddp = [], []
    for _ in range(args.rounds):
        t_ours += timed_steps(ours_step, args.steps)
        t_ddp += timed_steps(ddp_step, args.steps)

    # Both contenders took the same steps on the same data from the same weights: they must agree.
    drift = max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
        for a, b in zip(ours_model.parameters(), ddp_model.module.parameters())
    )
    # The slowest rank sets the pace: take each step's max over ranks.
    both = torch.tensor([t_ours, t_ddp], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if rt.is_main:
        params = sum(p.numel() for p in ours_model.parameters())
        med_ours, med_ddp = statistics.median(both[0].tolist()), statistics.median(both[1].tolist())
        result = {
            "benchmark": "dp",
            "form": "own loop (pt.setup)" if args.own_loop else "train_step",
            "precision": args.precision,
            "compiled": args.compile,
            "world_size": world,
            "parameters": params,
            "bucket_mb": args.bucket_mb,
            "samples_per_rank": args.batch,
            "timed_steps": len(t_ours),
            "paratrain_step_ms": med_ours * 1e3,
            "ddp_step_ms": med_ddp * 1e3,
            "paratrain_samples_per_s": args.batch * world / med_ours,
            "ddp_samples_per_s": args.batch * world / med_ddp,
            "ratio": med_ours / med_ddp,
            "max_rel_weight_diff": drift,
        }
        print(
            f"dp benchmark: {params / 1e6:.1f}M-parameter MLP, world {world}, {args.batch} samples/rank, "
            f"bucket {args.bucket_mb:g} MB, median of {len(t_ours)} interleaved steps each; ours: {result['form']}"
        )
        print(f"precision {precision_line(args.precision)}; {'both compiled' if args.compile else 'eager'}")
        print(f"{'contender':<12}{'step ms':>10}{'samples/s':>12}")
        print(f"{'paratrain':<12}{result['paratrain_step_ms']:>10.1f}{result['paratrain_samples_per_s']:>12.1f}")
        print(f"{'torch DDP':<12}{result['ddp_step_ms']:>10.1f}{result['ddp_samples_per_s']:>12.1f}")
        print(
            f"ratio paratrain/DDP step time: {result['ratio']:.3f} (<= 1.00 means not slower); "
            f"weights agree to {drift:.1e}"
        )
        emit_json(result, args.json)
    process.shutdown(together=True)


def precision_line(precision: str) -> str:
    """The precision as this CPU runs it: bf16 without native bf16 (AVX2) is emulated, slower than fp32."""
    from paratrain.runtime.machine import cpu_multiplies_bf16_natively

    if precision == "fp32":
        return "fp32"
    return "bf16 autocast" + (
        "" if cpu_multiplies_bf16_natively() else " (no native bf16 here: emulated, slower than fp32)"
    )


def own_loop_contender(args, cfg, x, y):
    """--own-loop: the Python API's dp around the very loop DDP runs (the same optimizer); returns
    (its step, its model)."""
    import paratrain
    from paratrain.optim import build_optimizer, cross_entropy

    pt = paratrain.init(strategy="dp", bucket_mb=args.bucket_mb)
    model = build(args)
    model, optimizer = pt.setup(model, build_optimizer(model.parameters(), cfg.train))

    def step():
        optimizer.zero_grad(set_to_none=False)
        pt.backward(cross_entropy(model(x), y))
        optimizer.step()

    return step, model


if __name__ == "__main__":
    from paratrain.runtime import process

    worker()
    process.leave()
