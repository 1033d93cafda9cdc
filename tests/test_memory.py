"""Peak memory: train.track_memory's measurement (the peak of tensor bytes torch allocates on a
rank) on a known allocation pattern, and the planner's predicted peak against it on real runs."""

import json

import pytest
import torch

from paratrain.bench.plan import MEMORY_STEPS, MODELS, PIPE, steady_peak_mib
from paratrain.config import load
from paratrain.data import build_dataset
from paratrain.errors import ConfigError
from paratrain.models import build_model
from paratrain.plan.planner import make_plan
from paratrain.profile import MemoryTracker

MIB = 2**20


def test_the_tracker_counts_a_known_allocation_pattern():
    """What exists when the tracker is made is left out; each step starts from what is alive (views
    not counted twice) and peaks where the most is alive at once, whatever was freed before its
    end; what happens between steps is not counted."""
    dataset = torch.zeros(4 * MIB, dtype=torch.uint8)
    tracker = MemoryTracker(torch.device("cpu"))
    model = torch.zeros(3 * MIB, dtype=torch.uint8)
    view = model[: MIB // 2]
    try:
        tracker.begin_step()
        temporary = torch.empty(5 * MIB, dtype=torch.uint8)
        del temporary
        kept = torch.empty(MIB, dtype=torch.uint8)
        assert tracker.end_step() == 8 * MIB  # the model, and the temporary at its largest
        between = torch.empty(9 * MIB, dtype=torch.uint8)  # evaluation, say: no step's
        del between, kept
        tracker.begin_step()
        ones = torch.ones(2 * MIB, dtype=torch.uint8)
        twos = ones + ones
        del ones, twos
        assert tracker.end_step() == 7 * MIB  # the model, both operands at once
    finally:
        tracker.close()
    assert dataset.numel() and view.numel()


def test_the_tracker_follows_autograd_through_backward():
    """Backward runs on autograd's own thread: its gradients are counted as they come and go."""
    w = torch.zeros(256, 256, requires_grad=True)  # 256 KiB
    tracker = MemoryTracker(torch.device("cpu"))
    x = torch.ones(1024, 256)  # 1 MiB, the batch
    try:
        tracker.begin_step()
        h = (x @ w).relu()  # the product (1 MiB), freed once the relu's output (1 MiB, saved) exists
        h.sum().backward()  # the relu's input gradient (1 MiB) while its saved output lives; w.grad
        peak = tracker.end_step()
    finally:
        tracker.close()
    # w and x, made before the step, and two 1 MiB tensors at once (in forward and again in
    # backward), plus the loss and its gradient (a float each)
    assert peak == 256 * 1024 + MIB + 2 * MIB + 8, peak - 3.25 * MIB


def test_tracking_memory_and_torch_profiler_traces_exclude_each_other(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text(MODELS["mlp"][0].format(**MODELS["mlp"][1]))
    with pytest.raises(ConfigError, match="^train.track_memory: .*train.torch_profiler"):
        load(str(config), ["train.track_memory=true", "train.torch_profiler=true"])


# the bench's own models (`paratrain bench plan`), each on 2 processes
LAYOUTS = {
    "gpt zero2": ("gpt", ["parallel.strategy='zero2'"]),
    "mlp tp 2": ("mlp", ["parallel.strategy='tp'", "parallel.tp=2"]),
    "gpt pp 2 1f1b": ("gpt", ["parallel.strategy='pp'", "parallel.pp=2", "parallel.schedule='1f1b'", *PIPE]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_planned_peak_is_within_5_percent_of_the_measured_one(gang, tmp_path, name):
    """A real run's peak (train.track_memory: the largest rank's, over its steps) against the
    plan's: the transients of a step (activation gradients, the logits, incoming gradients, ZeRO's
    unit in flight, tp's sharded activations, the pipeline's microbatches in flight) are counted."""
    model, sets = LAYOUTS[name]
    text, sizes = MODELS[model]
    config = tmp_path / "job.toml"
    config.write_text(text.format(**sizes))
    run = tmp_path / "run"
    gang(2).train(config, run, [*sets, f"train.steps={MEMORY_STEPS}", "train.log_every=1", "train.track_memory=true"])
    entries = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [json.loads(line) for line in (run / "profile.jsonl").read_text().splitlines()]
    for entry, step in zip(entries, steps, strict=True):  # metrics.jsonl: the largest rank's
        assert entry["peak_memory_mib"] == max(r["peak_memory_bytes"] for r in step["ranks"]) / MIB
    measured = steady_peak_mib(run)  # as the bench measures it

    cfg = load(str(config), sets)
    with torch.device("meta"):
        meta_model = build_model(cfg, build_dataset(cfg, "train"))
    predicted = make_plan(cfg, meta_model, 2, 1, "cpu")["predicted"]["peak_memory_gib"] * 1024
    assert abs(predicted / measured - 1) <= 0.05, (predicted, measured)
