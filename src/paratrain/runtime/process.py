"""Process group, device and seeding for one worker.

Reads the standard torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
so a worker runs the same under `paratrain run`, a plain `torchrun`, or the elastic agent's restarts.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import numpy as np
import torch
import torch.distributed as dist

from paratrain.errors import ConfigError, note


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    restart_count: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str, nproc: int) -> tuple[str, str | None]:
    """The device this node's workers train on, 'cpu' or 'cuda', decided before any of them starts,
    and a note for the user when 'auto' could not pick the GPU it found.

    NCCL takes one GPU per rank: two ranks on one GPU fail at init ("Duplicate GPU detected"). So
    'auto' picks CUDA only when this node has a GPU for each of its processes and otherwise
    trains on CPU with gloo, saying so; an explicit 'cuda' that cannot be honoured is a config
    error. Raises ConfigError.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cpu" or (device == "auto" and gpus == 0):
        return "cpu", None
    if gpus == 0:
        raise ConfigError("train.device", "'cuda' but no CUDA device is available")
    if nproc > gpus:
        if device == "cuda":
            raise ConfigError(
                "train.device",
                f"'cuda' needs one GPU per process (NCCL): {nproc} processes "
                f"per node, {gpus} GPU{'s' * (gpus > 1)} here; lower --nproc "
                f"or set train.device = 'cpu'",
            )
        return "cpu", (
            f"train.device 'auto': {nproc} processes per node but {gpus} GPU{'s' * (gpus > 1)} "
            f"(NCCL takes one GPU per process), so training on CPU with gloo"
        )
    return "cuda", None


