"""`paratrain bench suite`: where the time goes and what compression buys, ours beside torch's.

One run measures, in the same worker processes, interleaved in rounds (same machine noise for all):
  (a) paratrain dp against torch DDP;
  (b) each gradient compression against torch's equivalent DDP comm hook (bf16/fp16_compress_hook,
      powerSGD_hook at the same rank; top-k has no torch hook): step time, bytes each rank really
      sent per step (socket writes, /proc/self/io, plus payloads copied into a peer's shared-memory
      ring), and the loss after the same steps;
  (c) scaling: samples/s at 1, 2 and 4 processes (one thread each) and the scaling efficiency;
  (d) the backend's all-reduce bus bandwidth (nccl-tests' definition: 2(N-1)/N x size / time),
      the ceiling every figure above sits under;
  plus the profiler's own cost per step, and, for each of our codecs, the steps and time it takes
  to reach dp's loss (lossy codecs need more steps; "faster at equal loss" counts them).

Settings: loopback (this machine, gloo over 127.0.0.1), or `--slow-link 1gbit`: two hosts in
network namespaces joined by a veth pair that tc shapes to that rate (paratrain.testing.netns; skipped with
the reason where namespaces cannot be made), one worker per host.

Model and data: bench/dp.py's MLP (9.5M parameters by default), SGD with momentum on a fresh batch of
teacher-labelled random inputs every step, so the loss falls and "equal loss" can be checked. Every engine,
torch's included, steps with the optimizer paratrain builds (optim.build_optimizer: torch's fused
SGD), so the comparison is about communication.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..profile import bytes_sent, open_proc_io
from .common import COUNT, POSITIVE, emit_json, fraction, one_or_more_of
from .dp import add_options as dp_options
from .dp import build
from .suite_plot import plot

SCALING_DEFAULT = "1,2,4"
CODECS = ["bf16", "fp16", "topk", "powersgd"]


def add_parser(which) -> None:
    p = which.add_parser("suite", help="dp vs DDP, compression vs torch's hooks, scaling, bus bandwidth (table + PNG)")
    add_options(p)
    p.add_argument("--nproc", type=COUNT, default=2, help="processes for (a), (b), (d) (split over the hosts)")
    p.add_argument("--scaling", default=SCALING_DEFAULT, help="process counts for (c); empty to skip")
    p.add_argument(
        "--slow-link",
        default=None,
        metavar="RATE",
        help="run across two network namespaces joined by a veth pair shaped to RATE (e.g. 1gbit)",
    )
    p.add_argument(
        "--png", default=None, metavar="PATH", help="write the plots here (default: bench-suite-SETTING.png)"
    )
    p.set_defaults(func=run)


def add_options(p) -> None:
    dp_options(p)  # the dp benchmark's model and timing knobs, more rounds of fewer steps
    p.set_defaults(steps=5, rounds=6)
    p.add_argument("--lr", type=POSITIVE, default=0.02)
    # r8, from the README's sweep: r4 and r8 cost the same per step and r16 more; r8 lagged dp least
    # for its cost (4 steps at step 100 on a 32-batch pool; 2 at step 200 on fresh batches, as r4)
    p.add_argument("--powersgd-rank", type=COUNT, default=8)
    p.add_argument("--topk-ratio", type=fraction, default=0.01)
    p.add_argument(
        "--codecs",
        type=one_or_more_of(CODECS),
        default=",".join(CODECS),
        help="the compressions to measure in (b), each beside its torch hook",
    )
    p.add_argument(
        "--equal-loss-steps",
        type=COUNT,
        default=200,
        help="dp's steps (its timed ones included) whose loss every codec must reach, in up to twice as many",
    )


def _model_argv(args) -> list[str]:
    keys = (
        "steps",
        "rounds",
        "warmup",
        "batch",
        "hidden",
        "layers",
        "in_features",
        "bucket_mb",
        "lr",
        "powersgd_rank",
        "topk_ratio",
        "equal_loss_steps",
        "codecs",
    )
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]


# -- the parent: launches, collects, prints ---------------------------------------------------------
class Launcher:
    """Starts a group of bench workers on this machine, or split over two namespaced hosts."""

    def __init__(self, hosts=None):
        self.hosts = hosts
        self.port = 29611

    def run(self, mode: str, argv: list[str], nproc: int, out: Path) -> dict:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # one core per process
        worker = [mode, *argv, f"--out={out}"]
        agent = [sys.executable, "-m", "paratrain.bench.suite", "agent"]
        if self.hosts is None or nproc == 1:
            cmd = agent + [f"--nproc={nproc}", "--", *worker]
            procs = [
                self.hosts.popen(0, cmd, env=self.hosts.env(0, env)) if self.hosts else subprocess.Popen(cmd, env=env)
            ]
        else:
            if nproc % 2:
                raise ValueError(f"{nproc} processes do not split over two hosts")
            self.port += 1
            rdzv = f"{self.hosts.addr(0)}:{self.port}"
            procs = [
                self.hosts.popen(
                    node,
                    agent
                    + [f"--nproc={nproc // 2}", "--nnodes=2", f"--node-rank={node}", f"--rdzv={rdzv}", "--", *worker],
                    env=self.hosts.env(node, env),
                )
                for node in (0, 1)
            ]
        try:
            codes = [p.wait(timeout=900) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes) or not out.is_file():
            raise RuntimeError(f"bench workers ({mode}, {nproc} processes) failed with exit codes {codes}")
        return json.loads(out.read_text())


def run(args) -> int:
    if args.slow_link:
        from ..testing import netns

        ok, why = netns.available()
        if not ok:
            print(f"bench suite: slow-link setting skipped: {why}")
            return 0
        with netns.TwoHosts(rate=args.slow_link) as hosts:
            return _run(args, Launcher(hosts), f"slow link ({args.slow_link} veth between two network namespaces)")
    return _run(args, Launcher(), "loopback (one machine, gloo over 127.0.0.1)")


def _run(args, launcher: Launcher, setting: str) -> int:
    scaling = [int(n) for n in args.scaling.split(",") if n.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            result = launcher.run("engines", _model_argv(args), args.nproc, Path(tmp) / "engines.json")
            result["scaling"] = [
                launcher.run("scaling", _model_argv(args), n, Path(tmp) / f"scaling-{n}.json") for n in scaling
            ]
        except (RuntimeError, ValueError) as exc:
            print(f"paratrain: error: benchmark failed: {exc}", file=sys.stderr)
            return 1
    result["setting"] = setting
    base = result["scaling"][0]["engines"] if result["scaling"] and result["scaling"][0]["world_size"] == 1 else None
    for row in result["scaling"]:
        for name, e in row["engines"].items():
            if base and name in base:
                e["efficiency"] = e["samples_per_s"] / (row["world_size"] * base[name]["samples_per_s"])
    print_tables(result)
    png = Path(args.png or f"bench-suite-{'slow-link' if args.slow_link else 'loopback'}.png")
    plot(result, png)
    print(f"plots: {png}")
    emit_json(result, args.json)
    return 0


def print_tables(r: dict) -> None:
    w = r["world_size"]
    print(
        f"bench suite, {r['setting']}: {r['parameters'] / 1e6:.1f}M-parameter MLP, {w} processes, "
        f"{r['samples_per_rank']} samples/rank, median of {r['timed_steps']} interleaved steps per engine"
    )
    bw = r["bus_bandwidth"]
    print(
        "(d) all-reduce bus bandwidth: "
        + ", ".join(f"{b['mib']:g} MiB {b['busbw_gbps']:.2f} GB/s" for b in bw)
        + f"  (peak {max(b['busbw_gbps'] for b in bw):.2f} GB/s)"
    )
    base = r["engines"]["paratrain dp"]["step_ms"]
    print(
        f"{'(a, b) engine':<26}{'step ms':>9}{'x dp':>7}{'MB sent':>9}{'loss':>8}   {'torch peer':<27}"
        f"{'step ms':>9}{'MB sent':>9}{'loss':>8}{'ours/torch':>11}"
    )
    for name, peer in r["pairs"]:
        e = r["engines"][name]
        left = (
            f"{name:<26}{e['step_ms']:>9.1f}{base / e['step_ms']:>7.2f}{e['mb_sent']:>9.2f}{e['final_loss']:>8.4f}   "
        )
        t = r["engines"].get(peer) if peer else None
        if t is None:
            right = f"{'(no torch equivalent)':<27}"
        elif "error" in t:
            right = f"{peer:<27}  n/a: {t['error'][:60]}"
        else:
            right = (
                f"{peer:<27}{t['step_ms']:>9.1f}{t['mb_sent']:>9.2f}{t['final_loss']:>8.4f}"
                f"{e['step_ms'] / t['step_ms']:>11.2f}"
            )
        print(left + right)
    eq = r.get("equal_loss")
    if eq:
        parts = []
        for name, e in eq["engines"].items():
            label = name.replace("paratrain ", "")
            parts.append(
                f"{label} {e['steps']} steps, {e['speedup_at_equal_loss']:.2f}x"
                if e["steps"]
                else f"{label} not within {eq['max_steps']} steps"
            )
        print(
            f"at equal loss: dp's loss {eq['dp_loss']:.4f} (mean over ranks and its last {eq['window']} steps) "
            f"after {eq['dp_steps']} steps; to reach it within {eq['tolerance']:.1%} (speed-up over dp in time): "
            + ", ".join(parts)
        )
    floor = r["engines"]["compute only"]
    print(
        f"{'compute only (no comm.)':<26}{floor['step_ms']:>9.1f}{base / floor['step_ms']:>7.2f}"
        f"{floor['mb_sent']:>9.2f}{'':>8}   (each rank's local gradients: the floor, not a valid training)"
    )
    ov = r["profiler_overhead"]
    print(
        f"profiler: {ov['instrumentation_us_per_step']:.1f} us of instrumentation per step "
        f"({ov['instrumentation_pct']:.3f} % of a dp step), flush {ov['flush_ms']:.2f} ms per log point; "
        f"A/B step time on/off {ov['ab_ratio']:.3f}"
    )
    if r.get("scaling"):
        names = list(r["scaling"][0]["engines"])
        print(f"(c) scaling ({r['samples_per_rank']} samples/rank, one thread per process):")
        print(f"{'processes':>10}" + "".join(f"{n + ' samples/s':>32}{'eff.':>7}" for n in names))
        for row in r["scaling"]:
            print(
                f"{row['world_size']:>10}"
                + "".join(
                    f"{row['engines'][n]['samples_per_s']:>32.1f}{row['engines'][n].get('efficiency', float('nan')):>7.2f}"
                    for n in names
                )
            )


# -- the workers ------------------------------------------------------------------------------------
class Engine:
    """One model replica trained by one engine; records step times, bytes sent and losses."""

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
    larger than the run gives, different per rank and the same for every engine (batch i of a rank
    comes from its own seed). A pool of batches cycled over was memorised: 8 batches by step 100,
    32 by step 200 (loss 0.04), where the lossy codecs could not keep up with dp's memorising."""

    def __init__(self, args, rank: int):
        self.teacher = torch.randn(args.in_features, 10, generator=torch.Generator().manual_seed(123))
        self.shape, self.rank = (args.batch, args.in_features), rank

    def __getitem__(self, i: int):
        x = torch.randn(*self.shape, generator=torch.Generator().manual_seed(1_000_003 * (1 + self.rank) + i))
        return x, (x @ self.teacher).argmax(1)


