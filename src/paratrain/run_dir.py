"""The run directory of `paratrain run`: made writable and locked for this run, its config.toml
written, earlier checkpoints this run must not mix with put aside, and `--resume` checked against
what the directory holds before any worker starts."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from paratrain import config as config_mod
from paratrain.errors import ConfigError, write_failure

_LOCKS: list[int] = []  # the run directories' locks this process holds until the run ends


def prepare_run_dir(
    run_dir: Path, cfg: config_mod.Config, resume: str, node_rank: int, resume_step: int | None = None
) -> None:
    """Make the run directory (writable, with room), write its config.toml, and put earlier work
    that this run must not mix with aside: every checkpoint for a fresh start, and those past
    `resume_step` for --resume PATH, which are another run's future. Elastic restarts and a later
    --resume auto go on from the newest checkpoint here, so it must be this run's own."""
    # the checkpoints a resume goes on writing beside: a read-only folder fails here, not at the first save
    checkpoints = run_dir / "checkpoints"
    for folder in [run_dir, *([checkpoints] if resume != "none" and checkpoints.is_dir() else [])]:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            # A probe file of this process's own: the nodes of a multi-node run may share this
            # folder, and one node's unlink must not pull a shared name from under another.
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-") as probe:
                probe.write(b"ok")
        except OSError as exc:
            raise ConfigError("--run-dir", f"{folder} is not writable: {exc.strerror or exc}") from None
    if shutil.disk_usage(run_dir).free < 64 * 2**20:
        raise ConfigError("--run-dir", f"{run_dir} has less than 64 MiB free")
    write_config_toml(run_dir, cfg)
    if node_rank != 0:  # node 0 tidies a folder the nodes share
        return
    try:
        _put_earlier_work_aside(run_dir, resume, resume_step)
    except OSError as exc:  # a folder of it read-only, or a mount point that cannot move
        raise ConfigError("--run-dir", f"cannot put the earlier run's files in {run_dir} aside: {exc}") from None


def _put_earlier_work_aside(run_dir: Path, resume: str, resume_step: int | None) -> None:
    from paratrain.checkpoint.save import remove_unfinished

    old = run_dir / "checkpoints"
    for unfinished in (run_dir, old):  # saves and exports a crash cut short
        remove_unfinished(unfinished)
    if resume == "none":
        if old.is_dir() and any(old.iterdir()):
            aside = new_aside_dir(run_dir)
            old.rename(aside)
            print(f"paratrain: starting fresh; checkpoints of the earlier run moved to {aside}", flush=True)
        if (run_dir / "final").exists():  # it verifies, and would pass for this run's until its export
            aside = new_aside_dir(run_dir, "final")
            (run_dir / "final").rename(aside)
            print(f"paratrain: starting fresh; the earlier run's final export moved to {aside}", flush=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    elif resume_step is not None:
        from paratrain.checkpoint.reader import list_checkpoints

        later = [(step, path) for step, path in list_checkpoints(old) if step > resume_step]
        if later:
            aside = new_aside_dir(run_dir)
            aside.mkdir()
            for _, path in later:
                path.rename(aside / path.name)
            print(
                f"paratrain: resuming from step {resume_step}; the checkpoints past it here "
                f"(step {', '.join(str(step) for step, _ in later)}) moved to {aside}",
                flush=True,
            )


def write_config_toml(run_dir: Path, cfg: config_mod.Config) -> None:
    """RUN_DIR/config.toml, of a config that validated, written aside and renamed into place: a node
    reading it never sees another's half-write, and a failed write (a full disk) leaves the earlier
    one whole. ConfigError naming --run-dir, with the room left."""
    aside = run_dir / f".config-{uuid.uuid4().hex}.toml"
    try:
        aside.write_text(config_mod.to_toml(cfg))
        os.replace(aside, run_dir / "config.toml")
    except OSError as exc:
        aside.unlink(missing_ok=True)
        raise ConfigError("--run-dir", write_failure(run_dir / "config.toml", exc)) from None


def lock_run_dir(run_dir: Path) -> None:
    """Take RUN_DIR/.lock until the run ends; ConfigError if another run holds it.

    Two runs in one folder each put the other's checkpoints aside, prune them and write one
    metrics file. The lock is the kernel's (flock): it goes with the process, also when it is killed."""
    import fcntl

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError("--run-dir", f"{run_dir} is not writable: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            "--run-dir",
            f"{run_dir} is in use by another paratrain run (it holds {run_dir / '.lock'}); "
            f"wait for it, or give this run another name or --run-dir",
        ) from None
    _LOCKS.append(fd)


def new_aside_dir(run_dir: Path, what: str = "checkpoints") -> Path:
    """WHAT.prev-TIME, a name not taken yet (two runs may put checkpoints aside in one second)."""
    stamp = int(time.time())
    for n in itertools.count(1):
        aside = run_dir / (f"{what}.prev-{stamp}" + (f"-{n}" if n > 1 else ""))
        if not aside.exists():
            return aside
    raise AssertionError("unreachable: itertools.count never ends")


def check_resume(resume: str, cfg: config_mod.Config, run_dir: Path) -> int | None:
    """Check the checkpoint the run will resume from before any worker starts, and return its step.

    --resume PATH: that checkpoint, files and headers verified. auto: the newest in the run
    directory whose manifest and headers read; the workers verify its files and fall back to an
    older one if they fail, but all of them were written by one run, under one strategy and
    optimizer. None when there is nothing to resume from. ConfigError (exit 2) for a checkpoint this
    run cannot resume."""
    if resume == "none":
        return None
    import torch

    from paratrain.checkpoint.format import CheckpointError
    from paratrain.checkpoint.reader import CheckpointReader, check_files_present, list_checkpoints
    from paratrain.checkpoint.resume import check_resumable
    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.parallel.registry import checkpoint_family, strategy_class

    def check(reader: CheckpointReader) -> None:
        check_resumable(reader, cfg.parallel.strategy, cfg.train.optimizer, "--resume", checkpoint_family)
        with torch.device("meta"):  # names and shapes against the model, built on meta (no memory)
            model = build_model(cfg, build_dataset(cfg, "train"))
        strategy_class(cfg.parallel.strategy).check_checkpoint(reader, model)

    if resume != "auto":
        try:
            reader = CheckpointReader(resume)
            reader.verify()
            check(reader)
        except CheckpointError as exc:
            raise ConfigError("--resume", str(exc)) from None
        return reader.step
    for _, path in reversed(list_checkpoints(run_dir / "checkpoints")):
        try:
            reader = CheckpointReader(path)
            # before the model checks: a shard missing would read as a model that does not match,
            # which is the checkpoint's loss, not the config's error
            check_files_present(path, reader.manifest)
            check(reader)
            return reader.step
        except CheckpointError:
            continue  # rank 0 says why, as it skips it (checkpoint.latest_valid)
    return None


def newest_checkpoint_note(run_dir: Path) -> str:
    from paratrain.checkpoint.reader import list_checkpoints

    found = list_checkpoints(run_dir / "checkpoints")
    if not found:
        return "No checkpoint was written (checkpoint.every sets how often)."
    return f"The newest checkpoint is {found[-1][1]}: go on from it with --resume auto."


def release_locks() -> None:
    """Let go of the run directories this process locked (an in-process caller may start another
    run in the same folder next)."""
    while _LOCKS:
        os.close(_LOCKS.pop())