def pick_device(kind: str, local_rank: int, local_world: int) -> torch.device:
    """This worker's device. `paratrain run` has resolved 'auto' already; under plain torchrun the
    worker resolves it here, from how many processes share this node."""
    kind, why = resolve_device(kind, local_world)
    if why and local_rank == 0:
        note(why)
    if kind == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep freed memory for reuse instead of handing it back to the kernel.

    By default a freed block of over a few MiB goes back to the kernel (munmap, or a trim of the
    heap's top), so the next step's same-sized temporary (a weight gradient of a 2048 x 2048 layer
    is 16 MiB) is fresh memory again and faults in page by page: measured, 8-32 MiB of page
    faults per step per rank in the bench MLP, several ms of a ~90 ms step. Keeping blocks up to
    glibc's ceiling of 32 MiB on the heap and never trimming it is what jemalloc/tcmalloc preloads
    buy CPU training elsewhere; a process's resident memory stays at its peak, as with a CUDA
    caching allocator. No-op (False) where the C library is not glibc.
    """
    return _mallopt(32 << 20, 2**31 - 1)


def give_freed_memory_back() -> bool:
    """The opposite policy, for a process whose point is its peak memory (zero3 on CPU): a freed
    block of 8 MiB or more goes back to the kernel, and so does the heap's free top past 8 MiB.
    zero3 allocates and frees its units' full parameters and gradients every step anyway (its
    largest buffers page-fault in each step either way); kept, the heap's freed blocks between
    them held 45-60 MB per worker resident at the peak (mallinfo2, the 54.6M-parameter MLP of
    `bench memory` at world 2), which giving them back took off the peak. No-op (False) where
    the C library is not glibc."""
    return _mallopt(8 << 20, 8 << 20)


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def init(device_kind: str = "auto", timeout_s: float = 300.0) -> Runtime:
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(device_kind, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if device.type == "cpu":
        keep_freed_memory()
    backend = "nccl" if device.type == "cuda" else "gloo"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if not dist.is_initialized():
        store = _store(rank, world, timeout_s)
        attempt = _rendezvous_round(store, attempt)
        group_store = dist.PrefixStore(f"paratrain/attempt-{attempt}", store)
        dist.init_process_group(
            backend,
            store=group_store,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
        end_in_order_at_exit(group_store, rank, world, timeout_s)
    return Runtime(rank, world, local_rank, device, backend, attempt)


# -- the end of a process that did not call shutdown (a script that just ends, or sys.exit()) --------
# The interpreter's teardown must not meet a live process group. gloo's worker threads free each
# finished collective's tensors themselves, a moment after the caller's wait() returned, and a
# Python-owned tensor needs the GIL to go: once the interpreter is finalizing, a thread asking for
# the GIL is ended by pthread_exit, whose unwinding through gloo's noexcept frames calls
# std::terminate ("terminate called without an active exception", SIGABRT; the core's backtrace:
# ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> decref_pyobject -> take_gil -> pthread_exit).
# Seen in 1 of 10 to 1 of 20 torchrun runs of a finished own loop: a job that had trained and
# saved, marked failed. So an exit handler, which runs before the teardown, waits for every rank
# to reach its end, then destroys the groups and lets gloo's threads finish (_destroy_groups)
# while the interpreter is whole.
_exit_state: dict = {"failing": False, "checks": []}


class PeersGone(Exception):
    """A rank waited for its peers at its end and they did not come: one failed, or none came
    within the time."""


def end_in_order_at_exit(store, rank: int, world: int, timeout_s: float) -> None:
    """At this process's exit, unless it is failing (mark_failing): the checks at the end
    (check_at_end), every rank's end met in `store`, then the process groups destroyed.
    Installed once, by whoever joins the group."""
    import atexit

    if "store" not in _exit_state:
        atexit.register(_end_in_order)
        previous = sys.excepthook

        def excepthook(*exc_info) -> None:  # an uncaught exception: this rank fails, no waiting
            mark_failing()
            previous(*exc_info)

        sys.excepthook = excepthook
    _exit_state.update(store=store, rank=rank, world=world, timeout_s=timeout_s)


def check_at_end(check) -> None:
    """`check()`, a bound method, runs at a clean exit, before the ranks meet: a collective every rank makes at
    its end (a peer still inside a call it ran alone pairs with it: comm/lockstep.py). It waits
    through wait_for_peers, and may refuse (SystemExit) or raise PeersGone."""
    import weakref

    _exit_state["checks"].append(weakref.WeakMethod(check))  # not kept alive for it (the test gang's many jobs)


def mark_failing() -> None:
    """This rank is leaving on an error (a refusal, an uncaught exception): its exit handler
    waits for no one and destroys nothing, since its peers may be inside a collective with it;
    and the peers at their own end stop waiting for it."""
    if _exit_state["failing"]:
        return
    _exit_state["failing"] = True
    if "store" in _exit_state:
        try:
            _exit_state["store"].add("exit/failed", 1)
        except RuntimeError:  # the store's host is gone already: nobody waits there
            pass


def wait_for_peers(done, what: str) -> None:
    """Wait at this rank's end until `done()`; raises PeersGone where a peer failed first, or
    none of it came within parallel.timeout_s."""
    import time

    store, timeout_s = _exit_state["store"], _exit_state["timeout_s"]
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not done():
        if store.add("exit/failed", 0):  # (a store whose host is gone raises: the caller leaves)
            # a peer that refused on seeing this rank's own call (lockstep.py) marks itself failing
            # the moment their exchange completes, which this rank may not have seen yet
            grace = time.monotonic() + 0.5
            while not done():
                if time.monotonic() > grace:
                    raise PeersGone("a peer failed")
                time.sleep(0.005)
            return
        if time.monotonic() > deadline:
            raise PeersGone(f"{what} after parallel.timeout_s = {timeout_s:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _a_peer_failed(store) -> bool:
    try:
        return bool(store.add("exit/failed", 0))
    except RuntimeError:  # the store's host is gone
        return False


def _end_in_order() -> None:
    if not dist.is_initialized() or _exit_state["failing"]:
        return
    store, rank, world = _exit_state["store"], _exit_state["rank"], _exit_state["world"]
    try:
        for ref in _exit_state["checks"]:
            if (check := ref()) is not None:
                check()
        if world > 1:
            # every rank at its end first, as shutdown(together=True): a rank tearing gloo down
            # while a peer still talks to it can abort the peer. Met in the store, not by a
            # barrier: that would be one more collective, whose own work gloo's thread frees as
            # above. Rank 0 may host the store: it leaves once every other rank has seen the count.
            arrived = store.add("exit/arrived", 1)
            wait_for_peers(lambda: arrived >= world or store.add("exit/arrived", 0) >= world, "not every rank ended")
            store.add("exit/left", 1)
            if rank == 0:
                wait_for_peers(lambda: store.add("exit/left", 0) >= world, "not every rank left")
    except SystemExit as exc:  # a check at the end refused (and marked this rank failing): its line is said
        leave(exc.code if isinstance(exc.code, int) else 2)
    except (PeersGone, RuntimeError) as exc:  # a peer failed, or its store went with it
        # a collective of this rank's may still wait on it: destroying the group would wait too.
        # A failing peer marks the store before its exit closes its connections, so a collective
        # broken by that exit ("Connection closed by peer") is said as what it is
        why = "a peer failed" if _a_peer_failed(store) else str(exc).splitlines()[0]
        note(f"rank {rank}: left without its peers ({why})")
        leave(0)
    _destroy_groups()


def _store(rank: int, world: int, timeout_s: float) -> dist.TCPStore:
    """The store the workers meet in (the elastic agent's, when it hosts one)."""
    listener = None
    if "MASTER_ADDR" not in os.environ:  # a lone process started by hand
        listener = listen_on("127.0.0.1")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(listener.getsockname()[1]))
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=timeout_s)
    if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store_server(listener or listen_on(addr, port), timeout, world_size=world)
    return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)


def round_key(group_rank: int) -> str:
    """Where the agent of node `group_rank` puts the rendezvous round in the workers' store."""
    return f"paratrain/rendezvous-round/node-{group_rank}"


