"""fault.on_failure = "continue": the launcher's side, in place of the elastic agent (which stops and
restarts every worker when one fails).

The supervisor starts the workers itself (forked from the worker server, as launch.py's are),
hosts their store in this process, so that the store outlives any worker, and owns the membership
(runtime/survive.py has the workers' side):

    a worker is killed       (a signal: the process, node or device is gone) its replica leaves the
                             run: the replica's other ranks are killed too, the next generation
                             (the live replicas' ranks) is published at once, and the replica's
                             ranks are started again (while --max-restarts allows)
    they are all up          and the current generation has formed, the next generation takes
                             their replica back in at a step boundary
    SIGTERM                  to `paratrain run` (passed on to the workers) or to any worker: the run
                             stops as under "restart": the members save at a step they agree on
                             and exit 143; no replica is lost, none started again
    anything else            (replica 0 lost: its ranks hold the log and the state everyone copies;
                             a worker that exits with an error; one that cannot continue) every
                             worker is stopped and started again from the newest checkpoint, as
                             under "restart", with one line saying why

One node only: a store that lives with the launcher of node 0 dies with that node; across nodes the
elastic agent's restart stays the way (config refuses "continue" with --nnodes > 1).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta

from paratrain.comm.grid import ReplicaLayout
from paratrain.errors import say
from paratrain.runtime import process, survive
from paratrain.runtime.launch import Interrupted, WorkerFailure, start_worker_server


def supervise(target: Callable, args: list[str], *, layout: ReplicaLayout, max_restarts: int) -> None:
    """Run `target(*args)` on the layout's workers on this node through losses of replicas; raise
    WorkerFailure if they fail for good, Interrupted on Ctrl-C."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // layout.world)))
    start_worker_server()
    Supervisor(target, args, layout, max_restarts).run()


def _worker(env: dict, target: Callable, args: list[str]) -> None:
    os.environ.update(env)
    target(*args)


