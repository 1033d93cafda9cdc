"""strategy = "federated": one trainer step is one round.

Ranks: rank 0 is the server (samples the round's clients, aggregates, evaluates, checkpoints,
exports); ranks 1..W-1 are workers, each simulating the clients dealt to it (client c lives on
worker 1 + c mod (W-1)) one after another in one model. With one process, rank 0 does both.

A round, as point-to-point messages (gloo isend/irecv) between the server and each worker that
holds sampled clients (every rank derives the sample from (seed, round), so none is announced):

    server                                   worker w (clients C_w of the round)
      global weights             ->            each c in C_w: local training, delta_c
      [secure aggregation:
      keys: advertised pk table  <-> pk_c       share keys: encrypted Shamir shares, routed]
      sum over reports           <-            per client: [present, loss, update]
      [dropped clients           <-> their key shares from the survivors]
      w <- server optimizer(weighted mean delta)

An update is (n_c / N) delta_c with N the round's sampled samples; masked under secure
aggregation (secagg.py). A worker that does not answer within federated.round_timeout_s of the
round's start, or whose connection breaks (its process died), is dropped: its clients leave this
round and every later one, and the round completes with the others. Worker ranks run under a
guard (paratrain/guard.py), so one dying does not end the job.

The trainer's own collectives (evaluation, export) run on each rank's one-rank group: workers
never wait on each other, and a dead worker cannot block them. Rank 0 evaluates the global model.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from ... import checkpoint as ckpt
from ... import faults
from ...data import build_dataset
from ...optim import set_lr
from ..base import Strategy, unique_parameters
from ..parameter_server import first_line
from . import secagg
from .client import LocalTrainer, copy_into
from .partition import deal_clients, describe, local_batches, write_report
from .server import ServerOptimizer, owner_of, sample_clients

TAG_GLOBAL, TAG_KEYS, TAG_SHARES, TAG_UPDATE, TAG_DROPPED, TAG_REVEAL = range(31, 37)
HEAD = 2  # per client report: [present, loss] in front of its update


def check_model(cfg, model) -> None:
    """Before any worker starts: the partition can be drawn (alpha against min_samples)."""
    deal_clients(cfg, build_dataset(cfg, "train"))


def _loss_bits(loss: float) -> int:
    return struct.unpack("<q", struct.pack("<d", loss))[0]


def _bits_loss(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


class LostServer(RuntimeError):
    """A worker's message to or from the server failed or timed out."""


