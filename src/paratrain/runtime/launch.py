"""Start the workers through PyTorch's elastic agent (what torchrun runs).

Local runs keep every socket on loopback; multi-node runs meet at --rdzv HOST:PORT, where node 0
hosts the rendezvous store, and listen on that network alone (docs/security.md). With
--max-restarts K the agent restarts the whole worker group after a failure, and the workers resume
by themselves.

Workers of a training run are forked from a worker server (multiprocessing's forkserver) that
has imported torch and paratrain once, instead of each starting a fresh interpreter that imports
them again: measured here, `import torch` takes 1.1 s and the torch.compile stack that every
torch optimizer step imports another 1.0 s, per process. The server is itself forked from the
command once it has imported both (start_worker_server), so its imports of the rest overlap the
command's own checks and the rendezvous, and a worker's start then costs a fork. A restarted worker group forks from the same server. Benchmark workers, which
name a module, start as `python -m module` as before.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import logging
import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import cast

from paratrain.runtime.log_file import LogFileThatNeverFailsTheRun
from paratrain.runtime.worker_failure import STOPPED_EXITS, blame


class Interrupted(Exception):
    """The launcher got a stop signal (Ctrl-C: SIGINT; SIGTERM, SIGHUP); its workers were stopped."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def default_nproc(device: str) -> int:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


WORKER_SERVER = "paratrain.runtime.worker_server"  # what the server imports first, before it forks anyone


def call_preloaded(target: str, *args: str) -> None:
    """`target(*args)`, target a "module:function" that the worker server preloaded: the function a
    launcher hands the agent, so that the launcher itself never imports the training code, which
    is the server's to import (launch.start_worker_server's preload)."""
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)(*args)


def _forkserver_available() -> bool:
    return "forkserver" in multiprocessing.get_all_start_methods()


def start_worker_server(preload: tuple[str, ...] = ()) -> None:
    """Start the worker server now, in the background, so its imports overlap the caller's work.
    `preload`: the modules the workers will run (the trainer, say), which the server imports once
    for all of them; the caller names them, so that this module never imports what it launches.

    The server is forked from this process once it has imported torch, which the command needs
    anyway: a fresh interpreter would import torch a second time (about 3 s of CPU here, per
    command), and the suite starts a few hundred commands. Forked while this process has no thread
    of its own running yet, before the agent or any compute, as torch's DataLoader forks its
    workers. The server then imports only what the workers add (the trainer, a transformers model's
    modules).

    Idempotent: one server per process, reused by every later launch (and restart) of it. Call it
    from the main thread: the server and its workers die with the thread that started it."""
    if not _forkserver_available():
        return
    from multiprocessing import forkserver, util

    import torch  # noqa: F401  before the fork: the server inherits it

    # ... and torch.compile's stack, which the server would import next (every worker's first
    # optimizer step needs it) and the command imports anyway: building the model on the meta
    # device for its checks runs torch's Python decompositions, which import it (about 2 s of CPU
    # here, done once instead of in both)
    import torch._dynamo  # noqa: F401

    multiprocessing.get_context("forkserver").set_forkserver_preload([WORKER_SERVER, *preload])
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the server dies with this process (worker_server.py)
    spawn = util.spawnv_passfds
    # typeshed types the path as bytes; _fork_server passes it on as given
    util.spawnv_passfds = _fork_server  # type: ignore[assignment]
    try:
        forkserver.ensure_running()
    finally:
        util.spawnv_passfds = spawn


def _fork_server(path: str, args: list[str], passfds) -> int:
    """multiprocessing's spawnv_passfds for the server's start alone: fork this process and run the
    `-c` command an interpreter would have run.

    The child keeps this process's descriptors but one kind: the other end of a pipe it was passed
    (the "alive" pipe's write end, whose closing by every client is how the server learns to
    leave). Closing any other would free its number while an object here still holds it, and a
    later pipe taking the number would receive that object's writes."""
    command = args[args.index("-c") + 1]
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is printed twice
        stream.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        passed = {os.fstat(fd).st_ino for fd in passfds}
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                if fd not in passfds and os.fstat(fd).st_ino in passed:
                    os.close(fd)
            except OSError:  # the listing's own descriptor, closed by now
                pass
        exec(command, {"__name__": "__mp_forkserver__"})
    finally:
        os._exit(0)


