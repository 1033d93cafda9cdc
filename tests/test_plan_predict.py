"""`train.recompute`, the cluster description and the step-time model of `paratrain plan`.

Recompute must train equal to no recompute (the equivalence promise) and keep only each block's
input for backward, as the plan counts it; memory is measured here as the resident memory a real
forward adds (glibc told to mmap every allocation over 64 KiB, so a freed tensor leaves RSS)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import CPU_ONLY, check_ok, final_weights, max_rel_error, run_cli, write_config
from reference import train_reference

from paratrain.config import load
from paratrain.data import build_dataset, load_batch
from paratrain.models import build_model
from paratrain.optim import build_loss

GPT = """
name = "recompute"
[model]
factory = "gpt"
n_layer = 2
n_head = 4
d_model = 32
[data]
factory = "corpus"
block_size = 16
max_chars = 20000
batch_size = 8
shuffle = false
[train]
steps = 20
optimizer = "sgd"
lr = 0.1
log_every = 10
recompute = "full"
[parallel]
microbatches = 4
"""


DIGITS = """
[model]
factory = "{model}"
[data]
factory = "digits"
batch_size = 8
"""


@pytest.mark.parametrize("text", [GPT, DIGITS.format(model="mlp"), DIGITS.format(model="cnn")],
                         ids=["gpt", "mlp", "cnn"])
def test_recompute_gives_the_same_gradients(tmp_path, text):
    """Each built-in model: one forward and backward with and without recompute, equal gradients."""
    config = write_config(tmp_path / "job.toml", text)
    grads = []
    for mode in ("none", "full"):
        cfg = load(config, [f"train.recompute='{mode}'"])
        dataset = build_dataset(cfg, "train")
        torch.manual_seed(0)
        model = build_model(cfg, dataset)
        x, y = load_batch(dataset, torch.arange(8))
        build_loss(cfg)(model(x), y).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


def test_recompute_in_pipeline_stages_trains_equal(tmp_path):
    """Interleaved pp 2 (four virtual stages, each chunk checkpointed by block) against plain
    single-process training of the same gpt without recompute."""
    from paratrain.data.datasets import corpus
    from paratrain.models.gpt import gpt

    train = corpus("train", block_size=16, max_chars=20000)
    x, y = load_batch(train, torch.arange(20 * 8) % len(train))
    torch.manual_seed(0)
    reference = train_reference(gpt(train.vocab_size, n_layer=2, n_head=4, d_model=32, block_size=16), x, y,
                                steps=20, batch_size=8, lr=0.1)
    config = write_config(tmp_path / "gpt.toml", GPT)
    check_ok(run_cli("run", str(config), "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                     "--set", "parallel.strategy='pp'", "--set", "parallel.pp=2",
                     "--set", "parallel.schedule='interleaved'", "--set", "parallel.balance='params'"))
    weights = final_weights(tmp_path / "run")
    # the attention's key bias: rounding noise only (its gradient is exactly zero), compared absolutely
    small = {k for k, v in reference.items() if v.norm() < 1e-6}
    assert max_rel_error({k: v for k, v in weights.items() if k not in small},
                         {k: v for k, v in reference.items() if k not in small}) <= 1e-4
    for k in small:
        assert (weights[k] - reference[k]).abs().max() < 1e-6


MEASURE = """
import json, sys, torch
from paratrain.config import load
from paratrain.data import build_dataset, load_batch
from paratrain.models import build_model
from paratrain.optim import build_loss
from paratrain.plan import saved_activation_bytes

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

seen = {}
for mode in ("none", "full"):
    cfg = load(None, sys.argv[1:] + [f"train.recompute='{mode}'"])
    dataset = build_dataset(cfg, "train")
    model, loss_fn = build_model(cfg, dataset), build_loss(cfg)
    x, y = load_batch(dataset, torch.arange(cfg.data.batch_size))
    with torch.no_grad():  # the kernels' one-time set-up, outside the measurement
        loss_fn(model(x), y)
    before = resident()
    loss = loss_fn(model(x), y)
    seen[mode] = {"measured": resident() - before, "planned": saved_activation_bytes(cfg, len(x))[0]}
    del loss
print(json.dumps(seen))
"""


def test_recompute_lowers_measured_activations_as_planned(tmp_path):
    """A 4-block gpt (d_model 256, 32 x 64 tokens): the memory a forward leaves for backward, with
    and without recompute, within 10 % of the plan's count; recompute keeps under a tenth."""
    script = write_config(tmp_path / "measure.py", MEASURE)
    proc = subprocess.run([sys.executable, str(script), "model.d_model=256", "model.n_layer=4", "data.batch_size=32",
                           "data.max_chars=100000"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **CPU_ONLY, "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    for mode, bytes_ in seen.items():
        assert abs(bytes_["measured"] - bytes_["planned"]) <= 0.1 * bytes_["planned"], seen
    assert seen["full"]["planned"] < seen["none"]["planned"] / 10
