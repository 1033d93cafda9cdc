"""What a run exposes: its listening sockets, its processes after its launcher dies, its shared
memory, its run directory, and the input it trusts (docs/security.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import CPU_ONLY, descendants, is_loopback, listening_addresses, run_cli, write_config
from reference import DIGITS_MLP

from paratrain.bench.recovery import SLOW_MODEL, config_text


def _logged_steps(metrics: Path) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]
    except (OSError, ValueError, KeyError):
        return []


@pytest.fixture(scope="module")
def training_run(tmp_path_factory):
    """A real `paratrain run` of two workers, trained past step 2 and still training: (its process,
    its run directory, its config, the pids of it and every process under it). The last test of
    this module SIGKILLs it."""
    tmp_path = tmp_path_factory.mktemp("training")
    (tmp_path / "slowmodel.py").write_text(SLOW_MODEL)
    cfg = write_config(tmp_path / "c.toml", config_text(steps=2000, every=0, pause=0.02))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "paratrain.cli", "run", str(cfg), "--nproc", "2", "--run-dir", str(run_dir)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **CPU_ONLY},
    )
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 180  # the whole suite may be running beside it
        while max(_logged_steps(run_dir / "metrics.jsonl"), default=0) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(0.1)
        pids = descendants(proc.pid)
        assert len(pids) >= 4, pids  # the command, its worker server, two workers
        yield proc, run_dir, cfg, pids
    finally:
        proc.kill()
        proc.wait()
        for pid in pids - {proc.pid}:  # what outlived it, so that a failure leaves nothing behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_local_run_listens_on_loopback_only(training_run):
    """Issue 23, point 1: torch's TCPStore listened on every interface whatever host it was given,
    and the elastic rendezvous unpickles what that store holds (remote code execution); gloo
    listens on the address of the machine's hostname unless told an interface."""
    proc, _, _, pids = training_run
    assert proc.poll() is None
    listening = listening_addresses(pids)
    assert len(listening) >= 3, f"the stores and gloo were not all seen: {listening}"
    exposed = [(a, p) for a, p in listening if not is_loopback(a)]
    assert not exposed, f"a local run listens beyond loopback: {exposed} (all: {listening})"


def test_a_second_run_in_the_same_folder_exits_2(training_run):
    """Issue 23, point 10: nothing locked the run directory, so two runs of one name clobbered each
    other's checkpoints and metrics."""
    proc, run_dir, cfg, _ = training_run
    second = run_cli("run", str(cfg), "--nproc", "2", "--run-dir", str(run_dir), cwd=cfg.parent)
    assert second.returncode == 2, second.stdout + second.stderr
    last = second.stderr.strip().splitlines()
    assert len(last) == 1 and last[0].startswith(f"paratrain: error: --run-dir: {run_dir} is in use"), last
    assert proc.poll() is None, "the first run did not go on"


def test_the_command_leaves_no_temporary_folder(tmp_path):
    """Issue 23, point 10: the command leaves through os._exit, past multiprocessing's exit handler,
    which removes the /tmp/pymp-* folder of the worker server's socket: one was left per run."""
    cfg = write_config(tmp_path / "c.toml", DIGITS_MLP)
    # A short folder of its own: the server's socket path inside it must fit AF_UNIX's 108 bytes,
    # which pytest-xdist's tmp_path (…/popen-gwN/test_…/) may not leave room for.
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="pt-") as tmp:
        # refused after the worker server started, by the first check that needs the world size
        proc = run_cli("run", str(cfg), "--nproc", "5", "--run-dir", str(tmp_path / "run"), env={"TMPDIR": tmp})
        assert proc.returncode == 2 and "data.batch_size" in proc.stderr, proc.stderr
        assert not list(Path(tmp).glob("pymp-*")), "the command left multiprocessing's folder behind"


