"""docs/own-loop.md's "Porting nanoGPT" diff runs as the page writes it: applied to a DDP script of
nanoGPT's train.py layout (tests/porting/), the result trains at world 2 under zero3, stopped and
resumed, to the checkpoint one process writes (the same diff on nanoGPT's own train.py:
benchmarks/results/porting-nanogpt-2026-11-27.md)."""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import check_ok, max_rel_error, run_cli
from porting_diff import apply, diff_block

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def ported(tmp_path: Path) -> Path:
    """tests/porting/ in tmp_path with train.py ported by the page's diff, and its token files."""
    shutil.copytree(ROOT / "tests" / "porting", tmp_path, dirs_exist_ok=True)
    script = tmp_path / "train.py"
    diff = diff_block((ROOT / "docs" / "own-loop.md").read_text(), "## Porting nanoGPT")
    script.write_text("\n".join(apply(script.read_text().splitlines(), diff)) + "\n")
    (tmp_path / "data" / "tiny").mkdir(parents=True)
    rng = np.random.default_rng(0)
    rng.integers(0, 100, 6000, dtype=np.uint16).tofile(tmp_path / "data" / "tiny" / "train.bin")
    rng.integers(0, 100, 1000, dtype=np.uint16).tofile(tmp_path / "data" / "tiny" / "val.bin")
    return script


def weights(run: Path) -> dict:
    checkpoint = torch.load(run / "ckpt.pt", weights_only=True)
    assert checkpoint["iter_num"] == 6
    return checkpoint["model"]


def test_the_porting_diff_applies_to_nanogpts_layout_and_trains_as_one_process(tmp_path):
    script = ported(tmp_path)
    code = script.read_text().split('"""', 2)[2]  # after the docstring
    assert "ddp" not in code.lower() and "pt.backward(scaler.scale(loss))" in code
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    one = subprocess.run(
        [sys.executable, str(script), "--out_dir=one", "--strategy=dp"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    check_ok(one)
    check_ok(
        run_cli(
            "launch", "--nproc", "2", str(script), "--out_dir=res", "--strategy=zero3", "--max_iters=3", cwd=tmp_path
        )
    )
    check_ok(
        run_cli(
            "launch",
            "--nproc",
            "2",
            str(script),
            "--out_dir=res",
            "--strategy=zero3",
            "--init_from=resume",
            cwd=tmp_path,
        )
    )
    assert max_rel_error(weights(tmp_path / "res"), weights(tmp_path / "one")) <= 1e-4
