"""Per-rank memory of dp, zero1/2/3 and PyTorch FSDP2 (`fully_shard`) on the same model.

Every (strategy, world size) runs in its own fresh worker processes, so one configuration's peak
cannot hide in another's high-water mark. Each rank counts the bytes of the tensors it holds for
parameters, gradients and optimizer state (for zero2/zero3 including the peak of what is briefly
full: gradients while they are reduce-scattered, parameters while gathered), and reads its peak
resident memory (VmHWM) after a few AdamW steps. Both ours and FSDP2 build the model on the meta
device and initialise it shard by shard; dp builds it whole, as DDP would.

`--model module:function` measures a user's factory instead of the built-in MLP (called with no
arguments; its model takes (batch, --in-features) inputs and returns logits over at least 10
classes), materialised by zero1/2/3 as a training run does: its construction recorded on the meta
device and replayed a tensor at a time (models/materialize.py); FSDP2 runs each module's
reset_parameters on its shards.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.bench.common import COUNT, POSITIVE, add_json_option, emit_json, one_or_more_of
from paratrain.errors import error, say

STRATEGIES = ["dp", "zero1", "zero2", "zero3", "fsdp2"]


def add_parser(which) -> None:
    p = which.add_parser("memory", help="per-rank memory: dp vs zero1/2/3 vs torch FSDP2")
    add_model_options(p)
    p.add_argument("--worlds", type=one_or_more_of(COUNT), default="2,4", help="comma-separated world sizes")
    p.add_argument("--strategies", type=one_or_more_of(STRATEGIES), default=",".join(STRATEGIES))
    add_json_option(p)
    p.set_defaults(func=run)


def add_model_options(p) -> None:
    p.add_argument(
        "--model",
        default=None,
        metavar="MODULE:FUNCTION",
        help="a user's model factory (no arguments) instead of the built-in MLP",
    )
    p.add_argument("--in-features", type=COUNT, default=1024)
    p.add_argument("--hidden", type=COUNT, default=4096)
    p.add_argument("--layers", type=COUNT, default=4, help="hidden layers of the MLP (default: 54.6M parameters)")
    p.add_argument("--batch", type=COUNT, default=8, help="samples per rank")
    p.add_argument("--steps", type=COUNT, default=3, help="AdamW steps before reading the peak")
    p.add_argument("--bucket-mb", type=POSITIVE, default=25.0)


def run(args) -> int:
    from paratrain.errors import ConfigError
    from paratrain.resolve import resolve_callable
    from paratrain.runtime.launch import WorkerFailure, launch

    if args.model:
        try:
            resolve_callable(args.model, "--model")
        except ConfigError as exc:
            error(f"{exc}")
            return 2
    results = []
    for world in [int(w) for w in args.worlds.split(",")]:
        for strategy in args.strategies.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "result.json"
                argv = [
                    f"--strategy={strategy}",
                    f"--out={out}",
                    f"--in-features={args.in_features}",
                    f"--hidden={args.hidden}",
                    f"--layers={args.layers}",
                    f"--batch={args.batch}",
                    f"--steps={args.steps}",
                    f"--bucket-mb={args.bucket_mb}",
                ] + ([f"--model={args.model}"] if args.model else [])
                try:
                    launch("paratrain.bench.memory", argv, nproc=world, run_id=f"bench-memory-{strategy}-{world}")
                except WorkerFailure as exc:
                    error(f"{strategy} at world {world} failed: {exc}")
                    return 1
                results.append(json.loads(out.read_text()))
                say(f"  measured {strategy} at world {world}")
    print_table(results)
    emit_json(results, args.json)
    return 0


def print_table(results: list[dict]) -> None:
    mb = 2**20
    r0 = results[0]
    print(
        f"memory benchmark: {r0['parameters'] / 1e6:.1f}M-parameter {r0['model']}, AdamW fp32, {r0['batch']} samples/rank, "
        f"bucket {r0['bucket_mb']:g} MB; per-rank MB (max over ranks)"
    )
    head = f"{'world':>5} {'strategy':<9}{'params':>9}{'grads':>9}{'optim':>9}{'tensors':>9}{'peak RSS':>10}{'RSS-base':>10}"
    print(head)
    for r in results:
        base = next(x for x in results if x["world"] == r["world"] and x["strategy"] == "dp")
        print(
            f"{r['world']:>5} {r['strategy']:<9}{r['params_bytes'] / mb:>9.1f}{r['grads_bytes'] / mb:>9.1f}"
            f"{r['optim_bytes'] / mb:>9.1f}{r['tensor_bytes'] / mb:>9.1f}{r['peak_rss_bytes'] / mb:>10.1f}"
            f"{(r['peak_rss_bytes'] - r['base_rss_bytes']) / mb:>10.1f}"
        )
        r["optim_vs_dp"] = r["optim_bytes"] / base["optim_bytes"]
    for world in sorted({r["world"] for r in results}):
        by = {r["strategy"]: r for r in results if r["world"] == world}
        if "zero3" in by and "fsdp2" in by:
            print(
                f"world {world}: zero3/FSDP2 peak RSS ratio {by['zero3']['peak_rss_bytes'] / by['fsdp2']['peak_rss_bytes']:.3f}"
                f" (<= 1.00: zero3 peaks lower)"
            )


# -- worker ---------------------------------------------------------------------------------------
def rss_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process, from /proc (kB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(nbytes(v.to_local() if hasattr(v, "to_local") else v for v in s.values()) for s in opt.state.values())


def build_model(args, strategy: str):
    """The model as `strategy` gets it: whole for dp; on the meta device for the others (a user
    factory's construction recorded for zero to replay, as the trainer does)."""
    from paratrain.models.materialize import record_on_meta
    from paratrain.models.mlp import mlp
    from paratrain.resolve import resolve_callable

    torch.manual_seed(0)
    if args.model:
        factory = resolve_callable(args.model, "--model")
    else:

        def factory():
            return mlp(in_features=args.in_features, hidden=args.hidden, n_layers=args.layers, out_features=10)

    if strategy == "dp":
        return factory()
    if args.model and strategy != "fsdp2":
        return record_on_meta(factory)
    with torch.device("meta"):
        return factory()


def ours(strategy: str, args, rt, step_args):
    from paratrain import config as config_mod
    from paratrain.optim import cross_entropy
    from paratrain.parallel.registry import strategy_class

    cfg = config_mod.from_dict(
        {
            "data": {"batch_size": args.batch * rt.world_size},
            "train": {"optimizer": "adamw", "lr": 1e-4},
            "parallel": {"strategy": strategy, "bucket_mb": args.bucket_mb},
        }
    )
    engine = strategy_class(strategy)(build_model(args, strategy), cross_entropy, cfg, rt)
    for _ in range(args.steps):
        engine.train_step(step_args)
    if strategy == "dp":
        params = nbytes(engine.params)
        grads = nbytes(b.buffer for b in engine.reducer.buckets)
    else:
        stage = engine.stage
        if stage == 3:
            params = nbytes(u.shard for u in engine.units) + engine.gatherer.peak_bytes
        else:
            params = nbytes(u.full for u in engine.units)
        if stage == 1:
            grads = nbytes(b.buffer for b in engine.reducer.buckets)
        else:
            grads = nbytes(u.grad_shard for u in engine.units) + engine.reducer.peak_bytes
    n_params = sum(sum(u.numels) for u in engine.units) if strategy != "dp" else sum(p.numel() for p in engine.params)
    return params, grads, optimizer_bytes(engine.optimizer), n_params


def fsdp2(args, rt, step_args):
    """FSDP2 as its documentation recommends: meta build, fully_shard every Linear and the root,
    to_empty, then each module's reset_parameters on its shards."""
    from torch.distributed.fsdp import fully_shard

    from paratrain.optim import cross_entropy

    model = build_model(args, "fsdp2")
    for layer in model.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = step_args
    for _ in range(args.steps):
        cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()  # set_to_none: FSDP2 frees its sharded gradients
    n_params = sum(p.numel() for p in model.parameters())  # global (DTensor) sizes
    local = [p.to_local() for p in model.parameters()]
    # Gradients were freed by zero_grad: count what the step held (one local shard per parameter).
    return nbytes(local), nbytes(local), optimizer_bytes(opt), n_params


def worker(argv=None) -> None:
    from paratrain.runtime import process

    p = argparse.ArgumentParser()
    add_model_options(p)
    p.add_argument("--strategy", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rt = process.init("cpu")
    g = torch.Generator().manual_seed(1 + rt.rank)
    step_args = (
        torch.randn(args.batch, args.in_features, generator=g),
        torch.randint(0, 10, (args.batch,), generator=g),
    )
    base_rss = rss_bytes("VmRSS")
    t0 = time.perf_counter()
    if args.strategy == "fsdp2":
        params, grads, optim, n_params = fsdp2(args, rt, step_args)
    else:
        params, grads, optim, n_params = ours(args.strategy, args, rt, step_args)
    elapsed = time.perf_counter() - t0
    mine = torch.tensor([params, grads, optim, rss_bytes("VmHWM"), base_rss], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    if rt.is_main:
        params, grads, optim, peak, base = mine.tolist()
        Path(args.out).write_text(
            json.dumps(
                {
                    "strategy": args.strategy,
                    "world": rt.world_size,
                    "model": args.model or "MLP",
                    "parameters": n_params,
                    "batch": args.batch,
                    "bucket_mb": args.bucket_mb,
                    "params_bytes": params,
                    "grads_bytes": grads,
                    "optim_bytes": optim,
                    "tensor_bytes": params + grads + optim,
                    "peak_rss_bytes": peak,
                    "base_rss_bytes": base,
                    "seconds": elapsed,
                }
            )
        )
    process.shutdown(together=True)


if __name__ == "__main__":
    from paratrain.runtime import process

    worker()
    process.leave()
