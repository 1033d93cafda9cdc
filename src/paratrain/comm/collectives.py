"""Every collective paratrain issues goes through here, so a hang can be explained.

Each rank keeps a short log of its collectives (sequence number, operation, size, what it was for,
training step) and a running fingerprint of the whole sequence. Collectives run under the process
group's timeout (parallel.timeout_s), so a rank that stops participating makes its peers fail
within that time instead of after the default 30 minutes. When that happens, `explain_failure`
has every rank that can still answer post its log to the rendezvous store (which does not depend
on the failed collective), compares them and names the rank that issued a different collective,
fell behind, or never answered.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import time
import weakref
from collections import deque
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from paratrain.runtime import fault_points


@dataclass
class Record:
    seq: int
    op: str
    numel: int
    dtype: str
    what: str
    step: int

    def describe(self) -> str:
        return f"#{self.seq} {self.op}({self.numel} x {self.dtype}, {self.what}) at step {self.step}"

    def signature(self) -> tuple:
        return self.op, self.numel, self.dtype, self.what, self.step


class CollectiveLog:
    def __init__(self, keep: int = 128):
        self.records: deque[Record] = deque(maxlen=keep)
        self.seq = 0
        self.step = 0
        self._fingerprint = hashlib.blake2b(digest_size=8)

    def add(self, op: str, tensor: torch.Tensor, what: str, world: bool = True) -> Record:
        """`world`: issued on the whole world. Sub-group collectives (model parallelism: a tp group,
        the dp group of one pipeline stage) differ legitimately between ranks of different groups,
        so they are logged but kept out of the fingerprint that every rank must share."""
        rec = Record(self.seq, op, tensor.numel(), str(tensor.dtype).removeprefix("torch."), what, self.step)
        self.seq += 1
        self.records.append(rec)
        if world:
            self._fingerprint.update(repr(rec.signature()).encode())
        return rec

    @property
    def fingerprint(self) -> str:
        return self._fingerprint.hexdigest()

    @property
    def last(self) -> Record | None:
        return self.records[-1] if self.records else None


LOG = CollectiveLog()
# The process's step profiler (paratrain/profile.py sets it while one is open): every collective's
# payload is counted here and time blocked on one is its "comm" phase, whichever strategy issued it
PROFILER: Any = None  # a profile.Profiler while one runs (profile.py imports this module, not back)

# op name in the profile, and the payload as the byte accounting defines it (for the gathers: the
# whole gathered buffer), from (kind, tensor, world)
_ACCOUNTED = {
    "all_reduce": ("all_reduce", lambda t, n: t.nbytes),
    "broadcast": ("broadcast", lambda t, n: t.nbytes),
    "reduce_scatter": ("reduce_scatter", lambda t, n: t.nbytes),
    "all_gather": ("all_gather", lambda t, n: t.nbytes * n),
    "all_gather_into": ("all_gather", lambda t, n: t.nbytes * n),
}


def _blocked():
    """The "comm" phase of the open profiler (nothing without one)."""
    return PROFILER.phase("comm") if PROFILER is not None else contextlib.nullcontext()


class Handle:
    """Communication under way, as one handle: waits for `works` (Works of collectives, or other
    handles), then runs `then` once. With `second` (a function that starts another round and returns
    the function that finishes it), advance() starts that round early, so it overlaps what the caller
    does next. With nothing to wait for it stands in for communication that was not needed (a group
    of one) or that a fault injection skipped."""

    def __init__(self, works=(), then=None, second=None):
        self.works, self.then, self.second = list(works), then, second

    def _wait_works(self) -> None:  # the waits are the profile's "comm" (_Tracked)
        for w in self.works:
            w.wait()
        self.works = []

    def advance(self) -> None:
        if self.second is not None:
            self._wait_works()
            self.then, self.second = self.second(), None

    def wait(self) -> bool:
        self.advance()
        self._wait_works()
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True


class _Tracked:
    """An async collective whose failure, when waited on, is explained like a blocking one's."""

    def __init__(self, work, record: Record):
        self.work, self.record = work, record
        if not DIAGNOSE:  # fault.on_failure = "continue": forget_works may have to let it go
            _UNDER_WAY.add(self)

    def wait(self):
        try:
            with _blocked():
                return self.work.wait()
        except RuntimeError as exc:
            raise CollectiveFailure(explain_failure(exc, self.record)) from exc


_UNDER_WAY: weakref.WeakSet[_Tracked] = weakref.WeakSet()


