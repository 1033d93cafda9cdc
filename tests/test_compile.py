"""train.compile = true: block by block, equal to eager (rel <= 1e-4, fp32) under dp, zero3, tp
and pp at world 2; what is compiled; the compile time out of samples/s.

Compiling on 2 shared cores is slow: one tiny GPT, few steps (inductor's on-disk cache makes the
runs after the first quicker)."""

import pytest
import torch
from helpers import final_weights, metrics, rel_error, write_config
from reference import train_reference
from torch import nn

from paratrain.data import load_batch
from paratrain.data.datasets import corpus
from paratrain.models.compiled import blocks_of
from paratrain.models.gpt import gpt

STEPS, BATCH = 4, 8
GPT = f"""
name = "compiled"
[model]
factory = "gpt"
n_layer = 2
n_head = 4
d_model = 32
[data]
factory = "corpus"
block_size = 16
max_chars = 20000
batch_size = {BATCH}
shuffle = false
[train]
steps = {STEPS}
optimizer = "sgd"
lr = 0.1
log_every = 2
compile = true
[parallel]
microbatches = 2
"""


def test_blocks_are_the_layers_a_pipeline_cuts_between():
    model = gpt(50, n_layer=3, d_model=16, n_head=2, block_size=8)
    assert blocks_of(model) == [model.embed, *model.blocks, model.head]
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert blocks_of(seq) == [seq[0], seq[2]]  # parameterless children run eagerly

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.ReLU()])) for _ in range(2))

        def forward(self, x):
            return x

    stack = Stack()
    assert blocks_of(stack) == list(stack.layers)  # the outer list's elements, not the inner's
    single = nn.Linear(3, 3)
    assert blocks_of(single) == [single]


@pytest.fixture(scope="module")
def eager_reference():
    train = corpus("train", block_size=16, max_chars=20000)
    x, y = load_batch(train, torch.arange(STEPS * BATCH) % len(train))
    torch.manual_seed(0)
    model = gpt(train.vocab_size, n_layer=2, n_head=4, d_model=32, block_size=16)
    return train_reference(model, x, y, steps=STEPS, batch_size=BATCH, lr=0.1)


@pytest.mark.parametrize(
    "name,sets",
    [
        ("dp", []),
        ("zero3", ["parallel.strategy='zero3'"]),
        ("tp", ["parallel.strategy='tp'", "parallel.tp=2"]),
        ("pp", ["parallel.strategy='pp'", "parallel.pp=2"]),
    ],
)
def test_compiled_equals_eager_at_world_2(tmp_path, gang, eager_reference, name, sets):
    cfg = write_config(tmp_path / "gpt.toml", GPT)
    out = gang(2).train(cfg, tmp_path / name, sets, timeout=600)
    assert rel_error(final_weights(tmp_path / name), eager_reference) <= 1e-4, name
    first = metrics(tmp_path / name)[0]
    assert first["compile_s"] > 0 and "compile_s" not in metrics(tmp_path / name)[1]
    assert "compile " in out and out.count("torch.compile: ") == 1  # the graph breaks reported once
    graphs = int(out.split("torch.compile: ")[1].split()[0])
    assert graphs > 0, f"{name}: nothing compiled"


def test_the_planner_times_compiled_layers(tmp_path):
    """paratrain plan --calibrate times each layer as the run will run it: compiled where the config
    compiles (its own entry in the timings file, apart from eager's)."""
    from torch._dynamo.utils import counters

    from paratrain.plan import layer_times
    from paratrain.preflight import load

    cfg = load(str(write_config(tmp_path / "gpt.toml", GPT)), [])
    measured = layer_times.layer_times(cfg, 2, 1, forward_flops=0)
    assert len(measured) == 4 and all(t.forward_s > 0 and t.backward_s > 0 for t in measured)  # embed, 2 blocks, head
    assert counters["stats"]["unique_graphs"] > 0
