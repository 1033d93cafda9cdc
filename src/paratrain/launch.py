"""Start the workers through PyTorch's elastic agent (the engine behind torchrun).

Local runs pick a free port and keep the c10d rendezvous on loopback; multi-node runs meet at
--rdzv HOST:PORT, where node 0 hosts the rendezvous store. With --max-restarts K the agent
restarts the whole worker group after a failure, and the workers resume by themselves.

Workers of a training run are forked from a worker server (multiprocessing's forkserver) that
has imported torch and paratrain once, instead of each starting a fresh interpreter that imports
them again: measured here, `import torch` takes 1.1 s and the torch.compile stack that every
torch optimizer step imports another 1.0 s, per process. The server starts when the command does,
so its imports overlap the command's own checks and the rendezvous, and a worker's start then
costs a fork. A restarted worker group forks from the same server. Benchmark workers, which
name a module, start as `python -m module` as before.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import re
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable


@dataclass
class WorkerFailure(Exception):
    rank: int
    exitcode: int
    cause: str
    own_exitcodes: set  # of the workers that failed by themselves (not those the agent then stopped)

    def __str__(self) -> str:
        return f"rank {self.rank} failed (exit code {self.exitcode}): {self.cause}"


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


WORKER_PRELOAD = ("paratrain.worker_server",)  # what the server imports before it forks anyone


def _forkserver_available() -> bool:
    return "forkserver" in multiprocessing.get_all_start_methods()


def start_worker_server() -> None:
    """Start the worker server now, in the background, so its imports overlap the caller's work.

    Idempotent: one server per process, reused by every later launch (and restart) of it."""
    if not _forkserver_available():
        return
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(WORKER_PRELOAD))
    forkserver.ensure_running()


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
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15])  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


RDZV_BACKEND = "paratrain-c10d"  # torch's c10d rendezvous, telling each worker its round (below)


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
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry  # noqa: F401  registers "c10d"
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    from .runtime import round_key

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
                store = TCPStore(where.master_addr, where.master_port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=60))
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
        c10d = RendezvousParameters("c10d", params.endpoint, params.run_id, params.min_nodes, params.max_nodes,
                                    params.local_addr, **params.config)
        return RoundPublishing(rendezvous_handler_registry.create_handler(c10d))

    try:
        rendezvous_handler_registry.register(RDZV_BACKEND, create)
    except ValueError:  # registered already, by an earlier launch in this process
        pass


def launch(target: str | Callable, args: list[str], *, nproc: int, nnodes: int = 1, node_rank: int = 0,
           rdzv: str | None = None, max_restarts: int = 0, run_id: str = "paratrain") -> None:
    """Run `target(*args)` on nproc x nnodes workers; raise WorkerFailure if they fail.

    target: a module-level function, called in workers forked from the worker server (where the
    platform has one, else spawned), or a module name, run as `python -u -m target *args`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .runtime import free_port

    _register_rendezvous()
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_not_a_stop)
    # Each worker gets an equal share of the cores (torchrun does the same), so N processes
    # on N cores do not each spawn N compute threads and thrash.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    local = rdzv is None
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc, run_id=run_id,
        rdzv_backend=RDZV_BACKEND, rdzv_endpoint=rdzv or f"127.0.0.1:{free_port()}",
        rdzv_configs={"is_host": node_rank == 0} if not local else {},
        max_restarts=max_restarts, monitor_interval=0.1,
        start_method="forkserver" if callable(target) and _forkserver_available() else "spawn",
        # Where the other nodes reach this one. Node 0 hosts the rendezvous at --rdzv, so that
        # address is reachable by construction; a hostname lookup may give one that is not.
        local_addr="127.0.0.1" if local else (rdzv.rsplit(":", 1)[0] if node_rank == 0 else None),
    )
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
        raise blame(exc.failures) from None


# A worker's exit code when it stopped on a signal it was sent (trainer.run_worker), not by failing.
STOPPED_EXITS = {128 + signal.SIGINT, 128 + signal.SIGTERM}


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
    return not (msg.startswith("failed (exitcode: ") and record.args and record.args[0] in STOPPED_EXITS | {2})


def blame(failures: dict) -> WorkerFailure:
    """The worker to name for a failed group (rank -> the agent's ProcessFailure).

    The agent stops the other workers once one fails: blame a worker that failed by itself (an
    exit code > 0, with an error report), not one that was stopped (by the agent or a signal
    sent to it); and among those, one whose error is its own rather than a peer's going away
    (the peers' connections break within the same second, and the timestamps count whole
    seconds), the earliest."""
    own = [(_lost_a_peer(_cause(f)), f.timestamp, r) for r, f in failures.items()
           if f.exitcode > 0 and f.exitcode not in STOPPED_EXITS]
    rank = min(own)[2] if own else min(failures, key=lambda r: (failures[r].timestamp, r))
    return WorkerFailure(rank, failures[rank].exitcode, _cause(failures[rank]),
                         {f.exitcode for f in failures.values() if f.exitcode > 0})


# What a worker's collective or message says when the process at the other end has died.
_PEER_GONE = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused|peer .*(gone|died|exited)",
                        re.IGNORECASE)


def _lost_a_peer(cause: str) -> bool:
    return bool(_PEER_GONE.search(cause))


def _cause(failure) -> str:
    """The last line of a failed worker's error report, or what became of it."""
    cause = failure.message
    if isinstance(cause, dict):
        cause = cause.get("message", "<unknown>")
    if failure.exitcode < 0:
        cause = f"killed by signal {failure.signal_name()}"
    elif not cause or cause.startswith("To enable traceback"):
        cause = f"exited with code {failure.exitcode} (see its output above)"
    return str(cause).strip().splitlines()[-1]
