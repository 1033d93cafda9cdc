"""fault.on_failure = "continue": a rank SIGKILLed mid-run takes its replica out, the others train
on with the whole global batch, the replica rejoins with a live replica's state, and the run ends
equal to one process; what cannot continue falls back to today's restart."""

import functools
import json
import os
import subprocess
import sys

import pytest
from helpers import CPU_ONLY, check_ok, final_weights, max_rel_error, outputs_of, run_cli, write_config
from reference import DIGITS_MLP, digits_mlp_reference

from paratrain.cli import main
from paratrain.runtime.process import free_port

reference = functools.cache(digits_mlp_reference)  # (three tests compare with the same run)

CONTINUE = (
    DIGITS_MLP.replace("steps = 20", "steps = 80")
    + """
[parallel]
bucket_mb = 0.002
[checkpoint]
every = 10
[fault]
on_failure = "continue"
"""
)


def run_killed(tmp_path, rank: int, nproc: int, *sets: str):
    cfg = write_config(tmp_path / "c.toml", CONTINUE)
    args = ["run", str(cfg), "--nproc", str(nproc), "--max-restarts", "2", "--run-dir", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    proc = run_cli(*args, env={"PARATRAIN_FAULTS": f"kill@rank={rank},step=30,attempt=0"})
    check_ok(proc)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in lines if "event" not in e]
    events = [(e["event"], e["replica"]) for e in lines if "event" in e]
    return proc.stdout + proc.stderr, steps, events


# Dropout and micro-batches: the survivors take the lost replica's micro-batches as more of their
# own (train.grad_accum grows), each drawing the masks it draws in an uninterrupted run, and the
# rejoined rank draws its own again: the run still ends equal to one process.
DROPOUT = ["model.dropout=0.1", "train.grad_accum=2"]
MODEL_PARALLEL = ["parallel.replicas=2", "parallel.tp_plan={'0'='colwise', '2'='rowwise'}", "train.grad_accum=2"]


@pytest.mark.parametrize(
    "nproc, rank, replica, sets, optimizer, lr",
    [
        (3, 2, 2, DROPOUT, "sgd", 0.1),  # dp: every rank a replica
        (
            4,
            3,
            1,
            [*DROPOUT, "parallel.strategy='zero2'", "parallel.replicas=2", "train.optimizer='adamw'", "train.lr=0.01"],
            "adamw",
            0.01,
        ),
        # tp and pp keep one random stream per rank (no dropout equality): without dropout. A replica
        # is one dp index of the (pp, dp, tp) mesh: under tp ranks 2-3, under pp ranks 1 and 3
        (4, 3, 1, [*MODEL_PARALLEL, "parallel.strategy='tp'", "parallel.tp=2"], "sgd", 0.1),
        (4, 1, 1, [*MODEL_PARALLEL, "parallel.strategy='pp'", "parallel.pp=2", "parallel.microbatches=2"], "sgd", 0.1),
    ],
    ids=["dp-world3", "zero2-replicas2-world4", "tp2-replicas2-world4", "pp2-replicas2-world4"],
)
def test_a_lost_replica_rejoins_and_the_run_equals_one_process(tmp_path, nproc, rank, replica, sets, optimizer, lr):
    out, steps, events = run_killed(tmp_path, rank, nproc, *sets)
    assert "resumed from" not in out and "restarting every worker" not in out, out
    assert steps == sorted(set(steps)) == list(range(10, 81, 10)), steps  # none twice, none missing
    assert events == [("replica_lost", replica), ("replica_joined", replica)], events
    dropout = 0.1 if "model.dropout=0.1" in sets else 0.0
    micro = 24 // (nproc * 2)
    want = reference(steps=80, optimizer=optimizer, lr=lr, dropout=dropout, micro=micro)
    assert max_rel_error(final_weights(tmp_path / "run"), want) <= 1e-4


def test_a_replica_lost_again_while_it_rejoins_rejoins_later(tmp_path):
    """Rank 2 killed at step 30, and its first restart killed while it takes the state: the
    survivors wait for the next generation and take it back on its second restart."""
    cfg = write_config(tmp_path / "c.toml", CONTINUE)
    faults = "kill@rank=2,step=30,attempt=0;kill_joining@rank=2,incarnation=1"
    proc = run_cli(
        *("run", str(cfg), "--nproc", "3", "--max-restarts", "3", "--run-dir", str(tmp_path / "run")),
        env={"PARATRAIN_FAULTS": faults},
    )
    check_ok(proc)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["replica"]) for e in lines if "event" in e] == [("replica_lost", 2), ("replica_joined", 2)]
    assert proc.stderr.count("rank 2 killed by SIGKILL") == 2, proc.stderr
    assert [e["step"] for e in lines if "event" not in e] == list(range(10, 81, 10))
    assert max_rel_error(final_weights(tmp_path / "run"), reference(steps=80)) <= 1e-4


def test_losing_replica_0_falls_back_to_a_restart_saying_why(tmp_path):
    """Replica 0's ranks hold the log and the state the others copy: the run restarts from the
    step-30 checkpoint, as under "restart", and still ends equal to one process."""
    out, steps, events = run_killed(tmp_path, 0, 3)
    assert "rank 0 killed by SIGKILL, in replica 0" in out and "restarting every worker" in out, out
    assert "resumed from" in out and events == []
    assert steps == list(range(10, 81, 10)), steps
    assert max_rel_error(final_weights(tmp_path / "run"), reference(steps=80)) <= 1e-4


