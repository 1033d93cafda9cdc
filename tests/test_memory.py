"""Peak memory: train.track_memory's measurement (the peak of tensor bytes torch allocates on a
rank) on a known allocation pattern, and the planner's predicted peak against it on real runs."""

import hashlib
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


def test_the_tracker_skips_what_a_compiled_run_leaves_behind():
    """What torch.compile leaves in a process (a later run in it, as in the test gang): a dead
    weakref.proxy and a fake tensor are no storages to count, and do not stop the count. (The
    tracker also collects garbage before it starts: measured, a pipeline stage's peak after
    tests/test_compile.py in the same gang came out 7 % low without it.)"""
    import weakref

    from torch._subclasses.fake_tensor import FakeTensorMode

    class Node:
        pass

    gone = Node()
    left_behind = [weakref.proxy(gone), FakeTensorMode().from_tensor(torch.zeros(4))]
    del gone
    tracker = MemoryTracker(torch.device("cpu"))
    try:
        tracker.begin_step()
        kept = torch.empty(MIB, dtype=torch.uint8)
        assert tracker.end_step() == MIB
    finally:
        tracker.close()
    assert kept.numel() and left_behind


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


# 1.9M parameters, AdamW: a unit per Linear under zero3 (each 512 x 512 about 1 MiB)
EXPORTED = ["train.steps=3", "train.log_every=1", "train.track_memory=true", "parallel.bucket_mb=0.5"]


def export_peak_job(rt, config: str, run_dir: str, overrides: list[str]) -> int:
    """A run whose final export is counted like a step (train.track_memory's count): this rank's
    peak of tensor bytes during the export."""
    from pathlib import Path

    from paratrain import preflight
    from paratrain.trainer import Trainer

    cfg = preflight.load(config, overrides)
    cfg.train.device = rt.device.type
    trainer = Trainer(cfg, Path(run_dir), rt)
    export, peaks = trainer.export, []

    def counted() -> None:
        trainer.memory.begin_step()
        export()
        peaks.append(trainer.memory.end_step())

    trainer.export = counted
    trainer.fit()
    return peaks[0]


def test_the_export_streams_a_unit_at_a_time_and_zero3_peaks_below_dp(gang, tmp_path):
    """final/ is written as the strategy gathers it, a unit at a time: no rank's export holds more
    than one unit beyond its training peak (zero3's rank 0 held the whole model, gathered and copied,
    before), so zero3's whole-run peak stays well below dp's; the file is a safetensors file keyed
    like the model's state_dict, its sha256 in the manifest."""
    from helpers import max_rel_error
    from safetensors.torch import load_file

    from paratrain.checkpoint.format import sha256_file

    config = tmp_path / "job.toml"
    config.write_text(MODELS["mlp"][0].format(layers=8, width=512))
    cfg = load(str(config), EXPORTED)
    with torch.device("meta"):
        model = build_model(cfg, build_dataset(cfg, "train"))
    unit = max(sum(p.numel() * p.element_size() for p in m.parameters()) for m in model.children())
    whole_run, weights = {}, {}
    for strategy in ("dp", "zero3"):
        run = tmp_path / strategy
        overrides = [*EXPORTED, f"parallel.strategy='{strategy}'"]
        run.mkdir()
        exports = gang(2).run("test_memory:export_peak_job", config=str(config), run_dir=str(run), overrides=overrides)
        steps = [json.loads(line) for line in (run / "profile.jsonl").read_text().splitlines()]
        training = [max(step["ranks"][r]["peak_memory_bytes"] for step in steps) for r in range(2)]
        for rank in range(2):
            assert exports[rank] <= training[rank] + unit, (strategy, rank, exports[rank] - training[rank], unit)
        whole_run[strategy] = max(*exports, *training)
        final = run / "final"
        weights[strategy] = load_file(final / "model.safetensors")
        assert set(weights[strategy]) == set(model.state_dict())
        manifest = json.loads((final / "manifest.json").read_text())
        assert manifest["files"]["model.safetensors"]["sha256"] == sha256_file(final / "model.safetensors")
    assert whole_run["zero3"] <= 0.7 * whole_run["dp"], whole_run
    assert max_rel_error(weights["zero3"], weights["dp"]) <= 1e-5


def test_a_file_written_a_tensor_at_a_time_is_the_one_safetensors_writes(tmp_path):
    """Pieces in any order give safetensors' own bytes (every dtype's alignment kept); a piece
    outside the header, twice, or a tensor never given is an error, not a file with a hole."""
    from safetensors.torch import save

    from paratrain.checkpoint.writer import layout_of, write_safetensors

    tensors = {
        "b": torch.randn(3, 4).t(),  # not contiguous
        "a": torch.arange(2),
        "mask": torch.ones(3, dtype=torch.bool),
        "h": torch.ones(2, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.0),
        "empty": torch.zeros(0, 5),
    }
    path = tmp_path / "x.safetensors"
    pieces = [{k: v} for k, v in reversed(tensors.items())]
    digest, size = write_safetensors(path, layout_of(tensors), pieces, {"format": "pt"})
    expected = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})
    assert path.read_bytes() == expected and size == len(expected)
    assert digest == hashlib.sha256(expected).hexdigest()
    for wrong in ([*pieces, {"a": tensors["a"]}], pieces[1:], [{"other": torch.ones(1)}]):
        with pytest.raises(ValueError, match="x.safetensors"):
            write_safetensors(path, layout_of(tensors), wrong, {"format": "pt"})
