"""A federated round over worker processes, as point-to-point messages (gloo isend/irecv): the
server's side (rank 0) and a worker's side, mixed into Federated (engine.py, which describes the
round). Every wait is bounded by federated.round_timeout_s, a worker's receives by that plus
parallel.timeout_s (the server may be evaluating).
"""

from __future__ import annotations

import os
import signal
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from paratrain.errors import say
from paratrain.fault.guard import drop_worker
from paratrain.parallel.federated import secagg
from paratrain.parallel.federated.server import owner_of
from paratrain.parallel.ps.wire import first_line
from paratrain.runtime import fault_points

TAG_GLOBAL, TAG_KEYS, TAG_SHARES, TAG_UPDATE, TAG_DROPPED, TAG_REVEAL = range(31, 37)
HEAD = 2  # per client report: [present, loss] in front of its update

if TYPE_CHECKING:
    from paratrain.config import FederatedConfig
    from paratrain.parallel.base import Strategy as _Base
else:
    _Base = object  # at run time a plain mixin


def _loss_bits(loss: float) -> int:
    return struct.unpack("<q", struct.pack("<d", loss))[0]


def _bits_loss(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


class LostServer(RuntimeError):
    """A worker's message to or from the server failed or timed out."""


class RoundState(_Base):
    """What Federated (federated/engine.py) sets up for the two halves of a round it mixes in:
    declared for the type checker, which sees them as a Strategy (annotations only, nothing at run
    time)."""

    fed: FederatedConfig
    workers: list[int]
    live: set[int]
    dismissed: set[int]
    global_flat: torch.Tensor
    stats: dict
    round: int
    parts: list
    cut_off: bool
    _train_client: Callable[[int, int], tuple[torch.Tensor, float]]
    _dropped_by_fault: Callable[[int], bool]


class ServerRound(RoundState):
    """Rank 0's side of a round with worker ranks."""

    def _round_over_workers(self, sampled, total):
        fed, n = self.fed, len(sampled)
        deadline = time.monotonic() + fed.round_timeout_s
        mine = {w: [c for c in sampled if owner_of(c, self.workers) == w] for w in self.workers}
        busy = [w for w in self.workers if mine[w] and w in self.live]
        message = torch.cat([torch.zeros(1), self.global_flat])  # [dismissed, weights]
        dismissal = torch.cat([torch.ones(1), self.global_flat])
        for w in self.workers:  # a dropped worker that is still alive learns it at its next round
            if mine[w] and w in self.dismissed:
                self.dismissed.discard(w)
                self._exchange(dist.isend, dismissal, w, TAG_GLOBAL, deadline, quiet=True)
        busy = [w for w in busy if self._exchange(dist.isend, message, w, TAG_GLOBAL, deadline)]
        pos = {c: i for i, c in enumerate(sampled)}
        pks = torch.zeros(n, dtype=torch.int64)
        if fed.secure_aggregation:
            got = {w: torch.zeros(len(mine[w]), dtype=torch.int64) for w in busy}
            busy = self._gather(got, TAG_KEYS, deadline)
            for w in busy:
                pks[[pos[c] for c in mine[w]]] = got[w]
            busy = [w for w in busy if self._exchange(dist.isend, pks, w, TAG_KEYS, deadline)]
            got = {w: torch.zeros(len(mine[w]), n, dtype=torch.int64) for w in busy}
            busy = self._gather(got, TAG_SHARES, deadline)
            routed = torch.zeros(n, n, dtype=torch.int64)  # row i: client i's encrypted shares
            for w in busy:
                routed[[pos[c] for c in mine[w]]] = got[w]
            busy = [
                w
                for w in busy
                if self._exchange(
                    dist.isend, routed[:, [pos[c] for c in mine[w]]].contiguous(), w, TAG_SHARES, deadline
                )
            ]
        dtype = torch.int64 if fed.secure_aggregation else torch.float32
        got = {w: torch.zeros(len(mine[w]), HEAD + self.global_flat.numel(), dtype=dtype) for w in busy}
        busy = self._gather(got, TAG_UPDATE, deadline)
        present, losses, update = [], [], torch.zeros(self.global_flat.numel(), dtype=dtype)
        for w in busy:
            for c, row in zip(mine[w], got[w]):
                if row[0]:
                    present.append(c)
                    losses.append(_bits_loss(int(row[1])) if fed.secure_aggregation else float(row[1]))
                    update += row[HEAD:]
        present.sort()
        if not present:
            return [], [], None
        if not fed.secure_aggregation:
            return present, losses, update.double()
        advertised = [c for c in sampled if pks[pos[c]]]
        dropped = [c for c in advertised if c not in present]
        flags = torch.zeros(n, dtype=torch.int64)
        flags[[pos[c] for c in dropped]] = 1
        busy = [w for w in busy if self._exchange(dist.isend, flags, w, TAG_DROPPED, deadline)]
        got = {w: torch.zeros(len(mine[w]), n, dtype=torch.int64) for w in busy}
        busy = self._gather(got, TAG_REVEAL, deadline)
        revealed: dict[int, dict[int, int]] = {pos[d]: {} for d in dropped}
        for w in busy:
            for c, row in zip(mine[w], got[w]):
                if c in present:
                    for d in dropped:
                        revealed[pos[d]][pos[c]] = int(row[pos[d]])
        table = {pos[c]: int(pks[pos[c]]) for c in advertised}
        unmasked = secagg.unmask(
            torch.remainder(update, secagg.MODULUS),
            [pos[c] for c in present],
            [pos[d] for d in dropped],
            table,
            revealed,
        )
        return present, losses, None if unmasked is None else secagg.dequantise(unmasked)

    def _gather(self, bufs: dict[int, torch.Tensor], tag: int, deadline: float) -> list[int]:
        """Receive one message from each worker in `bufs` at once; the workers that answered."""
        works = {}
        for w, buf in bufs.items():
            try:
                works[w] = dist.irecv(buf, w, tag=tag)
            except RuntimeError as exc:
                self._drop(w, f"is gone: {first_line(exc)}")
        return [w for w, work in works.items() if self._wait(work, w, deadline, bufs[w], "up")]

    def _exchange(self, op, buf: torch.Tensor, peer: int, tag: int, deadline: float, quiet: bool = False) -> bool:
        try:
            work = op(buf, peer, tag=tag)
        except RuntimeError as exc:
            if not quiet:
                self._drop(peer, f"is gone: {first_line(exc)}")
            return False
        return self._wait(work, peer, deadline, buf, "down", quiet)

    def _wait(self, work, peer: int, deadline: float, buf: torch.Tensor, direction: str, quiet: bool = False) -> bool:
        """Wait for a message until the round's deadline. The wait itself runs in a daemon thread:
        a gloo wait that times out breaks the process's other connections too (the healthy
        workers'), so the deadline is kept here, and a late message lands in a buffer nobody reads."""
        done, error = threading.Event(), []

        def waiter():
            try:
                work.wait()
            except RuntimeError as exc:
                error.append(first_line(exc))
            done.set()

        threading.Thread(target=waiter, daemon=True).start()
        with self.profiler.phase("comm"):
            answered = done.wait(max(deadline - time.monotonic(), 0.001))
        if quiet:
            return answered and not error
        if not answered:
            self.dismissed.add(peer)
            self._drop(peer, "did not answer within federated.round_timeout_s")
            return False
        if error:
            self._drop(peer, f"is gone: {error[0]}")
            return False
        self.stats[f"bytes_{direction}"] += buf.numel() * buf.element_size()
        return True

    def _drop(self, w: int, why: str) -> None:
        drop_worker(
            self.live,
            w,
            lambda left: (
                f"federated: round {self.round + 1}: worker rank {w} {why}; dropped with its clients, "
                f"{left} of {len(self.workers)} workers go on"
            ),
        )


class WorkerRound(RoundState):
    """A worker rank's side of a round: it simulates the round's clients it holds."""

    def _work(self, sampled: list[int]) -> torch.Tensor:
        """Serve this worker's clients of the round. A worker that loses the server (which drops
        a worker past round_timeout_s, or has failed, which fails the run on its own) says so and
        sits out the remaining rounds instead of failing the job."""
        mine = [c for c in sampled if owner_of(c, self.workers) == self.rt.rank]
        if not mine or self.cut_off:
            return torch.zeros(())
        try:
            self._serve_clients(sampled, mine)
        except LostServer as exc:
            self.cut_off = True
            say(f"federated: worker rank {self.rt.rank}: {exc}; it leaves the federation")
        return torch.zeros(())

    def _serve_clients(self, sampled: list[int], mine: list[int]) -> None:
        n, pos = len(sampled), {c: i for i, c in enumerate(sampled)}
        total = sum(len(self.parts[c]) for c in sampled)
        wait_s = self.fed.round_timeout_s + self.cfg.parallel.timeout_s  # the server may be evaluating
        message = torch.empty(1 + self.global_flat.numel())
        self._from_server(message, TAG_GLOBAL, wait_s)
        if message[0]:
            raise LostServer("the server dropped it: it missed federated.round_timeout_s in an earlier round")
        self.global_flat.copy_(message[1:])
        if fault_points.fires("fed_stall", rank=self.rt.rank, round=self.round):  # tests: a straggler
            time.sleep(1.5 * self.fed.round_timeout_s)
        keys = {}
        if self.fed.secure_aggregation:
            keys = {c: secagg.SecAggClient(pos[c]) for c in mine}
            self._to_server(torch.tensor([keys[c].pk for c in mine], dtype=torch.int64), TAG_KEYS)
            pks = torch.zeros(n, dtype=torch.int64)
            self._from_server(pks, TAG_KEYS, wait_s)
            table = {i: int(pk) for i, pk in enumerate(pks.tolist()) if pk}
            shares = torch.zeros(len(mine), n, dtype=torch.int64)
            for row, c in enumerate(mine):
                for j, s in keys[c].share_keys(table).items():
                    shares[row, j] = s
            self._to_server(shares, TAG_SHARES)
            held = torch.zeros(n, len(mine), dtype=torch.int64)
            self._from_server(held, TAG_SHARES, wait_s)
            for col, c in enumerate(mine):
                keys[c].held = {i: int(s) for i, s in enumerate(held[:, col].tolist()) if i in table and i != pos[c]}
        dtype = torch.int64 if self.fed.secure_aggregation else torch.float32
        reports = torch.zeros(len(mine), HEAD + self.global_flat.numel(), dtype=dtype)
        for row, c in enumerate(mine):
            if row == 1 and fault_points.fires("fed_kill", rank=self.rt.rank, round=self.round):  # tests: mid-round
                os.kill(os.getpid(), signal.SIGKILL)
            update, loss = self._train_client(c, total)
            present = not self._dropped_by_fault(c)
            if self.fed.secure_aggregation:  # masked, then (fault) left without a word
                reports[row, HEAD:] = keys[c].mask(secagg.quantise(update))
                reports[row, :HEAD] = torch.tensor([int(present), _loss_bits(loss)])
            else:
                reports[row, HEAD:] = update
                reports[row, :HEAD] = torch.tensor([float(present), loss])
            if not present:
                reports[row] = 0
        self._to_server(reports, TAG_UPDATE)
        if self.fed.secure_aggregation:
            flags = torch.zeros(n, dtype=torch.int64)
            self._from_server(flags, TAG_DROPPED, wait_s)
            dropped = [i for i in range(n) if flags[i]]
            revealed = torch.zeros(len(mine), n, dtype=torch.int64)
            for row, c in enumerate(mine):
                if reports[row, 0]:
                    for d, s in keys[c].reveal(dropped).items():
                        revealed[row, d] = s
            self._to_server(revealed, TAG_REVEAL)

    def _from_server(self, buf: torch.Tensor, tag: int, wait_s: float) -> None:
        try:
            with self.profiler.phase("comm"):
                cast(dist.Work, dist.irecv(buf, 0, tag=tag)).wait(timedelta(seconds=wait_s))  # None only off the group
        except RuntimeError as exc:
            raise LostServer(f"no word from the server (rank 0) in round {self.round + 1}: {first_line(exc)}") from None

    def _to_server(self, buf: torch.Tensor, tag: int) -> None:
        try:
            with self.profiler.phase("comm"):
                cast(dist.Work, dist.isend(buf, 0, tag=tag)).wait(timedelta(seconds=self.fed.round_timeout_s))
        except RuntimeError as exc:
            raise LostServer(
                f"the server (rank 0) took no message in round {self.round + 1}: {first_line(exc)}"
            ) from None
