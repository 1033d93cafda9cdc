"""Messages between processes on one host, through shared memory: pipeline activations and
gradients (pipeline/comm.py), and the small sums of PowerSGD's rounds (`LocalSum`, below).

Why not gloo. gloo hands every received message to a helper thread of the receiving process
(its TCP loop), which must get a core before the waiting thread can go on. With every core busy
computing, that handoff waits for the scheduler: measured here with two ranks on two cores, a
message exchanged right after 2 ms of compute took over 3 ms in 12-20 % of exchanges (p50
0.4 ms). Through shared memory the waiting thread itself picks the message up: 0-2 % over 3 ms,
p50 0.1 ms. NCCL does the same on a GPU node (its shared-memory and P2P transports).

One channel per direction of a neighbour pair:

    sender ── payload bytes ──> ring (a shared file, `capacity` bytes) ──> receiver copies out
           ── record (offset, nbytes, tag) ──> data FIFO ──> read by the waiting receiver
           <── one byte per message consumed ── ack FIFO <──

Messages are matched in order, as NCCL matches them (the pipeline posts a neighbour's messages in
the order that neighbour posts them, see pipeline/comm.py); the record's size and tag are checked
against the receive, so a break of that order is an error, not silent corruption. The FIFO
syscalls order the memory accesses on both sides: a receiver reads a payload only after reading
its record, and a sender reuses ring space only after reading the ack, so no shared counters and
no memory fences are needed. A send returns once its payload is in the ring; it waits only when
the ring is full of messages not yet received.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import select
import shutil
import socket
import stat
import struct
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_copied = 0  # payload bytes this process copied into peers' rings, which no write call sees


def _count_copied(n: int) -> None:
    global _copied
    _copied += n


def copied_bytes() -> int:
    """Bytes this process has copied into peers' shared-memory rings (profile.bytes_sent adds them to
    what it wrote to sockets)."""
    return _copied


SHM_DIR = Path("/dev/shm")
RECORD = struct.Struct("qqq")  # offset, nbytes, tag: 24 bytes, written atomically (< PIPE_BUF)
MAX_UNREAD_ACKS = 4096  # an ack is one byte: far below a FIFO's 64 KiB
DEFAULT_CAPACITY = 8 * 2**20  # per direction of a pair, in /dev/shm; larger messages use gloo


class ChannelError(RuntimeError):
    pass


def _paths(directory: Path, src: int, dst: int) -> tuple[Path, Path, Path]:
    base = directory / f"{src}to{dst}"
    return base.with_suffix(".ring"), base.with_suffix(".data"), base.with_suffix(".ack")


def _create_ring(path: Path, capacity: int) -> torch.Tensor:
    """The receiver's ring: a new file of its own (never one that is there already, nor a link)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, capacity)
        return _map(fd, capacity)
    finally:
        os.close(fd)


