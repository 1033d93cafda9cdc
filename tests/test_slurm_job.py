"""`paratrain job slurm` on a real two-node Slurm cluster (slurmctld and two slurmd in two network
namespaces, paratrain.testing.slurm): the emitted script, submitted with sbatch, trains across both
nodes to the single-process result, through a worker killed on node 2 and restarted (--max-restarts 1).
The cluster's packages are installed by the project's own setup when missing (root, apt-get)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import CPU_ONLY, complete_lines, final_weights, max_rel_error, write_config
from reference import DIGITS_MLP, train_reference

from paratrain.bench.recovery import SLOW_MODEL
from paratrain.cli import main
from paratrain.data.datasets import digits
from paratrain.models.mlp import mlp
from paratrain.testing import netns, slurm

ok, why = netns.available()

# DIGITS_MLP's job on bench.recovery's model, an MLP with a pause in each forward so that a worker can be
# killed mid-run.
STEPS = 30
CFG = (
    DIGITS_MLP.replace('factory = "mlp"\nhidden = 32', 'factory = "slowmodel:slow_mlp"\npause = 0.03')
    .replace("steps = 20", f"steps = {STEPS}")
    .replace("log_every = 10", "log_every = 1")
    + "[checkpoint]\nevery = 5\nkeep = 2\n"
)


@pytest.mark.skipif(not ok, reason=f"Slurm test skipped: {why}")
def test_sbatch_script_trains_on_two_nodes_and_recovers_a_killed_worker(tmp_path, capsys):
    slurm.install()
    cfg = write_config(tmp_path / "c.toml", CFG)
    (tmp_path / "slowmodel.py").write_text(SLOW_MODEL)
    run_dir = tmp_path / "run"
    script = tmp_path / "job.sh"
    assert (
        main(
            [
                "job",
                "slurm",
                str(cfg),
                "--nodes",
                "2",
                "--nproc",
                "1",
                "--max-restarts",
                "1",
                "--run-dir",
                str(run_dir),
                "--out",
                str(script),
            ]
        )
        == 0
    ), capsys.readouterr().err
    # The job's tasks get this environment (sbatch exports it): paratrain on PATH, no GPU.
    env = {
        **os.environ,
        **CPU_ONLY,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONUNBUFFERED": "1",
    }
    with slurm.SlurmCluster(tmp_path / "slurm") as cluster:
        job = cluster.popen(
            ["sbatch", "--wait", str(script)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.monotonic() + 120
            while not any(json.loads(line)["step"] >= 12 for line in complete_lines(run_dir / "metrics.jsonl")):
                assert time.monotonic() < deadline and job.poll() is None, f"no step 12: {_job_output(tmp_path)}"
                time.sleep(0.05)
            os.kill(_worker_on_node(1, cluster.conf), signal.SIGKILL)
            out = job.communicate(timeout=120)[0]
        finally:
            job.kill()
    log = _job_output(tmp_path)
    assert job.returncode == 0, f"{out}\n{log}"
    assert "Slurm job" in log and "node 1 of 2, 1 process each (world 2), rendezvous at node1:" in log, log
    assert "resumed from" in log, log
    steps = [json.loads(line)["step"] for line in complete_lines(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1)), "every step is logged exactly once"
    ours = {k.removeprefix("net."): v for k, v in final_weights(run_dir).items()}
    x, y = digits("train").tensors
    torch.manual_seed(0)
    single = train_reference(mlp(64, hidden=64, n_layers=2, out_features=10), x, y, steps=STEPS, batch_size=24, lr=0.1)
    assert max_rel_error(ours, single) <= 1e-4


def test_sbatch_script_is_shellcheck_clean(tmp_path, capsys):
    slurm.install()
    script = tmp_path / "job.sh"
    assert (
        main(
            [
                "job",
                "slurm",
                "--nodes",
                "4",
                "--gpus",
                "8",
                "--cpus",
                "32",
                "--memory",
                "200Gi",
                "--run-dir",
                "/shared/runs/my run",
                "--out",
                str(script),
            ]
        )
        == 0
    ), capsys.readouterr().err
    check = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    text = script.read_text()
    assert "scontrol" not in text and "#SBATCH --nodes=4" in text and "#SBATCH --gpus-per-node=8" in text
    assert "--nproc 8" in text and "run_dir='/shared/runs/my run'" in text


def _worker_on_node(node: int, slurm_conf: Path) -> int:
    """The pid of a paratrain worker on Slurm node `node` of this test's cluster: workers are named
    paratrain-rN (launch.prepare_forked_worker) and inherit the job's environment."""
    wanted = (f"SLURM_NODEID={node}".encode(), f"SLURM_CONF={slurm_conf}".encode())
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().startswith("paratrain-r"):
                environ = (entry / "environ").read_bytes().split(b"\0")
                if all(item in environ for item in wanted):
                    return int(entry.name)
        except OSError:
            continue
    raise AssertionError(f"no worker of Slurm node {node} found")


def _job_output(tmp_path: Path) -> str:
    return "\n".join(path.read_text() for path in sorted(tmp_path.glob("equiv-*.out")))
