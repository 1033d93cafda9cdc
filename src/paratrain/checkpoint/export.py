"""RUN_DIR/final/: the consolidated model as one safetensors file with its manifest, written into
a hidden folder and renamed into place."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from paratrain.checkpoint.format import FINAL_FORMAT, UNFINISHED, fsync_dir, unshared, write_bytes_durably
from paratrain.checkpoint.save import remove_unfinished


# -- the consolidated export ---------------------------------------------------------------------
def export_final(
    run_dir: Path, state: dict[str, torch.Tensor], *, step: int, config: dict, extra: dict, files: dict | None = None
) -> Path:
    """RUN_DIR/final/model.safetensors keyed exactly like the user's model.state_dict(), and `files`
    (name -> bytes) beside it: a transformers model's config.json (models/hf.py)."""
    final = export_model(Path(run_dir) / "final", state, step=step, config=config, extra=extra, files=files)
    remove_unfinished(Path(run_dir) / "checkpoints")  # the run is over: no save of it is under way
    return final


def export_model(
    final: Path, state: dict[str, torch.Tensor], *, step: int, config: dict, extra: dict, files: dict | None = None
) -> Path:
    """FOLDER/model.safetensors, `files` beside it and its manifest.json (the Python API's
    pt.export names FOLDER)."""
    final = Path(final)
    tmp = final.parent / f"{UNFINISHED}{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    data = st_save(unshared(state), metadata={"format": "pt"})
    files = {"model.safetensors": data, **(files or {})}
    for name, content in files.items():
        write_bytes_durably(tmp / name, content)
    manifest = {
        "format": FINAL_FORMAT,
        "step": step,
        "config": config,
        "files": {name: {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)} for name, b in files.items()},
        "tensors": {
            k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in state.items()
        },
        **extra,
    }
    write_bytes_durably(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp)  # the files' names durable before the rename publishes them
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    return final
