"""`paratrain inspect PATH`: what a checkpoint or final export holds, and whether its files match
their checksums; given a run directory, every checkpoint and the final export of it, a line each.

Reads only the manifest and the safetensors headers (no tensor is loaded), hashes every file, and
prints step, world size, strategy, per-file tensor counts and bytes, and the tensors grouped by kind.
Exit 0 when every checksum holds, 2 when the directory is none of these or a file is missing or
corrupt.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

from safetensors import safe_open

from paratrain.checkpoint.format import FINAL_FORMAT, FORMAT, CheckpointError, regular_file, sha256_file
from paratrain.checkpoint.reader import list_checkpoints, read_manifest, verify_files
from paratrain.errors import error

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}


def tensor_headers(path: Path) -> list[tuple[str, str, list[int], int]]:
    """(name, dtype, shape, bytes) of every tensor in a safetensors file, from its header only."""
    out = []
    with safe_open(str(path), framework="pt") as fh:
        for name in fh.keys():
            piece = fh.get_slice(name)
            shape, dtype = piece.get_shape(), piece.get_dtype()
            out.append((name, dtype, shape, math.prod(shape) * DTYPE_BYTES.get(dtype, 0)))
    return out


def kind(name: str) -> str:
    """Group key of a tensor name: `zero.param`, `zero.optim`, `model`, `optim`, `rng`, ..."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "zero" else parts[0]


def inspect(path: str | Path, show_tensors: bool = False, out=None) -> int:
    out = out or sys.stdout  # looked up per call: the stdout of the moment (the CLI wraps it)
    path = Path(path)
    if not (path / "manifest.json").exists() and ((path / "checkpoints").is_dir() or (path / "final").is_dir()):
        return inspect_run(path, out)
    try:
        m = read_manifest(path, (FORMAT, FINAL_FORMAT))
    except CheckpointError as exc:
        error(f"{exc}")
        return 2
    final = m["format"] == FINAL_FORMAT
    group = (lambda name: "model") if final else kind  # a final export holds the model alone
    try:
        saved = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(m["time"])) if "time" in m else "?"
    except (OverflowError, ValueError, OSError):  # a time no calendar has
        saved = "?"
    print(f"{'final export' if final else 'checkpoint'} {path}", file=out)
    print(
        f"step {m['step']} | world size {m.get('world_size', '?')} | strategy {m.get('strategy', '?')} | "
        + (f"{m['parameters']:,} parameters" if final and "parameters" in m else f"saved {saved}"),
        file=out,
    )
    print(f"{'file':<26}{'tensors':>8}{'bytes':>14}  sha256", file=out)
    bad, total_tensors, total_bytes = 0, 0, 0
    kinds: Counter = Counter()
    kind_bytes: Counter = Counter()
    listing = []
    for name, entry in sorted(m["files"].items()):
        file = path / name
        try:
            size = regular_file(file).st_size
        except CheckpointError:  # missing, or a symlink: never followed
            status = (
                "MISSING"
                if not os.path.lexists(file)
                else "SYMLINK (not followed)"
                if file.is_symlink()
                else "NOT A REGULAR FILE"
            )
            print(f"{name:<26}{'-':>8}{'-':>14}  {status}", file=out)
            bad += 1
            continue
        ok = size == entry["bytes"] and sha256_file(file) == entry["sha256"]
        try:
            # a final export's other files (config.json, tokenizer, adapter's config) hold no tensors
            headers = tensor_headers(file) if name.endswith(".safetensors") else []
        except Exception as exc:  # a corrupt header: report it, keep going with the other files
            print(f"{name:<26}{'?':>8}{size:>14,}  CORRUPT ({exc})", file=out)
            bad += 1
            continue
        bad += not ok
        total_tensors += len(headers)
        total_bytes += size
        for tname, dtype, shape, nbytes in headers:
            kinds[group(tname)] += 1
            kind_bytes[group(tname)] += nbytes
            listing.append((name, tname, dtype, shape, nbytes))
        status = "ok" if ok else "CORRUPT (does not match the manifest)"
        print(f"{name:<26}{len(headers):>8}{size:>14,}  {status}", file=out)
    print(
        f"{'total':<26}{total_tensors:>8}{total_bytes:>14,}  {'all checksums ok' if not bad else f'{bad} bad file(s)'}",
        file=out,
    )
    print("tensors by kind: " + ", ".join(f"{k} {kinds[k]} ({kind_bytes[k]:,} B)" for k in sorted(kinds)), file=out)
    if show_tensors:
        for file, tname, dtype, shape, nbytes in listing:
            print(f"  {file}  {tname}  {dtype}{list(shape)}  {nbytes:,} B", file=out)
    if bad:
        error(f"{path}: {bad} file(s) missing or corrupt")
        return 2
    return 0


def inspect_run(run_dir: Path, out=None) -> int:
    """A line for each checkpoint of a run directory and its final export: what, and whether valid."""
    out = out or sys.stdout
    entries = [(f"checkpoints/{p.name}", p) for _, p in list_checkpoints(run_dir / "checkpoints")]
    if (run_dir / "final").is_dir():
        entries.append(("final", run_dir / "final"))
    print(f"run directory {run_dir}", file=out)
    bad = 0
    for label, entry in entries:
        try:
            m = read_manifest(entry, (FORMAT, FINAL_FORMAT))
            verify_files(entry, m)
            status = (
                f"step {m['step']} | world size {m.get('world_size', '?')} | strategy {m.get('strategy', '?')} | ok"
            )
        except CheckpointError as exc:
            status, bad = f"INVALID: {exc}", bad + 1
        print(f"{label:<26}{status}", file=out)
    if not entries:
        error(f"{run_dir}: no checkpoint and no final export")
        return 2
    if bad:
        error(f"{run_dir}: {bad} of {len(entries)} invalid")
        return 2
    return 0