LAUNCHER_PID = "PARATRAIN_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int, parent: int) -> None:
    """Have the kernel send this process `signum` when its parent, `parent`, dies (Linux; elsewhere
    a no-op), and leave at once if it has died already (this process was then handed to init).

    The kernel sends it when the *thread* that forked this process ends: a parent must start such a
    child from a thread that lives as long as the parent does (the main thread)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(128 + signum)


def prepare_forked_worker(name: str) -> None:
    """First thing in a worker forked from the server: what `python -u` and a fresh start gave.

    The server imported torch before this run's OMP_NUM_THREADS reached it, so the thread count is
    set from the worker's own environment; output is line-buffered; and the process is named
    (`ps`, `top`) after its rank, since every forked worker shares the server's command line."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    for stream in (sys.stdout, sys.stderr):
        try:
            cast(io.TextIOWrapper, stream).reconfigure(line_buffering=True)  # else AttributeError, below
        except (AttributeError, ValueError):
            pass
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15])  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


RDZV_BACKEND = "paratrain-c10d"  # torch's c10d rendezvous, telling each worker its round (below)


def _name_events_cheaply() -> None:
    """torch's dynamic rendezvous names each event it logs after the calling method, found with
    inspect.stack() twice a call, which reads every frame's source lines: measured, 0.2-0.4 s of
    CPU per `paratrain run` (18 calls). The frame's own code object has the same name."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # inspect.stack()[depth].function
        except ValueError:  # a stack shallower than depth
            return "no_method_name"

    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = get_method_name


def _register_rendezvous() -> None:
    """Register RDZV_BACKEND: torch's c10d rendezvous, which after each round writes its number to
    the store the workers share (MASTER_ADDR:MASTER_PORT) under this node's round_key, before this
    node's agent starts its workers.

    Why: that store lives as long as the job, so each restart of the worker group needs keys of its
    own, and the agents' restart counts cannot name them: an agent whose workers failed counts a
    restart, but one whose workers were still running when the other nodes came back to the
    rendezvous restarts them as a membership change, which it does not count. The workers of one
    round then used different keys and waited for each other until the timeout (a two-node run,
    one worker killed). The round is the same on every node."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousParameters,
        registry,  # noqa: F401  registers "c10d"
    )
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from paratrain.runtime.process import round_key, store_server

    _name_events_cheaply()

    class RoundPublishing(RendezvousHandler):
        def __init__(self, inner: RendezvousHandler):
            self.inner, self.rounds = inner, 0

        def next_rendezvous(self):
            info = self.inner.next_rendezvous()
            holder = getattr(self.inner, "_state_holder", None)  # torch's own round number, if it shows it
            number = holder.state.round if holder is not None else self.rounds
            self.rounds += 1
            if self.inner.use_agent_store:  # else rank 0's worker will host the store: nothing to write to yet
                where = info.bootstrap_store_info
                assert where is not None  # the agent's store: set whenever use_agent_store is
                store = TCPStore(
                    where.master_addr,
                    where.master_port,
                    is_master=False,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=60),
                )
                store.set(round_key(info.rank), str(number))
            return info

        def get_backend(self) -> str:
            return RDZV_BACKEND

        @property
        def use_agent_store(self) -> bool:
            return self.inner.use_agent_store

        def is_closed(self) -> bool:
            return self.inner.is_closed()

        def set_closed(self):
            return self.inner.set_closed()

        def num_nodes_waiting(self) -> int:
            return self.inner.num_nodes_waiting()

        def get_run_id(self) -> str:
            return self.inner.get_run_id()

        def shutdown(self) -> bool:
            return self.inner.shutdown()

    def create(params: RendezvousParameters) -> RendezvousHandler:
        c10d = RendezvousParameters(
            "c10d",
            params.endpoint,
            params.run_id,
            params.min_nodes,
            params.max_nodes,
            params.local_addr,
            **params.config,
        )
        listener = _RDZV_LISTENERS.pop(params.endpoint, None)
        if listener is None:  # another node hosts the rendezvous: this one connects to it
            inner = rendezvous_handler_registry.create_handler(c10d)
        else:  # torch's c10d backend would make this store itself, listening on every interface
            store = store_server(listener, timedelta(seconds=cast(int, c10d.get_as_int("read_timeout", 60))))
            inner = create_handler(store, C10dRendezvousBackend(store, params.run_id), c10d)
        _bind_workers_store(inner)
        return RoundPublishing(inner)

    try:
        rendezvous_handler_registry.register(RDZV_BACKEND, create)
    except ValueError:  # registered already, by an earlier launch in this process
        pass