def _open_ring(path: Path, capacity: int) -> torch.Tensor:
    """The sender's end of a receiver's ring: a regular file of this user's, `capacity` bytes long."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != capacity:
            raise ChannelError(f"{path} is not a ring of {capacity} bytes made by this user")
        return _map(fd, capacity)
    finally:
        os.close(fd)


def _map(fd: int, capacity: int) -> torch.Tensor:
    ring = torch.frombuffer(mmap.mmap(fd, capacity), dtype=torch.uint8)  # the tensor keeps the mapping
    # Touch every page now: a first touch of shared memory costs a page fault of microseconds per
    # 4 KiB, which would otherwise land on the messages of the first laps around the ring (measured:
    # 140 us per 32 KiB message before, 10 us after). Nothing is sent before both ends exist.
    ring.zero_()
    return ring


def _open_fifo(path: Path, flags: int) -> int:
    # O_RDWR: opening a FIFO this way never blocks waiting for the other end (Linux)
    return os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | flags)


class Sender:
    def __init__(self, ring: torch.Tensor, data_fd: int, ack_fd: int, peer: int, timeout_s: float):
        self.ring, self.capacity, self.ring_ptr = ring, ring.numel(), ring.data_ptr()
        self.data_fd, self.ack_fd = data_fd, ack_fd  # the ack FIFO is read without blocking
        self.peer, self.timeout_s = peer, timeout_s
        self.pos = 0  # where the next payload may start, counted without wrapping
        self.in_flight: deque[int] = deque()  # start of each payload not yet acknowledged

    def _acks(self, block: bool) -> None:
        if block and not select.select([self.ack_fd], [], [], self.timeout_s)[0]:
            raise ChannelError(
                f"send to rank {self.peer}: the ring is full and rank {self.peer} "
                f"received nothing for {self.timeout_s:.0f} s"
            )
        try:
            for _ in os.read(self.ack_fd, 65536):
                self.in_flight.popleft()
        except BlockingIOError:
            pass

    def send(self, t: torch.Tensor, tag: int) -> None:
        t = t.contiguous()
        n = t.nbytes
        start = self.pos
        if start % self.capacity + n > self.capacity:  # no room before the end: start over at 0
            start += self.capacity - start % self.capacity
        full = bool(self.in_flight) and start + n - self.in_flight[0] > self.capacity
        if full or len(self.in_flight) > MAX_UNREAD_ACKS:  # the latter keeps the ack FIFO from filling
            self._acks(block=False)  # what the receiver has taken already
            while self.in_flight and start + n - self.in_flight[0] > self.capacity:
                self._acks(block=True)  # wait for the receiver to take more
        offset = start % self.capacity
        # One memmove, not tensor ops: each op costs tens of microseconds right after heavy compute
        ctypes.memmove(self.ring_ptr + offset, t.data_ptr(), n)
        _count_copied(n)
        self.in_flight.append(start)
        self.pos = start + n
        os.write(self.data_fd, RECORD.pack(offset, n, tag))


class Receiver:
    def __init__(self, ring: torch.Tensor, data_fd: int, ack_fd: int, peer: int, timeout_s: float):
        self.ring, self.capacity, self.ring_ptr = ring, ring.numel(), ring.data_ptr()
        self.data_fd, self.ack_fd = data_fd, ack_fd
        self.peer, self.timeout_s = peer, timeout_s
        self.posted = 0
        self.pending: deque[Receive] = deque()

    def post(self, buf: torch.Tensor, tag: int) -> Receive:
        self.posted += 1
        r = Receive(self, buf, tag, self.posted - 1)
        self.pending.append(r)
        return r

    def complete(self, r: Receive) -> None:
        """Take messages in posting order up to `r`'s: a receive waited for before an earlier one
        takes the earlier one's message too, into that one's buffer."""
        while not r.done:
            earlier = self.pending.popleft()
            self._take(earlier)
            earlier.done = True

    def _take(self, r: Receive) -> None:
        try:  # the record is usually there already: one syscall, not a select and a read
            record = os.read(self.data_fd, RECORD.size)
        except BlockingIOError:
            if not select.select([self.data_fd], [], [], self.timeout_s)[0]:
                raise ChannelError(
                    f"receive #{r.index} (tag {r.tag}) from rank {self.peer} did not "
                    f"arrive within {self.timeout_s:.0f} s"
                ) from None
            record = os.read(self.data_fd, RECORD.size)
        offset, n, tag = RECORD.unpack(record)
        if n != r.buf.nbytes or tag != r.tag:
            raise ChannelError(
                f"message #{r.index} from rank {self.peer} is {n} bytes with tag {tag}; "
                f"this rank expected {r.buf.nbytes} bytes with tag {r.tag}: the two ranks "
                f"post their messages in different orders"
            )
        if not 0 <= offset <= self.capacity - n:  # a copy from outside the ring would read any memory
            raise ChannelError(
                f"message #{r.index} from rank {self.peer} lies at bytes [{offset}, {offset + n}) "
                f"of a {self.capacity}-byte ring"
            )
        dest = r.buf if r.buf.is_contiguous() else torch.empty_like(r.buf, memory_format=torch.contiguous_format)
        ctypes.memmove(dest.data_ptr(), self.ring_ptr + offset, n)
        if dest is not r.buf:
            r.buf.copy_(dest)
        os.write(self.ack_fd, b"\x01")


class Receive:
    """A posted receive; `wait()` takes its message (matching torch's Work.wait)."""

    def __init__(self, channel: Receiver, buf: torch.Tensor, tag: int, index: int):
        self.channel, self.buf, self.tag, self.index = channel, buf, tag, index
        self.done = False

    def wait(self) -> bool:
        if not self.done:
            self.channel.complete(self)
        return True


def _host_id() -> str:
    """Same value = same machine and same network namespace. The namespace counts because test
    hosts made of namespaces on one machine (paratrain.testing.netns) must talk over their shaped link."""
    facts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/net"):
        try:
            facts.append(Path(path).read_text().strip() if "boot" in path else str(os.stat(path).st_ino))
        except OSError:
            facts.append("")
    return "/".join(facts)


def connect(
    group, neighbours: set[int], timeout_s: float, capacity: int = DEFAULT_CAPACITY
) -> tuple[dict[int, Sender], dict[int, Receiver]]:
    """Channels to and from every neighbour (global ranks) on this host; collective over `group`.

    Returns ({peer: Sender}, {peer: Receiver}), empty where shared memory cannot be used (another
    host, no /dev/shm): those peers go through torch.distributed. Every rank of `group` calls this,
    and all of them agree on the outcome."""
    me = dist.get_rank()
    members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    # Each rank makes what it receives through in a directory of its own: a fresh name that only
    # this user can enter (0700), so no other user can read the messages, write into them, or plant
    # a file or a link in place of one.
    try:
        own_dir = Path(tempfile.mkdtemp(prefix="paratrain-", dir=SHM_DIR))
    except OSError:  # no /dev/shm here: the facts below say so
        own_dir = None
    facts: list[Any] = [None] * len(members)
    dist.all_gather_object(facts, (me, _host_id(), own_dir is not None, str(own_dir)), group=group)
    by_rank = {r: (host, ok) for r, host, ok, _ in facts}
    dirs = {r: Path(d) for r, _, _, d in facts}
    host, ok = by_rank[me]
    peers = sorted(p for p in neighbours if p != me and by_rank[p] == (host, True)) if ok else []
    failure = ""
    senders: dict[int, Sender] = {}
    receivers: dict[int, Receiver] = {}
    try:
        for p in peers:  # this rank makes what it receives through
            assert own_dir is not None  # no peers without one (ok above)
            ring, data, ack = _paths(own_dir, p, me)
            os.mkfifo(data, 0o600)
            os.mkfifo(ack, 0o600)
            receivers[p] = Receiver(
                _create_ring(ring, capacity), _open_fifo(data, os.O_NONBLOCK), _open_fifo(ack, 0), p, timeout_s
            )
    except (OSError, ChannelError) as exc:
        failure = f"rank {me}: {exc}"
    # everyone's files exist (or someone failed) before anyone opens a peer's
    failures = [None] * len(members)
    dist.all_gather_object(failures, failure, group=group)
    if not any(failures):
        try:
            for p in peers:
                ring, data, ack = _paths(dirs[p], me, p)
                senders[p] = Sender(
                    _open_ring(ring, capacity), _open_fifo(data, 0), _open_fifo(ack, os.O_NONBLOCK), p, timeout_s
                )
        except (OSError, ChannelError) as exc:
            failure = f"rank {me}: {exc}"
        dist.all_gather_object(failures, failure, group=group)
    if own_dir is not None:  # open descriptors and mappings keep them alive; nothing is left behind
        shutil.rmtree(own_dir, ignore_errors=True)
    if any(failures):
        close(senders, receivers)
        return {}, {}
    return senders, receivers


def close(senders: dict, receivers: dict) -> None:
    """Give back channels from connect(): their FIFOs now, their rings with the last reference."""
    for ch in [*senders.values(), *receivers.values()]:
        os.close(ch.data_fd)
        os.close(ch.ack_fd)
    senders.clear()
    receivers.clear()


class LocalSum:
    """SUM all-reduce of small CPU tensors among the ranks of a group that share one host.

    start() copies this rank's tensor into every other member's ring and posts the receives;
    wait() takes the others' tensors and adds all of them in rank order, so every rank computes the
    same sum bit for bit. Progress needs no helper thread: a peer's part is in the ring as soon as
    it has started, and the waiting thread reads it itself. gloo's small all-reduces on a busy
    2-core machine often waited several milliseconds for its threads to be scheduled.

    Construct it on every member of `group` at the same point (it connects, collectively);
    `usable` is False, on every rank alike, unless all members share this host."""

    def __init__(self, group, timeout_s: float, capacity: int = 2 * 2**20):
        self.me = dist.get_rank()
        self.members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.senders, self.receivers = connect(group, set(self.members), timeout_s, capacity)
        self.usable = len(self.members) > 1 and len(self.senders) == len(self.members) - 1
        if not self.usable:  # some members on another host: channels to the rest go unused
            close(self.senders, self.receivers)
        self.max_bytes = capacity // 8  # several rounds in flight never fill a ring
        self.started = 0

    def start(self, t: torch.Tensor) -> LocalSumWork:
        tag = self.started
        self.started += 1
        for p in self.members:
            if p != self.me:
                self.senders[p].send(t, tag)
        parts = [t if p == self.me else self.receivers[p].post(torch.empty_like(t), tag) for p in self.members]
        return LocalSumWork(t, parts)


class LocalSumWork:
    def __init__(self, t: torch.Tensor, parts: list):
        self.t, self.parts, self.done = t, parts, False

    def wait(self) -> bool:
        if self.done:
            return True
        tensors = []
        for part in self.parts:
            if isinstance(part, Receive):
                part.wait()
                part = part.buf
            tensors.append(part)
        acc = tensors[0]  # x0 + x1 + ... in this order on every rank
        for x in tensors[1:]:
            acc.add_(x)
        if acc is not self.t:
            self.t.copy_(acc)
        self.done = True
        return True