class Supervisor:
    def __init__(self, target: Callable, args: list[str], layout: ReplicaLayout, max_restarts: int):
        self.target, self.args, self.layout, self.world = target, args, layout, layout.world
        self.restarts_left = max_restarts
        self.listener = process.listen_on("127.0.0.1")
        self.port = self.listener.getsockname()[1]
        self.store = process.store_server(self.listener, timedelta(minutes=5))
        self.context = multiprocessing.get_context("forkserver")
        self.attempt = 0
        self.signalled = 0  # a stop signal to this process, acted on in attempt_run's loop

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self.on_signal)
        try:
            while (why := self.attempt_run()) is not None:
                if self.restarts_left <= 0:
                    raise WorkerFailure(*why)
                self.restarts_left -= 1
                self.attempt += 1
                say(f"paratrain: {why[2]}: restarting every worker from the newest checkpoint")
        except KeyboardInterrupt:
            self.stop_all()
            raise Interrupted(signal.SIGINT) from None

    # -- one start of every worker ------------------------------------------------------------------
    def attempt_run(self) -> tuple[int, int, str, set] | None:
        """None when every worker finished; else (rank, exit code, why, exit codes) of the failure
        that stopped them all."""
        self.prefix = survive.keys(self.attempt)
        self.procs, self.incarnation, self.waiting = {}, dict.fromkeys(range(self.world), 0), set()
        self.gen, self.members, self.finishing, self.stopping = -1, list(range(self.world)), False, 0
        self.publish(self.members)
        for rank in range(self.world):
            self.spawn(rank)
        while self.procs:
            if self.signalled and not self.stopping:
                self.stop(self.signalled, forward=True)
            for rank, proc in list(self.procs.items()):
                # (a replica's rank that `lost` stopped and started again earlier in this loop is a
                # stale entry here: its end is no loss, and the new process is not to be dropped)
                if proc.exitcode is None or self.procs.get(rank) is not proc:
                    continue
                del self.procs[rank]
                if proc.exitcode == 0:
                    self.finishing = True
                    self.drop_waiting()
                elif self.stopping or proc.exitcode in (128 + signal.SIGTERM, -signal.SIGTERM):
                    self.stop(self.stopping or signal.SIGTERM)
                    if proc.exitcode < 0:  # stopped before it could save: the others cannot meet it
                        self.stop_all()
                elif (why := self.lost(rank, proc.exitcode)) is not None:
                    self.stop_all()
                    return why
            self.admit()
            time.sleep(0.02)
        if self.stopping:
            code = 128 + self.stopping
            raise WorkerFailure(0, code, f"stopped by {signal.Signals(self.stopping).name}", {code})
        return None

    def on_signal(self, signum, _frame) -> None:
        self.signalled = signum

    def stop(self, signum: int, forward: bool = False) -> None:
        """The run stops as under "restart": each member saves at the step the members agree on
        (runtime/survive.py: Membership.after_step) and exits 128 + signum; `forward`: the signal
        came to this process and goes on to the workers. Ranks waiting to rejoin hold nothing to
        save: they are killed."""
        self.stopping = signum
        self.drop_waiting()
        for proc in self.procs.values() if forward else ():
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:  # (it has just ended: the loop sees it)
                pass

    def spawn(self, rank: int) -> None:
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.world),
            "LOCAL_WORLD_SIZE": str(self.world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],
            "TORCHELASTIC_RESTART_COUNT": str(self.attempt),
            survive.INCARNATION: str(self.incarnation[rank]),
            survive.REPLICA_SIZE: str(self.layout.size),
            survive.REPLICA_STAGES: str(self.layout.stages),
        }
        proc = self.context.Process(target=_worker, args=(env, self.target, self.args), name=f"paratrain-r{rank}")
        proc.start()
        self.procs[rank] = proc

    def publish(self, members: list[int]) -> None:
        self.gen += 1
        self.members = members
        self.store.set(f"{self.prefix}gen-{self.gen}", json.dumps(members))
        self.store.set(f"{self.prefix}latest", str(self.gen))

    def lost(self, rank: int, code: int) -> tuple[int, int, str, set] | None:
        """A worker that ended with `code` (not 0): its replica out and started again, or the reason
        every worker has to start again."""
        replica = self.layout.replica_of(rank)
        if code == survive.FALLBACK_EXIT:
            return rank, code, f"rank {rank} cannot continue (its line above says why)", {code}
        if code > 0:
            return rank, code, f"rank {rank} failed (exit code {code})", {code}
        cause = f"rank {rank} killed by {signal.Signals(-code).name}"
        if replica == 0:
            return rank, code, f"{cause}, in replica 0 (its ranks hold the log and the state the others copy)", set()
        if self.finishing:
            return None
        ranks = self.layout.ranks(replica)
        for other in ranks:  # (a rank we stop here is no longer watched: its exit is not a loss)
            if other != rank and other in self.procs:
                self.procs.pop(other).kill()
        self.waiting -= set(ranks)
        if any(m in ranks for m in self.members):  # (else it was lost on its way back in)
            self.publish([m for m in self.members if m not in ranks])
        again = self.restarts_left > 0
        say(
            f"paratrain: {cause}: replica {replica} leaves the run, the other {len(self.members)} rank(s) go on"
            + ("; its ranks start again to rejoin" if again else " (no restarts left)")
        )
        if again:
            self.restarts_left -= 1
            for other in ranks:
                self.incarnation[other] += 1
                self.waiting.add(other)
                self.spawn(other)
        return None

    def admit(self) -> None:
        """The restarted ranks back in, once all of a replica are up and the current generation has formed."""
        if not self.waiting or self.finishing:
            return
        up = [f"{self.prefix}ready-{r}-{self.incarnation[r]}" for r in self.waiting]
        formed = self.gen == 0 or self.store.check([f"{self.prefix}ack-{self.gen}-{r}" for r in self.members])
        whole = all(set(self.layout.ranks(self.layout.replica_of(r))) <= self.waiting for r in self.waiting)
        if whole and formed and self.store.check(up):
            self.publish(sorted(self.members + sorted(self.waiting)))
            self.waiting = set()

    def drop_waiting(self) -> None:
        """The run is ending: ranks still waiting to rejoin will not be let in."""
        for rank in self.waiting:
            if rank in self.procs:
                self.procs.pop(rank).kill()
        self.waiting = set()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.kill()
        for proc in self.procs.values():
            proc.join()
        self.procs = {}
