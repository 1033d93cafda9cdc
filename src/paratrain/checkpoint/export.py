"""RUN_DIR/final/: the consolidated model as one safetensors file with its manifest, written into
a hidden folder and renamed into place. The model comes a piece at a time (a strategy's
model_chunks: one unit gathered at a time), each written as it comes (checkpoint/writer.py)."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from paratrain.checkpoint.format import FINAL_FILE, FINAL_FORMAT, UNFINISHED, fsync_dir, write_bytes_durably
from paratrain.checkpoint.save import remove_unfinished
from paratrain.checkpoint.writer import Layout, write_safetensors


# -- the consolidated export ---------------------------------------------------------------------
def export_final(
    run_dir: Path,
    layout: Layout,
    chunks: Iterable[dict[str, torch.Tensor]],
    *,
    step: int,
    config: dict,
    extra: dict,
) -> Path:
    """RUN_DIR/final/model.safetensors keyed exactly like the user's model.state_dict(): `layout`
    names every tensor's dtype and shape, `chunks` bring their values."""
    run_dir = Path(run_dir)
    tmp, final = run_dir / f"{UNFINISHED}final", run_dir / "final"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    digest, size = write_safetensors(tmp / FINAL_FILE, layout, chunks, {"format": "pt"})
    manifest = {
        "format": FINAL_FORMAT,
        "step": step,
        "config": config,
        "files": {FINAL_FILE: {"sha256": digest, "bytes": size}},
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
    fsync_dir(run_dir)
    remove_unfinished(run_dir / "checkpoints")  # the run is over: no save of it is under way
    return final
