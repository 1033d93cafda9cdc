"""The per-rank profiler, byte accounting, `paratrain report` and TensorBoard, from one real run."""

import json

import pytest
from helpers import check_ok, metrics, run_cli, write_config

from paratrain.cli import main

RUN = """
name = "profiled"
[model]
factory = "mlp"
hidden = 32
[data]
factory = "digits"
batch_size = 24
[train]
steps = 12
optimizer = "sgd"
lr = 0.1
log_every = 5
eval_every = 6
torch_profiler = true
[parallel]
bucket_mb = 0.002   # several buckets: several all-reduces per step
[log]
tensorboard = true
"""
PARAMS = 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10  # mlp(64, hidden=32, n_layers=2, out=10)


def planned_comm(config, world: int, *sets: str) -> list[dict]:
    """`paratrain plan`'s bytes per step for each rank, to hold against what the profiler measured."""
    out = config.parent / "plan.json"
    args = [a for s in sets for a in ("--set", s)]
    assert main(["plan", str(config), "--nproc", str(world), "--json", str(out), *args]) == 0
    return [r["comm"] for r in json.loads(out.read_text())["ranks"]]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profiled")
    cfg = write_config(tmp / "c.toml", RUN)
    check_ok(run_cli("run", str(cfg), "--nproc", "2", "--run-dir", str(tmp / "run")))
    return tmp / "run"


