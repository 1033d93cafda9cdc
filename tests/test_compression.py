"""Gradient compression in dp (and 16-bit casts in zero's reduce-scatter): 16-bit casts stay close to
exact; top-k and PowerSGD still learn."""

import pytest
import torch
from helpers import final_weights, max_rel_error, metrics, write_config
from reference import DIGITS_MLP

from paratrain.cli import main

EQUIV = (
    DIGITS_MLP
    + """
[parallel]
bucket_mb = 0.002
"""
)

# The digits job of test_end_to_end: uncompressed it passes 90 % validation accuracy in 150 steps.
DIGITS = """
name = "digits-compressed"
[model]
factory = "mlp"
hidden = 128
[data]
factory = "digits"
batch_size = 64
[train]
steps = 225            # 1.5 x the uncompressed run's 150
optimizer = "adamw"
lr = 0.003
log_every = 75
eval_every = 225
"""


@pytest.fixture(scope="module")
def exact(tmp_path_factory, gang):
    tmp = tmp_path_factory.mktemp("exact")
    cfg = write_config(tmp / "c.toml", EQUIV)
    gang(2).train(cfg, tmp / "run")
    return final_weights(tmp / "run")


@pytest.mark.parametrize("strategy, codec", [("dp", "bf16"), ("dp", "fp16"), ("zero1", "fp16"), ("zero2", "bf16")])
def test_16_bit_casts_end_close_to_uncompressed(tmp_path, gang, exact, strategy, codec):
    cfg = write_config(tmp_path / "c.toml", EQUIV)
    gang(2).train(cfg, tmp_path / "run", [f"parallel.strategy='{strategy}'", f"parallel.compression='{codec}'"])
    err = max_rel_error(final_weights(tmp_path / "run"), exact)
    assert 0 < err <= 1e-2, err  # lossy (not bit-equal) but only by rounding


@pytest.mark.parametrize(
    "codec, options",
    [
        ("topk", ["parallel.topk_ratio=0.01"]),
        ("powersgd", ["parallel.powersgd_rank=2"]),
    ],
)
def test_lossy_codecs_reach_digits_accuracy_within_1_5x_steps(tmp_path, gang, codec, options):
    cfg = write_config(tmp_path / "c.toml", DIGITS)
    gang(2).train(cfg, tmp_path / "run", [f"parallel.compression='{codec}'", *options])
    final = metrics(tmp_path / "run")[-1]
    assert final["step"] == 225 and final["val_acc"] >= 0.90, final
    # and it sent less than the dense all-reduce would have: 4 bytes per parameter
    params = 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    assert final["bytes_min"] < 0.5 * 4 * params, final


