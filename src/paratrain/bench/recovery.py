"""Recovery benchmark: kill a dp worker mid-run; how long until training goes on, and how much
work is lost? Under fault.on_failure = "restart" and "continue", side by side.

Runs `paratrain run` with --max-restarts 1 and checkpoints every K steps, waits for a checkpoint,
signals rank 1 from outside (SIGKILL: a crash; SIGTERM: a preemption, which the ranks answer with
a checkpoint at an agreed step, fault/stop.py), and reads metrics.jsonl (one entry per step,
with wall-clock times):
    recovery time      the next step completed after the signal - the signal (restart: the
                       restarted group's first step; continue: the step in flight, which the
                       survivors finish)
    steps recomputed   restart: last step done before the signal - the checkpoint step resumed
                       from; continue: 0 unless it fell back to a restart
    outage             the signal until the full world trains again (restart: its first step;
                       continue: the first step after replica_joined), and the samples/s over it
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paratrain.bench.common import COUNT, add_json_option, at_least
from paratrain.errors import error, say
from paratrain.runtime.machine import emit_json

SLOW_MODEL = '''
import time
from torch import nn
from paratrain.models.mlp import mlp


class Slow(nn.Module):
    """The built-in MLP, with a fixed pause per forward so steps take long enough to be killed."""

    def __init__(self, pause):
        super().__init__()
        self.pause = pause
        self.net = mlp(64, hidden=64, n_layers=2, out_features=10)

    def forward(self, x):
        time.sleep(self.pause)
        return self.net(x)


def slow_mlp(pause=0.02):
    return Slow(pause)
'''


BATCH = 32


def config_text(steps: int, every: int, pause: float) -> str:
    return f"""
