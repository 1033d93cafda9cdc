"""`paratrain bench plan`: the planner's predictions against runs measured on this machine.

Each layout (a small gpt and an mlp over dp, zero1-3, bf16 on the wire, tp, pp with each schedule,
and hybrids, on 1-4 processes) is run for real with `paratrain run` and planned with
`paratrain plan --cluster` on the cluster file `paratrain plan --calibrate` writes (made first
unless `--cluster` names one). Measured:
  * step time: the ranks' mean training step as the profiler times it (profile.jsonl), the
    median over the steps after the first SETUP_STEPS (one-time set-up); with --repeats N the
    fastest of N runs (as timeit reports its best: what the others lose is other processes');
  * memory: the peak of tensor bytes allocated in a step on the run's largest rank
    (train.track_memory: torch.cuda.max_memory_allocated's meaning, counted on the CPU from
    torch's profiler): what the model, its state, its activations and every transient of a step
    hold (see measured_peak_mib).
The table puts both beside the predictions; MAE is the mean relative error, Kendall's tau the
agreement of the two rankings by step time, and the pick's ratio how much slower the layout the
planner predicts fastest ran than the fastest measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from paratrain.bench.common import COUNT, add_json_option
from paratrain.errors import error
from paratrain.runtime.machine import emit_json

GPT = """
[model]
factory = "gpt"
n_layer = {layers}
n_head = 4
d_model = {width}
block_size = {block}
[data]
factory = "corpus"
block_size = {block}
batch_size = {batch}
shuffle = false
max_chars = 200000
[train]
optimizer = "adamw"
"""

MLP = """
[model]
factory = "mlp"
hidden = {width}
n_layers = {layers}
[parallel]
tp_plan = {{ "0" = "colwise", "2" = "rowwise", "4" = "colwise", "6" = "rowwise" }}
[data]
factory = "digits"
batch_size = 64
shuffle = false
[train]
optimizer = "adamw"
"""

MODELS = {
    "gpt": (GPT, {"layers": 2, "width": 128, "block": 32, "batch": 16}),
    "mlp": (MLP, {"layers": 4, "width": 512}),
    # a second size of gpt: the time model holds at more than the sizes it was tuned on
    "gpt256": (GPT, {"layers": 4, "width": 256, "block": 64, "batch": 32}),
}
# the larger gpt's layouts: 2 processes, each strategy (the time a run of it takes here)
SECOND_SIZE = {"gpt256": ("x2 dp", "x2 zero3", "x2 tp 2", "x2 pp 2 1f1b")}

SETUP_STEPS = 5  # a run's first steps set up kernels and buffers (the 4th, here, up to 25x a step)
MEMORY_STEPS = 4  # the optimizer's state exists from the first step on: the later ones are the steady peak
PIPE = ["parallel.microbatches=4", "parallel.balance='params'"]
# (processes, [parallel] settings); the gpt and the mlp each run every one
LAYOUTS = [
    (1, ["parallel.strategy='dp'"]),
    (2, ["parallel.strategy='dp'"]),
    (2, ["parallel.strategy='dp'", "parallel.compression='bf16'"]),
    (2, ["parallel.strategy='zero1'"]),
    (2, ["parallel.strategy='zero2'"]),
    (2, ["parallel.strategy='zero3'"]),
    (2, ["parallel.strategy='tp'", "parallel.tp=2"]),
    (2, ["parallel.strategy='pp'", "parallel.pp=2", "parallel.schedule='gpipe'", *PIPE]),
    (2, ["parallel.strategy='pp'", "parallel.pp=2", "parallel.schedule='1f1b'", *PIPE]),
    (2, ["parallel.strategy='pp'", "parallel.pp=2", "parallel.schedule='interleaved'", *PIPE]),
    (4, ["parallel.strategy='dp'"]),
    (4, ["parallel.strategy='zero2'"]),
    (4, ["parallel.strategy='zero3'"]),
    (4, ["parallel.strategy='hybrid'", "parallel.tp=2"]),
    (4, ["parallel.strategy='hybrid'", "parallel.pp=2", "parallel.schedule='1f1b'", *PIPE]),
    (4, ["parallel.strategy='hybrid'", "parallel.tp=2", "parallel.pp=2", "parallel.schedule='1f1b'", *PIPE]),
    (4, ["parallel.strategy='pp'", "parallel.pp=4", "parallel.schedule='1f1b'", *PIPE]),
]


def add_parser(which) -> None:
    p = which.add_parser("plan", help="the planner's predicted step time and memory against measured runs here")
    p.add_argument(
        "--cluster", default=None, metavar="FILE", help="a calibrated cluster file (default: calibrate first)"
    )
    p.add_argument(
        "--steps", type=COUNT, default=16, help=f"steps per run (default 16; the first {SETUP_STEPS} are set-up)"
    )
    p.add_argument("--repeats", type=COUNT, default=1, help="timed runs per layout, the fastest taken (default 1)")
    p.add_argument(
        "--models",
        default="gpt,mlp,gpt256",
        help="comma-separated: gpt, mlp, gpt256 (d_model 256, 4 layers, sequence 64, batch 32: its 2-process dp, zero3, "
        "tp and pp 1f1b); default all",
    )
    p.add_argument(
        "--only",
        default="",
        metavar="TEXT,...",
        help="run only the layouts whose label holds one of these (e.g. 'x4,pp')",
    )
    add_json_option(p)
    p.set_defaults(func=run)


def label(model: str, nproc: int, sets: list[str]) -> str:
    shown = [
        s.split("=", 1)[1].strip("'")
        for s in sets
        if s.split("=")[0] not in ("parallel.microbatches", "parallel.balance")
    ]
    return f"{model} x{nproc} " + " ".join(shown)


def run_job(config: Path, nproc: int, sets: list[str], run_dir: Path, steps: int) -> None:
    """`paratrain run` to the end (RuntimeError with its last line of stderr if it fails)."""
    argv = [sys.executable, "-m", "paratrain.cli", "run", str(config), "--nproc", str(nproc), "--run-dir", str(run_dir)]
    for s in [*sets, f"train.steps={steps}", "train.log_every=4"]:
        argv += ["--set", s]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            proc.wait()
        finally:  # interrupted: its workers go with it (the launcher ends them on SIGTERM)
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
        if proc.returncode:
            err.seek(0)
            lines = err.read().strip().splitlines()
            raise RuntimeError(lines[-1] if lines else f"exit {proc.returncode}")


def measured_peak_mib(config: Path, nproc: int, sets: list[str], run_dir: Path) -> float:
    """The peak MiB of tensors allocated in a step on the largest rank, from a run of MEMORY_STEPS
    steps with train.track_memory apart from the timed run (the CPU's memory tracking slows every
    op): per rank the least of its steps after the first. Those steps allocate alike; one counted
    higher holds a buffer that a gloo thread freed, a free the CPU's count sees only at the step's
    end (profile.MemoryTracker)."""
    run_job(config, nproc, [*sets, "train.track_memory=true"], run_dir, MEMORY_STEPS)
    return steady_peak_mib(run_dir)


def steady_peak_mib(run_dir: Path) -> float:
    """From a run's profile.jsonl: the largest rank's least peak over its steps after the first."""
    steps = [json.loads(line)["ranks"] for line in (run_dir / "profile.jsonl").read_text().splitlines()][1:]
    per_rank = zip(*[[r["peak_memory_bytes"] for r in ranks] for ranks in steps])
    return max(min(peaks) for peaks in per_rank) / 2**20


def predict_layout(config: Path, nproc: int, sets: list[str], cluster) -> dict:
    import torch

    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.plan.planner import make_plan
    from paratrain.preflight import load

    cfg = load(str(config), sets)
    with torch.device("meta"):
        model = build_model(cfg, build_dataset(cfg, "train"))
    plan = make_plan(cfg, model, nproc, 1, "cpu", shared_by(cluster, nproc))
    return {**plan["predicted"], "breakdown": plan["step_breakdown"]}


def shared_by(cluster, nproc: int):
    """The calibrated machine run by `nproc` processes instead of the calibration's: its cores
    shared out (the launcher gives each process cores // nproc threads, at least one), so each
    process computes at its share of the cores (taken to scale with threads) and of the memory
    bandwidth, and dispatches its ops on one thread that shares a core once processes outnumber
    cores."""
    import dataclasses

    cores, calibrated = os.cpu_count() or 1, cluster.devices_per_node
    d = cluster.device
    device = dataclasses.replace(
        d,
        peak_tflops=d.peak_tflops * calibrated / nproc,
        hbm_GBps=d.hbm_GBps * calibrated / nproc,
        op_overhead_us=d.op_overhead_us * max(1.0, nproc / cores) / max(1.0, calibrated / cores),
        cpu_contention=d.cpu_contention if nproc == calibrated else 1.0,  # measured for one count only
    )
    return dataclasses.replace(cluster, nodes=1, devices_per_node=nproc, device=device)


def steps_after_setup(run_dir: Path) -> list[dict]:
    """A run's profile.jsonl records of the steps after the set-up steps."""
    steps = [json.loads(line) for line in (run_dir / "profile.jsonl").read_text().splitlines()]
    return [s for s in steps if s["step"] > SETUP_STEPS]


def median_step_s(run_dir: Path) -> float:
    """The median, over the steps after the set-up steps (one-time kernel and allocator set-up),
    of the ranks' mean step as the profiler timed it (profile.jsonl): the training step itself,
    without the log points between steps (a gather of every rank's records and two file writes,
    which cost more than a small model's step; a run logs every train.log_every steps).

    The ranks' mean, not the slowest rank's: each rank's steps follow each other without a gap,
    so over a run every rank takes the same time a step; a step one rank is late to is long on
    the others, which wait for it, and the next is short on them (measured here: 17.5 and 22.0 ms,
    then 20.0 and 16.5): the slowest of each step counts that skew twice, the mean as the run
    pays it. On a shared machine a median over steps holds still where a mean takes every other
    process's burst in."""
    import statistics

    return statistics.median(statistics.mean(r["step_s"] for r in s["ranks"]) for s in steps_after_setup(run_dir))


def measured_phases(run_dir: Path) -> dict[str, float]:
    """Where a step's time went on the rank whose step took longest (profile.jsonl): the median
    seconds of each phase over the steps after set-up, beside the predicted breakdown."""
    import statistics

    steps = steps_after_setup(run_dir)
    slowest = max(range(steps[0]["world"]), key=lambda r: statistics.median(s["ranks"][r]["step_s"] for s in steps))
    return {
        phase: statistics.median(s["ranks"][slowest]["phases"][phase] for s in steps)
        for phase in steps[0]["ranks"][slowest]["phases"]
    }


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-a: (concordant - discordant pairs) / all pairs."""
    n, score = len(xs), 0
    for i in range(n):
        for j in range(i + 1, n):
            a, b = xs[i] - xs[j], ys[i] - ys[j]
            score += (a * b > 0) - (a * b < 0)
    return score / (n * (n - 1) / 2)


def run(args) -> int:
    from paratrain.cost.cluster import load_cluster
    from paratrain.errors import ConfigError
    from paratrain.plan.calibrate import calibrate
    from paratrain.trainer import train

    tmp = Path(tempfile.mkdtemp(prefix="paratrain-bench-plan-"))
    # the machine as each process count uses it (one process: two's, shared out by `shared_by`)
    counts = sorted({max(2, nproc) for nproc, _ in LAYOUTS})
    try:
        if args.cluster:
            clusters = dict.fromkeys(counts, load_cluster(args.cluster))
        else:
            clusters = {n: calibrate(str(tmp / f"cluster-{n}.toml"), n, keep=False, train=train) for n in counts}
    except ConfigError as exc:
        error(f"{exc}")
        return 2
    for n, cluster in clusters.items():
        print(f"cluster: {args.cluster or f'calibrated now for {n} processes'}: {cluster.device}", flush=True)
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    print("| layout | predicted step s | measured step s | error | predicted MiB | measured MiB | error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for model in args.models.split(","):
        text, sizes = MODELS[model]
        config = tmp / f"{model}.toml"
        config.write_text(text.format(**sizes))
        for n, (nproc, sets) in enumerate(LAYOUTS):
            name = label(model, nproc, sets)
            if args.only and not any(part in name for part in args.only.split(",")):
                continue
            if model in SECOND_SIZE and name not in [f"{model} {which}" for which in SECOND_SIZE[model]]:
                continue
            try:
                runs = []
                for attempt in range(args.repeats):
                    run_dir = tmp / f"{model}-{n}-{attempt}"
                    run_job(config, nproc, sets, run_dir, args.steps)
                    runs.append((median_step_s(run_dir), run_dir))
                measured_step, run_dir = min(runs)
                measured_mib = measured_peak_mib(config, nproc, sets, tmp / f"{model}-{n}-memory")
                predicted = predict_layout(config, nproc, sets, clusters[max(2, nproc)])
            except (RuntimeError, ConfigError) as exc:
                print(f"| {name} | skipped: {exc} |||||| ", flush=True)
                continue
            row = {
                "layout": name,
                "model": model,
                "nproc": nproc,
                "sets": sets,
                "predicted_step_s": predicted["step_s"],
                "measured_step_s": measured_step,
                "predicted_mib": predicted["peak_memory_gib"] * 1024,
                "measured_mib": measured_mib,
            }
            row["predicted_breakdown"] = predicted["breakdown"]
            row["measured_phases"] = measured_phases(run_dir)
            row["step_error"] = row["predicted_step_s"] / measured_step - 1
            row["memory_error"] = row["predicted_mib"] / measured_mib - 1 if measured_mib > 0 else float("nan")
            rows.append(row)
            print(
                f"| {name} | {row['predicted_step_s']:.4f} | {measured_step:.4f} | {row['step_error']:+.1%} | "
                f"{row['predicted_mib']:.1f} | {measured_mib:.1f} | {row['memory_error']:+.1%} |",
                flush=True,
            )
    if not rows:
        return 1
    step_mae = sum(abs(r["step_error"]) for r in rows) / len(rows)
    by_model = {
        m: [abs(r["step_error"]) for r in rows if r["model"] == m] for m in dict.fromkeys(r["model"] for r in rows)
    }
    for m, errors in by_model.items():
        print(f"{m}: {len(errors)} layouts, step-time MAE {sum(errors) / len(errors):.1%}, worst {max(errors):.1%}")
    memory_mae = sum(abs(r["memory_error"]) for r in rows) / len(rows)
    tau = kendall_tau([r["predicted_step_s"] for r in rows], [r["measured_step_s"] for r in rows])
    pick = min(rows, key=lambda r: r["predicted_step_s"])
    fastest = min(rows, key=lambda r: r["measured_step_s"])
    pick_ratio = pick["measured_step_s"] / fastest["measured_step_s"]
    print(
        f"\n{len(rows)} layouts: step-time MAE {step_mae:.1%}, peak-memory MAE {memory_mae:.1%}, "
        f"Kendall tau {tau:.3f}; the planner's pick ({pick['layout']}) measured {pick_ratio:.2f}x the "
        f"fastest ({fastest['layout']}); load average at the end {os.getloadavg()[0]:.2f}"
    )
    emit_json(
        {
            "rows": rows,
            "step_mae": step_mae,
            "step_mae_by_model": {m: sum(e) / len(e) for m, e in by_model.items()},
            "memory_mae": memory_mae,
            "kendall_tau": tau,
            "pick_over_fastest": pick_ratio,
            "clusters": {n: str(c) for n, c in clusters.items()},
        },
        args.json,
    )
    return 0