@pytest.mark.parametrize(
    "override, key",
    [
        ("parallel.compression='zip'", "parallel.compression"),
        ("parallel.topk_ratio=0", "parallel.topk_ratio"),
        ("parallel.topk_ratio=1.5", "parallel.topk_ratio"),
        ("parallel.powersgd_rank=0", "parallel.powersgd_rank"),
        ("parallel.powersgd_warm_start=1", "parallel.powersgd_warm_start"),
    ],
)
def test_bad_compression_options_exit_2(tmp_path, capsys, override, key):
    cfg = write_config(tmp_path / "c.toml", EQUIV)
    code = main(["run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), "--set", override])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and key in err, err


@pytest.mark.parametrize("strategy, codec", [("zero2", "powersgd"), ("tp", "bf16"), ("ps", "fp16")])
def test_compression_a_strategy_cannot_use_exits_2(tmp_path, capsys, strategy, codec):
    cfg = write_config(tmp_path / "c.toml", EQUIV)
    code = main(
        [
            "run",
            str(cfg),
            "--nproc",
            "2",
            "--run-dir",
            str(tmp_path / "r"),
            "--set",
            f"parallel.strategy='{strategy}'",
            "--set",
            f"parallel.compression='{codec}'",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "parallel.compression" in err, err


RESUME = (
    EQUIV.replace("steps = 20", "steps = 8").replace("log_every = 10", "log_every = 4")
    + """
compression = "powersgd"
powersgd_rank = 1
[checkpoint]
every = 4
"""
)


def test_powersgd_resume_equals_uninterrupted(tmp_path, gang):
    """Error feedback and the warm-start Q are saved per rank: a resumed run continues exactly."""
    cfg = write_config(tmp_path / "c.toml", RESUME)
    gang(2).train(cfg, tmp_path / "straight")
    gang(2).train(cfg, tmp_path / "split", ["train.steps=4"])
    gang(2).train(cfg, tmp_path / "split", resume="auto")
    assert max_rel_error(final_weights(tmp_path / "split"), final_weights(tmp_path / "straight")) <= 1e-6
    # Its memory fits only the same buckets and rank: with other ones it is dropped, not forced
    # into buffers of other shapes (which crashed every worker)
    step4 = str(tmp_path / "split" / "checkpoints" / "step-4")
    for i, option in enumerate(["parallel.powersgd_rank=2", "parallel.bucket_mb=0.001"]):
        gang(2).train(cfg, tmp_path / f"other-{i}", [option], resume=step4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(37, 11), (300, 2000), (3, 600_000)])
def test_powersgd_blocked_reconstruction_equals_one_product(shape, dtype):
    """P Q^T and the error are made a cache-sized block of rows at a time, through a bf16 block
    buffer or straight into the result in fp32; the blocks must add up to exactly the one-product
    result (rows that do not divide, a row wider than a block). The squared norm it returns, taken
    from the factors (the clipping norm), is that of the result it wrote."""
    from paratrain.parallel.codecs.powersgd import _PowerBucket

    torch.manual_seed(0)
    n, m = shape
    flat = torch.randn(n * m)
    st = _PowerBucket(flat, [torch.Size(shape)], rank=2, seed=0, dtype=dtype)
    # several blocks even for small shapes
    block = torch.empty(max(1000, m), dtype=dtype) if st.copies_matrices else None
    M, out, Pt, Qt = st.views(flat)[0], st.views(st.out)[0], torch.randn(2, n), torch.randn(2, m)
    before = M.clone()
    squared_norm = st.reconstruct(M, out, Pt, Qt, block)
    expected = (Pt.t().to(dtype) @ Qt.to(dtype)).float()
    assert torch.equal(out, expected)
    assert torch.equal(M, before - expected)
    assert squared_norm.sqrt().item() == pytest.approx(torch.linalg.vector_norm(out.double()).item(), rel=1e-4)


@pytest.mark.parametrize(
    "native_bf16, device, expected",
    [
        (False, "cpu", torch.float32),  # AVX2 only (e.g. AMD EPYC): bf16 products are emulated, ~24x slower
        (True, "cpu", torch.bfloat16),  # AVX512-BF16 or AMX
        (False, "cuda", torch.bfloat16),
    ],
)
def test_powersgd_computes_in_the_dtype_the_device_multiplies_fast(monkeypatch, native_bf16, device, expected):
    """The codec's arithmetic follows the CPU's flags (faked here): on a CPU without bf16 instructions
    no bf16 copy of the matrices is kept (and the planner counts none); what is sent stays fp32."""
    from paratrain import config as config_mod
    from paratrain.parallel.codecs import basic as codecs
    from paratrain.parallel.codecs import powersgd

    monkeypatch.setattr(powersgd, "cpu_multiplies_bf16_natively", lambda: native_bf16)
    assert powersgd.arithmetic_dtype(torch.device(device), torch.float32) == expected
    if device == "cpu":
        shapes = [torch.Size((64, 32)), torch.Size((32,))]
        flat = torch.zeros(64 * 32 + 32)
        codec = powersgd.PowerSGD(rank=2, warm_start=True)
        st = codec._bucket(0, flat, shapes)
        assert st.dtype == expected and st.copies_matrices == (expected != torch.float32)
        assert st.first_round.dtype == st.q_flat.dtype == torch.float32  # the wire
        p = config_mod.from_dict({"parallel": {"compression": "powersgd", "powersgd_rank": 2}}).parallel
        kept = codecs.kept_bytes(p, [shapes], torch.float32, torch.device("cpu"))
        copies = 64 * 32 * 2 + powersgd.block_numel(st.matrices) * 2 if native_bf16 else 0
        assert kept == (flat.numel() + 2 * (64 + 32) + 32) * 4 + copies  # result, P, Q, the bias; copies


def local_sum_job(rt) -> None:
    import torch.distributed as dist

    from paratrain.comm.shm import LocalSum

    rank, world = rt.rank, rt.world_size
    local = LocalSum(None, timeout_s=30, capacity=64 * 1024)
    assert local.usable
    g = torch.Generator().manual_seed(rank)
    parts = [torch.randn(n, generator=g) for n in (1000, 7, 3000)]
    expected = [p.clone() for p in parts]
    for e in expected:
        dist.all_reduce(e)
    works = [local.start(p) for p in parts]
    for i in (2, 0, 1):  # waited out of order: a later wait takes the earlier messages too
        works[i].wait()
    for p, e in zip(parts, expected):
        assert torch.allclose(p, e, rtol=1e-6, atol=1e-6)
    gathered = [torch.empty_like(parts[2]) for _ in range(world)]
    dist.all_gather(gathered, parts[2])
    assert all(torch.equal(gathered[0], t) for t in gathered), "ranks disagree on the sum"


def test_shared_memory_sum_equals_all_reduce_on_every_rank(gang):
    """PowerSGD's small rounds on one host: the shared-memory sum at world 3 equals gloo's
    all-reduce, is bit-identical on every rank, and tolerates waits out of posting order."""
    gang(3).run("test_compression:local_sum_job")


class _ScriptedContender:
    """Stands in for a bench suite contender: its loss at step s is `loss(s)`."""

    def __init__(self, loss):
        self.loss, self.losses = loss, []

    def run(self, n: int, data) -> None:
        for _ in range(n):
            self.losses.append(self.loss(len(self.losses) + 1))


def equal_loss_job(rt) -> None:
    from paratrain.bench.suite_worker import equal_loss

    rank = rt.rank
    offset = 1.0 if rank == 0 else -1.0  # the ranks' losses differ; their mean is what counts
    dp = _ScriptedContender(lambda s: 100 - s + offset)  # pool mean after step s: 101.5 - s
    slow = _ScriptedContender(lambda s: 100 - s / 2 + offset)  # 100.75 - s / 2: twice the steps, nearly
    flat = _ScriptedContender(lambda s: 95.0)
    for e in (dp, slow, flat):
        e.run(8, None)  # the timed steps
    summary = {"paratrain dp": {"step_ms": 100.0}, "slow": {"step_ms": 50.0}, "flat": {"step_ms": 10.0}}
    out = equal_loss(
        {"paratrain dp": dp, "slow": slow, "flat": flat}, ["slow", "flat"], None, summary, 2, horizon=12, window=4
    )
    # dp trains on to the horizon: its loss after 12 steps is 89.5; within 0.1 % means <= 89.5895,
    # which "slow" reaches at step 23
    assert len(dp.losses) == 12
    assert (out["window"], out["dp_steps"], out["max_steps"]) == (4, 12, 24)
    assert out["dp_loss"] == pytest.approx(89.5)
    assert out["contenders"]["slow"]["steps"] == 23
    assert out["contenders"]["slow"]["speedup_at_equal_loss"] == pytest.approx(12 * 100.0 / (23 * 50.0))
    assert out["contenders"]["flat"] == {"steps": None, "steps_vs_dp": None, "speedup_at_equal_loss": None}
    assert len(flat.losses) == 24  # trained on up to twice dp's steps before giving up


def test_bench_suite_equal_loss_counts_the_extra_steps(gang):
    """The suite's "at equal loss" line: steps to dp's loss at the horizon (mean over ranks and the
    last `window` steps) and the speed-up in time that leaves; an engine that never gets there says so."""
    gang(2).run("test_compression:equal_loss_job")
