"""Shared test helpers: run the real CLI in subprocesses, write configs, read results."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# The suite tests the CPU path (gloo), the same on every machine: its processes see no GPU.
# tests/test_gpu.py covers CUDA and NCCL where there is a GPU.
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None,
            gpus: bool = False) -> subprocess.CompletedProcess:
    """`paratrain ARGS` in a fresh process (which starts real workers on a free port), on CPU
    unless `gpus`."""
    full_env = {**os.environ, **({} if gpus else CPU_ONLY), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "paratrain.cli", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def check_ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "final" / "model.safetensors"))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def max_rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"keys differ: {sorted(set(a) ^ set(b))}"
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12)).item() for k in a)


def complete_lines(path) -> list[str]:
    """The complete lines of a file another process is appending to (none yet: no lines)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return text.splitlines()[:-1] if not text.endswith("\n") else text.splitlines()
