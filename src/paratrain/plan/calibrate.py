"""`paratrain plan --calibrate FILE`: this machine's cluster figures, measured by runs of a tiny
model through the same launcher and trainer as training (latency and bandwidth of collectives as a
run meets them, the ranks' skew, contention, the framework's cost of a step, the pipeline's p2p
latency), each the median of a few launches, written as a [cluster] TOML file that later plans read."""

from __future__ import annotations

import contextlib
import functools

from paratrain.cost.cluster import GIB, Cluster, calibration_file, load_cluster, times_file_for
from paratrain.cost.layer_times import median_seconds
from paratrain.errors import ConfigError

CALIBRATION_SIZES = (2**10, 2**22)  # all-reduce payloads, bytes: the latency's and the bandwidth's


def _contention(rt, train_step) -> float:
    """How much slower tiny training steps run while every rank runs them than on rank 0 alone:
    the steps rank 0 gets through in a quarter of a second (longer than the scheduler's slices, so
    processes that outnumber the cores are seen taking turns; a fixed time, not a fixed count, so
    no rank finishes early and leaves the others its core), the median of 3 each."""
    import statistics
    import time

    import torch.distributed as dist

    def rate() -> float:
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < 0.25:
            train_step()
            count += 1
        return count / (time.perf_counter() - start)

    alone, together = [], []
    for _ in range(3):
        dist.barrier()
        if rt.rank == 0:
            alone.append(rate())
        dist.barrier()
        together.append(rate())
    return statistics.median(alone) / statistics.median(together) if rt.rank == 0 else 0.0


