"""`paratrain convert SRC DEST --to dcp|safetensors|hf`: a model's weights from one format to another.

SRC is a paratrain final/ or checkpoint step-N (its checksums verified first; a checkpoint whose
ranks hold the model whole, dp's or a pipeline's, not zero's or tp's shards), a torch DCP directory
(`{"model": ...}` or a flat state_dict: checkpoint/weights.py) or a Hugging Face directory. DEST is
  dcp          a DCP directory of `{"model": state_dict}`, readable by plain dcp.load at any world size
  safetensors  DEST/model.safetensors + manifest.json: a paratrain final/ (`inspect`, `pretrained`)
  hf           the same, which is a save_pretrained directory where SRC carries a transformers
               model's config.json (copied beside); refused where it carries none
The tensors keep their dtype and bytes. DEST is written aside and renamed into place.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from paratrain.checkpoint.export import export_model
from paratrain.checkpoint.format import (
    FINAL_FORMAT,
    FORMAT,
    UNFINISHED,
    CheckpointError,
    CheckpointWriteFailed,
    fsync_dir,
    write_bytes_durably,
)
from paratrain.checkpoint.reader import read_manifest, verify_files
from paratrain.checkpoint.weights import CheckpointModelWeights, Weights, save_dcp, weights_in
from paratrain.errors import write_failure

TARGETS = ("dcp", "safetensors", "hf")
# what save_pretrained writes beside the weights, carried over to a DEST that can hold it
HF_FILES = ("config.json", "generation_config.json")


class ConvertRefused(ValueError):
    """Input convert cannot take (exit 2, one line)."""


def convert(src: Path, dest: Path, to: str) -> Path:
    """Write SRC's model weights to DEST in format `to` (module docstring); ConvertRefused on bad input."""
    if to not in TARGETS:
        raise ConvertRefused(f"--to: {to!r} is none of {' | '.join(TARGETS)}")
    if not src.is_dir():
        raise ConvertRefused(f"{src}: no such directory")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConvertRefused(f"{dest} exists and is not an empty directory")
    manifest = _source_manifest(src)
    weights: Weights | None
    try:
        if manifest.get("format") == FORMAT:
            try:
                weights = CheckpointModelWeights(src, manifest["world_size"], manifest["strategy"])
            except CheckpointError as exc:
                raise ConvertRefused(f"{exc}: convert its run's final/ (its model, consolidated)") from None
        else:
            weights = weights_in(src)
    except CheckpointError as exc:  # a damaged DCP .metadata, say
        raise ConvertRefused(str(exc)) from None
    if weights is None:
        raise ConvertRefused(f"{src} holds no model.safetensors, DCP .metadata or paratrain manifest.json")
    beside = {name: (src / name).read_bytes() for name in HF_FILES if (src / name).is_file()}
    if to == "hf" and "config.json" not in beside:
        raise ConvertRefused(f"--to hf: {src} carries no config.json (only a transformers model's export has one)")
    if to == "dcp":
        _write_dcp(dest, weights, beside)
    else:
        export_model(
            dest,
            weights.layout(),
            ({name: value} for name, value in weights.tensors()),
            step=manifest.get("step", 0),
            config=manifest.get("config", {}),
            extra={"converted_from": str(src)},
            files=beside,
        )
    return dest


def _source_manifest(src: Path) -> dict:
    """A paratrain final/'s or checkpoint's manifest, its files verified; {} for a source without
    one (DCP, HF)."""
    if not (src / "manifest.json").is_file():
        return {}
    try:
        manifest = read_manifest(src, formats=(FINAL_FORMAT, FORMAT))
        verify_files(src, manifest)
    except CheckpointError as exc:
        raise ConvertRefused(str(exc)) from None
    return manifest


def _write_dcp(dest: Path, weights: Weights, beside: dict[str, bytes]) -> None:
    """`{"model": ...}` in DCP, `beside`'s files with it (a transformers model's config.json, which
    `pretrained` with the hf factory reads), written aside and renamed into place."""
    tmp = dest.parent / f"{UNFINISHED}{dest.name}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_dcp(tmp, dict(weights.tensors()))  # one dcp.save of the whole model: its own process's
        for name, content in beside.items():
            write_bytes_durably(tmp / name, content)
        fsync_dir(tmp)
        if dest.exists():
            dest.rmdir()  # empty (convert checked)
        os.rename(tmp, dest)
        fsync_dir(dest.parent)
    except OSError as exc:  # a full disk, say: no partial DEST, the failure said as export_model says it
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteFailed(f"{dest} not written: {write_failure(exc.filename or tmp, exc)}") from None
