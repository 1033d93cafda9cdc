"""Parameter-server modes against dp all-reduce: samples/s and time to a fixed validation loss.

One launch of 1 server + W workers runs every contender in turn, in the same processes, on the same
data order from the same initial weights: sync ps, async ps, ssp and dp all-reduce (over the W
worker ranks; the server rank idles), each without and with one worker slowed 3x. Rounds repeat
the whole set interleaved; the table shows medians.

The clock: the first non-straggling worker keeps a copy of the model after every one of its steps
(what it pulled from the server, or its dp replica) with a timestamp; after the run, off the clock,
each copy is evaluated on the validation set. Time to target = the first copy at or below
--target. samples/s = samples all workers had consumed by then (each worker counts its own steps)
/ that time (the whole run where the target was not reached).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from paratrain.bench.common import COUNT, NONNEG, POSITIVE, add_json_option, add_round_options, register, relaunch
from paratrain.comm import grid
from paratrain.runtime.machine import emit_json

CONTENDERS = ["sync", "async", "ssp", "dp"]


def add_parser(which) -> None:
    help = "sync / async / ssp parameter server vs dp all-reduce, with a straggler"
    register(which, "ps", help, add_options, run, procs=("--workers", 3))


def add_options(p) -> None:
    add_round_options(p, steps=200, rounds=3, warmup=None, steps_help="steps per worker per run")
    p.add_argument("--batch", type=COUNT, default=64, help="samples per worker per step")
    p.add_argument("--hidden", type=COUNT, default=512)
    p.add_argument("--lr", type=POSITIVE, default=0.1)
    p.add_argument("--staleness", type=NONNEG, default=3)
    p.add_argument("--factor", type=POSITIVE, default=3.0, help="how much slower the straggler is")
    p.add_argument("--target", type=float, default=0.5, help="validation loss to reach")
    p.add_argument("--plot", default="bench-ps.png", help="loss-vs-time PNG")
    add_json_option(p)


def run(args) -> int:
    return relaunch("paratrain.bench.ps", args, add_options, nproc=1 + args.workers, run_id="bench-ps")


def compute_time(args, data) -> float:
    """Median seconds of one worker's forward/backward, off the clock: the dp straggler's delay base."""
    from paratrain.models.mlp import mlp
    from paratrain.optim import cross_entropy

    model = mlp(64, hidden=args.hidden, n_layers=2, out_features=10)
    x, y = data.tensors[0][: args.batch], data.tensors[1][: args.batch]
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        cross_entropy(model(x), y).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def one_run(
    contender: str, straggler: bool, args, rt, worker_group, data, compute_s: float
) -> tuple[list[tuple[float, torch.Tensor]], list[float]]:
    """Train once: the recording rank's [(seconds since start, flat parameters)] and this rank's
    step end times."""
    from paratrain import config as config_mod
    from paratrain.data import GlobalBatchSampler, load_batch
    from paratrain.models.mlp import mlp
    from paratrain.optim import cross_entropy
    from paratrain.parallel.base import Strategy
    from paratrain.parallel.dp.engine import DataParallel
    from paratrain.parallel.ps.engine import ParameterServer
    from paratrain.parallel.ps.worker import straggle

    workers = rt.world_size - 1
    slow_rank = rt.world_size - 1 if straggler else -1
    recorder = 1  # the first worker; never the straggler
    cfg = config_mod.from_dict(
        {
            "data": {"batch_size": args.batch * workers, "shuffle": True},
            "train": {"steps": args.steps, "optimizer": "sgd", "lr": args.lr},
            "parallel": {"strategy": "dp" if contender == "dp" else "ps"},
            "ps": {
                "servers": 1,
                "mode": contender if contender != "dp" else "sync",
                "staleness": args.staleness,
                "straggler_rank": slow_rank,
                "straggler_factor": args.factor,
            },
        }
    )
    torch.manual_seed(0)
    model = mlp(64, hidden=args.hidden, n_layers=2, out_features=10)
    strategy: Strategy | None
    if contender == "dp":
        strategy = DataParallel(model, cross_entropy, cfg, rt, group=worker_group) if rt.rank > 0 else None
        dp_rank, dp_size = rt.rank - 1, workers
    else:
        strategy = ParameterServer(model, cross_entropy, cfg, rt)
        dp_rank, dp_size = strategy.dp_rank, strategy.dp_size
    sampler = GlobalBatchSampler(len(data), cfg.data.batch_size, True, 0)
    trace, ends = [], []
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(args.steps if strategy is not None else 0):
        batch = None
        if rt.rank > 0:
            batch = load_batch(data, sampler.rank_indices(step, dp_rank, dp_size))
        assert strategy is not None  # no steps without one (range above)
        strategy.train_step(batch)
        if contender == "dp" and rt.rank == slow_rank:
            # ps workers stretch their measured compute inside train_step; dp's step also holds the
            # all-reduce wait, so the dp straggler stretches a calibrated compute time instead.
            straggle(compute_s, args.factor)
        ends.append(time.perf_counter() - t0)
        if rt.rank == recorder:
            trace.append(
                (time.perf_counter() - t0, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
            )
    dist.barrier()
    return trace, ends if rt.rank > 0 else []


@torch.no_grad()
def val_losses(trace, args, val) -> list[tuple[float, float]]:
    from paratrain.models.mlp import mlp
    from paratrain.optim import cross_entropy

    model = mlp(64, hidden=args.hidden, n_layers=2, out_features=10)
    x, y = val.tensors
    out = []
    for t, flat in trace:
        torch.nn.utils.vector_to_parameters(flat, model.parameters())
        out.append((t, float(cross_entropy(model(x), y))))
    return out


def summarize(curve, args) -> dict:
    hit = next((i for i, (_, loss) in enumerate(curve) if loss <= args.target), None)
    return {
        "time_to_target_s": curve[hit][0] if hit is not None else None,
        "final_val_loss": curve[-1][1],
        "run_s": curve[-1][0],
    }


def samples_per_s(window_s: float, ends: list[float], batch: int) -> float:
    """Collective: every worker's steps finished within the window, as samples per second."""
    done = torch.tensor([sum(t <= window_s for t in ends)], dtype=torch.float64)
    dist.all_reduce(done)
    return done.item() * batch / window_s


