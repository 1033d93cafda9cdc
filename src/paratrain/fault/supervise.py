"""fault.on_failure = "continue": the launcher's side, in place of the elastic agent (which stops and
restarts every worker when one fails).

Each node's `paratrain run` is a supervisor: it starts its own workers (forked from the worker
server, as launch.py's are; global rank = node x nproc + local rank), watches them, and reports
each one's end to the store. Node 0's also hosts the store (in this process, so that it outlives
any worker: on loopback for one node, at --rdzv for several, the store the nodes met in) and owns
the membership (fault/leader.py); the workers' side is fault/survive.py:

    a worker is killed       (a signal: the process, node or device is gone) its replica leaves the
                             run: the replica's other ranks are killed too, on whichever node they
                             run, the next generation (the live replicas' ranks) is published at
                             once, and the replica's ranks are started again on their nodes (while
                             node 0's --max-restarts allows: one budget for the whole run)
    they are all up          and the current generation has formed, the next generation takes
                             their replica back in at a step boundary
    SIGTERM                  to any node's `paratrain run` (node 0's passes it on to its workers)
                             or to any worker: the run stops as under "restart": the members save
                             at a step they agree on and exit 143; no replica is lost, none started again
    anything else            (replica 0 lost: its ranks hold the log and the state everyone copies;
                             a worker that exits with an error; one that cannot continue) every
                             worker on every node is stopped and started again from the newest
                             checkpoint, as under "restart", with one line saying why
    node 0's run is lost     (with it the store) the other nodes' supervisors stop their workers and
                             exit 1 saying so, within parallel.timeout_s: the one failure that
                             ends the run; `--resume auto` goes on from the newest checkpoint
    another node's run stops (Ctrl-C) the run ends on every node
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from typing import cast

import torch.distributed as dist

from paratrain.comm.grid import ReplicaLayout
from paratrain.fault import survive
from paratrain.fault.leader import ATTEMPT, END, SIGNAL, Leader, event_key, left_key, read
from paratrain.runtime import process
from paratrain.runtime.launch import SOCKET_IFNAME_VARS, Interrupted, route_to, start_worker_server
from paratrain.runtime.worker_failure import WorkerFailure


def supervise(
    target: Callable,
    args: list[str],
    *,
    layout: ReplicaLayout,
    nproc: int,
    max_restarts: int,
    timeout_s: float,
    node_rank: int = 0,
    rdzv: str | None = None,
    store=None,
) -> None:
    """Run `target(*args)` on this node's `nproc` workers of the layout through losses of replicas;
    raise WorkerFailure if they fail for good, Interrupted on Ctrl-C. Several nodes: `rdzv` is
    node 0's HOST:PORT and `store` the one the nodes met in there (jobs/preflight.check_nodes)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    start_worker_server()
    if rdzv is None:
        listener = process.listen_on("127.0.0.1")
        master = ("127.0.0.1", listener.getsockname()[1])
        store = process.store_server(listener, timedelta(minutes=5))
    else:
        host, port = rdzv.rsplit(":", 1)
        master = (host.removeprefix("[").removesuffix("]"), int(port))
        route_to(*master)
        store.set_timeout(timedelta(seconds=timeout_s))  # node 0 lost: the others hear of it within this
    node = Supervisor(target, args, layout, store, master, node_rank, nproc)
    nnodes = layout.world // nproc
    node.run(Leader(store, layout, nnodes, max_restarts, timeout_s, node.forward) if node_rank == 0 else None)


def _worker(env: dict, target: Callable, args: list[str]) -> None:
    os.environ.update(env)
    target(*args)


