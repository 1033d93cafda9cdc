"""`paratrain bench data`: the streamed shards against a plain DataLoader over the same tokens in a
local NumPy file, and against MosaicML Streaming, side by side, from an S3 server on 127.0.0.1
(moto's), cold cache then warm; and the loader's cost inside a training step against batches
already in memory.

Every loader reads the same random uint16 token blocks in a shuffled order, batch by batch, for
one pass over the data. MosaicML Streaming runs in a virtual environment of its own
(bench/mosaic_side.py), since its pins and imports do not fit ours.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from paratrain.bench.common import COUNT, POSITIVE, add_json_option
from paratrain.errors import error
from paratrain.runtime.machine import emit_json

BUCKET = "paratrain-bench"


def add_parser(which) -> None:
    p = which.add_parser(
        "data",
        help="streamed shards vs a plain DataLoader vs MosaicML Streaming, from a local "
        "S3 server, cold and warm; the loader's share of a training step",
    )
    p.add_argument("--samples", type=COUNT, default=50_000, help="token blocks in the data set")
    p.add_argument("--block", type=COUNT, default=512, help="tokens per block")
    p.add_argument("--batch", type=COUNT, default=32)
    p.add_argument("--shard-mb", type=POSITIVE, default=16.0)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (plain and Mosaic)")
    p.add_argument(
        "--mosaic-venv",
        default=".venv-mosaic",
        help="a virtual environment with mosaicml-streaming (`none`: leave Mosaic out)",
    )
    p.add_argument("--step-batches", type=COUNT, default=20, help="training steps timed for the overhead")
    p.add_argument("--out", default=None, help="also write the results as markdown to this file")
    add_json_option(p)
    p.set_defaults(func=run)


@contextlib.contextmanager
def local_s3_server(timeout_s: float = 90):
    """moto's S3 server on 127.0.0.1 for the block, as fsspec storage options (s3fs's keys)."""
    from paratrain.runtime.process import free_port

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto's S3 server did not start (is moto[server] installed?)") from None
                time.sleep(0.1)
        yield {"endpoint_url": f"http://127.0.0.1:{port}", "key": "bench", "secret": "bench"}
    finally:
        server.terminate()
        server.wait(10)


def timed_pass(batches) -> float:
    """Seconds to go through `batches` (an iterable of tensors)."""
    t0 = time.perf_counter()
    for _ in batches:
        pass
    return time.perf_counter() - t0


def ours(url: str, options: dict, cache: str, args) -> tuple[float, object]:
    from paratrain.data.stream import shards

    ds = shards(url, cache_dir=cache, storage_options=options)
    sampler = ds.global_batch_sampler(args.batch, True, seed=0)
    steps = args.samples // args.batch
    return timed_pass(ds.load_batch(sampler.rank_indices(i, 0, 1)) for i in range(steps)), ds


def plain_dataloader(tokens_path: str, args) -> float:
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Memmap(Dataset):
        def __init__(self):
            self.rows = np.load(tokens_path, mmap_mode="r")

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            row = torch.from_numpy(self.rows[i].astype(np.int64))
            return row[:-1], row[1:]

    loader = DataLoader(
        Memmap(),
        batch_size=args.batch,
        shuffle=True,
        num_workers=args.workers,
        generator=torch.Generator().manual_seed(0),
        drop_last=True,
    )
    return timed_pass(loader)


def mosaic(python: str, step: str, tmp: Path, options: dict, args) -> dict:
    """bench/mosaic_side.py STEP in the Mosaic venv: `write` the MDS shards, or `read` them from S3."""
    env = {
        **os.environ,
        "S3_ENDPOINT_URL": options["endpoint_url"],
        "AWS_ACCESS_KEY_ID": options["key"],
        "AWS_SECRET_ACCESS_KEY": options["secret"],
    }
    proc = subprocess.run(
        [
            python,
            str(Path(__file__).with_name("mosaic_side.py")),
            step,
            str(tmp / "tokens.npy"),
            str(tmp / "mds"),
            f"s3://{BUCKET}/mds",
            str(tmp / "mosaic-cache"),
            str(args.batch),
            str(args.workers),
            str(args.shard_mb),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(f"MosaicML Streaming ({step}) failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_overhead(ds, args) -> dict:
    """A training step (forward, backward, SGD) with its batch read through the streamed loader
    (warm) against one whose batch is already in memory, alternating so that load from other
    processes falls on both alike: medians of the loader's time and of each kind of step."""
    import torch

    from paratrain.models.gpt import gpt
    from paratrain.optim import cross_entropy

    torch.manual_seed(0)
    block = min(args.block, 128)
    model = gpt(ds.vocab_size, n_layer=2, n_head=4, d_model=128, block_size=block)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sampler = ds.global_batch_sampler(args.batch, True, seed=1)
    preloaded = [ds.load_batch(sampler.rank_indices(i, 0, 1)) for i in range(args.step_batches)]

    def step(x, y):
        opt.zero_grad()
        cross_entropy(model(x[:, :block]), y[:, :block]).backward()
        opt.step()

    load, streamed, in_memory = [], [], []
    for i in range(args.step_batches):
        t0 = time.perf_counter()
        batch = ds.load_batch(sampler.rank_indices(args.step_batches + i, 0, 1))
        t1 = time.perf_counter()
        step(*batch)
        t2 = time.perf_counter()
        step(*preloaded[i])
        in_memory.append(time.perf_counter() - t2)
        streamed.append(t2 - t0)
        load.append(t1 - t0)
    return {
        "load_s": statistics.median(load),
        "step_s_streamed": statistics.median(streamed),
        "step_s_preloaded": statistics.median(in_memory),
    }


