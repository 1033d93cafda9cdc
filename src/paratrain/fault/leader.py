"""fault.on_failure = "continue": the membership of the whole run, which node 0's supervisor owns
(fault/supervise.py has every node's side, fault/survive.py the workers').

The leader decides and every node's supervisor carries it out, through the store (node 0's):

    the plan      (per start of the run) the incarnation each global rank runs, or None: a
                  supervisor starts its ranks' planned incarnations, kills a process whose rank the
                  plan moved past (a lost replica's ranks on every node) or set to None
    exits         each supervisor reports its own workers' ends (event-{node}-{n}); the leader
                  takes a replica out (the next generation), plans its ranks' restarts (one budget
                  for the run: node 0's --max-restarts), lets them back in once all are up, or
                  plans every rank None (a fallback) and, once every node is quiet, starts the run
                  again from the newest checkpoint (`attempt`)
    the end       `end`: {} when every rank finished, else the failure every node reports
    a node leaves (its `paratrain run` interrupted) the run ends on every node
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time

from paratrain.comm.grid import ReplicaLayout
from paratrain.errors import say
from paratrain.fault import survive
from paratrain.runtime.worker_failure import WorkerFailure

ROOT = "paratrain/continue/"  # the keys of the whole run; survive.keys(attempt) those of one start
ATTEMPT, END, SIGNAL = ROOT + "attempt", ROOT + "end", ROOT + "signal"
LEAVE_TIMEOUT_S = 30


def left_key(node: int) -> str:
    return f"{ROOT}left-{node}"


def event_key(prefix: str, node: int, n: int) -> str:
    return f"{prefix}event-{node}-{n}"


def read(store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


class Leader:
    def __init__(self, store, layout: ReplicaLayout, nnodes: int, max_restarts: int, timeout_s: float, forward):
        self.store, self.layout, self.world, self.nnodes = store, layout, layout.world, nnodes
        self.restarts_left, self.timeout_s = max_restarts, timeout_s
        self.forward = forward  # (signum, ranks): node 0's supervisor passes a signal on to those workers
        self.ended = False
        self.start_attempt(0)

    def start_attempt(self, attempt: int) -> None:
        self.attempt, self.prefix = attempt, survive.keys(attempt)
        self.incarnation, self.running, self.waiting = [0] * self.world, set(range(self.world)), set[int]()
        self.gen, self.members, self.finishing, self.stopping = -1, list[int](), False, 0
        self.over: tuple | None = None  # why every worker stops (WorkerFailure's fields)
        self.over_since = 0.0  # when every node was told to stop its workers
        self.seen = [0] * self.nnodes  # each node's events read so far
        self.publish(list(range(self.world)))
        self.published_plan: str | None = None
        self.publish_plan()
        self.store.set(ATTEMPT, str(attempt))

    # -- the leader's turn, after each node 0 supervisor's turn --------------------------------------
    def poll(self) -> None:
        if self.ended:
            return
        for rank, incarnation, code in self.exits():
            if rank in self.running and incarnation == self.incarnation[rank]:  # (else: a process replaced)
                self.running.discard(rank)
                self.on_exit(rank, code)
        if (signum := read(self.store, SIGNAL)) and not self.stopping:  # to any node's `paratrain run`
            self.stop(int(signum))
            self.forward(int(signum), [r for r in self.members if r in self.running])
        for node in range(1, self.nnodes):
            if self.store.check([left_key(node)]):
                self.over = self.over or (node * self.world // self.nnodes, 1, f"node {node}'s run stopped", set())
                self.finish(WorkerFailure(*self.over))
                return
        self.admit()
        self.publish_plan()
        if not self.running:
            self.end_attempt()

    def exits(self):
        """(rank, incarnation, exit code) of each worker end the nodes reported since the last poll."""
        for node in range(self.nnodes):
            while self.store.check([key := event_key(self.prefix, node, self.seen[node])]):
                self.seen[node] += 1
                yield json.loads(self.store.get(key))

    def on_exit(self, rank: int, code: int) -> None:
        if code == 0:
            self.finishing = True
            self.drop_waiting()
        elif self.stopping or code in (128 + signal.SIGTERM, -signal.SIGTERM):
            self.stop(self.stopping or signal.SIGTERM)
            if code < 0:  # stopped before it could save: the others cannot meet it
                self.running = set()
        elif (why := self.lost(rank, code)) is not None:
            self.running = set()
            self.over = why

    def end_attempt(self) -> None:
        """Every rank of this start has ended: the run's end, or (a fallback) its next start once
        every node has stopped its workers (a node that does not answer within the timeout: the end)."""
        if self.over is None and not self.stopping:
            self.finish(None)
            return
        if self.over is None:
            code = 128 + self.stopping
            self.finish(WorkerFailure(0, code, f"stopped by {signal.Signals(self.stopping).name}", {code}))
            return
        self.over_since = self.over_since or time.monotonic()
        quiet = self.store.check([f"{self.prefix}quiet-{n}" for n in range(self.nnodes)])
        if not quiet and time.monotonic() < self.over_since + self.timeout_s:
            return
        if self.restarts_left <= 0 or not quiet:
            self.finish(WorkerFailure(*self.over))
            return
        self.restarts_left -= 1
        say(f"paratrain: {self.over[2]}: restarting every worker from the newest checkpoint")
        self.start_attempt(self.attempt + 1)

    def finish(self, failure: WorkerFailure | None) -> None:
        """Publish the run's end: every node stops its workers and reports it."""
        self.running = set()
        self.publish_plan()
        self.store.set(END, json.dumps({} if failure is None else dataclasses.asdict(failure), default=sorted))
        self.ended = True

    def interrupted(self, signum: int) -> None:
        """Node 0's `paratrain run` stops on Ctrl-C: the other nodes stop with it."""
        if not self.ended:
            self.finish(WorkerFailure(0, 128 + signum, f"node 0 was stopped by {signal.Signals(signum).name}", set()))

    def wait_for_nodes(self) -> None:
        """Keep the store up until every other node has read the end (they look every 20 ms; one
        that has not within LEAVE_TIMEOUT_S is gone, and a Ctrl-C here must not wait for it long)."""
        deadline = time.monotonic() + LEAVE_TIMEOUT_S
        keys = [left_key(n) for n in range(1, self.nnodes)]
        while keys and not self.store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.02)

    # -- generations --------------------------------------------------------------------------------
    def publish(self, members: list[int]) -> None:
        self.gen += 1
        self.members = members
        self.store.set(f"{self.prefix}gen-{self.gen}", json.dumps(members))
        self.store.set(f"{self.prefix}latest", str(self.gen))

    def publish_plan(self) -> None:
        plan = json.dumps([self.incarnation[r] if r in self.running else None for r in range(self.world)])
        if plan != self.published_plan:
            self.store.set(f"{self.prefix}plan", plan)
            self.published_plan = plan

    def stop(self, signum: int) -> None:
        """The run stops as under "restart": each member saves at the step the members agree on
        (fault/survive.py: Membership.after_step) and exits 128 + signum. Ranks waiting to rejoin
        hold nothing to save: they are killed."""
        self.stopping = signum
        self.drop_waiting()

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
        self.running -= set(ranks)  # (the plan kills the replica's other ranks, wherever they run)
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
                self.running.add(other)
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
        self.running -= self.waiting
        self.waiting = set()