def worker(argv=None) -> None:
    from paratrain.data.datasets import digits
    from paratrain.runtime import process

    p = argparse.ArgumentParser()
    add_options(p)
    args = p.parse_args(argv)
    rt = process.init("cpu")
    workers = rt.world_size - 1
    worker_group = grid.subgroup(list(range(1, rt.world_size)))
    train, val = digits("train"), digits("val")
    compute_s = compute_time(args, train)
    results: dict[str, list] = {}
    curves: dict[str, list] = {}
    for _ in range(args.rounds):
        for straggler in (False, True):
            for contender in CONTENDERS:
                trace, ends = one_run(contender, straggler, args, rt, worker_group, train, compute_s)
                window = torch.zeros(1, dtype=torch.float64)
                if rt.rank == 1:
                    key = f"{contender}{' +straggler' if straggler else ''}"
                    curves[key] = val_losses(trace, args, val)
                    summary = summarize(curves[key], args)
                    window[0] = summary["time_to_target_s"] or summary["run_s"]
                dist.broadcast(window, src=1)
                rate = samples_per_s(window.item(), ends, args.batch)
                if rt.rank == 1:
                    results.setdefault(key, []).append({**summary, "samples_per_s": rate})
    if rt.rank == 1:
        report(results, curves, args, workers)
    dist.barrier()
    process.shutdown()


def median_of(runs: list[dict], key: str):
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if len(values) == len(runs) else None


def report(results: dict, curves: dict, args, workers: int) -> None:
    rows = {
        k: {m: median_of(v, m) for m in ("time_to_target_s", "samples_per_s", "final_val_loss", "run_s")}
        for k, v in results.items()
    }
    print(
        f"ps benchmark: digits MLP (hidden {args.hidden}), 1 server + {workers} workers, {args.batch} "
        f"samples/worker/step, {args.steps} steps/worker, SGD lr {args.lr}, ssp staleness {args.staleness}, "
        f"straggler {args.factor:g}x slower; medians of {args.rounds} interleaved rounds"
    )
    print(
        f"{'contender':<26}{'samples/s':>11}{f'time to val {args.target:g} (s)':>24}{'final val':>11}"
        f"{'vs sync ps':>12}{'vs dp':>8}"
    )
    for straggler in ("", " +straggler"):
        base_sync = rows[f"sync{straggler}"]["time_to_target_s"]
        base_dp = rows[f"dp{straggler}"]["time_to_target_s"]
        for contender in CONTENDERS:
            key = f"{contender}{straggler}"
            r = rows[key]
            ttt = r["time_to_target_s"]

            def speed(base, ttt=ttt):
                return f"{base / ttt:.2f}x" if ttt and base else "-"

            r["speedup_vs_sync_ps"] = base_sync / ttt if ttt and base_sync else None
            r["speedup_vs_dp"] = base_dp / ttt if ttt and base_dp else None
            print(
                f"{(contender if contender != 'dp' else 'dp all-reduce') + straggler:<26}{r['samples_per_s']:>11.0f}"
                f"{(f'{ttt:.2f}' if ttt else 'not reached'):>24}{r['final_val_loss']:>11.3f}"
                f"{speed(base_sync):>12}{speed(base_dp):>8}"
            )
    plot(curves, args)
    print(f"loss-vs-time plot: {args.plot}")
    out = {
        "benchmark": "ps",
        "workers": workers,
        "servers": 1,
        "target_val_loss": args.target,
        "steps": args.steps,
        "rounds": args.rounds,
        "straggler_factor": args.factor,
        "results": rows,
    }
    emit_json(out, args.json)


def plot(curves: dict, args) -> None:
    from paratrain.extras import require

    require("matplotlib", "the benchmark's plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, straggler in zip(axes, ("", " +straggler")):
        for contender in CONTENDERS:
            t, loss = zip(*curves[f"{contender}{straggler}"])
            ax.plot(t, loss, label="dp all-reduce" if contender == "dp" else f"{contender} ps")
        ax.axhline(args.target, color="gray", linestyle="--", linewidth=1, label=f"target {args.target:g}")
        ax.set_title(f"one worker {args.factor:g}x slower" if straggler else "no straggler")
        ax.set_xlabel("wall-clock time (s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (digits)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    from paratrain.runtime import process

    worker()
    process.leave()
