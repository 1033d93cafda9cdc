"""`paratrain data prepare SRC DEST`: text, JSONL, CSV, NumPy tokens or fine-tuning conversations
-> token-block shards.

The output is a folder (any fsspec URL) of safetensors shards, each one tensor "tokens" of shape
[samples, block_size + 1] (a sample's input is its first block_size tokens, its target the last
block_size), an `index.json` naming every shard with its sample count, byte size and sha256, and
the tokenizer. Blocks start every block_size tokens, as the character corpus's do. Fine-tuning data
(`--format chat|prompt-completion`) and packed documents (`--pack`) are shards of the columns that
data/sft.py makes instead, [samples, block_size] each, whose samples are dicts for `model(**item)`.
With `--val-fraction`, the last samples go to DEST/val/, a shard folder of its own that the index
names under "splits".

Deterministic by construction: files are read in sorted order, the work is split by file and
put back together in that order, safetensors writes no timestamps, and the index is sorted JSON.
Two process pools do the work: one encodes the source files, one cuts, hashes and uploads shards.
Workers hand tokens to the parent through .npy files in a scratch folder, never through pickles.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from paratrain.data import sft
from paratrain.data.sources import guess_format, read_array, read_documents, read_jsonl, source_files
from paratrain.data.tokenizing import END_OF_TEXT, bpe_vocab_size, parse_tokenizer, tokenizer_directory, train_bpe
from paratrain.errors import ConfigError, error

FORMATS = ("text", "jsonl", "csv", "npy", *sft.SFT_FORMATS)
INDEX = "index.json"
TOKENIZER = "tokenizer.json"
INDEX_FORMAT = "paratrain-shards/1"
VAL = "val"  # the validation split's folder in DEST


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
    pack: bool = False
    val_fraction: float = 0.0


@dataclass(frozen=True)
class Encoding:
    """How a worker turns a file into tokens: a stream, or documents with their labels (data/sft.py)."""

    format: str
    field: str
    tokenizer_json: str | None  # a BPE tokenizer's; neither it nor a directory: UTF-8 bytes
    tokenizer_dir: str | None
    documents: bool


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class WorkerInputError(Exception):
    """A ConfigError raised in a worker, in a form that crosses back to the parent intact."""

    def __init__(self, key: str, why: str):
        super().__init__(key, why)


def in_worker(fn, *args):
    try:
        return fn(*args)
    except ConfigError as exc:
        raise WorkerInputError(exc.key, exc.why) from None


def encode_file(url: str, encoding: Encoding, scratch: str, n: int) -> str:
    """Worker: one source file's tokens, to scratch/N.npy (bytes: UTF-8; BPE: each document
    followed by the end-of-text token; a tokenizer directory: its own special tokens and
    end-of-sequence), or its documents with their labels to scratch/N.npz."""
    if encoding.documents:
        out = os.path.join(scratch, f"{n:06d}.npz")
        np.savez(out, **vars(sft.Documents.of(encode_documents(url, encoding))))
        return out
    if encoding.format == "npy":
        arr = read_array(url)
    elif encoding.tokenizer_json is None and encoding.tokenizer_dir is None:  # bytes: no Python int per byte
        arr = np.frombuffer("".join(read_documents(url, encoding.format, encoding.field)).encode("utf-8"), np.uint8)
    else:
        arr = np.fromiter((t for ids, _ in encode_documents(url, encoding) for t in ids), dtype=np.uint32)
    out = os.path.join(scratch, f"{n:06d}.npy")
    np.save(out, arr)
    return out


def encode_documents(url: str, encoding: Encoding) -> list[tuple[list[int], list[int]]]:
    """One file's documents as (token ids, labels): fine-tuning formats learn only what data/sft.py
    says; the others learn every token."""
    fmt = encoding.format
    if encoding.tokenizer_dir is not None:
        tok = sft.load_tokenizer(encoding.tokenizer_dir)
        if fmt == sft.CHAT:
            return [sft.chat_sample(tok, sft.read_messages(r, where), where) for where, r in read_jsonl(url)]
        if fmt == sft.PROMPT_COMPLETION:
            return [
                sft.prompt_completion_sample(tok, *sft.read_prompt_completion(r, where)) for where, r in read_jsonl(url)
            ]
        encoded = [sft.text_ids(tok, doc) for doc in read_documents(url, fmt, encoding.field)]
    elif encoding.tokenizer_json is not None:
        from tokenizers import Tokenizer

        bpe = Tokenizer.from_str(encoding.tokenizer_json)
        eot = cast(int, bpe.token_to_id(END_OF_TEXT))  # a special token of its training: never None
        encoded = [[*enc.ids, eot] for enc in bpe.encode_batch(read_documents(url, fmt, encoding.field))]
    else:
        encoded = [list(doc.encode("utf-8")) for doc in read_documents(url, fmt, encoding.field)]
    return [(ids, ids) for ids in encoded]


# -- writing shards -------------------------------------------------------------------------------
def write_shard(dest: str, i: int, columns: dict[str, str], start: int, stop: int) -> dict:
    """Worker: rows [start, stop) of each column's .npy file as shard i at DEST; its index entry."""
    import fsspec
    from safetensors.numpy import save

    data = save({k: np.ascontiguousarray(np.load(p, mmap_mode="r")[start:stop]) for k, p in columns.items()})
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
    if not 0 <= job.val_fraction < 1:
        raise ConfigError("--val-fraction", f"must be in [0, 1) (0: no validation split), got {job.val_fraction}")
    directory = tokenizer_directory(job.tokenizer)
    bpe_vocab = None if directory else parse_tokenizer(job.tokenizer)
    files = source_files(job.src)
    fmt = job.format or guess_format(files)
    if fmt not in FORMATS:
        raise ConfigError("--format", f"expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt in sft.SFT_FORMATS and directory is None:
        raise ConfigError("--tokenizer", f"--format {fmt} needs the model's tokenizer: --tokenizer DIR")
    if job.pack and fmt == "npy":
        raise ConfigError("--pack", "packs documents: NumPy tokens have none")
    workers = max(1, job.workers or os.cpu_count() or 1)
    tokenizer_json = job.learnt_tokenizer
    if tokenizer_json is None and bpe_vocab and fmt != "npy":
        tokenizer_json = train_bpe(files, fmt, job.field, bpe_vocab)
    hf_tokenizer = sft.load_tokenizer(directory) if directory else None
    encoding = Encoding(fmt, job.field, tokenizer_json, directory, job.pack or fmt in sft.SFT_FORMATS)

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
                    [encoding] * len(files),
                    [scratch] * len(files),
                    range(len(files)),
                ),
                len(files),
                "encode",
            )
        )
        vocab_size = _vocab_size(hf_tokenizer, tokenizer_json, fmt, parts)
        dtype = token_dtype(vocab_size)
        about: dict = {}
        if encoding.documents:
            docs = sft.Documents.concatenate([sft.Documents(**np.load(p)) for p in parts])
            table, cut = sft.rows(docs, job.block_size, job.pack, sft.pad_id(hf_tokenizer))
            table["input_ids"] = table["input_ids"].astype(dtype)
            about = {"columns": sorted(table), "source_documents": len(docs.lengths), "cut_to_block_size": cut}
        else:
            table = {"tokens": token_blocks(parts, fmt, job.block_size, dtype)}
        n_samples = len(next(iter(table.values())))
        if n_samples == 0:
            raise ConfigError(
                "SRC",
                f"{job.src} holds no documents"
                if encoding.documents
                else f"{job.src} holds fewer than block_size + 1 = {job.block_size + 1} tokens",
            )
        n_val = round(n_samples * job.val_fraction)
        if job.val_fraction and not 0 < n_val < n_samples:
            raise ConfigError("--val-fraction", f"{job.val_fraction} of {n_samples} samples leaves a split empty")
        columns = {}
        for name, array in table.items():
            columns[name] = os.path.join(scratch, f"{name}.npy")
            np.save(columns[name], array)
        row_bytes = sum(a.dtype.itemsize * a.shape[1] for a in table.values())
        per_shard = max(1, int(job.shard_mb * 2**20) // row_bytes)
        del table
        common = {
            "format": INDEX_FORMAT,
            "dtype": dtype.name,
            "block_size": job.block_size,
            "vocab_size": vocab_size,
            "tokenizer": directory or ("bytes" if tokenizer_json is None else TOKENIZER),
            **about,
        }
        index = {**common, **({"splits": {"val": VAL}} if n_val else {})}
        if hf_tokenizer is not None:
            index["tokenizer_files"] = save_tokenizer(hf_tokenizer, job.dest, scratch)
        for split_dest, split_index, start, stop in (
            (job.dest, index, 0, n_samples - n_val),
            (f"{job.dest.rstrip('/')}/{VAL}", common, n_samples - n_val, n_samples),
        ):
            if start == stop:
                continue
            shards = write_shards(pool, split_dest, columns, range(start, stop, per_shard), stop)
            split_index.update(samples=stop - start, shards=shards)
            _write_text(split_dest, INDEX, json.dumps(split_index, indent=1, sort_keys=True) + "\n")
    if tokenizer_json is not None:
        _write_text(job.dest, TOKENIZER, tokenizer_json)
    return index


def _vocab_size(hf_tokenizer, tokenizer_json: str | None, fmt: str, parts: list[str]) -> int:
    """The model's own tokenizer's, the learnt BPE's, 256 bytes', or NumPy tokens' largest + 1."""
    if hf_tokenizer is not None:
        return len(hf_tokenizer)
    if fmt == "npy":
        return int(max((int(a.max()) for a in (np.load(p, mmap_mode="r") for p in parts) if a.size), default=0)) + 1
    return 256 if tokenizer_json is None else bpe_vocab_size(tokenizer_json)


def token_blocks(parts: list[str], fmt: str, block_size: int, dtype: np.dtype) -> np.ndarray:
    """The workers' token streams as blocks of block_size + 1 (NumPy rows: as they are)."""
    arrays = [np.load(p, mmap_mode="r") for p in parts]
    if fmt == "npy" and arrays and arrays[0].ndim == 2:
        widths = {a.shape[1] for a in arrays}
        if widths != {block_size + 1}:
            raise ConfigError(
                "--block-size",
                f"the arrays' rows are {sorted(widths)} tokens long: --block-size must be one less ({min(widths) - 1})",
            )
        return np.concatenate([a.astype(dtype) for a in arrays])
    if any(a.ndim != 1 for a in arrays):
        raise ConfigError("SRC", "mixes 1-D token streams with 2-D rows")
    return blocks_of(np.concatenate([a.astype(dtype) for a in arrays]), block_size)


def write_shards(pool, dest: str, columns: dict[str, str], starts: range, stop: int) -> list[dict]:
    """Rows [starts[0], stop) of the columns as shards at DEST, one from each start."""
    _make_dest(dest)
    return list(
        progress(
            pool.map(
                in_worker,
                [write_shard] * len(starts),
                [dest] * len(starts),
                range(len(starts)),
                [columns] * len(starts),
                starts,
                [min(s + starts.step, stop) for s in starts],
            ),
            len(starts),
            "shards",
        )
    )


def save_tokenizer(tokenizer, dest: str, scratch: str) -> list[str]:
    """The tokenizer's own files (save_pretrained's, not whatever else its folder holds: a model's
    weights) beside the index, where `from_pretrained(DEST)` and the run's final/ find them."""
    _make_dest(dest)
    folder = Path(scratch) / "tokenizer"
    tokenizer.save_pretrained(str(folder))
    names = sorted(p.name for p in folder.iterdir())
    for name in names:
        _write_text(dest, name, (folder / name).read_text(encoding="utf-8"))
    return names


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
    p = dsub.add_parser(
        "prepare", help="text, JSONL, CSV, NumPy tokens or chat data -> safetensors shards, index.json, tokenizer"
    )
    p.add_argument("src", metavar="SRC", help="a file, folder or glob; a local path or an fsspec URL")
    p.add_argument("dest", metavar="DEST", help="the output folder; a local path or an fsspec URL")
    p.add_argument("--format", choices=FORMATS, default=None, help="default: from the files' suffix, else text")
    p.add_argument("--field", default="text", help="the JSONL key or CSV column holding the text (default: text)")
    p.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes | bpe:VOCAB (trained on SRC itself) | DIR (a Hugging Face tokenizer's save_pretrained folder)",
    )
    p.add_argument("--block-size", type=int, default=64, help="tokens per sample's input (default: 64)")
    p.add_argument("--pack", action="store_true", help="pack whole documents into blocks, positions restarting")
    p.add_argument(
        "--val-fraction", type=float, default=0.0, help="the last F of the samples as DEST/val/ (default: 0)"
    )
    p.add_argument("--shard-mb", type=float, default=64.0, help="about this many MiB per shard (default: 64)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
    p.set_defaults(func=cmd_prepare)


def cmd_prepare(args) -> int:
    job = Job(
        args.src,
        args.dest,
        args.format,
        args.field,
        args.tokenizer,
        args.block_size,
        args.shard_mb,
        args.workers,
        pack=args.pack,
        val_fraction=args.val_fraction,
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
        + (f", and a validation split at {job.dest.rstrip('/')}/{VAL}" if "splits" in index else "")
    )
    if index.get("cut_to_block_size"):
        print(f"{index['cut_to_block_size']} of {index['source_documents']} documents were cut to --block-size")
    return 0
