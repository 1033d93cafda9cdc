"""The worker side of `paratrain bench suite` (bench/suite.py launches it, one elastic agent per
host): every contender (ours, torch DDP and its comm hooks, compute alone) trained in the same
processes, interleaved in rounds; step times, bytes sent, losses, the bus bandwidth and the
profiler's own cost, written as JSON for the parent to print."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratrain.bench.common import COUNT
from paratrain.bench.dp import build
from paratrain.bench.suite import add_options
from paratrain.errors import error
from paratrain.profile import bytes_sent, open_proc_io


# -- the workers ------------------------------------------------------------------------------------
class Contender:
    """One model replica trained by one contender; records step times, bytes sent and losses."""

    def __init__(self, step_fn):
        self.step_fn = step_fn
        self.io = open_proc_io()  # what the profiler counts bytes sent with
        self.times, self.sent, self.losses = [], [], []

    def run(self, n: int, data) -> None:
        for _ in range(n):
            x, y = data[len(self.losses)]
            dist.barrier()
            w0, t0 = bytes_sent(self.io), time.perf_counter()
            loss = self.step_fn(x, y)
            self.times.append(time.perf_counter() - t0)
            self.sent.append(bytes_sent(self.io) - w0)
            self.losses.append(float(loss))


class FreshBatches:
    """Teacher-labelled random inputs, a learnable task: a fresh batch every step, as a dataset
    larger than the run gives, different per rank and the same for every contender (batch i of a rank
    comes from its own seed). A pool of batches cycled over was memorised: 8 batches by step 100,
    32 by step 200 (loss 0.04), where the lossy codecs could not keep up with dp's memorising."""

    def __init__(self, args, rank: int):
        self.teacher = torch.randn(args.in_features, 10, generator=torch.Generator().manual_seed(123))
        self.shape, self.rank = (args.batch, args.in_features), rank

    def __getitem__(self, i: int):
        x = torch.randn(*self.shape, generator=torch.Generator().manual_seed(1_000_003 * (1 + self.rank) + i))
        return x, (x @ self.teacher).argmax(1)


def _train_section(args) -> dict:
    """The optimizer every contender here uses (ours through its config, torch's peers directly)."""
    return {"optimizer": "sgd", "lr": args.lr, "momentum": 0.9}


def _ours(args, rt, compression: str):
    from paratrain import config as config_mod
    from paratrain.optim import cross_entropy
    from paratrain.parallel.dp.engine import DataParallel

    cfg = config_mod.from_dict(
        {
            "data": {"batch_size": args.batch * rt.world_size},
            "train": _train_section(args),
            "parallel": {
                "bucket_mb": args.bucket_mb,
                "compression": compression,
                "powersgd_rank": args.powersgd_rank,
                "topk_ratio": args.topk_ratio,
            },
        }
    )
    dp = DataParallel(build(args), cross_entropy, cfg, rt)
    return dp, (lambda x, y: dp.train_step((x, y)))


def _compute_only(args):
    """The same step with no communication at all: the floor every contender sits above."""
    return _sgd_step(build(args), args)


def _sgd_step(model, args):
    """One plain training step of a module (a bare model or a DDP wrapper), returning the loss."""
    from paratrain import config as config_mod
    from paratrain.optim import build_optimizer, cross_entropy

    opt = build_optimizer(model.parameters(), config_mod.from_dict({"train": _train_section(args)}).train)

    def step(x, y):
        opt.zero_grad(set_to_none=False)
        loss = cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _ddp(args, hook: str | None):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    # torch's PowerSGD hook on gloo needs all gradients in one bucket (else: collective mismatch)
    model = DDP(build(args), bucket_cap_mb=1e4 if hook == "powersgd" else args.bucket_mb)
    if hook == "powersgd":
        state = psgd.PowerSGDState(None, matrix_approximation_rank=args.powersgd_rank, start_powerSGD_iter=2)
        model.register_comm_hook(state, psgd.powerSGD_hook)
    elif hook:
        model.register_comm_hook(None, getattr(default_hooks, f"{hook}_compress_hook"))
    return _sgd_step(model, args)


