"""`paratrain data prepare SRC DEST`: text, JSONL, CSV or NumPy tokens -> token-block shards.

The output is a folder (any fsspec URL) of safetensors shards, each one tensor "tokens" of shape
[samples, block_size + 1] (a sample's input is its first block_size tokens, its target the last
block_size), an `index.json` naming every shard with its sample count, byte size and sha256, and
the tokenizer. Blocks start every block_size tokens, as the character corpus's do.

Deterministic by construction: files are read in sorted order, the work is split by file and
put back together in that order, safetensors writes no timestamps, and the index is sorted JSON.
Two process pools do the work: one encodes the source files, one cuts, hashes and uploads shards.
Workers hand tokens to the parent through .npy files in a scratch folder, never through pickles.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paratrain.errors import ConfigError, error

FORMATS = ("text", "jsonl", "csv", "npy")
END_OF_TEXT = "<|endoftext|>"
INDEX = "index.json"
TOKENIZER = "tokenizer.json"
INDEX_FORMAT = "paratrain-shards/1"


@dataclass(frozen=True)
class Job:
    src: str
    dest: str
    format: str | None = None
    field: str = "text"
    tokenizer: str = "bytes"
    block_size: int = 64
    shard_mb: float = 64.0
    workers: int | None = None
    learnt_tokenizer: str | None = None  # a BPE tokenizer's JSON to encode with instead of training one on SRC


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# -- reading the source ---------------------------------------------------------------------------
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
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError("SRC", f"{url} line {n} is not JSON: {exc.msg}") from None
        if not isinstance(record, dict) or field not in record:
            raise ConfigError("--field", f"{field!r} is not in line {n} of {url}")
        if not isinstance(record[field], str):
            raise ConfigError(
                "--field", f"{field!r} in line {n} of {url} is a {type(record[field]).__name__}, not text"
            )
        docs.append(record[field])
    return docs


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


# -- tokenizers -----------------------------------------------------------------------------------
def parse_tokenizer(spec: str) -> int | None:
    """None for bytes, the vocabulary size for bpe:VOCAB."""
    if spec == "bytes":
        return None
    kind, _, vocab = spec.partition(":")
    if kind != "bpe" or not vocab.isdigit():
        raise ConfigError("--tokenizer", f"expected bytes or bpe:VOCAB, got {spec!r}")
    if int(vocab) < 257:
        raise ConfigError(
            "--tokenizer", f"a BPE vocabulary holds the 256 bytes and {END_OF_TEXT}: at least 257, got {vocab}"
        )
    return int(vocab)


def train_bpe(files: list[str], fmt: str, field: str, vocab_size: int) -> str:
    """A byte-level BPE tokenizer trained on the documents themselves; its JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((doc for f in files for doc in read_documents(f, fmt, field)), trainer)
    return tok.to_str()


def bpe_vocab_size(tokenizer_json: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json).get_vocab_size()


class WorkerInputError(Exception):
    """A ConfigError raised in a worker, in a form that crosses back to the parent intact."""

    def __init__(self, key: str, why: str):
        super().__init__(key, why)


def in_worker(fn, *args):
    try:
        return fn(*args)
    except ConfigError as exc:
        raise WorkerInputError(exc.key, exc.why) from None


def encode_file(url: str, fmt: str, field: str, tokenizer_json: str | None, scratch: str, n: int) -> str:
    """Worker: one source file's tokens, to scratch/N.npy (bytes: UTF-8; BPE: each document
    followed by the end-of-text token)."""
    if fmt == "npy":
        arr = read_array(url)
    else:
        docs = read_documents(url, fmt, field)
        if tokenizer_json is None:
            arr = np.frombuffer("".join(docs).encode("utf-8"), dtype=np.uint8)
        else:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_str(tokenizer_json)
            eot = tok.token_to_id(END_OF_TEXT)
            arr = np.fromiter((t for enc in tok.encode_batch(docs) for t in (*enc.ids, eot)), dtype=np.uint32)
    out = os.path.join(scratch, f"{n:06d}.npy")
    np.save(out, arr)
    return out


