"""`paratrain bench federated`: paratrain's federated strategy against Flower's Ray simulation on
one task, side by side: digits, an MLP 64-128-10, 100 Dirichlet(0.3) clients, 10 per round, 10
local SGD steps of 16 at lr 0.1, 50 rounds, the global model evaluated on the validation split
after every round.

Both start from the same initial weights and the same partition (ours, handed to Flower in an .npz,
so only the contenders differ; each samples its own clients). Ours runs twice, without and with
secure aggregation. Flower runs in its own venv (`make bench-federated` creates .venv-flower with
flwr[simulation]); without it, the table has our side only.

Measures: validation accuracy per round; seconds per round (median, from the evaluated rounds'
end times, so both include one evaluation); time to the target accuracy from the first round's
start; total wall time (process start to exit, Ray's start
included for Flower); peak memory (the largest sum of RSS over the process tree, sampled every
0.1 s); bytes per round between server and clients (ours).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from paratrain.bench.common import COUNT, POSITIVE
from paratrain.errors import note

FLOWER_SCRIPT = Path(__file__).with_name("flower_federated.py")


def add_parser(which) -> None:
    p = which.add_parser("federated", help="federated rounds: paratrain vs Flower's simulation")
    p.add_argument("--rounds", type=COUNT, default=50)
    p.add_argument("--clients", type=COUNT, default=100)
    p.add_argument("--per-round", type=COUNT, default=10)
    p.add_argument("--local-steps", type=COUNT, default=10)
    p.add_argument("--batch", type=COUNT, default=16)
    p.add_argument("--lr", type=POSITIVE, default=0.1)
    p.add_argument("--alpha", type=POSITIVE, default=0.3)
    p.add_argument(
        "--min-samples",
        type=COUNT,
        default=2,
        help="Dirichlet(0.3) over 100 clients leaves the smallest with 2 digits (seed 0)",
    )
    p.add_argument("--nproc", type=COUNT, default=3, help="our processes: 1 server + nproc-1 client workers")
    p.add_argument("--target", type=float, default=0.90, help="accuracy for the time-to-accuracy column")
    p.add_argument("--flower-python", default=".venv-flower/bin/python")
    p.add_argument("--out", default=None, help="also write the Markdown table to this file")
    p.set_defaults(func=run)


def tree_rss(root: int) -> int:
    """Bytes resident in `root` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)
        rss[pid] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total


def run_measured(cmd: list[str], env: dict) -> tuple[float, int, subprocess.CompletedProcess]:
    """(wall seconds, peak tree RSS bytes, the finished process)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    return time.perf_counter() - t0, peak[0], subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def write_config(args, path: Path, secure: bool) -> None:
    path.write_text(f"""name = "bench-federated"
