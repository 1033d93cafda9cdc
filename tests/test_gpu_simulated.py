"""Code only a GPU reaches, run on a machine without one: the GPU count is made up.

CI has no GPU, so tests/test_gpu.py skips there, and the branches it would reach (device choice,
NCCL's backend and `device_id`) went untested until a GPU run found them broken. Here:
  * two processes on a simulated one-GPU node, under plain torchrun and under `paratrain run`: the
    device rule falls back to CPU and gloo and says so once (a `sitecustomize` first on the
    children's PYTHONPATH makes torch report one GPU; nothing CUDA is ever touched);
  * in process, with the count monkeypatched: what a GPU node picks (NCCL, `device_id`, the GPU's
    rank) where init_process_group would be called;
  * benchmarks/gpu.py's whole flow in its CPU smoke mode, and the compiled strategies it holds in
    one process (several compiled models alive at once, zero3's gathers outside the graphs).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, check_ok, run_cli, write_config
from reference import DIGITS_MLP

# Loaded by every child interpreter (the launcher, the agent, the workers): once torch.cuda is
# imported, it says one GPU is there. Only what device choice reads is patched, and lazily, so a
# process that never imports torch stays as it was.
ONE_GPU = """
import importlib.abc
import importlib.util
import sys


class OneGpu(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch.cuda":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.is_available = lambda: True
            module.device_count = lambda: 1

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, OneGpu())
"""

NOTE = (
    "train.device 'auto': 2 processes per node but 1 GPU (NCCL takes one GPU per process), so training on CPU with gloo"
)


def one_gpu_env(tmp_path) -> dict:
    """The environment of a child that sees one (simulated) GPU."""
    site = tmp_path / "one-gpu"
    site.mkdir()
    (site / "sitecustomize.py").write_text(ONE_GPU)
    path = [str(site), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    # CUDA_VISIBLE_DEVICES="" (the suite's CPU-only setting) would not matter to the patch, but a
    # GPU machine's real devices must not be what the test sees either way
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p), "CUDA_VISIBLE_DEVICES": ""}


def short_config(tmp_path):
    return write_config(
        tmp_path / "c.toml", DIGITS_MLP.replace("batch_size = 24", "batch_size = 48").replace("steps = 20", "steps = 3")
    )


def check_cpu_fallback(run_dir, stderr: str) -> None:
    assert 'device = "cpu"' in (run_dir / "config.toml").read_text()
    assert stderr.count(NOTE) == 1, stderr


def test_the_simulated_gpu_is_seen_by_a_child(tmp_path):
    """The patch works (else the fallback tests below would pass on a machine with no GPU at all)."""
    code = "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"
    proc = check_ok(
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, **one_gpu_env(tmp_path)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    )
    assert proc.stdout.split() == ["True", "1"]


def test_plain_torchrun_on_a_one_gpu_node_trains_two_processes_on_cpu(tmp_path):
    """torchrun's workers resolve 'auto' each (pick_device, from LOCAL_WORLD_SIZE); local rank 0 says why."""
    run_dir = tmp_path / "run"
    command = ["--standalone", "--nproc-per-node", "2", "-m", "paratrain.trainer", str(short_config(tmp_path))]
    proc = check_ok(
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", *command, "--run-dir", str(run_dir)],
            env={**os.environ, **one_gpu_env(tmp_path)},
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    check_cpu_fallback(run_dir, proc.stderr)


def test_paratrain_run_on_a_one_gpu_node_trains_two_processes_on_cpu(tmp_path):
    """`paratrain run` resolves 'auto' once, before any worker starts, and says why."""
    run_dir = tmp_path / "run"
    proc = check_ok(
        run_cli(
            "run", str(short_config(tmp_path)), "--nproc", "2", "--run-dir", str(run_dir), env=one_gpu_env(tmp_path)
        )
    )
    check_cpu_fallback(run_dir, proc.stderr)


@pytest.fixture
def gpus(monkeypatch):
    """`gpus(n)`: torch reports n GPUs; set_device and init_process_group are recorded, not run
    (nor is a store made)."""
    calls = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: None)

    def count(n: int) -> dict:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        return calls

    return count


@pytest.mark.parametrize(
    "gpus_here, local_world, device, backend",
    [(2, 2, torch.device("cuda", 1), "nccl"), (1, 2, torch.device("cpu"), "gloo"), (0, 1, torch.device("cpu"), "gloo")],
)
def test_a_worker_picks_nccl_and_its_gpu_only_with_a_gpu_each(
    monkeypatch, gpus, gpus_here, local_world, device, backend
):
    """process.init under torchrun: local rank 1 of `local_world` on a node with `gpus_here` GPUs."""
    from paratrain.runtime import process

    calls = gpus(gpus_here)
    monkeypatch.setattr(process, "_store", lambda rank, world, timeout_s: None)
    monkeypatch.setattr(process, "_rendezvous_round", lambda store, attempt: attempt)
    monkeypatch.setattr(process, "keep_freed_memory", lambda: True)  # the test process's malloc stays as it was
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": str(local_world)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    rt = process.init("auto")
    assert (rt.device, rt.backend, calls["backend"]) == (device, backend, backend)
    assert calls["device_id"] == (device if backend == "nccl" else None)
    assert calls.get("set_device") == (1 if backend == "nccl" else None)


def test_a_regrouping_survivor_on_a_gpu_meets_over_nccl(gpus):
    """fault.on_failure = "continue": each generation's group is NCCL with the rank's GPU on a GPU."""
    from paratrain.fault.survive import Membership

    calls = gpus(1)
    membership = Membership(None, 0, None, torch.device("cuda", 0), 30.0)
    membership.members_of = lambda g: [0]
    membership.enter(3)
    assert (membership.backend, calls["backend"], calls["device_id"]) == ("nccl", "nccl", torch.device("cuda", 0))
    assert calls["rank"] == 0 and calls["world_size"] == 1


