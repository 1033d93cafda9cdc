"""What a run reports: metrics.jsonl, one grep-able line per logged step, a progress bar on a TTY,
TensorBoard scalars (RUN_DIR/tensorboard) when log.tensorboard is on, and the same numbers to MLflow
and wandb when log.mlflow or log.wandb is (trackers.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from paratrain.errors import say
from paratrain.trackers import Trackers

if TYPE_CHECKING:
    from paratrain.config import Config


class _OutlivesItsReader:
    """sys.stdout that turns into /dev/null when its reader goes away (`paratrain run ... | head`):
    the run goes on, logged to metrics.jsonl, instead of dying on a BrokenPipeError at its next line."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())  # what is still buffered drains there too
        os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def keep_stdout_when_its_reader_leaves() -> None:
    if not isinstance(sys.stdout, _OutlivesItsReader):
        sys.stdout = _OutlivesItsReader(sys.stdout)


# the keys of a metrics line, in its order, and how each is written
_LINE = (
    ("loss", "loss {:.6f}"),
    ("lr", "lr {:.3e}"),
    ("samples_per_s", "samples/s {:.1f}"),
    ("val_loss", "val_loss {:.4f}"),
    ("val_acc", "val_acc {:.4f}"),
    ("compile_s", "compile {:.1f}s"),  # train.compile: the first step's, left out of samples/s
    ("time", "time {:.1f}s"),
)


class MetricsLog:
    """Rank 0 only. Appends to RUN_DIR/metrics.jsonl (a resumed run continues the same file)."""

    def __init__(self, run_dir: Path, cfg: Config, start_step: int, enabled: bool):
        self.enabled = enabled
        self.file = open(Path(run_dir) / "metrics.jsonl", "a") if enabled else None
        self.tensorboard = None
        if enabled and cfg.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=start_step + 1)
        self.trackers = Trackers(run_dir, cfg) if enabled else None
        self.bar = None
        if enabled and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.steps, initial=start_step, unit="step", dynamic_ncols=True, leave=False)

    def print(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def advance(self, loss: float | None = None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}")

    def record(self, entry: dict) -> None:
        if not self.enabled:
            return
        assert self.file is not None  # open while enabled
        self.file.write(json.dumps(entry) + "\n")
        self.file.flush()
        numbers = {k: v for k, v in entry.items() if k != "step" and isinstance(v, (int, float))}
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, entry["step"])
            self.tensorboard.flush()
        assert self.trackers is not None  # open while enabled
        self.trackers.log(entry["step"], numbers)
        parts = [f"step {entry['step']:>6}"]  # pt.log's entries hold what the user's loop logged
        for key, template in _LINE:
            if isinstance(entry.get(key), (int, float)):
                parts.append(template.format(entry[key]))
        self.print("  ".join(parts))

    def artifact(self, directory: Path) -> None:
        """Hand `directory` (the exported model) to the trackers."""
        if self.trackers is not None:
            self.trackers.artifact(Path(directory))

    def close(self, failed: bool = False) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.trackers is not None:
            self.trackers.close(failed)


def read_jsonl(path: Path) -> list[dict]:
    """Every entry of a JSON-lines log (metrics.jsonl, profile.jsonl). A line that is not a JSON
    object, such as the torn last line of a run killed mid-write, is skipped with a warning: one bad
    line must not stop a resume or a report."""
    path = Path(path)
    if not path.is_file():
        return []
    entries, skipped = [], 0
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            entry = None
        if isinstance(entry, dict) and isinstance(entry.get("step", 0), (int, float)):
            entries.append(entry)
            continue
        skipped += 1
        if skipped <= WARNED_LINES:
            say(f"warning: {path}:{number}: skipping a line that is not a log entry (torn by a crash?)")
    if skipped > WARNED_LINES:  # a file that is not a log at all: a line each flooded the terminal
        say(f"warning: {path}: skipped {skipped - WARNED_LINES} more lines that are not log entries")
    return entries


WARNED_LINES = 3  # torn lines of a log named one by one; past them, only how many more


def keep_steps_up_to(path: Path, step: int) -> list[dict]:
    """Rewrite a JSON-lines log with its entries up to `step` (a resume redoes the later ones), into a
    temporary file renamed over it, so that a crash mid-rewrite leaves the old file whole."""
    path = Path(path)
    kept = [entry for entry in read_jsonl(path) if entry.get("step", 0) <= step]
    if path.is_file():
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps(entry) + "\n" for entry in kept))
        os.replace(tmp, path)
    return kept


def summary_line(result: dict, cfg: Config, run_dir: Path) -> str:
    first, last = result["first_step"], result["last_step"]
    if last == first:  # train.steps = 0, or resumed at or past it
        why = f"the checkpoint is at step {last}, " if last else ""
        return (
            f"done: nothing to train ({why}train.steps = {cfg.train.steps}) | "
            f"model: {run_dir / 'final' / 'model.safetensors'}"
        )
    steps = f"steps {first + 1}-{last}" if first else f"{last} steps"
    compile_s = result.get("compile_s", 0.0)  # train.compile's first step: out of samples/s
    parts = [f"done: {steps} in {result['elapsed']:.1f}s" + (f" (compile {compile_s:.1f}s)" if compile_s else "")]
    if "loss" in result:
        parts.append(f"loss {result['loss']:.4f}")
    for key in ("val_loss", "val_acc"):
        if key in result:
            parts.append(f"{key} {result[key]:.4f}")
    trained = last - first - (1 if compile_s else 0)
    parts.append(f"{trained * cfg.data.batch_size / max(result['elapsed'] - compile_s, 1e-9):.1f} samples/s")
    parts.append(f"model: {run_dir / 'final' / 'model.safetensors'}")
    return " | ".join(parts)