class Supervisor:
    """One node's workers: started, killed and restarted as node 0's plan says; their ends reported."""

    def __init__(self, target, args, layout: ReplicaLayout, store, master: tuple[str, int], node: int, nproc: int):
        self.target, self.args, self.layout, self.store, self.master = target, args, layout, store, master
        self.node, self.nproc, self.ranks = node, nproc, range(node * nproc, (node + 1) * nproc)
        self.context = multiprocessing.get_context("forkserver")
        self.attempt, self.prefix = -1, ""
        self.procs: dict[int, tuple[int, multiprocessing.process.BaseProcess]] = {}  # rank -> (incarnation, process)
        self.signalled, self.signal_sent = 0, False  # a stop signal to this process, passed to node 0

    def run(self, leader: Leader | None) -> None:
        signal.signal(signal.SIGTERM, self.on_signal)
        try:
            while (end := self.poll()) is None:
                if leader is not None:
                    leader.poll()
                time.sleep(0.02)
        except KeyboardInterrupt:
            self.kill(list(self.procs))
            if leader is not None:
                leader.interrupted(signal.SIGINT)
                leader.wait_for_nodes()
            else:
                self.store.set(left_key(self.node), "1")
            raise Interrupted(signal.SIGINT) from None
        except dist.DistError as exc:  # (another node's: node 0's store no longer answers)
            self.kill(list(self.procs))
            where = f"{self.master[0]}:{self.master[1]}"
            cause = str(exc).strip().splitlines()[0][:120]
            raise WorkerFailure(
                0,
                1,
                f"node 0 is lost: its store at {where} no longer answers ({cause}); this node's workers stopped",
                set(),
            ) from None
        if leader is not None:
            leader.wait_for_nodes()
        if end:
            raise WorkerFailure(**{**end, "own_exitcodes": set(end["own_exitcodes"])})

    def on_signal(self, signum, _frame) -> None:
        self.signalled = signum

    def poll(self) -> dict | None:
        """One look at the store: the plan followed, the workers' ends reported; the run's end
        (WorkerFailure's fields, {} for success) once node 0 has published it."""
        if self.signalled and not self.signal_sent:
            self.store.set(SIGNAL, str(self.signalled))
            self.signal_sent = True
        end = read(self.store, END)
        attempt = read(self.store, ATTEMPT)
        if attempt is not None and int(attempt) != self.attempt:  # every worker starts again
            self.kill(list(self.procs))
            self.attempt, self.prefix = int(attempt), survive.keys(int(attempt))
            self.started, self.reported, self.quiet = dict[int, int](), 0, False
        if (plan := read(self.store, f"{self.prefix}plan") if self.attempt >= 0 else None) is not None:
            self.follow(json.loads(plan))
        self.report_exits()
        if end is None:
            return None
        self.kill(list(self.procs))
        self.store.set(left_key(self.node), "1")
        return json.loads(end)

    def follow(self, plan: list[int | None]) -> None:
        """This node's ranks as the plan has them: a process the plan moved past killed (not a loss:
        its end is not reported), a planned incarnation started."""
        for rank in self.ranks:
            want = plan[rank]
            if rank in self.procs and (want is None or want > self.procs[rank][0]):
                self.kill([rank])
            if want is not None and want > self.started.get(rank, -1):
                self.spawn(rank, want)
        if not self.quiet and not self.procs and all(plan[r] is None for r in self.ranks):
            self.store.set(f"{self.prefix}quiet-{self.node}", "1")  # node 0 may start the run again
            self.quiet = True

    def report_exits(self) -> None:
        for rank, (incarnation, proc) in list(self.procs.items()):
            if proc.exitcode is not None:
                del self.procs[rank]
                key = event_key(self.prefix, self.node, self.reported)
                self.store.set(key, json.dumps([rank, incarnation, proc.exitcode]))
                self.reported += 1

    def forward(self, signum: int, ranks: list[int]) -> None:
        """Pass a stop signal on to those of this node's workers in `ranks`."""
        for rank in ranks:
            if rank in self.procs:
                try:
                    os.kill(cast(int, self.procs[rank][1].pid), signum)  # started, so it has a pid
                except ProcessLookupError:  # (it has just ended: the next poll reports it)
                    pass

    def kill(self, ranks: list[int]) -> None:
        procs = [self.procs.pop(rank)[1] for rank in ranks]
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.join()

    def spawn(self, rank: int, incarnation: int) -> None:
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank - self.ranks.start),
            "WORLD_SIZE": str(self.layout.world),
            "LOCAL_WORLD_SIZE": str(self.nproc),
            "GROUP_RANK": str(self.node),
            "MASTER_ADDR": self.master[0],
            "MASTER_PORT": str(self.master[1]),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],
            "TORCHELASTIC_RESTART_COUNT": str(self.attempt),
            survive.INCARNATION: str(incarnation),
            survive.REPLICA_SIZE: str(self.layout.size),
            survive.REPLICA_STAGES: str(self.layout.stages),
            **{var: os.environ[var] for var in SOCKET_IFNAME_VARS if var in os.environ},
        }
        proc = self.context.Process(target=_worker, args=(env, self.target, self.args), name=f"paratrain-r{rank}")
        proc.start()
        self.procs[rank] = (incarnation, proc)
        self.started[rank] = incarnation
