"""Where each step's time and bytes go, on every rank: a cheap, always-on timeline.

What a strategy calls (through `self.profiler`; the trainer sets it, the Strategy base has a no-op):

    with self.profiler.phase("forward"):       # time spent in a phase; a phase nested in another
        ...                                     # is subtracted from the outer one (exclusive times)
    self.profiler.comm("all_reduce", buffer, group)   # bytes handed to a collective (tensor or int)

Phases of one step (anything else in the step counts as "other"):

    data       waiting for the batch (sampling, loading, host -> device)
    forward    forward pass and loss
    backward   backward compute (launching async collectives from hooks included)
    compress   gradient compression arithmetic (parallel/codecs/basic.py)
    comm       exposed communication: time blocked waiting on collectives (work.wait(), or a
               blocking collective); communication hidden behind compute costs nothing here
    optimizer  gradient clipping and the optimizer step
    idle       pipeline bubbles: a stage waiting for its neighbour's activations or gradients

Bytes: each comm() call adds its payload to the op's count and the op's theoretical minimum of
bytes this rank must send for it (ring all-reduce 2(N-1)/N of the buffer, reduce-scatter and
all-gather (N-1)/N of the full buffer, send all of it). On Linux the bytes the process really wrote
to sockets during the step (`wchar` of /proc/self/io: gloo's TCP writes) are measured beside them.

Cost: two perf_counter() calls and a list append per phase, one pread per step; the records stay
on the rank until the trainer's next log point, where one all_gather of a float64 tensor per kind
(step records, trace spans) brings them to rank 0, which appends RUN_DIR/profile.jsonl (one line
per step: every rank's breakdown and bytes) and RUN_DIR/trace.json (Chrome/Perfetto trace event
format, one pid per rank, the first TRACE_STEPS steps of the run). Rank clocks are aligned by a
barrier when the profiler starts. On CUDA a phase ends with a sync of the current stream, so the
times are the device's, not the launch queue's (communication streams keep overlapping).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.comm import collectives, shm
from paratrain.metrics import keep_steps_up_to

PHASES = ("data", "forward", "backward", "compress", "comm", "optimizer", "idle")
COMM_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send", "recv")
TRACE_STEPS = 1000  # trace.json covers this many steps; profile.jsonl covers every step


def min_bytes_sent(op: str, nbytes: float, n: int) -> float:
    """The fewest bytes one of n ranks must send for `op` on an nbytes buffer (bandwidth-optimal ring)."""
    if n <= 1 or op == "recv":
        return 0.0
    if op == "send":
        return float(nbytes)
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    return (n - 1) / n * nbytes  # reduce_scatter, all_gather: nbytes is the full (unsharded) buffer


class NullProfiler:
    """The default: every call does nothing (strategies call the profiler unconditionally)."""

    _null = contextlib.nullcontext()

    def phase(self, name: str, index: int | None = None):
        return self._null

    def comm(self, op: str, data, group=None) -> None:
        pass


NULL_PROFILER = NullProfiler()


class _Phase:
    """Context manager for one phase; keeps a stack so nested phases are subtracted from their parent."""

    __slots__ = ("prof", "code", "index", "start", "child")

    def __init__(self, prof: Profiler, code: int, index: int | None):
        self.prof, self.code, self.index = prof, code, index

    def __enter__(self):
        self.child = 0.0
        self.prof._stack.append(self)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        prof = self.prof
        if prof._sync is not None and prof._draining:
            prof._sync()
        end = time.perf_counter()
        prof._stack.pop()
        elapsed = end - self.start
        prof._phase_s[self.code] += elapsed - self.child
        if prof._stack:
            prof._stack[-1].child += elapsed
        if prof._tracing:
            prof._spans.append(
                (prof._step, self.code, self.start - prof.t0, end - prof.t0, -1 if self.index is None else self.index)
            )
        return False


# layout of one step record (a float64 row): step, start, seconds, phases..., sent, payload/op, min/op
_P, _O = len(PHASES), len(COMM_OPS)
_PHASE0, _SENT = 3, 3 + _P
_PEAK = _SENT + 1  # peak bytes allocated during the step (-1: train.track_memory is off)
_PAYLOAD0 = _PEAK + 1
_MIN0 = _PAYLOAD0 + _O
_WIDTH = _MIN0 + _O


class Profiler:
    """One rank's profiler. Collective methods (start, flush, close) are called by every rank."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world_size: int,
        device: torch.device,
        start_step: int = 0,
        torch_profiler: bool = False,
        memory: MemoryTracker | None = None,
    ):
        self.run_dir, self.rank, self.world = Path(run_dir), rank, world_size
        self.device = device
        self._codes = {name: i for i, name in enumerate(PHASES)}
        self._ops = {name: i for i, name in enumerate(COMM_OPS)}
        self._sync = torch.cuda.current_stream().synchronize if device.type == "cuda" else None
        self._stack: list[_Phase] = []
        self._rows: list[list[float]] = []
        self._spans: list[tuple] = []
        self._step = start_step
        self._first_step = start_step
        self._phase_s = [0.0] * _P
        self._payload = [0.0] * _O
        self._min = [0.0] * _O
        self._tracing = False
        self._in_step = False
        self._draining = True
        self._io = open_proc_io() if device.type == "cpu" else None
        self._torch_prof = None
        self._memory = memory
        if world_size > 1:
            collectives.barrier("profiler start")  # a common time origin for all ranks' traces
        self.t0 = time.perf_counter()
        if rank == 0:
            self._profile_file = _open_profile(self.run_dir / "profile.jsonl", start_step)
            self._trace_file = open(self.run_dir / "trace.json", "w")
            self._trace_file.write("[\n")
            self._trace_first = True
            self._trace_events(
                [
                    {"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}}
                    for r in range(world_size)
                ]
                + [
                    {"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}}
                    for r in range(world_size)
                ]
            )
        if torch_profiler:
            self._torch_prof = _start_torch_profiler(self.run_dir / "torch_profiler", rank)
        collectives.PROFILER = self  # every collective is counted and its waits timed (see there)

    # -- what strategies call ---------------------------------------------------------------------
    def phase(self, name: str, index: int | None = None):
        """Time a phase of the current step; `index` (e.g. a micro-batch) labels it in the trace.
        Outside a step (evaluation, checkpoints, logging) nothing is recorded."""
        return _Phase(self, self._codes[name], index) if self._in_step else NullProfiler._null

    def comm(self, op: str, data, group=None) -> None:
        """Count a collective or message: `data` is the tensor handed to it (or its size in bytes)."""
        if not self._in_step:
            return
        nbytes = data if isinstance(data, int) else data.numel() * data.element_size()
        i = self._ops[op]
        self._payload[i] += nbytes
        self._min[i] += min_bytes_sent(op, nbytes, dist.get_world_size(group) if self.world > 1 else 1)

    # -- what the trainer calls -------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int, drain: bool = True):
        """One training step; `step` is its number as metrics.jsonl counts it (1 = the first).
        On a GPU, `drain` waits for the device at the end of each phase and of the step, so that
        their times are the device's: the trainer drains only at a logged step (no host sync in the
        steps between, whose times are then the host's, the device's wait falling on the logged
        step; the steps' sum is the same)."""
        self._draining = drain
        self._step = step
        self._tracing = step - self._first_step <= TRACE_STEPS
        self._phase_s = [0.0] * _P
        self._payload = [0.0] * _O
        self._min = [0.0] * _O
        io_before = bytes_sent(self._io)
        if self._memory is not None:
            self._memory.begin_step()
        start = time.perf_counter()
        self._in_step = True
        try:
            yield self
        finally:
            self._in_step = False
        if self._sync is not None and drain:
            self._sync()
        end = time.perf_counter()
        sent = bytes_sent(self._io) - io_before if self._io is not None else -1.0
        peak = self._memory.end_step() if self._memory is not None else -1.0
        self._rows.append([step, start - self.t0, end - start, *self._phase_s, sent, peak, *self._payload, *self._min])
        if self._tracing:
            self._spans.append((step, -1, start - self.t0, end - self.t0, -1))
        if self._torch_prof is not None:
            self._torch_prof.step()

    def flush(self, group=None) -> dict:
        """Collective over `group` (default: every rank; a parameter server passes its live ranks):
        bring the ranks' records since the last flush to rank 0 and write them.

        Returns (on rank 0) the means over ranks and steps for metrics.jsonl: step_s, comm_s,
        bytes_sent (measured; absent where it cannot be), bytes_min."""
        rows = torch.tensor(self._rows, dtype=torch.float64).reshape(-1, _WIDTH)
        spans = torch.tensor(self._spans, dtype=torch.float64).reshape(-1, 5)
        self._rows, self._spans = [], []
        all_rows = self._gather(rows, group)
        all_spans = self._gather(spans, group)
        if self.rank != 0 or not min(len(r) for r in all_rows):
            return {}
        ranks = (
            list(range(len(all_rows)))
            if group is None
            else [dist.get_global_rank(group, i) for i in range(len(all_rows))]
        )
        self._write_profile(dict(zip(ranks, all_rows)))
        self._write_trace(dict(zip(ranks, all_spans)))
        stacked = torch.stack([r[: min(len(x) for x in all_rows)] for r in all_rows])  # ranks x steps x fields
        summary = {
            "step_s": stacked[:, :, 2].mean().item(),
            "comm_s": stacked[:, :, _PHASE0 + self._codes["comm"]].mean().item(),
            "bytes_min": stacked[:, :, _MIN0:_WIDTH].sum(-1).mean().item(),
        }
        if (stacked[:, :, _SENT] >= 0).all():
            summary["bytes_sent"] = stacked[:, :, _SENT].mean().item()
        if (stacked[:, :, _PEAK] >= 0).all():
            summary["peak_memory_mib"] = stacked[:, :, _PEAK].max().item() / 2**20
        return summary

    def close(self) -> None:
        if collectives.PROFILER is self:
            collectives.PROFILER = None
        if self._torch_prof is not None:
            self._torch_prof.stop()
            self._torch_prof = None
        if self._memory is not None:
            self._memory.close()
        if self.rank == 0:
            self._profile_file.close()
            self._trace_file.write("\n]\n")
            self._trace_file.close()
        if self._io is not None:
            os.close(self._io)
            self._io = None

    # -- gathering and writing (rank 0) -----------------------------------------------------------
    def _gather(self, rows: torch.Tensor, group=None) -> list[torch.Tensor]:
        """all_gather rows of possibly different counts per rank (as tensors: no pickles)."""
        if self.world == 1:
            return [rows]
        size = dist.get_world_size(group)
        count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=self.device)
        count_tensors = [torch.zeros_like(count) for _ in range(size)]
        collectives.all_gather(count_tensors, count, "profile record counts", group=group)
        counts = [int(c.item()) for c in count_tensors]
        width = rows.shape[1]
        padded = torch.zeros(max(counts), width, dtype=torch.float64, device=self.device)
        padded[: rows.shape[0]] = rows.to(self.device)
        out = [torch.empty_like(padded) for _ in range(size)]
        collectives.all_gather(out, padded, "profile records", group=group)
        return [t[:c].cpu() for t, c in zip(out, counts)]

    def _write_profile(self, all_rows: dict[int, torch.Tensor]) -> None:
        for i in range(min(len(rows) for rows in all_rows.values())):
            ranks = []
            for r, rows in all_rows.items():
                row = rows[i].tolist()
                phases = dict(zip(PHASES, row[_PHASE0:_SENT]))
                phases["other"] = max(row[2] - sum(row[_PHASE0:_SENT]), 0.0)
                comm = {
                    op: {"payload": int(row[_PAYLOAD0 + j]), "min_sent": int(row[_MIN0 + j])}
                    for j, op in enumerate(COMM_OPS)
                    if row[_PAYLOAD0 + j]
                }
                entry = {
                    "rank": r,
                    "start_s": round(row[1], 6),
                    "step_s": row[2],
                    "phases": phases,
                    "comm": comm,
                    "bytes_min": int(sum(row[_MIN0:_WIDTH])),
                }
                if row[_SENT] >= 0:
                    entry["bytes_sent"] = int(row[_SENT])
                if row[_PEAK] >= 0:
                    entry["peak_memory_bytes"] = int(row[_PEAK])
                ranks.append(entry)
            record = {"step": int(all_rows[0][i, 0]), "world": self.world, "ranks": ranks}
            self._profile_file.write(json.dumps(record) + "\n")
        self._profile_file.flush()

    def _write_trace(self, all_spans: dict[int, torch.Tensor]) -> None:
        events = []
        for r, spans in all_spans.items():
            for step, code, start, end, index in spans.tolist():
                name = f"step {int(step)}" if code < 0 else PHASES[int(code)]
                args = {"step": int(step)}
                if index >= 0:
                    args["index"] = int(index)
                events.append(
                    {
                        "name": name,
                        "cat": "step" if code < 0 else "phase",
                        "ph": "X",
                        "pid": r,
                        "tid": 0,
                        "ts": round(start * 1e6, 3),
                        "dur": round((end - start) * 1e6, 3),
                        "args": args,
                    }
                )
        self._trace_events(events)

    def _trace_events(self, events: list[dict]) -> None:
        for event in events:
            self._trace_file.write(("" if self._trace_first else ",\n") + json.dumps(event))
            self._trace_first = False
        self._trace_file.flush()


def _open_profile(path: Path, start_step: int):
    """A fresh run starts the file anew; a resumed one keeps the steps before its checkpoint."""
    if start_step and path.is_file():
        keep_steps_up_to(path, start_step)
        return open(path, "a")
    return open(path, "w")


def open_proc_io() -> int | None:
    try:
        return os.open("/proc/self/io", os.O_RDONLY)
    except OSError:
        return None


def bytes_sent(fd: int | None) -> float:
    """Bytes this process has sent so far: written to sockets and pipes (gloo's TCP traffic), plus
    the payloads it copied into peers' shared-memory rings (comm/shm.py), which no write call sees.
    `fd`: from open_proc_io()."""
    if fd is None:
        return 0.0
    text = os.pread(fd, 512, 0)
    start = text.index(b"wchar:") + 6
    return float(text[start : text.index(b"\n", start)]) + shm.copied_bytes()


def _start_torch_profiler(out_dir: Path, rank: int):
    """torch.profiler over steps 2-4 of the run (after one step of warm-up), Chrome traces per rank."""
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(
        activities=activities,
        schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(out_dir), worker_name=f"rank{rank}"),
        record_shapes=False,
    )
    prof.start()
    return prof


