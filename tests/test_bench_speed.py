"""The speed benchmarks' own checks: the GPU script skips cleanly without a GPU (its whole flow on a
tiny GPT on the CPU: tests/test_gpu_simulated.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script would run, not skip")
def test_gpu_script_skips_in_one_line_without_a_gpu():
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == ["gpu benchmark: skipped, no CUDA GPU on this machine"]
    assert not proc.stderr.strip()
