"""[log] mlflow and [log] wandb: the real libraries, read back from their local stores (nothing
reaches the network: MLflow writes RUN_DIR/mlruns, wandb runs offline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import check_ok, metrics, run_cli, write_config
from reference import DIGITS_MLP

mlflow_tracking = pytest.importorskip("mlflow.tracking")
wandb_proto = pytest.importorskip("wandb.proto.wandb_internal_pb2")

LOGGED = ["--set", "train.steps=6", "--set", "train.log_every=2"]


def mlflow_run(run_dir: Path, monkeypatch):
    """The client over RUN_DIR/mlruns, and the one run in it."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it to read a file store
    client = mlflow_tracking.MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    experiments = [e.experiment_id for e in client.search_experiments()]
    (run,) = client.search_runs(experiments)
    return client, run


def mlflow_losses(client, run) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(entry["step"], entry["loss"]) for entry in metrics(run_dir)]


def wandb_records(path: Path):
    """The protobuf records of an offline run's .wandb file: a 7-byte file header, then a LevelDB
    log of 32 KiB blocks, each record a 7-byte header (checksum, length, kind) and its bytes, split
    across blocks as first/middle/last parts (wandb ships no Python reader of its own)."""
    block, header = 32768, 7
    raw, pos, pending = path.read_bytes(), header, b""
    while pos + header <= len(raw):
        if block - pos % block < header:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(raw[pos + 4 : pos + 6], "little"), raw[pos + 6]
        pending += raw[pos + header : pos + header + length]
        pos += header + length
        if kind in (1, 4):  # a whole record, or the last part of one
            record = wandb_proto.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def test_a_run_logs_its_metrics_config_and_model_to_mlflow_and_wandb(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # RUN_DIR/mlruns
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "c.toml", DIGITS_MLP)
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "paratrain-test"}
    sets = ["--set", "log.mlflow=true", "--set", "log.wandb=true"]
    check_ok(run_cli("run", str(cfg), "--nproc", "2", "--run-dir", str(run_dir), *LOGGED, *sets, env=env))
    logged = logged_losses(run_dir)
    assert [step for step, _ in logged] == [2, 4, 6]

    client, run = mlflow_run(run_dir, monkeypatch)
    assert mlflow_losses(client, run) == logged
    assert run.data.params["parallel.strategy"] == "dp" and run.data.params["train.steps"] == "6"
    assert run.info.status == "FINISHED"
    final = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "final")}
    assert {"model.safetensors", "manifest.json"} <= final

    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    records = list(wandb_records(next(offline.glob("run-*.wandb"))))
    history = [
        {".".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in records if r.history.item
    ]
    assert [(h["_step"], h["loss"]) for h in history] == logged
    (started,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert started.project == "paratrain-test"
    assert any(r.WhichOneof("record_type") == "artifact" for r in records)  # final/


def test_pt_log_reaches_mlflow_with_the_exported_model(tmp_path, gang, monkeypatch):
    """The own loop's `paratrain.init(log={"mlflow": True})`: pt.log's values, pt.export's directory."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    gang(2).run(
        "own_loop_model:job", strategy="dp", optimizer="sgd", out=str(tmp_path / "out"), run_dir=str(run_dir),
        log={"mlflow": True},
    )  # fmt: skip
    client, run = mlflow_run(run_dir, monkeypatch)
    assert mlflow_losses(client, run) == logged_losses(run_dir) and len(logged_losses(run_dir)) == 6
    assert run.data.params["parallel.strategy"] == "dp"
    assert "out/model.safetensors" in {a.path for a in client.list_artifacts(run.info.run_id, "out")}