def test_a_lost_replica_under_restart_restarts_every_worker_as_before(tmp_path):
    out, steps, events = run_killed(tmp_path, 2, 3, "fault.on_failure='restart'")
    assert "resumed from" in out and "at step 30" in out and events == [], out
    assert steps == list(range(10, 81, 10)), steps
    assert max_rel_error(final_weights(tmp_path / "run"), reference(steps=80)) <= 1e-4


def test_sigterm_to_a_worker_saves_and_stops_the_run_as_under_restart(tmp_path):
    """Preemption is no lost replica: rank 1 alone gets SIGTERM as step 6 begins; every rank saves
    step 6, agreed in the all-reduce after each step, and the run exits 143 without a restart."""
    cfg = write_config(tmp_path / "c.toml", CONTINUE)
    run = tmp_path / "run"
    args = ("run", str(cfg), "--nproc", "2", "--max-restarts", "2", "--run-dir", str(run))
    proc = run_cli(*args, env={"PARATRAIN_FAULTS": "term@rank=1,step=5"})
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert "leaves the run" not in proc.stderr and "restarting" not in proc.stderr, proc.stderr
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-6"]
    assert "SIGTERM: stopped after step 6" in proc.stdout, proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert "stopped by SIGTERM" in last and "step-6" in last and "--resume auto" in last, proc.stderr


@pytest.mark.parametrize(
    "sets, why",
    [
        (["parallel.strategy='ps'"], "'continue' takes strategies"),
        (["parallel.compression='powersgd'"], "parallel.compression 'powersgd'"),
    ],
)
def test_what_continue_cannot_take_exits_2_naming_the_key(tmp_path, capsys, sets, why):
    cfg = write_config(tmp_path / "c.toml", CONTINUE)
    args = ["run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r")]
    for s in sets:
        args += ["--set", s]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "fault.on_failure" in err and why in err, err


@pytest.mark.integration
@pytest.mark.parametrize(
    "nproc, sets, lost, leaves",
    [
        (2, [], 3, "replica 3 leaves the run"),
        # three replicas of two ranks over 2 nodes of 3: replica 1 is rank 2 (node 0) and rank 3
        # (node 1); rank 3's loss takes it out whole, so node 0's supervisor stops rank 2 and starts
        # it again alongside node 1's rank 3
        (3, ["parallel.replicas=3", "parallel.strategy='zero2'"], 1, "replica 1 leaves the run"),
    ],
    ids=["dp", "zero2-replica-spanning-nodes"],
)
def test_two_nodes_lose_a_rank_of_node_1_and_go_on(tmp_path, nproc, sets, lost, leaves):
    """Two `paratrain run`s meeting on loopback: rank 3 (node 1) is killed at step 30; node 0's
    supervisor takes its replica out, the supervisors of the replica's ranks start them again, and
    it rejoins. (Under dp, rank 1, no neighbour of rank 3 in gloo's ring, waited in the broken
    all-reduce until the timeout while its peers held the works of the broken step:
    collectives.forget_works.)"""
    cfg = write_config(tmp_path / "c.toml", CONTINUE)
    rdzv, run = f"127.0.0.1:{free_port()}", tmp_path / "run"
    env = {**os.environ, **CPU_ONLY, "PYTHONUNBUFFERED": "1", "PARATRAIN_FAULTS": "kill@rank=3,step=30,attempt=0"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "paratrain.cli", "run", str(cfg), "--nproc", str(nproc), "--nnodes", "2"]
            + ["--node-rank", str(node), "--rdzv", rdzv, "--max-restarts", "1", "--run-dir", str(run)]
            + [arg for s in sets for arg in ("--set", s)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outs = outputs_of(procs, timeout=120)  # both exit 0
    assert f"rank 3 killed by SIGKILL: {leaves}" in outs[0], outs
    assert "resumed from" not in outs[0] and "restarting every worker" not in outs[0], outs
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    events = [(e["event"], e["replica"]) for e in lines if "event" in e]
    assert events == [("replica_lost", lost), ("replica_joined", lost)]
    assert [e["step"] for e in lines if "event" not in e] == list(range(10, 81, 10))  # none twice, none missing
    assert max_rel_error(final_weights(run), reference(steps=80)) <= 1e-4


def test_node_0_lost_ends_another_nodes_run_saying_so():
    """The one loss `continue` does not go on through: node 0's run, with the store. Node 1's
    supervisor (here without workers yet) stops at its next look at the store, naming it."""
    import signal
    from datetime import timedelta

    import torch.distributed as dist

    from paratrain.comm.grid import ReplicaLayout
    from paratrain.fault.supervise import Supervisor
    from paratrain.runtime import process
    from paratrain.runtime.worker_failure import WorkerFailure

    listener = process.listen_on("127.0.0.1")
    master = ("127.0.0.1", listener.getsockname()[1])
    server = process.store_server(listener)
    client = dist.TCPStore(*master, is_master=False, timeout=timedelta(seconds=5))
    node = Supervisor(None, [], ReplicaLayout(2, 1, 1), client, master, node=1, nproc=1)
    assert node.poll() is None  # node 0 has published nothing yet
    del server  # node 0's run is gone
    handler = signal.getsignal(signal.SIGTERM)  # (run() takes SIGTERM over, as in `paratrain run`)
    try:
        with pytest.raises(WorkerFailure, match=f"node 0 is lost: its store at {master[0]}:{master[1]} no longer"):
            node.run(leader=None)
    finally:
        signal.signal(signal.SIGTERM, handler)