# Which interface gloo and NCCL (its bootstrap) listen on; unset, each picks one by itself.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

# The listening socket of the rendezvous store this process hosts, by endpoint: bound by launch()
# before the agent starts, taken over by the store when the agent creates the rendezvous.
_RDZV_LISTENERS: dict[str, socket.socket] = {}


def _bind_workers_store(handler) -> None:
    """Make the store that the agent of the rendezvous's rank 0 hosts for the workers (MASTER_ADDR:
    MASTER_PORT) listen on this node's rendezvous address alone, as the rendezvous store does.

    torch's handler creates that store in one method, listening on every interface; no option
    reaches it. Where a torch release renames the method, refuse to run rather than expose the store."""
    from paratrain.runtime.process import listen_on, store_server

    if not callable(getattr(handler, "_create_tcp_store_server", None)):
        raise RuntimeError(
            f"{type(handler).__name__} has no _create_tcp_store_server: this torch release "
            f"cannot be made to bind the workers' store to one address"
        )
    handler._create_tcp_store_server = lambda addr, port: store_server(listen_on(addr, port))


def route_to(host: str, port: int) -> str:
    """This node's address on the route to host:port (the rendezvous); gloo and NCCL, which would
    each pick an interface by themselves, listen on the one that holds it. OSError if no route."""
    local_addr = _address_towards(host, port)
    if iface := _interface_of(local_addr):
        for var in SOCKET_IFNAME_VARS:
            os.environ.setdefault(var, iface)
    return local_addr