def _rendezvous_round(store: dist.TCPStore, restart_count: int) -> int:
    """Which start of the worker group this is, the same number on every node: the rendezvous
    round, which paratrain's launcher puts in the store (launch._register_rendezvous); under another launcher
    (plain torchrun), the agent's restart count.

    The agent's store lives as long as the job, so each start of the group gets a key prefix of its
    own: without one, a restarted worker can read the address its dead predecessor published and
    try to connect to nobody. The agents' restart counts disagree across nodes after a membership
    change, which only the nodes whose workers failed count."""
    key = round_key(int(os.environ.get("GROUP_RANK", 0)))
    if os.environ.get("TORCHELASTIC_RUN_ID") and store.check([key]):
        return int(store.get(key))
    return restart_count


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for tests that hand one to processes they spawn; a launch holds its
    sockets open instead (listen_on), since another process may take this port before it is used."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen_on(host: str, port: int = 0):
    """A TCP socket listening on `host`'s address alone, on `port` (0: one the kernel picks), for a
    store_server to take over: held open from the start, so no other process can take its port."""
    import socket

    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port just left (TIME_WAIT), as torch does
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def store_server(listener, timeout: timedelta = timedelta(minutes=5), **kwargs) -> dist.TCPStore:
    """A TCPStore server on `listener` (listen_on), which it takes over.

    Given a host and a port, torch's TCPStore server listens on every interface whatever the host,
    and torch's elastic rendezvous unpickles what it reads from its store: anyone who could reach
    the port could run code in the launcher (docs/security.md)."""
    host, port = listener.getsockname()[:2]
    return dist.TCPStore(
        host,
        port,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
        **kwargs,
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class SeededMicroBatches(list):
    """A step's micro-batches whose iteration seeds torch's RNG before each one from (seed, step,
    its index in the global batch): dropout draws the same masks for a micro-batch whichever rank
    computes it, so a rank started again (fault.on_failure = "continue") or a run at another world
    size with the same micro-batch size draws what an uninterrupted one does."""

    def __init__(self, parts: list, seed: int, step: int, first: int):
        super().__init__(parts)
        self.seed, self.step, self.first = seed, step, first

    def __iter__(self):
        for i, part in enumerate(super().__iter__()):
            seed = micro_batch_seed(self.seed, self.step, self.first + i)
            # (not torch.manual_seed: it costs 0.5 ms, a tenth of a small model's step)
            torch.default_generator.manual_seed(seed)
            if torch.cuda.is_initialized():
                torch.cuda.manual_seed(seed)
            yield part


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """The RNG seed of micro-batch `index` (counted over the global batch) of step `step`: each
    value mixed in by splitmix64, so that neighbouring steps and micro-batches get unrelated streams."""
    x = 0
    for value in (seed, step, index):
        x = (x ^ value) + 0x9E3779B97F4A7C15 & _U64
        x = (x ^ x >> 30) * 0xBF58476D1CE4E5B9 & _U64
        x = (x ^ x >> 27) * 0x94D049BB133111EB & _U64
        x ^= x >> 31
    return x


_U64 = 2**64 - 1


def rng_state() -> dict:
    """Every RNG of this process: tensors for torch, JSON-able values for Python and NumPy."""
    state: dict[str, dict] = {"tensors": {"rng.torch": torch.get_rng_state()}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["tensors"]["rng.cuda"] = torch.cuda.get_rng_state()
    version, internal, gauss = random.getstate()
    np_state = cast(tuple, np.random.get_state())  # numpy's stub: dict | tuple; the global MT19937's is a tuple
    state["json"] = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    return state


def set_rng_state(tensors: dict, meta: dict) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = meta["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))


def leave(code: int = 0) -> None:
    """End a worker process once everything it opened is closed and flushed, skipping the
    interpreter's teardown of torch: it costs most of a second, and a process group that something
    still holds (DDP's reducer, a torch peer in a benchmark) is only freed there, where gloo's
    threads can abort the process ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shutdown(together: bool = False) -> None:
    """Leave the process group; `together` (on a success path only) waits for every rank first:
    a rank tearing gloo down while a peer still talks to it can abort the peer."""
    if dist.is_initialized():
        if together and dist.get_world_size() > 1:
            dist.barrier()
        _destroy_groups()


def _destroy_groups() -> None:
    """Destroy every process group, then let go of the GIL for a moment. A group whose Python
    object something still holds (a strategy's, the lockstep check's) is only unregistered here,
    its threads joined when the last holder goes, in the interpreter's teardown: a gloo thread
    still freeing the last collective's tensors then needs the GIL, and aborts the process as
    above (1 run in 100 under torchrun after the exit handler alone). It frees them within
    microseconds of completing; 20 ms without the GIL is ample and costs nothing at an exit."""
    import time

    dist.destroy_process_group()
    time.sleep(0.02)