def forget_works() -> None:
    """Let go of every collective issued (under "continue"), once its group is aborted. A work holds
    its group's connections open: measured with gloo at world 4, a survivor that kept the works of
    a step the lost rank broke held its peer, blocked in that step's all-reduce, until the timeout
    instead of 0.05 s (fault/survive.py: Membership.release)."""
    for tracked in list(_UNDER_WAY):
        tracked.work = None
    _UNDER_WAY.clear()


def _eager_under_compile(fn):
    """torch.compiler.disable(fn), applied at the first call instead of at import: applying it
    imports torch._dynamo (about 2 s of CPU, sympy included), which a launcher, `plan` or `inspect`
    would pay for this module and never use. A worker has dynamo before its first collective (the
    worker server preloads it) and torch.compile imports it before it traces anything."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call


@contextlib.contextmanager
def unprofiled():
    """Collectives of a one-time check (parallel.verify_plan) that are not the step's traffic: the
    profiler does not count them, as the plan does not."""
    global PROFILER
    profiler, PROFILER = PROFILER, None
    try:
        yield
    finally:
        PROFILER = profiler


# Inside a block that train.compile compiles (tensor parallelism's paired operators), a collective
# is a graph break: its logging, fingerprint and profiling run eagerly, as everywhere else
@_eager_under_compile
def _issue(kind: str, fn, tensor: torch.Tensor, what: str, **kwargs):
    if fault_points.fires("skip_collective", rank=dist.get_rank(), step=LOG.step, what=what):
        return Handle() if kwargs.get("async_op") else None  # as if this rank never issued it
    group = kwargs.get("group")
    record = LOG.add(kind, tensor, what, world=group in (None, dist.group.WORLD))
    if PROFILER is not None and kind in _ACCOUNTED:
        op, payload = _ACCOUNTED[kind]
        PROFILER.comm(op, payload(tensor, dist.get_world_size(group)), group)
    # A blocking call holds the host only on CPU (gloo); NCCL's merely enqueues, and timing it would
    # cost a stream sync per call (tp issues two per layer and microbatch): on a GPU its time stays
    # in the phase around it
    blocks_host = not kwargs.get("async_op") and tensor.device.type == "cpu"
    try:
        with _blocked() if blocks_host else contextlib.nullcontext():
            work = fn(tensor, **kwargs)
    except RuntimeError as exc:
        raise CollectiveFailure(explain_failure(exc, record)) from exc
    return _Tracked(work, record) if work is not None else None


def all_reduce(tensor: torch.Tensor, what: str, group=None, async_op: bool = False, op=dist.ReduceOp.SUM):
    return _issue("all_reduce", dist.all_reduce, tensor, what, group=group, async_op=async_op, op=op)


def all_reduce_via(start, tensor: torch.Tensor, what: str, group=None):
    """An asynchronous SUM all-reduce through another transport's `start(tensor) -> work` (e.g.
    comm/shm.py.LocalSum), logged, fault-injected and explained like every other collective."""
    return _issue("all_reduce", lambda t, **_: start(t), tensor, what, group=group, async_op=True)


def broadcast(tensor: torch.Tensor, src: int, what: str, group=None, async_op: bool = False):
    return _issue("broadcast", dist.broadcast, tensor, what, src=src, group=group, async_op=async_op)


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, what: str, group=None):
    return _issue("all_gather", lambda t, **kw: dist.all_gather(outputs, t, **kw), tensor, what, group=group)


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, what: str, group=None, async_op: bool = False):
    """`output` (this rank's chunk's size) gets the sum over ranks of this rank's chunk of `tensor`."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return _issue("reduce_scatter", lambda t, **kw: fn(output, t, **kw), tensor, what, group=group, async_op=async_op)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, what: str, group=None, async_op: bool = False):
    """Every rank's `tensor`, concatenated in rank order into `output`."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _issue("all_gather_into", lambda t, **kw: fn(output, t, **kw), tensor, what, group=group, async_op=async_op)


def barrier(what: str, group=None) -> None:
    _issue("barrier", lambda t, **kw: dist.barrier(**kw), torch.empty(0), what, group=group)


# -- explaining a failed collective ---------------------------------------------------------------
class CollectiveFailure(RuntimeError):
    """A collective timed out or broke; the message names the rank, operation and step."""


DIAGNOSE = True  # whether a failed collective waits for its peers' logs to name the culprit
# Called where a collective failed, before its diagnosis waits on the peers: fault/stop.py
# puts making SIGTERM fatal again here (the agent may be stopping the group already).
BEFORE_DIAGNOSIS: list = []


def _store():
    return dist.distributed_c10d._get_default_store()


def explain_failure(exc: BaseException, record: Record | None = None, wait_s: float = 10.0) -> str:
    """One paragraph: what this rank was doing, and which rank is to blame if that can be told."""
    if DIAGNOSE:  # (under "continue" it is a lost peer: the survivors go on, and a SIGTERM still saves)
        for hook in BEFORE_DIAGNOSIS:
            hook()
    if isinstance(exc, CollectiveFailure):
        return str(exc)
    rank, world = dist.get_rank(), dist.get_world_size()
    if not DIAGNOSE:  # fault.on_failure = "continue": the survivors regroup instead (fault/survive.py)
        return f"rank {rank}: {str(exc).strip()[:200]}"
    mine = record or LOG.last
    head = (
        f"rank {rank}: collective {mine.describe()} did not complete" if mine else f"rank {rank}: a collective failed"
    )
    cause = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    try:
        store = _store()
        key = f"paratrain/collectives/{rank}"
        store.set(key, json.dumps({"seq": LOG.seq, "records": [asdict(r) for r in LOG.records]}))
        logs: dict[int, Any] = {rank: LOG}  # own log; each peer's as JSON, or None if it never answered
        deadline = time.monotonic() + wait_s
        for peer in range(world):
            if peer == rank:
                continue
            try:
                store.wait([f"paratrain/collectives/{peer}"], timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
                logs[peer] = json.loads(store.get(f"paratrain/collectives/{peer}"))
            except Exception:  # that peer never answered: dead, or stuck outside any collective
                logs[peer] = None
        verdict = _compare(rank, logs)
    except Exception as diag_exc:  # the store itself is gone: say what we know
        verdict = f"(no diagnosis: {type(diag_exc).__name__}: {diag_exc})"
    return f"{head} ({cause}); {verdict}"


def _compare(rank: int, logs: dict) -> str:
    silent = sorted(p for p, log in logs.items() if log is None)
    seqs = {rank: {r.seq: r for r in LOG.records}}
    counts = {rank: LOG.seq}
    for peer, log in logs.items():
        if peer != rank and log is not None:
            seqs[peer] = {r["seq"]: Record(**r) for r in log["records"]}
            counts[peer] = log["seq"]
    common = set.intersection(*(set(s) for s in seqs.values())) if seqs else set()
    for seq in sorted(common):
        sigs = {p: s[seq].signature() for p, s in seqs.items()}
        if len(set(sigs.values())) > 1:
            odd = _odd_rank(seq, seqs)
            peer = next(p for p in sigs if sigs[p] != sigs[odd])
            return (
                f"collective sequences diverge at #{seq}: rank {odd} issued {seqs[odd][seq].describe()} "
                f"while rank {peer} issued {seqs[peer][seq].describe()}; rank {odd} issued a different "
                f"collective than its peers"
            )
    if len(set(counts.values())) > 1:
        behind = min(counts, key=counts.__getitem__)
        ahead = max(counts, key=counts.__getitem__)
        last = seqs[behind].get(counts[behind] - 1)
        return (
            f"rank {behind} stopped after {counts[behind]} collectives"
            f"{' (last: ' + last.describe() + ')' if last else ''} while rank {ahead} issued {counts[ahead]}"
        )
    if silent:
        return f"rank(s) {', '.join(map(str, silent))} did not answer: dead, or stuck outside any collective"
    return "every rank issued the same collectives; the failure is in the transport"


def _odd_rank(seq: int, seqs: dict[int, dict[int, Record]]) -> int:
    """Which rank broke ranks at position `seq`.

    A rank that skipped a collective is ahead: what it issued at `seq`, its peers issue later. A
    rank that issued an extra one is behind: what its peers issued at `seq` it issues later. Only
    when neither tells (or with three or more ranks) does the minority signature decide.
    """
    sig = {p: s[seq].signature() for p, s in seqs.items()}
    later = {p: {r.signature() for k, r in s.items() if k > seq} for p, s in seqs.items()}
    for p in sig:
        others = [q for q in sig if sig[q] != sig[p]]
        if others and all(sig[p] in later[q] for q in others):
            return p  # skipped: its peers have yet to issue what it already did
    for p in sig:
        others = [q for q in sig if sig[q] != sig[p]]
        if others and all(sig[q] in later[p] for q in others):
            return p  # extra: it has yet to issue what its peers already did
    groups: dict[tuple, list[int]] = {}
    for p, signature in sig.items():
        groups.setdefault(signature, []).append(p)
    return min(groups.values(), key=len)[0]