def run(args) -> int:
    import numpy as np
    import s3fs
    import torch

    from paratrain.data.prepare import Job, prepare

    python = None if args.mosaic_venv == "none" else str(Path(args.mosaic_venv) / "bin" / "python")
    if python and not Path(python).exists():
        error(f"--mosaic-venv: no {python} (`make bench-data-peer` makes .venv-mosaic), or pass none")
        return 2
    sample_mb = (args.block + 1) * 2 / 2**20
    rows = []

    def add(name: str, cache: str, seconds: float) -> None:
        rate = args.samples // args.batch * args.batch / seconds
        rows.append({"loader": name, "cache": cache, "samples_per_s": rate, "mb_per_s": rate * sample_mb})

    with tempfile.TemporaryDirectory(prefix="paratrain-bench-data-") as tmp_name, local_s3_server() as options:
        tmp = Path(tmp_name)
        tokens = np.random.default_rng(0).integers(0, 4096, (args.samples, args.block + 1), dtype=np.uint16)
        np.save(tmp / "tokens.npy", tokens)
        del tokens
        prepare(Job(str(tmp / "tokens.npy"), str(tmp / "shards"), block_size=args.block, shard_mb=args.shard_mb))
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir(BUCKET)
        fs.put(str(tmp / "shards") + "/", f"{BUCKET}/shards/", recursive=True)
        url = f"s3://{BUCKET}/shards"

        seconds, _ = ours(url, options, str(tmp / "cache"), args)
        add("paratrain shards", "cold", seconds)
        seconds, ds = ours(url, options, str(tmp / "cache"), args)
        add("paratrain shards", "warm", seconds)
        add(
            f"plain DataLoader ({args.workers} workers, local .npy memmap)",
            "local",
            plain_dataloader(str(tmp / "tokens.npy"), args),
        )
        if python:
            mosaic(python, "write", tmp, options, args)
            fs.put(str(tmp / "mds") + "/", f"{BUCKET}/mds/", recursive=True)
            timings = mosaic(python, "read", tmp, options, args)
            add(f"MosaicML Streaming ({args.workers} workers)", "cold", timings["cold_s"])
            add(f"MosaicML Streaming ({args.workers} workers)", "warm", timings["warm_s"])
        overhead = step_overhead(ds, args)

    result = {
        "samples": args.samples,
        "block": args.block,
        "batch": args.batch,
        "shard_mb": args.shard_mb,
        "loaders": rows,
        **overhead,
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    text = markdown(result, args)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    emit_json(result, args.json)
    return 0


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def markdown(r: dict, args) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    warm = {row["loader"].split(" (")[0]: row["samples_per_s"] for row in r["loaders"] if row["cache"] != "cold"}
    lines = [
        f"# bench data, {date.today().isoformat()}",
        "",
        f"`paratrain bench data --samples {args.samples} --block {args.block} --batch {args.batch} "
        f"--shard-mb {args.shard_mb:g} --workers {args.workers}` at commit {commit or 'unknown'}; torch "
        f"{r['torch']}, {r['cpu']}, `get_cpu_capability()` = {r['cpu_capability']}, {os.cpu_count()} cores.",
        "",
        f"{args.samples} random uint16 blocks of {args.block + 1} tokens, shuffled, one pass, batch {args.batch}, "
        "from moto's S3 server on 127.0.0.1 (the plain DataLoader reads the same tokens from a local file).",
        "",
        "| loader | cache | samples/s | MB/s |",
        "|---|---|---:|---:|",
    ]
    lines += [
        f"| {row['loader']} | {row['cache']} | {row['samples_per_s']:,.0f} | {row['mb_per_s']:,.1f} |"
        for row in r["loaders"]
    ]
    if "MosaicML Streaming" in warm:
        lines += [
            "",
            f"Warm: paratrain {warm['paratrain shards'] / warm['MosaicML Streaming']:.2f}x MosaicML Streaming.",
        ]
    lines += [
        "",
        f"A training step (gpt 2x128, vocabulary 4096, batch {args.batch}, block {min(args.block, 128)}), "
        f"medians over {args.step_batches} alternating steps: reading its batch through the streamed loader "
        f"(warm) takes {r['load_s'] * 1e3:.2f} ms, {r['load_s'] / r['step_s_preloaded'] * 100:.2g} % of a "
        f"step on a batch already in memory ({r['step_s_preloaded'] * 1e3:.1f} ms); the whole step with "
        f"the loader: {r['step_s_streamed'] * 1e3:.1f} ms "
        f"({(r['step_s_streamed'] / r['step_s_preloaded'] - 1) * 100:+.1f} %).",
        "",
    ]
    return "\n".join(lines)