def test_a_gpu_node_runs_one_process_per_gpu_unless_told(gpus):
    from paratrain.runtime.launch import default_nproc

    gpus(4)
    assert default_nproc("auto") == 4 and default_nproc("cuda") == 4 and default_nproc("cpu") == 2
    gpus(0)
    assert default_nproc("auto") == 2


def test_zero_takes_nccls_own_collectives():
    """NCCL's reduce-scatter and all-gather are native; gloo's are built from in-place primitives."""
    from paratrain.parallel.zero.comm import from_primitives

    assert not from_primitives("nccl") and from_primitives("gloo")


# A GPT whose blocks are each a little bigger than a ZeRO-3 unit (parallel.bucket_mb), as GPT-2
# small's 28 MB blocks are at the default 25 MB: each block is cut into units (its layer norms,
# attention and feed-forward), whose hooks act inside the block
TINY = {"vocab_size": 64, "n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 16}
BLOCK_SPLITTING_MB = 0.04  # a block holds 12.6k fp32 parameters (50 KB)


@pytest.fixture
def world_of_one():
    from paratrain.runtime.process import Runtime

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Runtime(0, 1, 0, torch.device("cpu"), "gloo", 0)
    finally:
        dist.destroy_process_group()


def compiled_strategy(rt, strategy: str):
    """`strategy` over the tiny GPT, compiled as `paratrain run` compiles it (same seed each time)."""
    from paratrain import config as config_mod
    from paratrain.models.gpt import gpt
    from paratrain.optim import cross_entropy
    from paratrain.parallel.registry import build_for_training

    cfg = config_mod.from_dict(
        {
            "data": {"batch_size": 4},
            "train": {"optimizer": "adamw", "lr": 1e-2, "compile": True, "device": "cpu"},
            "parallel": {"strategy": strategy, "bucket_mb": BLOCK_SPLITTING_MB},
        }
    )
    torch.manual_seed(0)
    return build_for_training(gpt(**TINY), cross_entropy, cfg, rt)


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return tuple(torch.randint(0, TINY["vocab_size"], (4, TINY["block_size"]), generator=g) for _ in range(2))


def test_two_compiled_models_live_in_one_process(world_of_one):
    """dp compiled, then zero3 compiled beside it (as benchmarks/gpu.py holds them): each keeps its
    compiled code (compiling the second made the first recompile: torch._dynamo.reset()), and both
    train as one model would (world 1, same seed and batches)."""
    from torch._dynamo.utils import counters

    dp = compiled_strategy(world_of_one, "dp")
    first = float(dp.train_step(batch(0)))
    zero3 = compiled_strategy(world_of_one, "zero3")
    assert float(zero3.train_step(batch(0))) == pytest.approx(first, rel=1e-5)
    frames = counters["frames"]["total"]
    for step in (1, 2):
        assert float(dp.train_step(batch(step))) == pytest.approx(float(zero3.train_step(batch(step))), rel=1e-4)
    assert counters["frames"]["total"] == frames, "a compiled model recompiled after another one compiled"


def test_zero3_units_inside_blocks_compile_once_per_kind(world_of_one):
    """ZeRO-3's gathers stay out of the compiled code: no graph break, and the frames dynamo
    compiles (first compiles and recompiles) are one per kind of layer, not one per unit (they
    were 45 for the 18 units of a 4-layer model: the hooks traced, guarded on each unit's name and version)."""
    from torch._dynamo.utils import counters

    zero3 = compiled_strategy(world_of_one, "zero3")
    for step in range(3):
        zero3.train_step(batch(step))
    units = len(zero3.units)
    assert units == 2 + 4 * TINY["n_layer"]  # the tied embedding, the position table, 4 per block
    assert not counters["graph_break"], list(counters["graph_break"])
    # embedding (2 shapes), layer norm, attention, feed-forward
    assert counters["frames"]["total"] <= 5 < units, dict(counters["frames"])


def test_the_gpu_benchmark_runs_its_whole_flow_on_the_cpu(tmp_path):
    """benchmarks/gpu.py --smoke: every contender (the trainer, dp and zero3 compiled, the plain
    compiled loop, DDP, FSDP2) built, compiled and timed in one process, as on the GPU, with a tiny
    GPT; and the results file make gpu-check keeps. Its compiles dominate: about 40 s with
    inductor's on-disk cache warm, minutes on a cold one."""
    out, log = tmp_path / "rows.json", tmp_path / "matrix.txt"
    log.write_text("gpu matrix: all ok\n")
    smoke = ["--smoke", "--steps", "2", "--rounds", "2", "--warmup", "1", "--json", str(out)]
    proc = check_ok(
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "gpu.py"),
                *smoke,
                "--results",
                str(tmp_path),
                "--attach",
                str(log),
            ],
            env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""},
            capture_output=True,
            text=True,
            timeout=900,
        )
    )
    rows = {r["contender"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["paratrain run", "dp", "zero3", "plain", "ddp", "fsdp2"], proc.stdout
    assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["plain"]["vs_plain"] == 1.0
    (results,) = tmp_path.glob("gpu-*.md")
    text = results.read_text()
    assert "| contender | step ms | tokens/s | MFU | tokens/s vs plain |" in text and "| fsdp2 |" in text
    assert "Commit: " in text and "## matrix.txt" in text and "gpu matrix: all ok" in text
