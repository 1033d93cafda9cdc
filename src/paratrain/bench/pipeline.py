"""paratrain's pipeline against torch.distributed.pipelining, same model and schedule, interleaved rounds.

Model: `--layers` blocks of Linear(width, width) + GELU as an nn.Sequential, cut into `--nproc`
stages (2 chunks per rank for interleaved), `--microbatches` microbatches of `--rows` rows, MSE
loss, SGD. A timed step is zero-grad + the schedule + the optimizer step, for both engines.
For every schedule the table gives:
  * step time, ours and torch's (ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B), and ratio;
  * the ideal: (m*v + p - 1) x the slowest stage chunk's forward+backward for one microbatch,
    measured alone on each rank (small CPU microbatches cost more per row, so this is the honest
    lower bound), and our ratio to it;
  * the measured bubble: each stage's idle fraction of the schedule (1 - its compute / the schedule's
    wall time, which is the slowest rank's: every rank starts the step off the same barrier, and a
    stage that finishes early idles until the last one is done), against the theory
    (p - 1) / (v*m + p - 1), which assumes stages of equal cost; beside it the same theory for the
    stage costs measured in the run (a lighter stage idles by its lightness too:
    1 - busy_s / ((v*m + p - 1) / (v*m) * busy_max), which is the theory for the slowest);
  * the peak bytes of activations saved for backward (1f1b keeps at most p microbatches alive).
Then tensor parallelism: per-rank parameter bytes of the built-in gpt at tp = world size.
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref

import torch
import torch.distributed as dist
from torch import nn

from paratrain import errors
from paratrain.bench.common import (
    COUNT,
    add_json_option,
    add_round_options,
    one_or_more_of,
    register,
    relaunch,
    timed_steps,
)
from paratrain.runtime.machine import emit_json

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def add_parser(which) -> None:
    register(
        which,
        "pipeline",
        "paratrain pipeline vs torch.distributed.pipelining (bubble, memory, step time, ideal) and tp parameter bytes",
        add_options,
        run,
    )


def add_options(p) -> None:
    add_round_options(p, steps=5, rounds=4, warmup=2, steps_help="timed steps per round per contender and schedule")
    p.add_argument("--layers", type=COUNT, default=8)
    p.add_argument("--width", type=COUNT, default=1024)
    p.add_argument("--microbatches", type=COUNT, default=8)
    p.add_argument("--rows", type=COUNT, default=8, help="rows per microbatch")
    p.add_argument("--schedules", type=one_or_more_of(SCHEDULES), default=",".join(SCHEDULES))
    add_json_option(p)


def shape_error(args) -> str | None:
    """What makes these options a pipeline neither engine can run (checked before any worker starts)."""
    schedules = args.schedules.split(",")
    stages = args.nproc * (2 if "interleaved" in schedules else 1)
    if args.layers < stages:  # each stage (for interleaved: each of a rank's two chunks) needs a layer
        return (
            f"--layers: {args.layers} layers cannot be cut into {stages} stages "
            f"(--nproc {args.nproc}{', 2 chunks each for interleaved' if stages > args.nproc else ''})"
        )
    if args.microbatches < args.nproc and {"1f1b", "interleaved"} & set(schedules):
        return f"--microbatches: 1f1b and interleaved need at least one microbatch per stage ({args.nproc})"
    if "interleaved" in schedules and args.microbatches % args.nproc:
        return f"--microbatches: interleaved needs a multiple of --nproc ({args.nproc}), got {args.microbatches}"
    return None


def run(args) -> int:
    if (why := shape_error(args)) is not None:
        errors.error(why)
        return 2
    return relaunch("paratrain.bench.pipeline", args, add_options, nproc=args.nproc, run_id="bench-pipeline")


def build(args) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(args.layers)])


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedActivations:
    """Peak bytes of tensors autograd saves for backward (parameters and their views excluded)."""

    def __init__(self, params):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.live = self.peak = 0

    def _pack(self, t):
        if t.untyped_storage().data_ptr() in self.param_storages:
            return t
        holder = _Saved(t)
        self.live += t.numel() * t.element_size()
        self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._free, t.numel() * t.element_size())
        return holder

    def _free(self, nbytes):
        self.live -= nbytes

    @staticmethod
    def _unpack(x):
        return x.tensor if isinstance(x, _Saved) else x

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


def stage_alone_seconds(module: nn.Module, x: torch.Tensor, repeats: int = 15) -> float:
    """Median forward+backward of one stage chunk on one microbatch, no communication."""
    times = []
    for i in range(repeats + 2):
        inp = x.detach().requires_grad_()
        t0 = time.perf_counter()
        module(inp).sum().backward()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    module.zero_grad(set_to_none=True)
    return statistics.median(times)


def compare_schedule(schedule: str, args, rt, x, y, torch_classes) -> dict | None:
    """One schedule on both engines, interleaved rounds; rank 0 gets its row, the others None."""
    from torch.distributed.pipelining import PipelineStage

    from paratrain import config as config_mod
    from paratrain.optim import build_optimizer, mse
    from paratrain.parallel.hybrid.engine import ModelParallel

    world, rank = rt.world_size, rt.rank
    m, rows = args.microbatches, args.rows
    v = 2 if schedule == "interleaved" else 1
    n_stages = world * v
    cfg = config_mod.from_dict(
        {
            "data": {"batch_size": m * rows},
            "train": {"optimizer": "sgd", "lr": 1e-4, "loss": "mse"},
            "parallel": {
                "strategy": "pp",
                "pp": world,
                "microbatches": m,
                "schedule": schedule,
                "virtual_stages": v,
                "balance": "params",
            },
        }
    )
    ours = ModelParallel(build(args), mse, cfg, rt)

    # torch.distributed.pipelining on the same cut of the same weights
    blocks = list(build(args).children())
    per = len(blocks) // n_stages
    mine = [s for s in range(n_stages) if s % world == rank]
    modules = [nn.Sequential(*blocks[s * per : (s + 1) * per]) for s in mine]
    stages = [PipelineStage(mod, s, n_stages, rt.device) for s, mod in zip(mine, modules)]
    torch_schedule = torch_classes[schedule](stages if v > 1 else stages[0], n_microbatches=m, loss_fn=mse)
    torch_opt = build_optimizer([q for mod in modules for q in mod.parameters()], cfg.train)  # as ours

    def ours_step():
        ours.train_step((x, y))

    def torch_step():
        torch_opt.zero_grad(set_to_none=False)
        if rank == 0:
            torch_schedule.step(x)
        elif rank == world - 1:
            torch_schedule.step(target=y, losses=[])
        else:
            torch_schedule.step()
        torch_opt.step()

    def ours_recorded():
        ours.engine.timeline = []
        ours_step()
        spans, ours.engine.timeline = ours.engine.timeline, None
        busy_s.append(sum(e - s for kind, s, e in spans if kind in "FB"))
        wall_s.append(sum(e - s for kind, s, e in spans if kind == "step"))

    def alone_step():  # the ideal's unit, taken under the same machine noise as the steps
        alone.append(max(stage_alone_seconds(chunk, x[:rows], repeats=3) for chunk in ours.chunks))

    timed_steps(ours_step, args.warmup)
    timed_steps(torch_step, args.warmup)
    t_ours, t_torch, busy_s, wall_s, alone = list[float](), list[float](), list[float](), list[float](), list[float]()
    for _ in range(args.rounds):  # rounds alternate the engines so both see the same noise
        t_ours += timed_steps(ours_recorded, args.steps)
        t_torch += timed_steps(torch_step, args.steps)
        timed_steps(alone_step, args.steps)
    memory = SavedActivations(ours.params)
    with memory.hooks():
        ours_step()
    alone_s = statistics.median(alone)

    # the schedule's wall time of each recorded step is the slowest rank's
    walls = torch.tensor(wall_s, dtype=torch.float64)
    dist.all_reduce(walls, op=dist.ReduceOp.MAX)
    idle = statistics.median((1 - torch.tensor(busy_s, dtype=torch.float64) / walls).tolist())
    stats = torch.tensor(
        [statistics.median(t_ours), statistics.median(t_torch), idle, memory.peak, alone_s, statistics.median(busy_s)],
        dtype=torch.float64,
    )
    return _row(schedule, rt, v, m, rows, stats)


def _row(schedule: str, rt, v: int, m: int, rows: int, stats: torch.Tensor) -> dict | None:
    """The schedule's table row from every rank's `stats` (compare_schedule's), on rank 0; None elsewhere."""
    world = rt.world_size
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    if rt.rank != 0:
        return None
    per_rank = torch.stack(gathered)
    step_ours, step_torch = per_rank[:, 0].max().item(), per_rank[:, 1].max().item()
    slowest = per_rank[:, 4].max().item()
    ideal = (m * v + world - 1) * slowest
    busy = per_rank[:, 5]
    span = (m * v + world - 1) / (m * v) * busy.max().item()  # the slowest stage's ideal wall time
    return {
        "schedule": schedule,
        "stages": world,
        "virtual_stages": v,
        "microbatches": m,
        "rows": rows,
        "paratrain_step_ms": step_ours * 1e3,
        "torch_step_ms": step_torch * 1e3,
        "ratio_vs_torch": step_ours / step_torch,
        "ideal_ms": ideal * 1e3,
        "ratio_vs_ideal": step_ours / ideal,
        "torch_ratio_vs_ideal": step_torch / ideal,
        "bubble_measured": per_rank[:, 2].tolist(),
        "bubble_theory": (world - 1) / (m * v + world - 1),
        "bubble_theory_measured_loads": (1 - busy / span).tolist(),
        "peak_saved_activation_bytes": per_rank[:, 3].tolist(),
    }


def worker(argv=None) -> None:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from paratrain.runtime import process

    p = argparse.ArgumentParser()
    add_options(p)
    args = p.parse_args(argv)
    rt = process.init("cpu")
    world, rank = rt.world_size, rt.rank
    m, rows = args.microbatches, args.rows
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m * rows, args.width, generator=g)
    y = torch.randn(m * rows, args.width, generator=g)
    torch_classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}

    results = [
        row
        for schedule in args.schedules.split(",")
        if (row := compare_schedule(schedule, args, rt, x, y, torch_classes)) is not None
    ]

    tp_result = tensor_parallel_bytes(rt, world)
    if rank == 0:
        report(results, tp_result, args, world)
    process.shutdown(together=True)


