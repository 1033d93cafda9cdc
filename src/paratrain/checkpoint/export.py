"""RUN_DIR/final/: the consolidated model as one safetensors file with its manifest, written into
a hidden folder and renamed into place. The model comes a piece at a time (a strategy's
model_chunks: one unit gathered at a time), each written as it comes (checkpoint/writer.py)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from paratrain.checkpoint.format import (
    FINAL_FILE,
    FINAL_FORMAT,
    UNFINISHED,
    CheckpointWriteFailed,
    fsync_dir,
    sha256_file,
    write_bytes_durably,
)
from paratrain.checkpoint.save import remove_unfinished
from paratrain.checkpoint.writer import Layout, write_safetensors
from paratrain.errors import write_failure

# derived(export folder, its layout) -> the names of the files it wrote there from model.safetensors
Derived = Callable[[Path, Layout], list[str]]


# -- the consolidated export ---------------------------------------------------------------------
def export_final(
    run_dir: Path,
    layout: Layout,
    chunks: Iterable[dict[str, torch.Tensor]],
    *,
    step: int,
    config: dict,
    extra: dict,
    files: dict[str, bytes] | None = None,
    derived: Derived | None = None,
) -> Path:
    """RUN_DIR/final/model.safetensors keyed exactly like the user's model.state_dict(): `layout`
    names every tensor's dtype and shape, `chunks` bring their values; `files` (name -> bytes) go
    beside it (a transformers model's config.json: models/hf.py), and what `derived` writes from it
    (a LoRA model's adapter and merged model: models/lora.py)."""
    run_dir = Path(run_dir)
    final = export_model(
        run_dir / "final", layout, chunks, step=step, config=config, extra=extra, files=files, derived=derived
    )
    remove_unfinished(run_dir / "checkpoints")  # the run is over: no save of it is under way
    return final


def export_model(
    final: Path,
    layout: Layout,
    chunks: Iterable[dict[str, torch.Tensor]],
    *,
    step: int,
    config: dict,
    extra: dict,
    files: dict[str, bytes] | None = None,
    derived: Derived | None = None,
) -> Path:
    """FOLDER/model.safetensors, `files` beside it, what `derived(folder, layout)` writes there from
    model.safetensors (the names it returns) and its manifest.json listing them all, written aside
    and renamed into place (the Python API's pt.export names FOLDER). A failed write (a full disk)
    leaves no partial files and raises CheckpointWriteFailed."""
    final = Path(final)
    tmp = final.parent / f"{UNFINISHED}{final.name}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        digest, size = write_safetensors(tmp / FINAL_FILE, layout, chunks, {"format": "pt"})
        listed = {FINAL_FILE: {"sha256": digest, "bytes": size}}
        for name, content in (files or {}).items():
            write_bytes_durably(tmp / name, content)
            listed[name] = {"sha256": hashlib.sha256(content).hexdigest(), "bytes": len(content)}
        for name in derived(tmp, layout) if derived else ():
            listed[name] = {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size}
        manifest = {
            "format": FINAL_FORMAT,
            "step": step,
            "config": config,
            "files": listed,
            "tensors": {
                k: {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
                for k, (dtype, shape) in layout.items()
            },
            "parameters": sum(math.prod(shape) for _, shape in layout.values()),
            **extra,
        }
        write_bytes_durably(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
        fsync_dir(tmp)  # the files' names durable before the rename publishes them
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteFailed(
            f"final export {final} not written: {write_failure(exc.filename or tmp, exc)}"
        ) from None
    return final