[model]
factory = "mlp"
hidden = {128}
n_layers = 1
[data]
factory = "digits"
batch_size = {args.batch}
[train]
steps = {args.rounds}
optimizer = "sgd"
lr = {args.lr}
eval_every = 1
[parallel]
strategy = "federated"
[federated]
clients = {args.clients}
clients_per_round = {args.per_round}
local_steps = {args.local_steps}
partition = "dirichlet"
alpha = {args.alpha}
min_samples = {args.min_samples}
secure_aggregation = {"true" if secure else "false"}
""")


def run_ours(args, tmp: Path, secure: bool) -> dict:
    cfg = tmp / f"ours-{secure}.toml"
    write_config(args, cfg, secure)
    run_dir = tmp / f"run-{secure}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    wall, peak, proc = run_measured(
        [sys.executable, "-m", "paratrain.cli", "run", str(cfg), "--nproc", str(args.nproc), "--run-dir", str(run_dir)],
        env,
    )
    if proc.returncode:
        raise SystemExit(f"paratrain: error: our federated run failed:\n{proc.stderr[-2000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "accuracy": [m["val_acc"] for m in lines],
        "elapsed": [m["time"] for m in lines],
        "wall_s": wall,
        "peak_bytes": peak,
        "bytes_per_round": statistics.mean(m["bytes_up"] + m["bytes_down"] for m in lines),
    }


def write_task(args, path: Path) -> None:
    """Our digits split, partition and initial weights, for Flower (an .npz of plain arrays)."""
    import numpy as np
    from torch.utils.data import TensorDataset

    from paratrain import preflight
    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.parallel.federated.partition import deal_clients
    from paratrain.runtime import process

    cfg_path = path.with_suffix(".toml")
    write_config(args, cfg_path, False)
    cfg = preflight.load(cfg_path)
    train, val = build_dataset(cfg, "train"), build_dataset(cfg, "val")
    assert isinstance(train, TensorDataset) and isinstance(val, TensorDataset)  # digits: both in memory
    parts, _ = deal_clients(cfg, train)
    process.seed_everything(cfg.train.seed)  # the trainer's initial weights
    params = [p.detach().numpy() for p in build_model(cfg, train).parameters()]
    arrays: dict[str, Any] = {
        "x_train": train.tensors[0].numpy(),
        "y_train": train.tensors[1].numpy(),
        "x_val": val.tensors[0].numpy(),
        "y_val": val.tensors[1].numpy(),
        "clients": np.array(len(parts)),
        "tensors": np.array(len(params)),
    }
    arrays.update({f"part_{c}": p for c, p in enumerate(parts)})
    arrays.update({f"w{i}": w for i, w in enumerate(params)})
    np.savez(path, **arrays)


def run_flower(args, tmp: Path) -> dict | None:
    if not Path(args.flower_python).is_file():
        note(f"{args.flower_python} not found (make bench-federated creates it): our side only")
        return None
    task, out = tmp / "task.npz", tmp / "flower.json"
    write_task(args, task)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_DISABLE_USAGE_STATS": "1"}
    wall, peak, proc = run_measured(
        [
            args.flower_python,
            str(FLOWER_SCRIPT),
            str(task),
            str(args.rounds),
            str(args.per_round),
            str(args.local_steps),
            str(args.batch),
            str(args.lr),
            str(out),
        ],
        env,
    )
    if proc.returncode or not out.is_file():
        raise SystemExit(f"paratrain: error: the Flower run failed:\n{proc.stderr[-2000:]}")
    result = json.loads(out.read_text())
    return {**result, "wall_s": wall, "peak_bytes": peak}


def first_at(accuracy: list[float], target: float) -> int | None:
    return next((i + 1 for i, a in enumerate(accuracy) if a >= target), None)


def round_seconds(r: dict) -> list[float]:
    return [b - a for a, b in zip([0.0] + r["elapsed"], r["elapsed"])]


def table(results: dict[str, dict], target: float) -> str:
    rows = [
        f"| contender | s/round mean | s/round median | rounds to acc >= {target} | time to it | acc @ last round | "
        "best acc | wall | peak RSS (tree) | bytes/round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = results.get("flower")
    for name, r in results.items():
        mean, median = statistics.mean(round_seconds(r)), statistics.median(round_seconds(r))
        reach = first_at(r["accuracy"], target)
        to_target = r["elapsed"][reach - 1] if reach else None
        traffic = f"{r['bytes_per_round'] / 1e6:.2f} MB" if "bytes_per_round" in r else "-"
        ours = base and name != "flower"
        mean_ratio = f" ({statistics.mean(round_seconds(base)) / mean:.1f}x)" if base and ours else ""
        median_ratio = f" ({statistics.median(round_seconds(base)) / median:.1f}x)" if base and ours else ""
        rows.append(
            f"| {name} | {mean:.3f}{mean_ratio} | {median:.3f}{median_ratio} | {reach or '-'} | "
            f"{f'{to_target:.1f} s' if to_target else '-'} | {r['accuracy'][-1]:.3f} | {max(r['accuracy']):.3f} | "
            f"{r['wall_s']:.1f} s | {r['peak_bytes'] / 2**20:.0f} MiB | "
            f"{traffic} |"
        )
    acc = ["", "accuracy per round:", ""] + [
        f"- {name}: " + " ".join(f"{a:.2f}" for a in r["accuracy"]) for name, r in results.items()
    ]
    return "\n".join(rows + acc)


def run(args) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-federated-") as tmp_name:
        tmp = Path(tmp_name)
        results = {}
        flower = run_flower(args, tmp)
        if flower:
            results["flower"] = flower
        results["paratrain"] = run_ours(args, tmp, secure=False)
        results["paratrain + secagg"] = run_ours(args, tmp, secure=True)
    text = table(results, args.target)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0