def _synced_s(size: int, work, iterations: int) -> tuple[float, float]:
    """What an all-reduce of `size` bytes adds to `work` where every rank does the work and then
    the all-reduce, as a run's ranks meet a collective each after its own compute (each waits for
    the last to arrive: on a shared machine one rank in a few is late, descheduled or waiting for
    an idle core's wake-up), against every rank doing the work alone at once; and the seconds the
    work takes so. Means over `iterations`, twice each: a run's steps pay the mean."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    buf = torch.zeros(size // 4)
    dist.all_reduce(buf)

    def per_iteration(sync: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            work()
            if sync:
                dist.all_reduce(buf)
        return (time.perf_counter() - start) / iterations

    free, synced = [], []
    for _ in range(2):
        free.append(per_iteration(False))
        synced.append(per_iteration(True))
    return statistics.mean(synced) - statistics.mean(free), statistics.mean(free)


def _work(seconds: float):
    """A fixed amount of compute (small matmuls) that takes about `seconds` on these ranks, the
    same count on every rank (the ranks' mean rate), so that a rank slowed on the way arrives late."""
    import time

    import torch
    import torch.distributed as dist

    a = torch.randn(128, 128)
    start = time.perf_counter()
    for _ in range(50):
        a @ a
    each = torch.tensor((time.perf_counter() - start) / 50)
    dist.all_reduce(each)
    count = max(1, round(seconds / (each.item() / dist.get_world_size())))

    def work():
        for _ in range(count):
            a @ a

    return work


def _step_overhead_s(rt, run_dir: str, train) -> float:
    """The trainer's own cost of a step besides a model's compute, communication and optimizer
    arithmetic: loading the batch, the profiler's and the strategy's bookkeeping, the optimizer
    phase's checks. A real run of 12 steps of a tiny mlp on synthetic data through the trainer
    (`train`: trainer.train, on this process group), whose compute is next to nothing: on rank 0, the
    median over the steps after the first 5 of the slowest rank's data, optimizer and other
    phases (profile.jsonl)."""
    import io
    import json
    import statistics
    from pathlib import Path

    from paratrain.config import from_dict

    raw = {
        "model": {"factory": "mlp", "in_features": 32, "hidden": 8, "n_layers": 1},
        "data": {"factory": "synthetic", "batch_size": 4 * rt.world_size, "shuffle": False},
        "train": {"steps": 12, "log_every": 12, "optimizer": "adamw"},
    }
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(from_dict(raw), Path(run_dir), rt)
    if rt.rank != 0:
        return 0.0
    steps = [json.loads(line) for line in (Path(run_dir) / "profile.jsonl").read_text().splitlines()]
    return statistics.median(
        max(sum(r["phases"][k] for k in ("data", "optimizer", "other")) for r in step["ranks"])
        for step in steps
        if step["step"] > 5
    )


def _stream_s(train_step) -> float:
    """Per collective, what a stream of 30 asynchronous all-reduces of 1 KiB adds to the compute
    it was started beside (as ZeRO-3 on gloo all-reduces each gradient as backward makes it, and
    gloo works through them on its own thread while the compute goes on): 40 tiny training steps
    with the stream started before them and waited for after, less the same steps alone. The
    median of 5."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    bufs = [torch.zeros(256) for _ in range(30)]

    def steps_s(stream: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        works = [dist.all_reduce(b, async_op=True) for b in bufs] if stream else []
        for _ in range(40):
            train_step()
        for work in works:
            work.wait()
        return time.perf_counter() - start

    added = [steps_s(True) - steps_s(False) for _ in range(6)]
    return max(statistics.median(added[1:]), 0.0) / len(bufs)


def _p2p_latency_s(rt) -> float:
    """One way of a 64 KiB pipeline message between ranks 0 and 1, through the pipeline's own
    transport (pipeline_comm.P2P: shared memory between processes of one host): half the median
    round trip of a ping-pong (the other ranks wait)."""
    import statistics
    import time

    import torch

    from paratrain.parallel.pipeline.comm import P2P

    peer = {0: 1, 1: 0}.get(rt.rank)
    p2p = P2P(None, 2, set() if peer is None else {peer}, timeout_s=60)
    if peer is None:
        return 0.0
    out, into = torch.ones(2**14), torch.empty(2**14)
    trips = []
    for _ in range(40):
        start = time.perf_counter()
        for first in (rt.rank == 0, rt.rank == 1):
            if first:
                p2p.post([(out, peer, 0)], [])
            else:
                (work,) = p2p.post([], [(into, peer, 0)])
                work.wait()
        trips.append(time.perf_counter() - start)
    p2p.finish()
    return statistics.median(trips[5:]) / 2


def calibration_worker(out_path: str, train) -> None:
    """One of the ranks: times, together with the others, a 512^3 fp32 matmul, an add over
    16 MiB tensors, and a training step (forward, backward, AdamW) of 8 tiny layers, whose time per
    op is the eager framework's cost of an op (the predictor charges it every op of the forward,
    three times: forward and backward); then all-reduces of CALIBRATION_SIZES bytes, each after
    some compute on every rank (_synced_s). Rank 0 writes the medians over ranks as JSON."""
    import json
    import os

    import torch
    import torch.distributed as dist
    from torch import nn

    from paratrain.cost.op_counts import OpRecorder
    from paratrain.runtime import process
    from paratrain.runtime.launch import prepare_forked_worker

    # forked from the worker server, which imported torch before the launch's OMP_NUM_THREADS:
    # without this each rank computed on every core, N ranks oversubscribing them (an all-reduce
    # after compute measured 9.5 ms here instead of 2, and tp's planned all-reduces with it)
    prepare_forked_worker(f"paratrain-calibrate-r{os.environ.get('RANK', '?')}")
    rt = process.init("cpu")
    a, big = torch.randn(512, 512), torch.randn(4 * 2**20)
    tiny = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(16, 16), nn.ReLU())])
    optimizer, x = torch.optim.AdamW(tiny.parameters()), torch.randn(8, 16)

    def train_step():
        optimizer.zero_grad()
        tiny(x).square().mean().backward()
        optimizer.step()

    recorder = OpRecorder()
    with recorder:
        tiny(x).square().mean()
    dist.barrier()
    rates = {
        "threads": float(torch.get_num_threads()),
        "matmul_s": median_seconds(lambda: a @ a, 9),
        "add_s": median_seconds(lambda: big + big, 9),
        "op_s": median_seconds(train_step, 31) / (3 * len(recorder.ops)),
    }
    # all-reduces after 1 ms of compute on every rank (alpha-beta); and after 8 ms, which the
    # ranks' skew grows with: per second of compute, the skew (sync_skew)
    short, long = _work(0.001), _work(0.008)
    small, large = CALIBRATION_SIZES
    rates["small_s"], short_s = _synced_s(small, short, 60)
    rates["large_s"], _ = _synced_s(large, short, 24)
    added_long, long_s = _synced_s(small, long, 24)
    rates["skew"] = (added_long - rates["small_s"]) / max(long_s - short_s, 1e-6)
    rates["p2p_s"] = _p2p_latency_s(rt)
    rates["contention"] = _contention(rt, train_step)
    rates["stream_s"] = _stream_s(train_step)
    rates["step_overhead_s"] = _step_overhead_s(rt, os.path.join(os.path.dirname(out_path), "tiny-run"), train)
    mine = torch.tensor(list(rates.values()), dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(rt.world_size)]
    dist.all_gather(gathered, mine)
    if rt.rank == 0:
        medians = torch.stack(gathered).median(dim=0).values.tolist()
        result = dict(zip(rates, medians))
        keys = list(rates)
        # the p2p pair's own figure (the other ranks report none); rank 0's contention and overhead
        result["p2p_s"] = max(row[keys.index("p2p_s")] for row in gathered).item()
        result["contention"] = gathered[0][keys.index("contention")].item()
        result["step_overhead_s"] = gathered[0][keys.index("step_overhead_s")].item()
        with open(out_path, "w") as fh:
            json.dump(result, fh)
    dist.barrier()
    dist.destroy_process_group()


# separate launches, each key the median of theirs: on a shared virtual machine one launch's
# processes meet one state of its scheduler (measured here: a 1 KiB all-reduce after compute at
# 1.6 ms on average in one launch, 2.6 ms in another; four processes' contention 1.4 and 2.5)
CALIBRATION_ROUNDS = 3


def calibrate(path: str, nproc: int = 2, keep: bool = True, *, train) -> Cluster:
    """Measures this machine as `nproc` processes use it (at least two: gloo processes on
    loopback, half a minute) and writes `path`: a [cluster] file of one node of `nproc` cpu
    devices that `--cluster` reads back; `keep`: also this host's calibration for `nproc`, which
    plans without --cluster take (cluster.calibration_file); `train`: trainer.train, which times the
    trainer's own cost of a step (the caller passes it: the planner sits below the trainer)."""
    import json
    import os
    import statistics
    import tempfile
    from datetime import datetime, timezone

    import torch

    from paratrain.runtime.launch import launch_measurement

    ranks = max(2, nproc)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(CALIBRATION_ROUNDS):
            out = os.path.join(tmp, f"calibration-{n}.json")
            # named as the function: the agent names its workers by the entry point's __name__
            worker = functools.update_wrapper(functools.partial(calibration_worker, train=train), calibration_worker)
            launch_measurement(worker, [out], nproc=ranks, run_id="calibrate")
            with open(out) as fh:
                rounds.append(json.load(fh))
    m = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    # alpha-beta from the ring all-reduces of n ranks (each sends 2(n-1)/n of its buffer in 2(n-1)
    # steps): the latency from the small one, the bandwidth from the difference to the large one
    small, large = CALIBRATION_SIZES
    steps = 2 * (ranks - 1)
    latency_s = max(m["small_s"] / steps, 1e-7)
    slope = max(m["large_s"] - m["small_s"], 1e-9) / (large - small) / (steps / ranks)
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    values = {
        "nodes": 1,
        "devices_per_node": nproc,
        "device": "cpu",
        "peak_tflops": 2 * 512**3 / m["matmul_s"] / 1e12,
        "memory_gib": host_gib,
        "hbm_GBps": 2 * 4 * 4 * 2**20 / m["add_s"] / 1e9,  # as the model counts an op: its output, twice
        "op_overhead_us": m["op_s"] * 1e6,
        "intra_node_GBps": 1 / slope / 1e9,
        "intra_latency_us": latency_s * 1e6,
        "latency_us": latency_s * 1e6,
        # what a busy machine can measure as nothing is written as the least a key takes (> 0)
        "p2p_latency_us": max(m["p2p_s"] * 1e6, 0.1),
        "stream_latency_us": max(m["stream_s"] * 1e6, 0.1),
        "step_overhead_us": max(m["step_overhead_s"] * 1e6, 0.1),
        "time_layers": True,
        "cpu_contention": max(1.0, m["contention"]),
        "sync_skew": max(m["skew"], 0.001),
    }
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# paratrain plan --calibrate: this machine ({os.cpu_count()} cores, torch {torch.__version__}), {stamp};",
        f"# per rank with {ranks} ranks at work ({m['threads']:g} compute thread(s) each), medians: a 512^3",
        "# fp32 matmul (peak), an add over 16 MiB tensors (memory), a tiny model's training step per",
        "# op (op overhead); all-reduces of 1 KiB and 4 MiB over gloo on loopback, each after 1 ms",
        "# of compute on every rank (alpha-beta),",
        "# and after 8 ms (sync skew); a pipeline message's ping-pong through shared",
        "# memory (p2p latency); 30 asynchronous all-reduces beside compute (stream latency, per op).",
        "# a tiny model's steps through the trainer (step overhead). inter_node_Gbps: the cpu preset's, assumed.",
        "[cluster]",
        "# time_layers: plans time the model's layers here; cpu_contention: training steps on every",
        f"# rank at once against rank 0 alone. Each figure the median of {CALIBRATION_ROUNDS} launches.",
    ]
    lines += [f"{k} = {v:.6g}" if isinstance(v, float) else f"{k} = {json.dumps(v)}" for k, v in values.items()]
    text = "\n".join(lines) + "\n"
    try:
        write_calibration(path, text)
    except OSError as exc:
        raise ConfigError("--calibrate", f"{path}: {exc.strerror}") from None
    if keep:  # for this host's plans without --cluster, where it can be kept
        with contextlib.suppress(OSError):
            calibration_file(nproc).parent.mkdir(parents=True, exist_ok=True)
            write_calibration(str(calibration_file(nproc)), text)
    return load_cluster(path)


def write_calibration(path: str, text: str) -> None:
    """A cluster file, its kept layer times gone: a new calibration times the layers afresh."""
    import os

    with open(path, "w") as fh:
        fh.write(text)
    with contextlib.suppress(FileNotFoundError):
        os.remove(times_file_for(path))