class Federated(Strategy):
    name = "federated"
    check_model = staticmethod(check_model)

    def __init__(self, model, loss_fn, cfg, rt):
        super().__init__(model.to(rt.device), loss_fn, cfg, rt)
        self.fed = fed = cfg.federated
        cfg.train.log_every = 1  # a round is the unit of the run: one metrics line each
        self.is_server = rt.rank == 0
        self.workers = list(range(1, rt.world_size)) or [0]
        self.reads_data = False  # clients read their own partitions
        self.dp_rank, self.dp_size = 0, 1
        self.reports_loss = False  # the server hears the clients' losses: reduce_loss
        self.lockstep = False
        self.checkpoint_ranks = 1  # the server holds the whole state
        if rt.world_size > 1:
            self.trainer_group = dist.new_group([rt.rank], use_local_synchronization=True)
        self.params = [p for _, p in unique_parameters(self.model)]
        if any(p.dtype != torch.float32 for p in self.params):
            raise NotImplementedError("strategy 'federated' needs float32 parameters")
        self.global_flat = parameters_to_vector(self.params).detach().cpu().clone()
        self.train_set = build_dataset(cfg, "train")
        self.parts, self.summary = deal_clients(cfg, self.train_set)
        simulates = not self.is_server or rt.world_size == 1
        self.local = LocalTrainer(self.model, loss_fn, cfg, rt.device) if simulates else None
        self.optimizer = self.local.optimizer if self.local else None
        self.server_opt = (
            ServerOptimizer(fed.algorithm, fed.server_lr, self.global_flat.numel()) if self.is_server else None
        )
        self.round = 0
        self.live = set(self.workers)
        self.loss_sums = torch.zeros(2, dtype=torch.float64)
        self.stats: dict = {}
        self.reported = False
        self.cut_off = False  # a worker that lost the server (it dropped us, or it is gone)
        self.dismissed: set[int] = set()  # server: workers dropped for silence, maybe still alive

    @property
    def evaluates(self) -> bool:
        return self.is_server

    def set_lr(self, lr: float) -> None:
        if self.optimizer is not None:
            set_lr(self.optimizer, lr)

    # -- the round --------------------------------------------------------------------------------
    def train_step(self, batch) -> torch.Tensor:
        sampled = sample_clients(self.cfg.train.seed, self.round, self.fed.clients, self.fed.clients_per_round)
        if self.is_server:
            self._report_partition()
            loss = self._serve(sampled)
        else:
            loss = self._work(sampled)
        self.round += 1
        return loss

    def _report_partition(self) -> None:
        if not self.reported:
            self.reported = True
            print(describe(self.summary), flush=True)
            if self.run_dir is not None:
                write_report(self.run_dir, self.summary)

    def _batches(self, client: int):
        return local_batches(
            self.parts[client], self.fed.local_steps, self.cfg.data.batch_size, self.cfg.train.seed, self.round, client
        )

    def _train_client(self, client: int, total_samples: int) -> tuple[torch.Tensor, float]:
        """A client's weighted update (n_c / N) delta_c and its mean local loss."""
        delta, loss = self.local.train(self.global_flat, self.train_set, self._batches(client), self.profiler)
        return delta.mul_(len(self.parts[client]) / total_samples), loss

    def _dropped_by_fault(self, client: int) -> bool:
        return faults.active("fed_drop", client=client, round=self.round)

    def _serve(self, sampled: list[int]) -> torch.Tensor:
        t0 = time.perf_counter()
        self.stats = {"bytes_up": 0, "bytes_down": 0}
        total = sum(len(self.parts[c]) for c in sampled)
        if self.rt.world_size == 1:
            present, losses, update = self._round_in_process(sampled, total)
        else:
            present, losses, update = self._round_over_workers(sampled, total)
        self.skipped_step = False
        dropped = [c for c in sampled if c not in present]
        if update is None:
            print(
                f"federated: round {self.round + 1}: no update ({len(present)} of {len(sampled)} clients "
                f"reported{'; too few key shares to unmask' if present else ''})",
                file=sys.stderr,
                flush=True,
            )
        elif not torch.isfinite(update).all():
            self.skipped_step = True
        else:
            weight = sum(len(self.parts[c]) for c in present) / total
            self.server_opt.step(self.global_flat, update.float() / weight)
        copy_into(self.params, self.global_flat.to(self.rt.device))  # the model rank 0 evaluates
        if losses:
            self.loss_sums += torch.tensor([sum(losses), len(losses)], dtype=torch.float64)
        self.stats.update(clients=len(present), dropped_clients=dropped, round_s=time.perf_counter() - t0)
        return torch.tensor(sum(losses) / len(losses) if losses else float("nan"))

    def _round_in_process(self, sampled, total):
        updates, losses = {}, {}
        for pos, c in enumerate(sampled):
            updates[pos], losses[c] = self._train_client(c, total)
        gone = {pos for pos, c in enumerate(sampled) if self._dropped_by_fault(c)}
        present = [c for pos, c in enumerate(sampled) if pos not in gone]
        if not self.fed.secure_aggregation:
            if not present:
                return [], [], None
            return present, [losses[c] for c in present], sum(updates[sampled.index(c)].double() for c in present)
        masked_sum, _ = secagg.run_in_process({p: secagg.quantise(u) for p, u in updates.items()}, gone)
        return present, [losses[c] for c in present], None if masked_sum is None else secagg.dequantise(masked_sum)

    # -- server side over workers ---------------------------------------------------------------
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
        self.live.discard(w)
        print(
            f"federated: round {self.round + 1}: worker rank {w} {why}; dropped with its clients, "
            f"{len(self.live)} of {len(self.workers)} workers go on",
            file=sys.stderr,
            flush=True,
        )
        if not self.live:
            raise RuntimeError("federated: every worker is gone")

    # -- worker side ----------------------------------------------------------------------------
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
            print(
                f"federated: worker rank {self.rt.rank}: {exc}; it leaves the federation", file=sys.stderr, flush=True
            )
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
        if faults.active("fed_stall", rank=self.rt.rank, round=self.round):  # tests: a straggler
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
            if row == 1 and faults.active("fed_kill", rank=self.rt.rank, round=self.round):  # tests: mid-round
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
                dist.irecv(buf, 0, tag=tag).wait(timedelta(seconds=wait_s))
        except RuntimeError as exc:
            raise LostServer(f"no word from the server (rank 0) in round {self.round + 1}: {first_line(exc)}") from None

    def _to_server(self, buf: torch.Tensor, tag: int) -> None:
        try:
            with self.profiler.phase("comm"):
                dist.isend(buf, 0, tag=tag).wait(timedelta(seconds=self.fed.round_timeout_s))
        except RuntimeError as exc:
            raise LostServer(
                f"the server (rank 0) took no message in round {self.round + 1}: {first_line(exc)}"
            ) from None

    # -- metrics, loss ----------------------------------------------------------------------------
    def step_metrics(self) -> dict:
        return dict(self.stats) if self.is_server else {}

    def reduce_loss(self, sums: torch.Tensor) -> torch.Tensor:
        out, self.loss_sums = self.loss_sums, torch.zeros_like(self.loss_sums)
        return out

    # -- state ----------------------------------------------------------------------------------
    def _named_global(self) -> dict[str, torch.Tensor]:
        names = [n for n, _ in unique_parameters(self.model)]
        out, offset = {}, 0
        for name, p in zip(names, self.params):
            out[name] = self.global_flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        return out

    def state_dict(self):
        tensors = {f"model.{k}": v for k, v in self._named_global().items()}
        tensors.update(self.server_opt.state())
        return tensors, {"federated": {"round": self.round, "algorithm": self.fed.algorithm}}

    def load_state_dict(self, reader) -> None:
        tensors, meta = reader.load(rank=0)
        missing = [k for k in self._named_global() if f"model.{k}" not in tensors]
        if missing:
            raise ckpt.CheckpointMismatch(
                "resume", "checkpoint does not match the model: missing " + ", ".join(missing)
            )
        with torch.no_grad():
            for k, v in self._named_global().items():
                v.copy_(tensors[f"model.{k}"])
        if self.server_opt is not None:
            self.server_opt.load(tensors)
        self.round = int(meta["federated"]["round"])
        copy_into(self.params, self.global_flat.to(self.rt.device))

    def full_model_state(self):
        if not self.is_server:
            return None
        copy_into(self.params, self.global_flat.to(self.rt.device))
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