def _address_towards(host: str, port: int) -> str:
    """This node's address on the route to host:port (the rendezvous), by the kernel's routing table.
    A UDP connect sends nothing."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def _interface_of(address: str) -> str | None:
    """The name of the network interface that holds the IPv4 `address`, None if none does."""
    import fcntl
    import struct

    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def launch_measurement(target: Callable, args: list[str], *, nproc: int, run_id: str) -> None:
    """`launch` for a measurement taken from within another command (`paratrain plan`'s
    calibration and layer timing): the thread count it sets for its workers does not stay in
    this process's environment, where a later launch would take it for the user's."""
    before = os.environ.get("OMP_NUM_THREADS")
    try:
        launch(target, args, nproc=nproc, run_id=run_id)
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


def _bind_rendezvous(rdzv: str | None, node_rank: int) -> tuple[str, str]:
    """(the rendezvous endpoint, this node's address). Every socket of the run listens on one
    address (docs/security.md): loopback for a local run; for a multi-node run, this node's address
    towards --rdzv, where the other nodes reach it. The rendezvous store's socket is bound now and
    held (_RDZV_LISTENERS), so no other process can take its port."""
    from paratrain.errors import ConfigError
    from paratrain.runtime.process import listen_on

    if rdzv is None:
        listener = listen_on("127.0.0.1")
        endpoint, local_addr = f"127.0.0.1:{listener.getsockname()[1]}", "127.0.0.1"
        os.environ.update({var: "lo" for var in SOCKET_IFNAME_VARS})
    else:
        endpoint, (host, port) = rdzv, rdzv.rsplit(":", 1)
        host = host.removeprefix("[").removesuffix("]")  # [IPv6]:PORT
        try:
            local_addr = route_to(host, int(port))
            listener = listen_on(host, int(port)) if node_rank == 0 else None
        except OSError as exc:
            raise ConfigError(
                "--rdzv", f"cannot {'listen on' if node_rank == 0 else 'reach'} {rdzv}: {exc.strerror or exc}"
            ) from None
    if listener is not None:
        _RDZV_LISTENERS[endpoint] = listener
    return endpoint, local_addr


def launch(
    target: str | Callable,
    args: list[str],
    *,
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv: str | None = None,
    max_restarts: int = 0,
    run_id: str = "paratrain",
    agent_log: Path | None = None,
) -> None:
    """Run `target(*args)` on nproc x nnodes workers; raise WorkerFailure if they fail.

    target: a module-level function, called in workers forked from the worker server (where the
    platform has one, else spawned), or a module name, run as `python -u -m target *args`.
    agent_log: where what the agent logs goes instead of stderr (None: stderr)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _register_rendezvous()
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_not_a_stop)
    # Each worker gets an equal share of the cores (torchrun does the same), so N processes
    # on N cores do not each spawn N compute threads and thrash.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    endpoint, local_addr = _bind_rendezvous(rdzv, node_rank)
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend=RDZV_BACKEND,
        rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": node_rank == 0} if rdzv is not None else {},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="forkserver" if callable(target) and _forkserver_available() else "spawn",
        local_addr=local_addr,
    )
    restore_logging = _agent_logging_to(agent_log)
    try:
        if callable(target):
            start_worker_server()
            elastic_launch(config, target)(*args)
        else:
            elastic_launch(config, sys.executable)("-u", "-m", target, *args)
    except SignalException as exc:  # the agent has stopped the workers already
        raise Interrupted(exc.sigval) from None
    except KeyboardInterrupt:  # before the agent took the signals over (at the rendezvous)
        raise Interrupted(signal.SIGINT) from None
    except ChildFailedError as exc:
        # Raised unnamed: bound to a local of this frame, which its traceback holds, it kept the
        # agent's objects in a cycle that the command's os._exit comes before any collection of,
        # and multiprocessing's resource tracker warned of their semaphores as leaked.
        raise blame(exc.failures, agent_log) from None
    finally:
        restore_logging()
        # not taken over where the agent failed before its rendezvous
        if (unused := _RDZV_LISTENERS.pop(endpoint, None)) is not None:
            unused.close()


# The loggers of the agent and of what it runs: its worker processes' start and stop, the rendezvous.
AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


def _agent_logging_to(path: Path | None) -> Callable[[], None]:
    """Send what the agent logs to `path` (made at its first record) instead of stderr, until the
    function returned is called, which leaves the loggers as they were (for a later launch here).

    When a worker fails, the agent logs the worker's traceback inside one of its own (its wait
    for the processes), every line prefixed, above paratrain's line, and on a stop, which worker
    it sent which signal: the command shows the worker's traceback once and names the failure
    itself (cli.outcome)."""
    if path is None:
        return lambda: None
    handler = LogFileThatNeverFailsTheRun(path, delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in AGENT_LOGGERS]
    propagating = [logger.propagate for logger in loggers]
    for logger in loggers:  # torch's own handler, on an ancestor, no longer sees them
        logger.addHandler(handler)
        logger.propagate = False

    def restore() -> None:
        for logger, before in zip(loggers, propagating):
            logger.removeHandler(handler)
            logger.propagate = before
        handler.close()

    return restore


# What the agent logs when it stops the workers on a signal, or finds one stopped by a signal
# sent to it: `paratrain run` says it in one line (with the checkpoint to go on from).
_STOP_CHATTER = ("Received %s death signal", "Closing process %s via signal %s")


def _not_a_stop(record: logging.LogRecord) -> bool:
    """Keep the agent's logging of a stop out of the output: what it says as it passes a signal on,
    and a worker that stopped on a signal, or on bad input it named in its one line (exit 2: a
    corrupt data shard), reported as a failure with the agent's own traceback."""
    msg = str(record.msg)
    if msg.startswith(_STOP_CHATTER):
        return False
    return not (
        msg.startswith("failed (exitcode: ")
        and isinstance(record.args, tuple)
        and record.args
        and record.args[0] in STOPPED_EXITS | {2}
    )
