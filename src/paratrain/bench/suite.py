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
teacher-labelled random inputs every step, so the loss falls and "equal loss" can be checked. Every contender,
torch's included, steps with the optimizer paratrain builds (optim.build_optimizer: torch's fused
SGD), so the comparison is about communication.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from paratrain.bench.common import COUNT, POSITIVE, fraction, one_or_more_of
from paratrain.bench.dp import add_options as dp_options
from paratrain.bench.suite_plot import plot
from paratrain.errors import error
from paratrain.runtime.machine import emit_json

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
        agent = [sys.executable, "-m", "paratrain.bench.suite_worker", "agent"]
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
        from paratrain.testing import netns

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
            result = launcher.run("contenders", _model_argv(args), args.nproc, Path(tmp) / "contenders.json")
            result["scaling"] = [
                launcher.run("scaling", _model_argv(args), n, Path(tmp) / f"scaling-{n}.json") for n in scaling
            ]
        except (RuntimeError, ValueError) as exc:
            error(f"benchmark failed: {exc}")
            return 1
    result["setting"] = setting
    base = result["scaling"][0]["contenders"] if result["scaling"] and result["scaling"][0]["world_size"] == 1 else None
    for row in result["scaling"]:
        for name, e in row["contenders"].items():
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
        f"{r['samples_per_rank']} samples/rank, median of {r['timed_steps']} interleaved steps per contender"
    )
    bw = r["bus_bandwidth"]
    print(
        "(d) all-reduce bus bandwidth: "
        + ", ".join(f"{b['mib']:g} MiB {b['busbw_gbps']:.2f} GB/s" for b in bw)
        + f"  (peak {max(b['busbw_gbps'] for b in bw):.2f} GB/s)"
    )
    base = r["contenders"]["paratrain dp"]["step_ms"]
    print(
        f"{'(a, b) contender':<26}{'step ms':>9}{'x dp':>7}{'MB sent':>9}{'loss':>8}   {'torch peer':<27}"
        f"{'step ms':>9}{'MB sent':>9}{'loss':>8}{'ours/torch':>11}"
    )
    for name, peer in r["pairs"]:
        e = r["contenders"][name]
        left = (
            f"{name:<26}{e['step_ms']:>9.1f}{base / e['step_ms']:>7.2f}{e['mb_sent']:>9.2f}{e['final_loss']:>8.4f}   "
        )
        t = r["contenders"].get(peer) if peer else None
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
        for name, e in eq["contenders"].items():
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
    floor = r["contenders"]["compute only"]
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
        names = list(r["scaling"][0]["contenders"])
        print(f"(c) scaling ({r['samples_per_rank']} samples/rank, one thread per process):")
        print(f"{'processes':>10}" + "".join(f"{n + ' samples/s':>32}{'eff.':>7}" for n in names))
        for row in r["scaling"]:
            print(
                f"{row['world_size']:>10}"
                + "".join(
                    f"{row['contenders'][n]['samples_per_s']:>32.1f}{row['contenders'][n].get('efficiency', float('nan')):>7.2f}"
                    for n in names
                )
            )
