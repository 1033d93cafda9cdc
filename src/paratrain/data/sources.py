"""What `paratrain data prepare` reads: SRC's files (local paths or fsspec URLs), each one's
documents (the whole text, JSONL fields, CSV columns) or NumPy tokens, checked as they are read:
anything unreadable is a ConfigError naming SRC or --field."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np

from paratrain.errors import ConfigError


def source_files(src: str) -> list[str]:
    """SRC's files as URLs, sorted: a file, every file under a folder, or a glob."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(src)
        if fs.isdir(path):
            paths = sorted(p for p in fs.find(path) if not Path(p).name.startswith("."))
        elif any(ch in path for ch in "*?["):
            paths = sorted(fs.glob(path))
        elif fs.isfile(path):
            paths = [path]
        else:
            paths = []
    except (ImportError, ValueError, OSError) as exc:
        raise ConfigError("SRC", f"cannot read {src}: {exc}") from None
    if not paths:
        raise ConfigError("SRC", f"{src}: no such file or folder (or nothing in it)")
    return [fs.unstrip_protocol(p) for p in paths]


def guess_format(files: list[str]) -> str:
    suffixes = {Path(f).suffix.lower() for f in files}
    for fmt, suffix in (("jsonl", ".jsonl"), ("csv", ".csv"), ("npy", ".npy")):
        if suffixes == {suffix}:
            return fmt
    return "text"


def read_documents(url: str, fmt: str, field: str) -> list[str]:
    """One file's documents: the whole text, each JSONL line's field, or each CSV row's column."""
    import fsspec

    with fsspec.open(url, "rb") as fh:
        raw = fh.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("SRC", f"{url} is not UTF-8 text (byte {exc.start})") from None
    if fmt == "text":
        return [text]
    if fmt == "csv":
        reader = csv.DictReader(io.StringIO(text))
        if field not in (reader.fieldnames or []):
            raise ConfigError("--field", f"{field!r} is not a column of {url} (columns: {reader.fieldnames})")
        return [row[field] or "" for row in reader]
    docs = []
    for where, record in read_jsonl(url, text):
        if field not in record:
            raise ConfigError("--field", f"{field!r} is not in {where}")
        if not isinstance(record[field], str):
            raise ConfigError("--field", f"{field!r} in {where} is a {type(record[field]).__name__}, not text")
        docs.append(record[field])
    return docs


def read_jsonl(url: str, text: str | None = None) -> list[tuple[str, dict]]:
    """Each non-blank line's object, with where it is ("line N of URL")."""
    if text is None:
        (text,) = read_documents(url, "text", "")
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"line {n} of {url}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError("SRC", f"{where} is not JSON: {exc.msg}") from None
        if not isinstance(record, dict):
            raise ConfigError("SRC", f"{where} is not a JSON object")
        records.append((where, record))
    return records


def read_array(url: str) -> np.ndarray:
    import fsspec

    with fsspec.open(url, "rb") as fh:
        try:
            arr = np.load(io.BytesIO(fh.read()), allow_pickle=False)
        except ValueError as exc:
            raise ConfigError("SRC", f"{url} is not a NumPy array of tokens: {exc}") from None
    if arr.dtype.kind not in "iu" or arr.ndim not in (1, 2) or (arr.size and arr.min() < 0):
        raise ConfigError(
            "SRC",
            f"{url} holds {arr.dtype} of shape {arr.shape}: expected non-negative "
            "integer tokens, a 1-D stream or 2-D rows of block_size + 1",
        )
    return arr