class MemoryTracker:
    """The peak of the tensor bytes torch holds allocated on this rank in each training step
    (train.track_memory): what a GPU user means by peak memory. On CUDA it is
    torch.cuda.max_memory_allocated. The CPU allocator keeps no such counter. So when a step begins,
    the bytes of every tensor storage reachable from Python are added up (less those that existed
    when the tracker was made: the datasets; less shared memory and lent buffers, which the allocator
    does not hand out), and during the step torch's profiler with memory profiling reports every
    allocation (+bytes) and free (-bytes) as a "[memory]" event: their running sum from that count
    is the bytes allocated, its maximum the step's peak. What runs between steps (logging,
    evaluation, checkpoints) is not counted. The profiler (its legacy, kineto-free form: no trace
    files, no log lines) records every op of the step, and the count walks Python's objects: the
    cost of the key. It sees the threads that run the step's ops (autograd's included), not gloo's:
    a buffer whose last reference a collective's thread drops stays counted to the step's end."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._device = device
        self.live = 0  # bytes allocated, as of the last event counted
        self._on = False
        if not self.cuda:
            # Garbage first: what a reference cycle holds now (a previous run's in the same process,
            # torch.compile's) is freed during the run, and a storage of the run's own at one of its
            # addresses would be left out (measured: a pipeline stage's peak 7 % low after compiling)
            gc.collect()
        self._before = set() if self.cuda else set(_cpu_storages().items())

    def begin_step(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self._device)
            return
        from torch._C._profiler import _ExperimentalConfig
        from torch.autograd import ProfilerConfig, ProfilerState, _enable_profiler_legacy

        self.live = sum(n for ptr, n in _cpu_storages().items() if (ptr, n) not in self._before)
        _enable_profiler_legacy(
            ProfilerConfig(ProfilerState.CPU, False, True, False, False, False, _ExperimentalConfig(), "")
        )
        self._on = True

    def end_step(self) -> int:
        """The step's peak of allocated bytes."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(self._device)
        from torch.autograd import _disable_profiler_legacy

        self._on = False
        events = [e for thread in _disable_profiler_legacy() for e in thread if e.kind() == "memory_alloc"]
        peak = self.live
        # each thread's in order; threads merged by time (torch's stub of the event lacks start_us)
        for e in sorted(events, key=lambda e: e.start_us()):  # type: ignore[attr-defined]
            self.live += e.cpu_memory_usage()
            peak = max(peak, self.live)
        return peak

    def close(self) -> None:
        if self._on:
            self.end_step()


def _cpu_storages() -> dict[int, int]:
    """{address: bytes} of the CPU allocator's storages behind every tensor Python reaches."""
    out = {}
    for obj in gc.get_objects():
        # by type, not isinstance: that reads __class__, which a weakref.proxy whose object is gone
        # (torch.compile's caches hold some) answers with ReferenceError
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                address = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage, a fake
                continue  # tensor that torch.compile's caches keep (no memory of its own)
            # torch's own allocations only: not shared memory, nor a buffer lent to a tensor
            # (torch.frombuffer, numpy's), whose storage cannot be resized
            if storage.nbytes() and storage.resizable() and not storage.is_shared():
                out[address] = storage.nbytes()
    return out