def _train_section(args) -> dict:
    """The optimizer every engine here uses (ours through its config, torch's peers directly)."""
    return {"optimizer": "sgd", "lr": args.lr, "momentum": 0.9}


def _ours(args, rt, compression: str):
    from .. import config as config_mod
    from ..optim import cross_entropy
    from ..parallel.data_parallel import DataParallel

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
    """The same step with no communication at all: the floor every engine sits above."""
    return _sgd_step(build(args), args)


def _sgd_step(model, args):
    """One plain training step of a module (a bare model or a DDP wrapper), returning the loss."""
    from .. import config as config_mod
    from ..optim import build_optimizer, cross_entropy

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
    from ..profile import NULL_PROFILER, Profiler

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
        plain = Engine(lambda x, y: ours.train_step((x, y)))
        with_prof = Engine(lambda x, y: ours.train_step((x, y)))
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


def _summary(engines: dict, world: int, batch: int) -> dict:
    """Per engine: median over steps of the slowest rank's step time, mean bytes, final loss."""
    out = {}
    for name, e in engines.items():
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
    `window` steps (single batches differ more than engines do). Collective."""
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    t /= world
    return [t[i - window : i].mean().item() for i in range(window, len(t) + 1)]


EQUAL_LOSS_TOLERANCE = 1e-3  # bf16's loss equals dp's to 4 digits but can sit a hair above it
EQUAL_LOSS_WINDOW = 32  # steps the loss is averaged over


def equal_loss(
    engines: dict, codecs: list[str], data, summary: dict, world: int, horizon: int, window: int = EQUAL_LOSS_WINDOW
) -> dict:
    """How many steps each codec needs to reach the loss dp reached after `horizon` steps, and what
    that makes its speed-up over dp at equal loss: (dp's steps x dp's step time) / (its steps x its
    step time). "Reached" is within EQUAL_LOSS_TOLERANCE. dp trains on from its timed steps to the
    horizon, the codecs up to twice it. Why a horizon of its own: a lossy codec with error feedback
    lags dp by a roughly constant number of steps, which the 33 timed steps would inflate. Collective."""
    dp = engines["paratrain dp"]
    dp.run(max(0, horizon - len(dp.losses)), data)
    window = min(window, len(dp.losses))  # a short run averages what it has
    dp_curve = _loss_curve(dp.losses, world, window)
    target = dp_curve[-1] * (1 + EQUAL_LOSS_TOLERANCE)
    dp_steps = next(i + window for i, loss in enumerate(dp_curve) if loss <= target)
    dp_ms = summary["paratrain dp"]["step_ms"]
    out = {
        "window": window,
        "dp_loss": dp_curve[-1],
        "tolerance": EQUAL_LOSS_TOLERANCE,
        "dp_steps": dp_steps,
        "max_steps": 2 * len(dp.losses),
        "engines": {},
    }
    for name in codecs:
        e = engines[name]
        if isinstance(e, str):
            continue
        e.run(2 * len(dp.losses) - len(e.losses), data)
        curve = _loss_curve(e.losses, world, window)
        steps = next((i + window for i, loss in enumerate(curve) if loss <= target), None)
        out["engines"][name] = {
            "steps": steps,
            "steps_vs_dp": steps / dp_steps if steps else None,
            "speedup_at_equal_loss": dp_steps * dp_ms / (steps * summary[name]["step_ms"]) if steps else None,
        }
    return out


def worker(argv=None) -> None:
    from .. import runtime

    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("engines", "scaling"))
    add_options(p)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rt = runtime.init("cpu", timeout_s=300)
    world = rt.world_size
    data = FreshBatches(args, rt.rank)
    torch.manual_seed(0)
    result = {"world_size": world, "samples_per_rank": args.batch}
    r = args.powersgd_rank
    if args.mode == "scaling":
        dp, dp_step = _ours(args, rt, "none")
        engines = {
            "paratrain dp": Engine(dp_step),
            f"paratrain powersgd r{r}": Engine(_ours(args, rt, "powersgd")[1]),
            "torch DDP": Engine(_ddp(args, None)),
        }
        rounds, steps = 3, args.steps
    else:
        dp, dp_step = _ours(args, rt, "none")
        engines = {
            "paratrain dp": Engine(dp_step),
            "torch DDP": Engine(_ddp(args, None)),
            "compute only": Engine(_compute_only(args)),
        }
        pct = f"{args.topk_ratio:.0%}" if args.topk_ratio >= 0.01 else f"{args.topk_ratio:g}"
        pairs = [("paratrain dp", "torch DDP")]
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
            engines[name] = Engine(_ours(args, rt, codec)[1])
            if hook:
                try:
                    engines[label] = Engine(_ddp(args, hook))
                except (RuntimeError, TypeError) as exc:  # e.g. torch's bf16 hook refuses gloo/CPU
                    engines[label] = str(exc).strip().splitlines()[0]
            pairs.append((name, label))
        result["pairs"] = pairs
        rounds, steps = args.rounds, args.steps
    for name, e in list(engines.items()):  # warm-up; an engine that cannot run here is reported, not fatal
        if isinstance(e, str):
            continue
        try:
            e.run(args.warmup, data)
        except RuntimeError as exc:
            engines[name] = str(exc).strip().splitlines()[0]
            dist.barrier()
    for e in engines.values():
        if not isinstance(e, str):
            e.times, e.sent = [], []
    for _ in range(rounds):
        for e in engines.values():
            if not isinstance(e, str):
                e.run(steps, data)
    result["timed_steps"] = rounds * steps
    result["engines"] = _summary(engines, world, args.batch)
    if args.mode == "engines":
        result["equal_loss"] = equal_loss(
            engines, [ours for ours, _ in pairs[1:]], data, result["engines"], world, args.equal_loss_steps
        )
        result["parameters"] = sum(p.numel() for p in dp.params)
        result["bus_bandwidth"] = bus_bandwidth(world)
        result["profiler_overhead"] = profiler_overhead(args, rt, dp, data)
    if rt.is_main:
        Path(args.out).write_text(json.dumps(result))
    runtime.shutdown(together=True)


def agent(argv) -> int:
    """One node's elastic agent for the bench workers (so the parent can start it inside a namespace)."""
    from ..launch import WorkerFailure, launch

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
            "paratrain.bench.suite",
            ["worker", *worker_argv],
            nproc=args.nproc,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv=args.rdzv,
            run_id="bench-suite",
        )
    except WorkerFailure as exc:
        print(f"paratrain: error: benchmark worker failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from .. import runtime

    if sys.argv[1] == "agent":
        sys.exit(agent(sys.argv[2:]))
    worker(sys.argv[2:])
    runtime.leave()