# -- writing shards -------------------------------------------------------------------------------
def write_shard(dest: str, i: int, blocks_path: str, start: int, stop: int) -> dict:
    """Worker: rows [start, stop) of the blocks file as shard i at DEST; its index entry."""
    import fsspec
    from safetensors.numpy import save

    rows = np.load(blocks_path, mmap_mode="r")[start:stop]
    data = save({"tokens": np.ascontiguousarray(rows)})
    with fsspec.open(f"{dest.rstrip('/')}/{shard_name(i)}", "wb") as fh:
        fh.write(data)
    return {
        "name": shard_name(i),
        "samples": stop - start,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def blocks_of(stream: np.ndarray, block_size: int) -> np.ndarray:
    """Rows of block_size + 1 tokens starting every block_size tokens (a view, no copy)."""
    n = max(len(stream) - 1, 0) // block_size
    return np.lib.stride_tricks.as_strided(
        stream, shape=(n, block_size + 1), strides=(block_size * stream.itemsize, stream.itemsize)
    )


def progress(iterable, total: int, what: str):
    from tqdm import tqdm

    return tqdm(
        iterable,
        total=total,
        desc=what,
        unit="file" if what == "encode" else "shard",
        disable=not sys.stderr.isatty(),
        leave=False,
    )


def prepare(job: Job) -> dict:
    """Run the job; the index it wrote. ConfigError on bad input."""
    if job.block_size < 1:
        raise ConfigError("--block-size", f"must be >= 1, got {job.block_size}")
    if not job.shard_mb > 0:
        raise ConfigError("--shard-mb", f"must be > 0, got {job.shard_mb}")
    bpe_vocab = parse_tokenizer(job.tokenizer)
    files = source_files(job.src)
    fmt = job.format or guess_format(files)
    if fmt not in FORMATS:
        raise ConfigError("--format", f"expected one of {', '.join(FORMATS)}, got {fmt!r}")
    workers = max(1, job.workers or os.cpu_count() or 1)
    tokenizer_json = job.learnt_tokenizer
    if tokenizer_json is None and bpe_vocab and fmt != "npy":
        tokenizer_json = train_bpe(files, fmt, job.field, bpe_vocab)

    with (
        tempfile.TemporaryDirectory(prefix="paratrain-prepare-") as scratch,
        _encoders(workers) as pool,
    ):
        parts = list(
            progress(
                pool.map(
                    in_worker,
                    [encode_file] * len(files),
                    files,
                    [fmt] * len(files),
                    [job.field] * len(files),
                    [tokenizer_json] * len(files),
                    [scratch] * len(files),
                    range(len(files)),
                ),
                len(files),
                "encode",
            )
        )
        arrays = [np.load(p, mmap_mode="r") for p in parts]
        if fmt == "npy":
            vocab_size = int(max((int(a.max()) for a in arrays if a.size), default=0)) + 1
        else:
            vocab_size = 256 if tokenizer_json is None else bpe_vocab_size(tokenizer_json)
        dtype = token_dtype(vocab_size)
        if fmt == "npy" and arrays and arrays[0].ndim == 2:
            widths = {a.shape[1] for a in arrays}
            if widths != {job.block_size + 1}:
                raise ConfigError(
                    "--block-size",
                    f"the arrays' rows are {sorted(widths)} tokens long: "
                    f"--block-size must be one less ({min(widths) - 1})",
                )
            blocks = (
                np.concatenate([a.astype(dtype) for a in arrays])
                if arrays
                else np.zeros((0, job.block_size + 1), dtype)
            )
        else:
            if any(a.ndim != 1 for a in arrays):
                raise ConfigError("SRC", "mixes 1-D token streams with 2-D rows")
            blocks = blocks_of(np.concatenate([a.astype(dtype) for a in arrays]), job.block_size)
        if len(blocks) == 0:
            raise ConfigError("SRC", f"{job.src} holds fewer than block_size + 1 = {job.block_size + 1} tokens")
        blocks_path = os.path.join(scratch, "blocks.npy")
        np.save(blocks_path, blocks)
        del arrays, blocks
        n_samples = len(np.load(blocks_path, mmap_mode="r"))
        per_shard = max(1, int(job.shard_mb * 2**20) // ((job.block_size + 1) * dtype.itemsize))
        starts = list(range(0, n_samples, per_shard))
        _make_dest(job.dest)
        shards = list(
            progress(
                pool.map(
                    in_worker,
                    [write_shard] * len(starts),
                    [job.dest] * len(starts),
                    range(len(starts)),
                    [blocks_path] * len(starts),
                    starts,
                    [min(s + per_shard, n_samples) for s in starts],
                ),
                len(starts),
                "shards",
            )
        )
    index = {
        "format": INDEX_FORMAT,
        "dtype": dtype.name,
        "block_size": job.block_size,
        "vocab_size": vocab_size,
        "tokenizer": "bytes" if tokenizer_json is None else TOKENIZER,
        "samples": n_samples,
        "shards": shards,
    }
    _write_text(job.dest, INDEX, json.dumps(index, indent=1, sort_keys=True) + "\n")
    if tokenizer_json is not None:
        _write_text(job.dest, TOKENIZER, tokenizer_json)
    return index


def prepare_text_once(text: str, tokenizer: str, block_size: int, val_fraction: float, cache_dir: str) -> Path:
    """`text` as shards in train/ and val/ (its last val_fraction of characters; a BPE tokenizer is
    learnt on train/ alone), in a folder of cache_dir named by a hash of everything that decides
    their bytes. The first process to ask prepares it under a file lock and renames it into place
    whole; the ranks of the run and later runs find it there."""
    from filelock import FileLock

    recipe = json.dumps([INDEX_FORMAT, tokenizer, block_size, val_fraction]).encode()
    key = hashlib.sha256(recipe + text.encode("utf-8")).hexdigest()[:16]
    root = Path(os.path.expanduser(cache_dir)) / f"text-{key}"
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{root}.lock"):
        if not root.is_dir():
            started = time.perf_counter()
            with tempfile.TemporaryDirectory(dir=root.parent, prefix=f".{root.name}-") as scratch:
                out = Path(scratch) / "out"
                n_train = int(len(text) * (1 - val_fraction))
                learnt = None
                for split, part in (("train", text[:n_train]), ("val", text[n_train:])):
                    if not part:  # val_fraction = 0: no val/ (an empty split)
                        continue
                    src = Path(scratch) / f"{split}.txt"
                    src.write_text(part, encoding="utf-8")
                    # one worker: a corpus that fits in memory takes seconds, and the caller may be a training rank
                    prepare(
                        Job(
                            str(src),
                            str(out / split),
                            "text",
                            tokenizer=tokenizer,
                            block_size=block_size,
                            shard_mb=1,
                            workers=1,
                            learnt_tokenizer=learnt,
                        )
                    )
                    if (out / "train" / TOKENIZER).is_file():
                        learnt = (out / "train" / TOKENIZER).read_text(encoding="utf-8")
                os.replace(out, root)
            print(f"data: prepared the corpus as {tokenizer} tokens in {time.perf_counter() - started:.1f}s at {root}")
    return root


class _InProcess:
    """One worker: encode here. A corpus prepared by a training rank on first use (a daemonic
    process where the test gang or another launcher runs it) may not start processes of its own."""

    map = staticmethod(map)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _encoders(workers: int):
    return ProcessPoolExecutor(workers, initializer=_quiet_worker) if workers > 1 else _InProcess()


def _quiet_worker() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already


def _make_dest(dest: str) -> None:
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(dest)
        fs.makedirs(path, exist_ok=True)
    except (ImportError, ValueError, OSError) as exc:
        raise ConfigError("DEST", f"cannot write to {dest}: {exc}") from None


def _write_text(dest: str, name: str, text: str) -> None:
    import fsspec

    with fsspec.open(f"{dest.rstrip('/')}/{name}", "w", encoding="utf-8") as fh:
        fh.write(text)


def add_data_parser(sub) -> None:
    d = sub.add_parser("data", help='prepare a dataset once as shards that `[data] factory = "shards"` streams')
    dsub = d.add_subparsers(dest="data_command", required=True)
    p = dsub.add_parser("prepare", help="text, JSONL, CSV or NumPy tokens -> safetensors shards, index.json, tokenizer")
    p.add_argument("src", metavar="SRC", help="a file, folder or glob; a local path or an fsspec URL")
    p.add_argument("dest", metavar="DEST", help="the output folder; a local path or an fsspec URL")
    p.add_argument("--format", choices=FORMATS, default=None, help="default: from the files' suffix, else text")
    p.add_argument("--field", default="text", help="the JSONL key or CSV column holding the text (default: text)")
    p.add_argument("--tokenizer", default="bytes", help="bytes | bpe:VOCAB (trained on SRC itself)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per sample's input (default: 64)")
    p.add_argument("--shard-mb", type=float, default=64.0, help="about this many MiB per shard (default: 64)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
    p.set_defaults(func=cmd_prepare)


def cmd_prepare(args) -> int:
    job = Job(
        args.src, args.dest, args.format, args.field, args.tokenizer, args.block_size, args.shard_mb, args.workers
    )
    try:
        try:
            index = prepare(job)
        except WorkerInputError as exc:
            raise ConfigError(*exc.args) from None
    except ConfigError as exc:
        error(f"{exc}")
        return 2
    mb = sum(s["bytes"] for s in index["shards"]) / 2**20
    print(
        f"prepared {index['samples']} samples of {index['block_size']} tokens (vocabulary {index['vocab_size']}) "
        f"in {len(index['shards'])} shards, {mb:.1f} MiB, at {job.dest}"
    )
    return 0
