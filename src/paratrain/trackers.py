"""Experiment trackers beside metrics.jsonl: MLflow (`[log] mlflow`) and Weights & Biases
(`[log] wandb`). Rank 0 only, through MetricsLog, so `paratrain run` and `pt.log` log the same
values: the config as params, every logged step's numbers, and the exported model as an artifact.

Nothing here reaches the network unless the user points it there: MLflow writes to
MLFLOW_TRACKING_URI, else to a file store in RUN_DIR/mlruns; wandb runs offline (into RUN_DIR/wandb)
unless WANDB_MODE says otherwise or WANDB_API_KEY is set."""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paratrain.config import Config

# MlflowClient.log_batch takes at most this many params in one call
_MLFLOW_PARAMS_PER_BATCH = 100


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """The config as dotted keys (`parallel.strategy`), each value as text: how trackers take params."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class _MLflow:
    def __init__(self, run_dir: Path, cfg: Config):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 refuses a file store unless told: RUN_DIR/mlruns is one by the contract, and
            # a database store would need SQLAlchemy, which mlflow-skinny does not bring
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (Path(run_dir).resolve() / "mlruns").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(cfg.name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.name)
        self.run_id = self.client.create_run(experiment_id, run_name=Path(run_dir).name).info.run_id
        params = [Param(key, value) for key, value in flat_params(cfg.to_dict()).items()]
        for first in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[first : first + _MLFLOW_PARAMS_PER_BATCH])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now_ms, step) for k, v in values.items()])

    def artifact(self, directory: Path) -> None:
        self.client.log_artifacts(self.run_id, str(directory), artifact_path=directory.name)

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class _Wandb:
    def __init__(self, run_dir: Path, cfg: Config):
        import wandb

        # without a say from the user, offline: a run must not stop to ask for a login
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", cfg.name),
            name=Path(run_dir).name,
            dir=str(run_dir),
            config=cfg.to_dict(),
            mode=mode,  # type: ignore[arg-type]  # (WANDB_MODE's own values)
            # the console stays ours: metrics lines and the progress bar go straight to stdout
            settings=wandb.Settings(console="off"),
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def artifact(self, directory: Path) -> None:
        import wandb

        artifact = wandb.Artifact(f"{self.run.name}-{directory.name}", type="model")
        artifact.add_dir(str(directory))
        self.run.log_artifact(artifact)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Trackers:
    """The trackers that `cfg.log` turns on, each with its own run for this run directory."""

    def __init__(self, run_dir: Path, cfg: Config):
        self.open = [
            tracker(run_dir, cfg) for tracker, on in ((_MLflow, cfg.log.mlflow), (_Wandb, cfg.log.wandb)) if on
        ]
        if self.open:  # an own loop need not call pt.close(): its runs end when its process does
            atexit.register(self.close)

    def log(self, step: int, values: dict[str, float]) -> None:
        for tracker in self.open:
            tracker.log(step, values)

    def artifact(self, directory: Path) -> None:
        for tracker in self.open:
            tracker.artifact(directory)

    def close(self, failed: bool = False) -> None:
        for tracker in self.open:
            tracker.close(failed)
        self.open = []
        atexit.unregister(self.close)