def tensor_parallel_bytes(rt, world: int) -> dict:
    """Per-rank parameter bytes of the built-in gpt (d_model 128, 4 layers) at tp = world."""
    from paratrain import config as config_mod
    from paratrain.models.gpt import gpt
    from paratrain.optim import cross_entropy
    from paratrain.parallel.hybrid.engine import ModelParallel

    torch.manual_seed(0)
    full = gpt(vocab_size=96, n_layer=4, n_head=4, d_model=128, block_size=64)
    full_bytes = sum(t.numel() * t.element_size() for t in full.parameters())
    cfg = config_mod.from_dict({"data": {"batch_size": 8}, "parallel": {"strategy": "tp", "tp": world}})
    tp = ModelParallel(full, cross_entropy, cfg, rt)
    mine = torch.tensor([float(sum(t.numel() * t.element_size() for t in tp.params))], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    per_rank = [t.item() for t in gathered]
    return {
        "tp": world,
        "full_bytes": full_bytes,
        "per_rank_bytes": per_rank,
        "per_rank_fraction": [b / full_bytes for b in per_rank],
    }


def report(results: list[dict], tp: dict, args, world: int) -> None:
    print(
        f"pipeline benchmark: {args.layers} x Linear({args.width}, {args.width})+GELU, {world} stages, "
        f"{args.microbatches} microbatches of {args.rows} rows, gloo; medians of "
        f"{args.rounds * args.steps} interleaved steps per engine"
    )
    head = (
        f"{'schedule':<12}{'ours ms':>9}{'torch ms':>10}{'ours/torch':>11}{'ideal ms':>10}{'ours/ideal':>11}"
        f"{'torch/ideal':>12}{'bubble (per stage)':>22}{'theory':>8}{'at measured loads':>20}{'peak act MiB':>15}"
    )
    print(head)
    for r in results:
        bubble = " ".join(f"{b * 100:.1f}%" for b in r["bubble_measured"])
        memory = " ".join(f"{b / 2**20:.1f}" for b in r["peak_saved_activation_bytes"])
        loads = " ".join(f"{b * 100:.1f}%" for b in r["bubble_theory_measured_loads"])
        print(
            f"{r['schedule']:<12}{r['paratrain_step_ms']:>9.1f}{r['torch_step_ms']:>10.1f}{r['ratio_vs_torch']:>11.2f}"
            f"{r['ideal_ms']:>10.1f}{r['ratio_vs_ideal']:>11.2f}{r['torch_ratio_vs_ideal']:>12.2f}"
            f"{bubble:>22}{r['bubble_theory'] * 100:>7.1f}%{loads:>20}{memory:>15}"
        )
    fractions = " ".join(f"{f:.3f}" for f in tp["per_rank_fraction"])
    print(
        f"tensor parallel gpt (4 layers, d_model 128, vocab 96) at tp {tp['tp']}: "
        f"{tp['full_bytes'] / 2**20:.2f} MiB of parameters, per rank {fractions} of it (1/tp = {1 / tp['tp']:.3f})"
    )
    out = {"benchmark": "pipeline", "world_size": world, "schedules": results, "tensor_parallel": tp}
    emit_json(out, args.json)


if __name__ == "__main__":
    from paratrain.runtime import process

    worker()
    process.leave()
