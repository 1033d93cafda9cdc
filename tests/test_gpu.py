"""The CUDA path: GPU tensors, NCCL, bf16. CI has no GPU, so every test here skips without one.

NCCL takes one GPU per rank (two ranks on one GPU fail at init with "Duplicate GPU detected"), so
the multi-process tests need a GPU per process; on a one-GPU machine they skip and the one-process
ones still run the whole training path on the device.
"""

import subprocess
import sys

import pytest
import torch
from helpers import check_ok, final_weights, max_rel_error, metrics, run_cli, write_config
from reference import DIGITS_MLP, digits_mlp_reference
from test_data_parallel import RESUME

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int):
    reason = "no CUDA device" if n == 1 else f"needs {n} CUDA devices (NCCL takes one per process); {GPUS} here"
    return pytest.mark.skipif(GPUS < n, reason=reason)


def run_digits(tmp_path, nproc: int, *sets: str):
    cfg = write_config(tmp_path / "c.toml", DIGITS_MLP)
    run_dir = tmp_path / "run"
    args = [a for s in sets for a in ("--set", s)]
    proc = check_ok(run_cli("run", str(cfg), "--nproc", str(nproc), "--run-dir", str(run_dir), *args, gpus=True))
    return run_dir, proc


@needs_gpus(1)
@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_one_gpu_equals_single_process_cpu_training(tmp_path, strategy):
    run_dir, _ = run_digits(tmp_path, 1, f'parallel.strategy="{strategy}"')
    assert 'device = "cuda"' in (run_dir / "config.toml").read_text()
    assert max_rel_error(final_weights(run_dir), digits_mlp_reference()) <= 1e-4


@needs_gpus(1)
def test_bf16_on_the_gpu_trains_the_default_gpt(tmp_path):
    check_ok(
        run_cli(
            "run",
            "--nproc",
            "1",
            "--run-dir",
            str(tmp_path / "run"),
            "--set",
            "train.steps=60",
            "--set",
            'train.precision="bf16"',
            "--set",
            "train.log_every=10",
            gpus=True,
        )
    )
    losses = [m["loss"] for m in metrics(tmp_path / "run")]
    assert losses[-1] < 0.8 * losses[0], losses
    weights = final_weights(tmp_path / "run")
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in weights.values())


@needs_gpus(1)
def test_gpu_checkpoints_resume_on_the_gpu_and_on_cpu(tmp_path):
    """A checkpoint written on the GPU (CUDA RNG state included) resumes there like an
    uninterrupted run, and also on CPU."""
    cfg = write_config(tmp_path / "c.toml", RESUME)
    on_gpu = ("--nproc", "1")
    check_ok(run_cli("run", str(cfg), *on_gpu, "--run-dir", str(tmp_path / "straight"), gpus=True))
    check_ok(
        run_cli("run", str(cfg), *on_gpu, "--set", "train.steps=8", "--run-dir", str(tmp_path / "split"), gpus=True)
    )
    proc = check_ok(
        run_cli("run", str(cfg), *on_gpu, "--resume", "auto", "--run-dir", str(tmp_path / "split"), gpus=True)
    )
    assert "resumed from" in proc.stdout and "at step 8" in proc.stdout
    straight = final_weights(tmp_path / "straight")
    assert max_rel_error(final_weights(tmp_path / "split"), straight) <= 1e-6
    check_ok(
        run_cli(
            "run",
            str(cfg),
            *on_gpu,
            "--set",
            'train.device="cpu"',
            "--resume",
            str(tmp_path / "split" / "checkpoints" / "step-12"),
            "--run-dir",
            str(tmp_path / "cpu"),
            gpus=True,
        )
    )
    assert 'device = "cpu"' in (tmp_path / "cpu" / "config.toml").read_text()
    assert max_rel_error(final_weights(tmp_path / "cpu"), straight) <= 1e-4


@needs_gpus(1)
def test_auto_device_trains_on_cpu_when_gpus_are_fewer_than_processes(tmp_path):
    nproc = GPUS + 1
    run_dir, proc = run_digits(tmp_path, nproc, f"data.batch_size={24 * nproc}", "train.steps=3")
    assert 'device = "cpu"' in (run_dir / "config.toml").read_text()
    assert "training on CPU with gloo" in proc.stderr


@needs_gpus(1)
def test_plain_torchrun_with_more_processes_than_gpus_trains_on_cpu(tmp_path):
    """Under torchrun itself the workers resolve 'auto' on their own, from LOCAL_WORLD_SIZE."""
    nproc = GPUS + 1
    cfg = write_config(
        tmp_path / "c.toml",
        DIGITS_MLP.replace("batch_size = 24", f"batch_size = {24 * nproc}").replace("steps = 20", "steps = 3"),
    )
    proc = check_ok(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(nproc),
                "-m",
                "paratrain.trainer",
                str(cfg),
                "--run-dir",
                str(tmp_path / "run"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    assert 'device = "cpu"' in (tmp_path / "run" / "config.toml").read_text()
    assert "training on CPU with gloo" in proc.stderr


@needs_gpus(2)
@pytest.mark.parametrize(
    "sets",
    [
        ['parallel.strategy="dp"'],
        ['parallel.strategy="zero2"'],
        ['parallel.strategy="pp"', "parallel.pp=2", 'parallel.schedule="1f1b"'],
    ],
    ids=["dp", "zero2", "pp-1f1b"],
)
def test_two_gpus_equal_single_process_cpu_training(tmp_path, sets):
    run_dir, _ = run_digits(tmp_path, 2, *sets)
    assert 'device = "cuda"' in (run_dir / "config.toml").read_text()
    assert max_rel_error(final_weights(run_dir), digits_mlp_reference()) <= 1e-4


@needs_gpus(1)
def test_plan_on_a_gpu_checks_the_gpu_memory():
    """`paratrain plan` on a GPU node: one process per GPU, each rank against its GPU's memory."""
    import json

    proc = check_ok(run_cli("plan", "--nproc", "1", "--json", gpus=True))
    plan = json.loads(proc.stdout)
    assert plan["device"] == "cuda"
    capacity = plan["capacity"]
    assert capacity["kind"] == "GPU memory" and capacity["bytes"] == torch.cuda.get_device_properties(0).total_memory
    assert capacity["where"] == "rank 0" and capacity["fits"]