def test_a_sigkilled_launcher_takes_its_processes_with_it(training_run):
    """Issue 23, point 9: a SIGKILLed `paratrain run` (an OOM killer, a scheduler) left its worker
    server and its workers training on, reparented to init."""
    proc, _, _, pids = training_run
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 3
    while (alive := {pid for pid in pids - {proc.pid} if _alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"processes of the run outlived its SIGKILLed launcher: {sorted(alive)}"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_shared_memory_refuses_a_planted_link_and_stays_private(tmp_path, monkeypatch):
    """Issue 23, point 2: a ring was opened through any link planted at its predictable name in
    world-writable /dev/shm (and its target zero-extended), and its FIFOs were created 0644."""
    from paratrain.comm import shm

    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    link = tmp_path / "0to1.ring"
    link.symlink_to(target)
    with pytest.raises(FileExistsError):
        shm._create_ring(link, 4096)  # the receiver makes its ring anew, never through a link
    with pytest.raises(OSError):
        shm._open_ring(link, 4096)  # the sender does not follow one either
    assert target.read_bytes() == b"keep me"

    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    monkeypatch.setattr(shm.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(shm.dist, "get_world_size", lambda: 2)
    modes = {}

    def gather(out, obj, group=None):
        if isinstance(obj, tuple):  # the facts: rank 1 is on this host too
            out[:] = [obj, (1, *obj[1:])]
        else:  # whether a rank failed: note what rank 0 made, before it is removed
            own = next(tmp_path.glob("paratrain-*"))
            modes.update(
                {"dir": own.stat().st_mode & 0o777}, **{p.name: p.stat().st_mode & 0o777 for p in own.iterdir()}
            )
            out[:] = [obj, ""]

    monkeypatch.setattr(shm.dist, "all_gather_object", gather)
    assert shm.connect(None, {1}, timeout_s=1, capacity=4096) == ({}, {})
    assert modes == {"dir": 0o700, "1to0.ring": 0o600, "1to0.data": 0o600, "1to0.ack": 0o600}, modes
    assert not list(tmp_path.glob("paratrain-*")), "the private directory was left behind"


def test_shared_memory_refuses_a_record_outside_the_ring():
    """Issue 23, point 2: a record's offset was trusted, so a copy could read any memory."""
    import torch

    from paratrain.comm import shm

    data_r, data_w = os.pipe()
    ack_r, ack_w = os.pipe()
    ring = torch.zeros(4096, dtype=torch.uint8)
    receiver = shm.Receiver(ring, data_r, ack_w, peer=1, timeout_s=1)
    os.write(data_w, shm.RECORD.pack(4096 - 8, 64, 7))
    with pytest.raises(shm.ChannelError, match="4096-byte ring"):
        receiver.post(torch.empty(16, dtype=torch.float32), tag=7).wait()
    for fd in (data_r, data_w, ack_r, ack_w):
        os.close(fd)


@pytest.mark.parametrize(
    "override, key",
    [
        ("parallel.timeout_s=1e15", "parallel.timeout_s"),  # overflowed a timedelta in every worker
        ("train.seed=18446744073709551616", "train.seed"),  # 2**64: torch.manual_seed raised in every worker
        ("train.seed=-1", "train.seed"),
        ("name='../elsewhere'", "name"),  # runs/NAME is the run directory
        ("name='a/b'", "name"),
        ("name='..'", "name"),
    ],
)
def test_values_that_crashed_the_workers_or_escaped_runs_exit_2(tmp_path, capsys, monkeypatch, override, key):
    from paratrain.cli import main

    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path / "c.toml", DIGITS_MLP)
    assert main(["run", str(cfg), "--set", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"paratrain: error: {key}: "), err
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "value, why",
    [
        ("skip_collective@rank=1,step", "got 'step'"),  # a bare ValueError at the first collective
        ("skip_collective@rank=1,=3", "got '=3'"),
        ("@rank=1", "got the name ''"),
    ],
)
def test_malformed_faults_exit_2_in_one_line(tmp_path, capsys, monkeypatch, value, why):
    """Issue 23, point 4: PARATRAIN_FAULTS was read by the workers alone, at their first collective."""
    from paratrain.cli import main

    monkeypatch.setenv("PARATRAIN_FAULTS", value)
    cfg = write_config(tmp_path / "c.toml", DIGITS_MLP)
    assert main(["run", str(cfg), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("paratrain: error: PARATRAIN_FAULTS: ") and why in err[0], err


def test_faults_that_are_set_are_announced(tmp_path, capsys, monkeypatch):
    """Issue 23, point 4: a well-formed PARATRAIN_FAULTS made ranks fail without a word."""
    from paratrain.cli import main

    monkeypatch.setenv("PARATRAIN_FAULTS", "exit_in_save@rank=0,step=8;skip_colective@rank=1")
    cfg = write_config(tmp_path / "c.toml", DIGITS_MLP)
    assert main(["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--set", "train.steps=-1"]) == 2
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith("paratrain: warning: PARATRAIN_FAULTS is set (exit_in_save@rank=0,step=8;"), warning
    assert "skip_colective never fires" in warning, warning  # a misspelt name
    assert error.startswith("paratrain: error: train.steps: "), error


def test_a_multi_node_run_binds_the_address_towards_its_rendezvous():
    """Issue 23, point 1: a node's stores listen on its address on the route to --rdzv, and gloo and
    NCCL on the interface holding it (tests/test_multinode.py runs two nodes over a veth pair)."""
    from paratrain.runtime.launch import _address_towards, _interface_of
    from paratrain.runtime.process import listen_on

    assert _address_towards("127.0.0.1", 29400) == "127.0.0.1"
    assert _interface_of("127.0.0.1") == "lo"
    assert _interface_of("192.0.2.1") is None  # TEST-NET-1: held by no interface here
    with listen_on("localhost") as sock:
        assert is_loopback(sock.getsockname()[0]) and sock.getsockname()[1] > 0