name = "recovery"
[model]
factory = "slowmodel:slow_mlp"
pause = {pause}
[data]
factory = "digits"
batch_size = {BATCH}
[train]
steps = {steps}
optimizer = "adamw"
lr = 0.003
log_every = 1
[checkpoint]
every = {every}
keep = 2
"""


def worker_pids(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of the paratrain workers under the agent process `agent_pid`.

    Workers are forked from the agent's worker server, so they are the agent's grandchildren,
    named `paratrain-rN` after their rank (launch.prepare_forked_worker)."""
    parent, name = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                name[int(entry.name)] = (entry / "comm").read_text().strip()
            except (OSError, ValueError, IndexError):
                continue

    def under_agent(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == agent_pid:
                return True
        return False

    return {
        int(n.removeprefix("paratrain-r")): pid
        for pid, n in name.items()
        if n.startswith("paratrain-r") and n.removeprefix("paratrain-r").isdigit() and under_agent(pid)
    }


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


def run_and_kill(
    workdir: Path,
    *,
    steps: int,
    every: int,
    pause: float,
    kill_after_step: int,
    extra_args: tuple = (),
    nproc: int = 2,
    sig: int = signal.SIGKILL,
    mode: str = "restart",
) -> dict:
    """Start a run under fault.on_failure = `mode`, send rank 1 `sig` once `kill_after_step` is
    logged, let the agent (restart) or the supervisor (continue) bring it back."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "slowmodel.py").write_text(SLOW_MODEL)
    cfg = workdir / "recovery.toml"
    cfg.write_text(config_text(steps, every, pause))
    run_dir = workdir / "run"
    metrics = run_dir / "metrics.jsonl"
    started_at = time.time()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paratrain.cli",
            "run",
            str(cfg),
            "--nproc",
            str(nproc),
            "--max-restarts",
            "1",
            "--run-dir",
            str(run_dir),
            "--set",
            f"fault.on_failure='{mode}'",
            *extra_args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )

    def logged() -> list[dict]:
        try:
            return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            return []

    try:
        wait_for(lambda: any(e.get("step", 0) >= kill_after_step for e in logged()), 120, f"step {kill_after_step}")
        victim = worker_pids(proc.pid)[1]
        os.kill(victim, sig)
        killed_at = time.time()
        before = max(e["step"] for e in logged())
        output, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    entries = [e for e in logged() if "event" not in e]
    joined = next((e["step"] for e in logged() if e.get("event") == "replica_joined"), None)
    resumed_from = next(
        (int(line.split("at step ")[1].split()[0]) for line in output.splitlines() if "resumed from" in line), None
    )
    # The restarted group's first step. (Not the first step logged after the signal: after a
    # SIGTERM the old group goes on to the step it agrees to stop at, which is work kept.) Under
    # continue, the step in flight at the signal, which the survivors finish.
    after = resumed_from if resumed_from is not None else before
    first = next((e for e in entries if e["step"] == after + 1), None)
    whole = first if resumed_from is not None else next((e for e in entries if e["step"] == (joined or -2) + 1), None)
    outage_s = (whole["wall"] - killed_at) if whole else None
    done_in_outage = sum(1 for e in entries if whole and killed_at < e["wall"] <= whole["wall"] and e is not whole)
    return {
        "returncode": proc.returncode,
        "output": output,
        "run_dir": run_dir,
        "killed_at": killed_at,
        # the command's start to its first step: what a restart redoes but the command's own imports
        "start_s": (entries[0]["wall"] - started_at) if entries else None,
        "last_step_before_kill": before,
        "resumed_from": resumed_from,
        "recovery_s": (first["wall"] - killed_at) if first else None,
        # a SIGTERM's checkpoint may come a step or two after the last step logged before it
        "steps_recomputed": max(before - resumed_from, 0) if resumed_from is not None else 0,
        "outage_s": outage_s,
        "samples_per_s_in_outage": done_in_outage * BATCH / outage_s if outage_s else None,
        "rejoined_at_step": joined,
    }


SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}


def add_parser(which) -> None:
    p = which.add_parser(
        "recovery",
        help="time from a killed worker to the next completed step, and the steps lost (dp, world 2), "
        "under fault.on_failure restart and continue",
    )
    p.add_argument("--steps", type=COUNT, default=60)
    p.add_argument("--every", type=COUNT, default=10, help="checkpoint.every")
    p.add_argument("--kill-after", type=COUNT, default=25, help="signal rank 1 once this step is logged")
    p.add_argument(
        "--signal",
        choices=("kill", "term"),
        default="kill",
        help="SIGKILL (a crash) or SIGTERM (a preemption: the ranks save first)",
    )
    p.add_argument("--modes", choices=("both", "restart", "continue"), default="both", help="fault.on_failure")
    p.add_argument(
        "--pause", type=at_least(0.0, float), default=0.05, help="seconds of sleep per forward (step length)"
    )
    add_json_option(p)
    p.set_defaults(func=run)


def run(args) -> int:
    modes = ("restart", "continue") if args.modes == "both" else (args.modes,)
    results = {}
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="paratrain-recovery-") as tmp:
            r = run_and_kill(
                Path(tmp),
                steps=args.steps,
                every=args.every,
                pause=args.pause,
                kill_after_step=args.kill_after,
                sig=SIGNALS[args.signal],
                mode=mode,
            )
        if r["returncode"] != 0:
            say(r["output"])
            error(f"the run under {mode!r} did not recover")
            return 1
        results[mode] = {k: r[k] for k in ("resumed_from", "steps_recomputed", "recovery_s", "outage_s")}
        results[mode].update(
            killed_after_step=r["last_step_before_kill"],
            samples_per_s_in_outage=r["samples_per_s_in_outage"],
            rejoined_at_step=r["rejoined_at_step"],
        )
    result = {
        "benchmark": "recovery",
        "strategy": "dp",
        "world_size": 2,
        "checkpoint_every": args.every,
        "signal": SIGNALS[args.signal].name,
        "modes": results,
        "target_recovery_s": 15.0,
    }
    print(
        f"recovery benchmark: dp, world 2, {SIGNALS[args.signal].name} to rank 1, checkpoint every {args.every} steps"
    )
    print(f"{'fault.on_failure':<34}" + "".join(f"{m:>12}" for m in results))

    def row(label: str, key: str, fmt: str) -> None:
        print(
            f"{label:<34}" + "".join(f"{'-' if r[key] is None else format(r[key], fmt):>12}" for r in results.values())
        )

    row("signal -> next step (s)", "recovery_s", ".2f")
    row("steps recomputed", "steps_recomputed", "d")
    row("outage: signal -> full world (s)", "outage_s", ".2f")
    row("samples/s during the outage", "samples_per_s_in_outage", ".1f")
    row("last step at signal", "killed_after_step", "d")
    emit_json(result, args.json)
    return 0
