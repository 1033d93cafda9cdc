"""Models and samples as users bring them: inputs of any structure, outputs with their own loss
or logits, each strategy equal to single-process PyTorch written here."""

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import final_weights, max_rel_error, metrics, run_cli, write_config
from user_models import two_halves

from paratrain.cli import main

HALVES = """
name = "halves"
[model]
factory = "user_models:two_halves"
[data]
factory = "user_models:digit_halves"
batch_size = 24
shuffle = false
[train]
steps = 12
optimizer = "sgd"
lr = 0.1
log_every = 6
"""


@pytest.fixture(scope="module")
def halves_reference():
    """TwoHalves trained in one plain process on the unshuffled digits (the contract's batches)."""
    from paratrain.data.datasets import digits

    x, y = digits("train").tensors
    torch.manual_seed(0)
    model = two_halves()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(12):
        idx = torch.arange(step * 24, (step + 1) * 24) % len(x)
        opt.zero_grad()
        F.cross_entropy(model(x[idx, :32], x[idx, 32:]), y[idx]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "world, layout, overrides",
    [
        (2, "tuple", ["train.grad_accum=2"]),  # model(*x), cut into micro-batches
        (2, "dict", ["model.key='logits'"]),  # model(**x); the built-in loss reads `logits`
        (3, "labelled", ["train.loss='model'"]),  # model(**item) computes its own loss
        (2, "labelled", ["train.loss='model'", "parallel.strategy='zero3'"]),
    ],
)
def test_structured_samples_equal_single_process(tmp_path, gang, halves_reference, world, layout, overrides):
    cfg = write_config(tmp_path / "c.toml", HALVES)
    gang(world).train(cfg, tmp_path / "run", [f"data.layout='{layout}'", *overrides])
    assert max_rel_error(final_weights(tmp_path / "run"), halves_reference) <= 1e-4


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["data.layout='bare'"], "data.factory"),  # a bare tensor is no sample
        (["data.layout='labelled'"], "train.loss"),  # no target for cross_entropy
        (["data.layout='dict'", "model.key='scores'"], "train.loss"),  # a dict output with no logits
        (["data.layout='dict'", "train.loss='model'"], "train.loss"),  # an output with no loss
    ],
)
def test_bad_samples_and_outputs_exit_2(tmp_path, capsys, overrides, key):
    cfg = write_config(tmp_path / "c.toml", HALVES)
    sets = [a for o in overrides for a in ("--set", o)]
    code = main(["run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), *sets])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and key in lines[0], err


BN_CNN = """
name = "bn"
[model]
factory = "user_models:bn_cnn"
[data]
factory = "digits"
batch_size = 24
shuffle = false
[train]
steps = 12
optimizer = "sgd"
lr = 0.1
log_every = 6
"""

CLIPPED = BN_CNN.replace("user_models:bn_cnn", "user_models:clipped_mlp")


@pytest.fixture(scope="module")
def bn_reference():
    from reference import train_reference
    from user_models import bn_cnn

    from paratrain.data.datasets import digits

    x, y = digits("train").tensors
    torch.manual_seed(0)
    return train_reference(bn_cnn(), x, y, steps=12, batch_size=24, lr=0.1)


@pytest.mark.parametrize(
    "world, overrides",
    [
        (2, ["parallel.strategy='dp'"]),
        (3, ["parallel.strategy='dp'"]),
        (2, ["parallel.strategy='zero2'"]),
        (3, ["parallel.strategy='zero2'"]),
        (3, ["parallel.strategy='zero3'"]),
        (3, ["parallel.strategy='ps'", "ps.mode='sync'"]),  # one server, two workers
        (2, ["parallel.strategy='hybrid'", "parallel.microbatches=1"]),  # dp 2 x tp 1 x pp 1
    ],
)
def test_batchnorm_over_the_global_batch_equals_single_process(tmp_path, gang, bn_reference, world, overrides):
    """Weights and running statistics (final/ holds them) equal one process's."""
    cfg = write_config(tmp_path / "c.toml", BN_CNN)
    gang(world).train(cfg, tmp_path / "run", overrides)
    weights = final_weights(tmp_path / "run")
    assert {"2.running_mean", "2.running_var", "6.running_var"} <= weights.keys()
    assert max_rel_error(weights, bn_reference) <= 1e-4


def ddp_bn_job(rt, out: str, accum: int, steps: int = 12, batch: int = 24) -> None:
    """torch DDP (broadcast_buffers: rank 0's statistics before a forward that follows a synced
    backward) on paratrain dp's data split, accumulating `accum` microbatches as DDP users do (all
    but the last under no_sync(), so only a step's first forward broadcasts), run on a gang's
    process group; rank 0 writes the final weights."""
    from safetensors.torch import save_file
    from torch.nn.parallel import DistributedDataParallel
    from user_models import bn_cnn

    from paratrain.data.datasets import digits

    x, y = digits("train").tensors
    torch.manual_seed(0)
    model = DistributedDataParallel(bn_cnn())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    share = batch // rt.world_size
    for step in range(steps):
        idx = (torch.arange(step * batch, (step + 1) * batch) % len(x))[rt.rank * share : (rt.rank + 1) * share]
        opt.zero_grad()
        for i, micro in enumerate(idx.chunk(accum)):
            with model.no_sync() if i < accum - 1 else contextlib.nullcontext():
                (F.cross_entropy(model(x[micro]), y[micro]) / accum).backward()
        opt.step()
    if rt.rank == 0:
        save_file({k: v.contiguous() for k, v in model.module.state_dict().items()}, out)


@pytest.mark.parametrize("strategy, accum", [("dp", 1), ("zero2", 2)])
def test_batchnorm_per_rank_equals_torch_ddp(tmp_path, gang, strategy, accum):
    """parallel.sync_batchnorm = false: each rank's own statistics, rank 0's kept, as DDP does,
    with gradient accumulation too (rank 0's buffers before each step's first microbatch). The
    validation after the last step scores rank 0's statistics on every rank (DDP broadcasts them
    before an eval forward): the model `final/` holds."""
    from safetensors.torch import load_file
    from user_models import bn_cnn

    from paratrain.data.datasets import digits

    gang(2).run("test_user_models:ddp_bn_job", out=str(tmp_path / "ddp.safetensors"), accum=accum)
    cfg = write_config(tmp_path / "c.toml", BN_CNN)
    sets = [f"parallel.strategy='{strategy}'", "parallel.sync_batchnorm=false", f"train.grad_accum={accum}"]
    gang(2).train(cfg, tmp_path / "run", sets)
    final = final_weights(tmp_path / "run")
    assert max_rel_error(final, load_file(str(tmp_path / "ddp.safetensors"))) <= 1e-4
    model = bn_cnn()
    model.load_state_dict(final)
    x, y = digits("val").tensors
    with torch.no_grad():
        val_loss = F.cross_entropy(model.eval()(x), y).item()
    assert metrics(tmp_path / "run")[-1]["val_loss"] == pytest.approx(val_loss, rel=1e-5)


@pytest.mark.parametrize(
    "job, sets",
    [
        (BN_CNN, ["parallel.strategy='zero2'"]),
        (HALVES, ["data.layout='labelled'", "train.loss='model'"]),
        # its forward reads values (.item(), numpy): measured on a real microbatch, said in a note
        (CLIPPED, []),
        (CLIPPED, ["parallel.strategy='tp'", "parallel.tp=2", "parallel.tp_plan={first='colwise',second='rowwise'}"]),
    ],
)
def test_plan_takes_these_jobs(tmp_path, capsys, monkeypatch, job, sets):
    from paratrain.cost import played

    monkeypatch.setattr(played, "_VERDICTS", {})  # each plan tries fake tensors afresh (one per process)
    cfg = write_config(tmp_path / "c.toml", job)
    code = main(["plan", str(cfg), "--nproc", "2", *[a for s in sets for a in ("--set", s)]])
    out = capsys.readouterr()
    assert code == 0 and "predicted" in out.out, out.err
    if job is CLIPPED:
        assert "measured on a real microbatch" in out.err, out.err


def test_plan_on_a_forward_nothing_can_play_exits_2_in_one_line(tmp_path, capsys, monkeypatch):
    """Where neither fake tensors nor a real batch run the model's forward, one line, no traceback."""
    import user_models

    def broken(self, x):
        raise TypeError("this forward takes no tensors")

    monkeypatch.setattr(user_models.ClippedMLP, "forward", broken)
    code = main(["plan", str(write_config(tmp_path / "c.toml", CLIPPED)), "--nproc", "2"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "model.factory" in lines[-1] and "TypeError" in lines[-1], lines
    assert not any("Traceback" in line for line in lines), lines


def test_pipeline_that_would_train_no_copy_of_a_parameter_exits_2(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.toml", BN_CNN.replace("user_models:bn_cnn", "user_models:forgetful_stack"))
    sets = ["--set", "parallel.strategy='pp'", "--set", "parallel.pp=2"]
    code = main(["run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), *sets])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "parallel.pp" in lines[0] and "scale" in lines[0], lines


def test_a_pipeline_cut_that_drops_what_the_forward_does_exits_2_naming_it(tmp_path):
    """The model's forward runs a tanh between the layers its pipeline_layers() lists: cut there,
    the stages would train without it, silently. parallel.verify_plan checks each cut against the
    model's own forward before training and exits 2 naming the cut."""
    cfg = write_config(tmp_path / "c.toml", BN_CNN.replace("user_models:bn_cnn", "user_models:skipping_stack"))
    sets = ["--set", "parallel.strategy='pp'", "--set", "parallel.pp=2", "--set", "parallel.balance='params'"]
    proc = run_cli("run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "r"), *sets, cwd=Path(__file__).parent)
    lines = sorted(set(proc.stderr.strip().splitlines()))  # each rank says the one line
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "parallel.pp" in lines[0] and "'second'" in lines[0], lines
