"""safetensors files written a tensor at a time.

A safetensors file is an 8-byte header length, a JSON header with every tensor's dtype, shape and
byte offsets, then the tensors' raw bytes. The header follows from dtypes and shapes alone, so it is
written first and each tensor is written at its own offset as it arrives: no copy of the whole set
ever exists in memory, and a strategy can hand the consolidated model over a unit at a time. The
bytes are those of safetensors' own `save` of the same tensors (its order: larger dtypes first, then
by name, so that every tensor is aligned to its element size).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from paratrain.checkpoint.format import sha256_file

# a tensor's place in the file: its dtype and shape
Layout = Mapping[str, tuple[torch.dtype, Sequence[int]]]

DTYPE_NAMES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
}
RANK = {name: i for i, name in enumerate(DTYPE_NAMES.values())}  # safetensors' Dtype order, which save sorts by


def layout_of(tensors: dict[str, torch.Tensor]) -> Layout:
    return {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}


def header(layout: Layout, metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """The file's first bytes (length, JSON header, padding to 8 bytes) and where each tensor's
    bytes start in the file."""
    names = {k: DTYPE_NAMES[dtype] for k, (dtype, _) in layout.items()}
    entries: dict = {"__metadata__": metadata}
    offset = 0
    for k in sorted(layout, key=lambda k: (-RANK[names[k]], k)):
        dtype, shape = layout[k]
        size = math.prod(shape) * dtype.itemsize
        entries[k] = {"dtype": names[k], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    starts = {k: start + e["data_offsets"][0] for k, e in entries.items() if k != "__metadata__"}
    return len(text).to_bytes(8, "little") + text, starts


def write_safetensors(
    path: Path, layout: Layout, chunks: Iterable[dict[str, torch.Tensor]], metadata: dict[str, str]
) -> tuple[str, int]:
    """Write `path` from `chunks`, pieces of {name: tensor} that together hold every tensor of
    `layout` once, each written as it comes (a piece may be freed once the next is asked for);
    synced to disk. (sha256, bytes) of the file."""
    head, starts = header(layout, metadata)
    left = dict(layout)
    with open(path, "wb") as fh:
        fh.write(head)
        for chunk in chunks:
            for name, t in chunk.items():
                expected = left.pop(name, None)
                if expected is None or t.dtype != expected[0] or tuple(t.shape) != tuple(expected[1]):
                    raise ValueError(f"{path}: tensor {name!r} is not in the header, comes twice, or differs from it")
                t = t.detach().cpu().contiguous()
                fh.seek(starts[name])
                # its bytes in place: numpy's view (t.numpy()) would leave the storage unresizable for
                # good, and zero3 frees a gathered unit by resizing its storage to nothing
                fh.write((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))
        if left:
            raise ValueError(f"{path}: no values came for {sorted(left)[:5]}")
        fh.flush()
        os.fsync(fh.fileno())
    return sha256_file(path), os.path.getsize(path)
