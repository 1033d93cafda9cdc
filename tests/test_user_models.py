"""Models and samples as users bring them: inputs of any structure, outputs with their own loss
or logits, each strategy equal to single-process PyTorch written here."""

import pytest
import torch
import torch.nn.functional as F
from helpers import final_weights, max_rel_error, write_config
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
