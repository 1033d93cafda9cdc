"""The per-rank profiler, byte accounting, `paratrain report` and TensorBoard, from one real run."""
import json

import pytest

from helpers import check_ok, metrics, run_cli, write_config

from paratrain.cli import main
from paratrain.report import plot_timeline

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


def test_trace_is_chrome_trace_format_with_one_pid_per_rank(run_dir):
    events = json.loads((run_dir / "trace.json").read_text())
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {e["name"] for e in events if e["ph"] == "M"} >= {"process_name"}
    steps = [e for e in spans if e["cat"] == "step"]
    assert len(steps) == 2 * 12
    for step in steps:  # every phase lies inside its step, on the same rank
        inner = [e for e in spans if e["cat"] == "phase" and e["pid"] == step["pid"]
                 and e["args"]["step"] == step["args"]["step"]]
        assert inner and all(step["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1
                             for e in inner)


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
    assert "| rank | step |" in text and "all_reduce" in text and "val acc" in text


def test_pipeline_timeline_from_trace_records(tmp_path):
    """The pipeline strategy's spans (micro-batch indices, idle bubbles) draw without a pp run."""
    trace = []
    for rank in range(2):
        trace.append({"name": "step 1", "cat": "step", "ph": "X", "pid": rank, "ts": 0, "dur": 100, "args": {"step": 1}})
        for mb in range(4):
            start = 10 * mb + 10 * rank
            trace.append({"name": "forward", "cat": "phase", "ph": "X", "pid": rank, "ts": start, "dur": 10,
                          "args": {"step": 1, "index": mb}})
        trace.append({"name": "idle", "cat": "phase", "ph": "X", "pid": rank, "ts": 50, "dur": 20, "args": {"step": 1}})
    assert plot_timeline(trace, pp=2, name="pp", path=tmp_path / "t.png").stat().st_size > 10_000


def test_report_on_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a paratrain run directory" in err and len(err.strip().splitlines()) == 1
    assert main(["report", str(tmp_path / "missing")]) == 2
