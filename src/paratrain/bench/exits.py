"""`paratrain bench exits`: does a finished job exit 0, every time?

A job that trained and saved everything but whose process dies at exit (a C++ thread meeting the
interpreter's teardown: runtime/process.py, end_in_order_at_exit) is reported failed by torchrun,
Slurm or Kubernetes, at random. One run proves little; this runs the same short job many times in
a row through each door a user takes and counts the non-zero exits:
    torchrun   an own loop (the Python API) under plain `torchrun --standalone`
    launch     the same script under `paratrain launch`
    run        `paratrain run`: a small config per strategy, or (strategy `default`) the built-in
               default job, shortened to --default-steps steps
at world 2, for each strategy asked for. Each failure's last lines are printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paratrain.bench.common import COUNT, one_or_more_of
from paratrain.errors import say

ROUTES = ("torchrun", "launch", "run")
STRATEGIES = ("dp", "zero1", "zero2", "zero3", "tp", "pp", "default")

OWN_LOOP = """
import sys

import torch
from torch import nn

import paratrain
from paratrain.models.gpt import GPT

strategy = sys.argv[1]
keys = {"tp": 2} if strategy == "tp" else {"pp": 2, "microbatches": 2} if strategy == "pp" else {}
pt = paratrain.init(strategy=strategy, **keys)
torch.manual_seed(0)
if strategy == "tp":  # a model with a tp plan of its own
    model = GPT(16, n_layer=1, n_head=2, d_model=8, block_size=6)
    data = torch.utils.data.TensorDataset(torch.randint(16, (32, 6)), torch.randint(16, (32, 6)))
    loss_fn = lambda out, y: nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
else:
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    data = torch.utils.data.TensorDataset(torch.randn(32, 5), torch.randn(32, 3))
    loss_fn = nn.functional.mse_loss
model, optimizer = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.05), loss=loss_fn)
loader = pt.setup_dataloader(torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, drop_last=True))
for x, y in loader:
    if strategy == "pp":  # its schedule owns forward, backward and the optimizer's step
        pt.train_step((x, y))
        continue
    pt.backward(loss_fn(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
pt.export(sys.argv[2])
"""

RUN_CONFIG = """
name = "exits-{strategy}"
[model]
factory = "mlp"
hidden = 16
[data]
factory = "synthetic"
batch_size = 8
[train]
steps = 4
log_every = 2
[parallel]
strategy = "{strategy}"
{parallel_keys}
"""


def add_parser(which) -> None:
    p = which.add_parser("exits", help="a finished job exits 0: many short runs in a row through each door")
    p.add_argument("--runs", type=COUNT, default=50, help="runs per route and strategy")
    p.add_argument("--routes", type=one_or_more_of(ROUTES), default=",".join(ROUTES))
    p.add_argument(
        "--strategies",
        type=one_or_more_of(STRATEGIES),
        default="zero1,zero3",
        help=f"{', '.join(STRATEGIES)} (default: `paratrain run`'s default job; the run route only)",
    )
    p.add_argument("--default-steps", type=COUNT, default=20, help="train.steps of the default job's runs")
    p.set_defaults(func=run)


def commands(route: str, strategy: str, work: Path, default_steps: int) -> list[str] | None:
    """The command of one run, or None where the route has no such job."""
    paratrain = [sys.executable, "-m", "paratrain.cli"]
    script = str(work / "own_loop.py")
    if route == "torchrun" and strategy != "default":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            script,
            strategy,
            str(work / "out"),
        ]
    if route == "launch" and strategy != "default":
        return [*paratrain, "launch", "--nproc", "2", script, strategy, str(work / "out")]
    if route != "run":
        return None
    run_dir = ["--run-dir", str(work / f"run-{strategy}")]
    if strategy == "default":
        return [*paratrain, "run", "--nproc", "2", *run_dir, "--set", f"train.steps={default_steps}"]
    config = work / f"{strategy}.toml"
    return [*paratrain, "run", str(config), "--nproc", "2", *run_dir]


def write_jobs(work: Path) -> None:
    (work / "own_loop.py").write_text(OWN_LOOP)
    for strategy in STRATEGIES[:-1]:
        layout = {"tp": 'tp = 2\ntp_plan = { "0" = "colwise", "2" = "rowwise" }', "pp": "pp = 2\nmicrobatches = 2"}
        (work / f"{strategy}.toml").write_text(
            RUN_CONFIG.format(strategy=strategy, parallel_keys=layout.get(strategy, ""))
        )


def run(args) -> int:
    rows = []
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-exits-") as tmp:
        work = Path(tmp)
        write_jobs(work)
        for route in args.routes.split(","):
            for strategy in args.strategies.split(","):
                argv = commands(route, strategy, work, args.default_steps)
                if argv is None:
                    continue
                failed, start = 0, time.perf_counter()
                for i in range(args.runs):
                    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=work)
                    if proc.returncode != 0:
                        failed += 1
                        said = (proc.stdout + proc.stderr).strip().splitlines()
                        # the cause (an abort, a traceback's last line) before the launcher's summary
                        causes = [
                            line for line in said if any(w in line for w in ("terminate", "Error", "error:", "Signal"))
                        ]
                        tail = causes[:6] + said[-4:]
                        say(f"{route} {strategy} run {i + 1}: exit {proc.returncode}\n  " + "\n  ".join(tail))
                seconds = (time.perf_counter() - start) / args.runs
                rows.append((route, strategy, args.runs, failed, seconds))
                print(
                    f"{route:<9} {strategy:<8} runs {args.runs:>4}  non-zero exits {failed:>3}  {seconds:6.1f} s a run",
                    flush=True,
                )
    print()
    print("| route | strategy | runs | non-zero exits | s a run |")
    print("|---|---|---|---|---|")
    for route, strategy, runs, failed, seconds in rows:
        print(f"| {route} | {strategy} | {runs} | {failed} | {seconds:.1f} |")
    return 1 if any(row[3] for row in rows) else 0
