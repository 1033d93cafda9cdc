"""A disk that fills while a checkpoint is written: the run ends in a few lines naming the path and
the room left, no traceback, no partial files, and the checkpoint before it verifies.

The disk is a real one where this process may mount a small tmpfs (root); elsewhere the
checkpoint's writes meet ENOSPC at a fault point (PARATRAIN_FAULTS), the same error raised."""

from __future__ import annotations

import subprocess
import uuid

import pytest
from helpers import run_cli, write_config

from paratrain.cli import main

# 8.5M parameters: a checkpoint with AdamW's state is about 100 MB, so a 150 MiB disk (above the
# 64 MiB a run asks for at its start) holds step-5 and fills during step-10.
CONFIG = """
name = "full-disk"
[model]
factory = "mlp"
hidden = 2048
n_layers = 3
[data]
factory = "digits"
batch_size = 32
[train]
steps = 12
log_every = 5
[checkpoint]
every = 5
"""


@pytest.fixture
def small_disk(tmp_path):
    """(a folder on a 150 MiB filesystem, the faults to set): the tmpfs where it can be mounted,
    else a plain folder and the fault that fails step 10's writes as a full disk would."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=150m", f"full-{uuid.uuid4().hex[:8]}", str(disk)], capture_output=True
        ).returncode
        == 0
    )
    try:
        yield disk, {} if mounted else {"PARATRAIN_FAULTS": "disk_full_in_save@step=10"}
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_a_disk_that_fills_during_a_checkpoint_loses_nothing_saved(tmp_path, capsys, small_disk, strategy):
    disk, faults = small_disk
    cfg = write_config(tmp_path / "c.toml", CONFIG)
    run_dir = disk / "run"
    proc = run_cli(
        "run",
        str(cfg),
        "--nproc",
        "2",
        "--run-dir",
        str(run_dir),
        "--set",
        f"parallel.strategy='{strategy}'",
        env=faults,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) <= 3 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    failure = next(line for line in lines if "step-10 not written" in line)
    assert "No space left on device" in failure and "MiB free" in failure, failure
    assert not list(run_dir.rglob(".tmp-*")), sorted(run_dir.rglob("*"))
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-5"]
    capsys.readouterr()
    assert main(["inspect", str(run_dir / "checkpoints" / "step-5")]) == 0
    assert "all checksums ok" in capsys.readouterr().out