def bus_bandwidth(world: int, sizes_mib=(1, 4, 16, 38), reps: int = 5) -> list[dict]:
    out = []
    for mib in sizes_mib:
        t = torch.ones(int(mib * 2**20) // 4)
        for _ in range(2):
            dist.all_reduce(t)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        sec = torch.tensor(statistics.median(times), dtype=torch.float64)
        dist.all_reduce(sec, op=dist.ReduceOp.MAX)
        nbytes = t.numel() * 4
        out.append(
            {
                "mib": mib,
                "ms": sec.item() * 1e3,
                "algbw_gbps": nbytes / sec.item() / 1e9,
                "busbw_gbps": 2 * (world - 1) / world * nbytes / sec.item() / 1e9,
            }
        )
    return out


def profiler_overhead(args, rt, ours, data) -> dict:
    """The profiler's cost: its instrumentation timed alone, and dp steps with it on vs off (A/B)."""
    from paratrain.profile import NULL_PROFILER, Profiler

    with tempfile.TemporaryDirectory() as tmp:
        prof = Profiler(Path(tmp), rt.rank, rt.world_size, rt.device)
        n = 2000
        t0 = time.perf_counter()
        for i in range(n):  # what the trainer and dp call per step: one step, 6 phases, 1 comm
            with prof.step(i + 1):
                for name in ("data", "forward", "backward", "comm", "compress", "optimizer"):
                    with prof.phase(name):
                        pass
                prof.comm("all_reduce", 1 << 20)
        per_step = (time.perf_counter() - t0) / n
        prof.flush()
        plain = Contender(lambda x, y: ours.train_step((x, y)))
        with_prof = Contender(lambda x, y: ours.train_step((x, y)))
        flush_s = []

        def profiled_step(x, y):
            with prof.step(len(with_prof.losses) + 1):
                return ours.train_step((x, y))

        with_prof.step_fn = profiled_step
        for _ in range(args.rounds):
            ours.profiler = NULL_PROFILER
            plain.run(args.steps, data)
            ours.profiler = prof
            with_prof.run(args.steps, data)
            t0 = time.perf_counter()
            prof.flush()
            flush_s.append(time.perf_counter() - t0)
        ours.profiler = NULL_PROFILER
        prof.close()
    both = torch.tensor(
        [statistics.median(plain.times), statistics.median(with_prof.times), per_step, statistics.median(flush_s)],
        dtype=torch.float64,
    )
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    off, on, per_step, flush = both.tolist()
    return {
        "instrumentation_us_per_step": per_step * 1e6,
        "instrumentation_pct": 100 * per_step / off,
        "flush_ms": flush * 1e3,
        "ab_ratio": on / off,
    }


def _summary(contenders: dict, world: int, batch: int) -> dict:
    """Per contender: median over steps of the slowest rank's step time, mean bytes, final loss."""
    out: dict[str, Any] = {}
    for name, e in contenders.items():
        if isinstance(e, str):
            out[name] = {"error": e}
            continue
        mx = torch.tensor(e.times, dtype=torch.float64)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        last = max(1, len(e.losses) // 6)  # the final loss: mean over ranks of the last steps
        sm = torch.tensor([statistics.fmean(e.sent), statistics.fmean(e.losses[-last:])], dtype=torch.float64)
        dist.all_reduce(sm)
        step = statistics.median(mx.tolist())
        out[name] = {
            "step_ms": step * 1e3,
            "samples_per_s": batch * world / step,
            "mb_sent": sm[0].item() / world / 1e6,
            "final_loss": sm[1].item() / world,
            "steps_trained": len(e.losses),
        }
    return out


def _loss_curve(losses: list[float], world: int, window: int) -> list[float]:
    """After each step from the window-th on: the loss averaged over the ranks and over the last
    `window` steps (single batches differ more than contenders do). Collective."""
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    t /= world
    return [t[i - window : i].mean().item() for i in range(window, len(t) + 1)]


EQUAL_LOSS_TOLERANCE = 1e-3  # bf16's loss equals dp's to 4 digits but can sit a hair above it
EQUAL_LOSS_WINDOW = 32  # steps the loss is averaged over


def equal_loss(
    contenders: dict, codecs: list[str], data, summary: dict, world: int, horizon: int, window: int = EQUAL_LOSS_WINDOW
) -> dict:
    """How many steps each codec needs to reach the loss dp reached after `horizon` steps, and what
    that makes its speed-up over dp at equal loss: (dp's steps x dp's step time) / (its steps x its
    step time). "Reached" is within EQUAL_LOSS_TOLERANCE. dp trains on from its timed steps to the
    horizon, the codecs up to twice it. Why a horizon of its own: a lossy codec with error feedback
    lags dp by a roughly constant number of steps, which the 33 timed steps would inflate. Collective."""
    dp = contenders["paratrain dp"]
    dp.run(max(0, horizon - len(dp.losses)), data)
    window = min(window, len(dp.losses))  # a short run averages what it has
    dp_curve = _loss_curve(dp.losses, world, window)
    target = dp_curve[-1] * (1 + EQUAL_LOSS_TOLERANCE)
    dp_steps = next(i + window for i, loss in enumerate(dp_curve) if loss <= target)
    dp_ms = summary["paratrain dp"]["step_ms"]
    out: dict[str, Any] = {
        "window": window,
        "dp_loss": dp_curve[-1],
        "tolerance": EQUAL_LOSS_TOLERANCE,
        "dp_steps": dp_steps,
        "max_steps": 2 * len(dp.losses),
        "contenders": {},
    }
    for name in codecs:
        e = contenders[name]
        if isinstance(e, str):
            continue
        e.run(2 * len(dp.losses) - len(e.losses), data)
        curve = _loss_curve(e.losses, world, window)
        steps = next((i + window for i, loss in enumerate(curve) if loss <= target), None)
        out["contenders"][name] = {
            "steps": steps,
            "steps_vs_dp": steps / dp_steps if steps else None,
            "speedup_at_equal_loss": dp_steps * dp_ms / (steps * summary[name]["step_ms"]) if steps else None,
        }
    return out


def worker(argv=None) -> None:
    from paratrain.runtime import process

    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("contenders", "scaling"))
    add_options(p)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rt = process.init("cpu", timeout_s=300)
    world = rt.world_size
    data = FreshBatches(args, rt.rank)
    torch.manual_seed(0)
    result = {"world_size": world, "samples_per_rank": args.batch}
    r = args.powersgd_rank
    if args.mode == "scaling":
        dp, dp_step = _ours(args, rt, "none")
        contenders: dict[str, Contender | str] = {  # a str: why that contender cannot run here
            "paratrain dp": Contender(dp_step),
            f"paratrain powersgd r{r}": Contender(_ours(args, rt, "powersgd")[1]),
            "torch DDP": Contender(_ddp(args, None)),
        }
        rounds, steps = 3, args.steps
    else:
        dp, dp_step = _ours(args, rt, "none")
        contenders = {
            "paratrain dp": Contender(dp_step),
            "torch DDP": Contender(_ddp(args, None)),
            "compute only": Contender(_compute_only(args)),
        }
        pct = f"{args.topk_ratio:.0%}" if args.topk_ratio >= 0.01 else f"{args.topk_ratio:g}"
        pairs: list[tuple[str, str | None]] = [("paratrain dp", "torch DDP")]
        for codec, hook, label in (
            ("bf16", "bf16", "DDP bf16_compress_hook"),
            ("fp16", "fp16", "DDP fp16_compress_hook"),
            ("topk", None, None),
            ("powersgd", "powersgd", f"DDP powerSGD_hook r{r}"),
        ):
            if codec not in args.codecs.split(","):
                continue
            name = {"topk": f"paratrain topk {pct}", "powersgd": f"paratrain powersgd r{r}"}.get(
                codec, f"paratrain {codec}"
            )
            contenders[name] = Contender(_ours(args, rt, codec)[1])
            if hook and label:  # (set together)
                try:
                    contenders[label] = Contender(_ddp(args, hook))
                except (RuntimeError, TypeError) as exc:  # e.g. torch's bf16 hook refuses gloo/CPU
                    contenders[label] = str(exc).strip().splitlines()[0]
            pairs.append((name, label))
        result["pairs"] = pairs
        rounds, steps = args.rounds, args.steps
    for name, e in list(contenders.items()):  # warm-up; a contender that cannot run here is reported, not fatal
        if isinstance(e, str):
            continue
        try:
            e.run(args.warmup, data)
        except RuntimeError as exc:
            contenders[name] = str(exc).strip().splitlines()[0]
            dist.barrier()
    for e in contenders.values():
        if not isinstance(e, str):
            e.times, e.sent = [], []
    for _ in range(rounds):
        for e in contenders.values():
            if not isinstance(e, str):
                e.run(steps, data)
    result["timed_steps"] = rounds * steps
    result["contenders"] = _summary(contenders, world, args.batch)
    if args.mode == "contenders":
        result["equal_loss"] = equal_loss(
            contenders, [ours for ours, _ in pairs[1:]], data, result["contenders"], world, args.equal_loss_steps
        )
        result["parameters"] = sum(p.numel() for p in dp.params)
        result["bus_bandwidth"] = bus_bandwidth(world)
        result["profiler_overhead"] = profiler_overhead(args, rt, dp, data)
    if rt.is_main:
        Path(args.out).write_text(json.dumps(result))
    process.shutdown(together=True)


def agent(argv) -> int:
    """One node's elastic agent for the bench workers (so the parent can start it inside a namespace)."""
    from paratrain.runtime.launch import launch
    from paratrain.runtime.worker_failure import WorkerFailure

    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=COUNT, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--rdzv", default=None)
    p.add_argument("worker", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    worker_argv = args.worker[1:] if args.worker[:1] == ["--"] else args.worker
    try:
        launch(
            "paratrain.bench.suite_worker",
            ["worker", *worker_argv],
            nproc=args.nproc,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv=args.rdzv,
            run_id="bench-suite",
        )
    except WorkerFailure as exc:
        error(f"benchmark worker failed: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    from paratrain.runtime import process

    if sys.argv[1] == "agent":
        sys.exit(agent(sys.argv[2:]))
    worker(sys.argv[2:])
    process.leave()