def test_profile_jsonl_has_every_step_of_every_rank(run_dir):
    records = [json.loads(line) for line in (run_dir / "profile.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    for record in records:
        assert [r["rank"] for r in record["ranks"]] == [0, 1]
        for r in record["ranks"]:
            phases = r["phases"]
            assert {"data", "forward", "backward", "comm", "optimizer", "idle", "other"} <= phases.keys()
            assert all(v >= 0 for v in phases.values())
            assert phases["forward"] > 0 and phases["backward"] > 0 and phases["idle"] == 0
            assert sum(phases.values()) == pytest.approx(r["step_s"], rel=1e-6, abs=1e-6)
            # byte accounting: every gradient once through a ring all-reduce, 2(N-1)/N = 1 x for N = 2
            assert r["comm"]["all_reduce"]["payload"] == 4 * PARAMS
            assert r["comm"]["all_reduce"]["min_sent"] == 4 * PARAMS == r["bytes_min"]
            assert r["bytes_sent"] >= 0.9 * r["bytes_min"]  # measured socket writes, plus headers
    entries = metrics(run_dir)
    assert all({"step_s", "comm_s", "bytes_min"} <= e.keys() for e in entries)
    # and `paratrain plan` said so before the run: the same collectives, payloads and minimum
    planned = planned_comm(run_dir.parent / "c.toml", 2)
    assert all(r["comm"] == planned[r["rank"]] for record in records for r in record["ranks"])


def test_trace_is_chrome_trace_format_with_one_pid_per_rank(run_dir):
    events = json.loads((run_dir / "trace.json").read_text())
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {e["name"] for e in events if e["ph"] == "M"} >= {"process_name"}
    steps = [e for e in spans if e["cat"] == "step"]
    assert len(steps) == 2 * 12
    for step in steps:  # every phase lies inside its step, on the same rank
        inner = [
            e
            for e in spans
            if e["cat"] == "phase" and e["pid"] == step["pid"] and e["args"]["step"] == step["args"]["step"]
        ]
        assert inner and all(
            step["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1 for e in inner
        )


def test_tensorboard_and_torch_profiler_files(run_dir):
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    traces = list((run_dir / "torch_profiler").glob("*.json"))
    assert {t.name.split(".")[0] for t in traces} == {"rank0", "rank1"}


def test_report_writes_plots_and_summary(run_dir, capsys):
    assert main(["report", str(run_dir)]) == 0
    out = run_dir / "report"
    for name in ("loss.png", "throughput.png", "breakdown.png", "timeline.png"):
        assert (out / name).stat().st_size > 10_000, name
    text = (out / "report.md").read_text()
    assert "| rank | steps | step |" in text and "all_reduce" in text and "val acc" in text
    assert "| 0 | 11 |" in text and "| 1 | 11 |" in text  # 12 steps, less the first (warm-up)


PIPELINE = (
    RUN.replace("torch_profiler = true", "")
    .replace("tensorboard = true", "tensorboard = false")
    .replace("[parallel]\n", '[parallel]\nstrategy = "pp"\npp = 2\nmicrobatches = 4\n')
)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["parallel.tp=2", "parallel.strategy='hybrid'", 'parallel.tp_plan={ "0" = "colwise", "2" = "rowwise" }'],
    ],
    ids=["pp", "tp-x-pp"],
)
def test_model_parallel_steps_are_profiled_per_microbatch(tmp_path, gang, extra):
    """Every strategy reports to the profiler; here the pipeline: forward and backward of each
    microbatch, idle while a neighbour's message is not there yet, messages counted as sent and
    received, collectives (tp's, the gradient norm's) as communication."""
    cfg = write_config(tmp_path / "c.toml", PIPELINE)
    world = 4 if extra else 2
    gang(world).train(cfg, tmp_path / "run", extra)
    records = [json.loads(line) for line in (tmp_path / "run" / "profile.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    idle = [0.0] * world
    for record in records:
        ranks = record["ranks"]
        for r in ranks:
            phases = r["phases"]
            assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0
            assert sum(phases.values()) == pytest.approx(r["step_s"], rel=1e-6, abs=1e-6)
            assert r["comm"]["all_reduce"]["payload"] > 0  # the gradient norm, tp's activations
            idle[r["rank"]] += phases["idle"]
        # pipeline rank 0 sends activations that rank 1 receives, and receives their gradients
        first, last = ranks[0]["comm"], ranks[-1]["comm"]
        assert first["send"]["payload"] == last["recv"]["payload"] > 0
        assert first["recv"]["payload"] == last["send"]["payload"] == first["send"]["payload"]
    assert all(t > 0 for t in idle), idle  # each stage waits on the other at some point
    # `paratrain plan` foresaw every message and collective, tp's all-reduces included
    planned = planned_comm(cfg, world, *extra)
    assert all(r["comm"] == planned[r["rank"]] for record in records for r in record["ranks"])
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    forwards = {(e["pid"], e["args"]["index"]) for e in trace if e.get("name") == "forward"}
    assert forwards == {(rank, mb) for rank in range(world) for mb in range(4)}
    assert main(["report", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "report" / "timeline.png").stat().st_size > 10_000


@pytest.mark.parametrize("strategy, world", [("zero2", 2), ("ps", 3)])
def test_sharded_and_parameter_server_steps_are_profiled(tmp_path, gang, strategy, world):
    """ZeRO: compute phases, and its gradient reduce-scatter (an in-place all-reduce on gloo) counted
    in full. Parameter server: workers' compute and their pushes (send) and pulls (recv) of every
    parameter, the server's optimizer."""
    cfg = write_config(
        tmp_path / "c.toml",
        RUN.replace("torch_profiler = true", "").replace("tensorboard = true", "tensorboard = false"),
    )
    gang(world).train(cfg, tmp_path / "run", [f"parallel.strategy='{strategy}'"])
    records = [json.loads(line) for line in (tmp_path / "run" / "profile.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    for record in records:
        for r in record["ranks"]:
            phases, comm = r["phases"], r["comm"]
            assert sum(phases.values()) == pytest.approx(r["step_s"], rel=1e-6, abs=1e-6)
            if strategy == "ps" and r["rank"] == 0:  # the server
                assert phases["optimizer"] > 0 and comm["recv"]["payload"] >= 2 * 4 * PARAMS
                continue
            assert phases["forward"] > 0 and phases["backward"] > 0
            if strategy == "ps":
                assert comm["send"]["payload"] >= 4 * PARAMS and comm["recv"]["payload"] >= 4 * PARAMS
            else:
                assert phases["optimizer"] > 0 and comm["all_reduce"]["payload"] >= 4 * PARAMS
    # every collective, push and pull as `paratrain plan` foresaw them (ZeRO's built from gloo's primitives)
    planned = planned_comm(cfg, world, f"parallel.strategy='{strategy}'")
    assert all(r["comm"] == planned[r["rank"]] for record in records for r in record["ranks"])


def test_report_on_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a paratrain run directory" in err and len(err.strip().splitlines()) == 1
    assert main(["report", str(tmp_path / "missing")]) == 2
