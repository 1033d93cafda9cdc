"""Parameter servers: the first `ps.servers` ranks hold the parameters and run the optimizer, the
other ranks are workers that compute gradients on their share of each batch.

Sharding: whole parameters are dealt to servers greedily by bytes (largest first, to the least
loaded server), so shards are balanced without splitting a tensor. On both sides a shard lives in
one flat buffer with a small header in front, parameters (or gradients) are views into it, and a
push or a pull is one point-to-point message per server (gloo, `isend`/`irecv`).

One step as seen from one worker and one server (`v` = the server's update count, its version):

    worker w                                server s
      forward/backward on its batch share
      push [step, v_used, loss | grads_s]  ->  sync:  wait for every worker, average, 1 update
                                               async: apply this push alone, at once
                                               ssp:   apply at once; hold the reply while w is
                                                      more than ps.staleness steps ahead of the
                                                      slowest live worker
      pull [v, final | params_s]           <-  reply

Sync: one update per step from the average of all workers' gradients = single-process training.
Async and ssp: each push is applied as it arrives (staleness of a push = updates applied since the
parameters it was computed on were sent). The server's train_step for trainer step k serves
pushes until every live worker has finished step k, so rank 0 logs at the slowest worker's pace;
its last train_step serves until every live worker is done and then sends all of them the final
parameters, so the run ends in lockstep (evaluation, export) even though it ran asynchronously.

Non-finite gradients: a sync step whose averaged gradient (or any worker's loss) is not finite is
skipped on every server, as dp skips it, and the reply tells each worker so (the trainer counts
it against train.max_bad_steps); async and ssp servers refuse a non-finite push alone, say so, and
tell that worker.

Faults: async/ssp servers drop a worker whose connection breaks or that stays silent for
ps.drop_after_s (and say so), and the trainer's collectives then run over the live ranks only;
checkpoints are the servers' alone. A worker that dies or stalls after its push, before it takes
its pull, is dropped (dead) or served late (stalled) without holding up the others: each reply is
sent and waited for off the server's main thread. A push whose header is not one a worker sends
(a step other than the worker's next, a version the server never had, NaN) drops that worker.
A worker process that crashes is kept from failing the whole
job by `guard_worker` (its parent reports the death and leaves cleanly, so the elastic agent lets the
others go on). A sync server, or a worker whose server does not answer within parallel.timeout_s,
fails with a message naming the missing rank.

Fault points (PARATRAIN_FAULTS, see paratrain/faults.py), each at one worker's push of one step:
    ps_kill_before_pull@rank=R,step=S    the worker SIGKILLs itself after its push, before its pull
    ps_stall_before_pull@rank=R,step=S   ... stalls there for FAULT_STALL_S seconds
    ps_bad_header@rank=R,step=S          ... pushes NaN as its step, and leaves (exit 0)
"""

from __future__ import annotations

import os
import queue
import re
import signal
import sys
import threading
import time
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from .. import checkpoint as ckpt
from .. import faults, guard
from ..optim import build_optimizer, set_lr
from .base import Strategy, clip_factor, unique_parameters

HEADER = 4  # float32 slots in front of every message (small integers are exact in float32)
FAULT_STALL_S = 4.0
PUSH_TAG, PULL_TAG, EXPORT_TAG = 11, 12, 13
# push header: [step the gradient is for, server version it was computed on, worker loss, 0]
# pull header: [server version, 1 if these are the final parameters,
#               1 if the gradient of the worker's last push was not finite and not applied, 0]


def assign_shards(sizes: list[int], servers: int) -> list[list[int]]:
    """Parameter indices per server: largest first, each to the server with the fewest bytes so far."""
    load, shards = [0] * servers, [[] for _ in range(servers)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        s = min(range(servers), key=lambda s: load[s])
        shards[s].append(i)
        load[s] += sizes[i]
    return [sorted(shard) for shard in shards]


def straggle(compute_s: float, factor: float) -> None:
    """Make a step take `factor` times its compute time (experiments: one slow worker)."""
    if factor > 1:
        time.sleep((factor - 1) * compute_s)


class FlatShard:
    """One server's parameters as a flat buffer [header | tensors]; `bind` makes tensors views of it."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.shapes = [p.shape for p in params]  # a server empties the parameters it does not hold
        self.numel = sum(p.numel() for p in params)
        self.nbytes = (HEADER + self.numel) * 4

    def new_buffer(self) -> torch.Tensor:
        return torch.zeros(HEADER + self.numel, dtype=torch.float32)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        out, offset = [], HEADER
        for shape in self.shapes:
            n = shape.numel()
            out.append(buf[offset : offset + n].view(shape))
            offset += n
        return out

    def bind_data(self, buf: torch.Tensor) -> None:
        for p, v in zip(self.params, self.views(buf)):
            v.copy_(p.detach())
            p.data = v

    def bind_grads(self, buf: torch.Tensor) -> None:
        for p, v in zip(self.params, self.views(buf)):
            p.grad = v


class ParameterServer(Strategy):
    name = "ps"

    def __init__(self, model, loss_fn, cfg, rt):
        is_server = rt.rank < cfg.ps.servers
        # Servers keep their shard and optimizer in host memory, the classic design; workers compute
        # on their device. All ps traffic is gloo point-to-point on host buffers (NCCL has no
        # receive that can be waited on from a thread), so on GPUs it gets a gloo group of its own.
        super().__init__(model if is_server else model.to(rt.device), loss_fn, cfg, rt)
        self.comm_group = None if rt.backend == "gloo" else dist.new_group(backend="gloo")
        self.ps = cfg.ps
        self.mode = cfg.ps.mode
        self.servers = list(range(cfg.ps.servers))
        self.workers = list(range(cfg.ps.servers, rt.world_size))
        self.is_server = is_server
        self.timeout = timedelta(seconds=cfg.parallel.timeout_s)
        # Servers read no data; workers split each global batch like dp ranks.
        self.reads_data = not self.is_server
        self.dp_size = len(self.workers)
        self.dp_rank = max(rt.rank - cfg.ps.servers, 0)
        # Server 0 hears every worker's loss with its pushes and hands it over in reduce_loss.
        self.reports_loss = False
        self.loss_sums = torch.zeros(2, dtype=torch.float64)
        named = unique_parameters(model)
        self.names = [n for n, _ in named]
        params = [p for _, p in named]
        if any(p.dtype != torch.float32 for p in params):
            raise NotImplementedError("strategy 'ps' needs float32 parameters (train.precision may be bf16)")
        self.shard_index = assign_shards([p.numel() for p in params], len(self.servers))
        self.shards = [FlatShard([params[i] for i in idx]) for idx in self.shard_index]
        # Servers that must agree on something (sync clipping, the live set, metrics) talk in here.
        self.server_group = dist.new_group(self.servers, backend="gloo") if len(self.servers) > 1 else None
        if self.mode != "sync":
            # Only servers hold state, and async workers must not wait for a checkpoint (nor for a
            # dropped worker at one): the servers write it among themselves.
            self.checkpoint_ranks, self.checkpoint_group = len(self.servers), self.server_group
            self.lockstep = False
        self.step_index = 0  # the trainer step the next train_step is for
        self.total_steps = cfg.train.steps
        self.stats = PushStats()
        self.t0 = None  # first step: pushes/s count from there
        if self.is_server:
            self._init_server()
        else:
            self._init_worker()

    # -- setup ----------------------------------------------------------------------------------
    def _init_server(self) -> None:
        self.shard = self.shards[self.rt.rank]
        self.param_buf = self.shard.new_buffer()
        self.shard.bind_data(self.param_buf)
        self.grad_buf = self.shard.new_buffer()
        self.shard.bind_grads(self.grad_buf)
        self.own_names = [self.names[i] for i in self.shard_index[self.rt.rank]]
        # A server computes nothing with the model: it keeps its own shard only (rank 0 receives
        # the other shards when it exports the final model)
        own = {id(p) for p in self.shard.params}
        for p in self.model.parameters():
            if id(p) not in own:
                p.data = torch.empty(0, dtype=p.dtype)
        self.optimizer = build_optimizer(self.shard.params, self.cfg.train) if self.shard.params else None
        self.version = 0
        self.live = set(self.workers)
        self.clock = dict.fromkeys(self.workers, 0)  # steps each worker has pushed
        self.last_heard = dict.fromkeys(self.workers, time.monotonic())
        self.held: list[int] = []  # ssp: workers whose reply waits for the slowest
        self.refused: set[int] = set()  # async: workers whose last push was not finite
        self.done: set[int] = set()
        self.max_gap = 0
        self.recv_bufs = {w: self.shard.new_buffer() for w in self.workers}
        self.arrivals: queue.Queue | None = None  # async: (worker, error) as its push lands

    def _init_worker(self) -> None:
        # Host buffers go on the wire; on a CPU they are the parameters' and gradients' own storage,
        # on a GPU the device copies are, and each push and pull copies once across.
        self.param_bufs = [shard.new_buffer() for shard in self.shards]
        self.grad_bufs = [shard.new_buffer() for shard in self.shards]
        on_host = self.rt.device.type == "cpu"
        self.dev_param_bufs = self.param_bufs if on_host else [b.to(self.rt.device) for b in self.param_bufs]
        self.dev_grad_bufs = self.grad_bufs if on_host else [b.to(self.rt.device) for b in self.grad_bufs]
        for shard, pbuf, gbuf in zip(self.shards, self.dev_param_bufs, self.dev_grad_bufs):
            shard.bind_data(pbuf)
            shard.bind_grads(gbuf)
        self.versions = [0] * len(self.servers)
        self.straggle = self.ps.straggler_factor if self.rt.rank == self.ps.straggler_rank else 1.0

    def set_lr(self, lr: float) -> None:
        if self.optimizer is not None:
            set_lr(self.optimizer, lr)

    # -- the step -------------------------------------------------------------------------------
    def train_step(self, batch) -> torch.Tensor:
        self.t0 = self.t0 or time.perf_counter()
        if faults.active("ps_vanish", rank=self.rt.rank, step=self.step_index):  # tests: leave with exit 0
            print(f"ps: {self._role(self.rt.rank)} vanishes at step {self.step_index} (fault injection)", flush=True)
            os._exit(0)
        if faults.active("ps_kill", rank=self.rt.rank, step=self.step_index):  # tests: a crash
            os.kill(os.getpid(), signal.SIGKILL)
        final = self.step_index == self.total_steps - 1
        if self.is_server:
            loss = self._serve_sync() if self.mode == "sync" else self._serve_async(final)
        else:
            loss = self._work(batch, final)
        self.step_index += 1
        return loss

    def _work(self, batch, final: bool) -> torch.Tensor:
        t0 = time.perf_counter()
        for buf in self.dev_grad_bufs:
            buf.zero_()
        micro = self.micro_batches(batch)
        total = torch.zeros((), device=self.rt.device)
        for x, y in micro:
            with self.profiler.phase("forward"), self.autocast():
                loss = self.loss_fn(self.model(x), y)
            with self.profiler.phase("backward"):
                (loss / len(micro)).backward()
            total += loss.detach().float()
        loss = total / len(micro)
        if self.mode != "sync" and self.cfg.train.clip_grad_norm > 0:  # sync clips the average on the servers
            torch.nn.utils.clip_grad_norm_([p for s in self.shards for p in s.params], self.cfg.train.clip_grad_norm)
        straggle(time.perf_counter() - t0, self.straggle)
        sends = []
        for s, buf, dev_buf in zip(self.servers, self.grad_bufs, self.dev_grad_bufs):
            if dev_buf is not buf:
                buf.copy_(dev_buf)
            lie = faults.active("ps_bad_header", rank=self.rt.rank, step=self.step_index)
            buf[:HEADER] = torch.tensor([float("nan") if lie else self.step_index, self.versions[s], float(loss), 0.0])
            sends.append(self._p2p(dist.isend, buf, s, PUSH_TAG))
        for s, work in zip(self.servers, sends):
            self._wait(work, s)
        self._between_push_and_pull()
        recvs = [self._p2p(dist.irecv, buf, s, PULL_TAG) for s, buf in zip(self.servers, self.param_bufs)]
        for s, work in zip(self.servers, recvs):
            self._wait(work, s)
        self.versions = [int(buf[0]) for buf in self.param_bufs]
        self.skipped_step = any(bool(buf[2]) for buf in self.param_bufs)
        for buf, dev_buf in zip(self.param_bufs, self.dev_param_bufs):
            if dev_buf is not buf:
                dev_buf.copy_(buf)
        if final and self.mode != "sync":  # who else made it to the end (server 0 tells)
            alive = torch.zeros(self.rt.world_size, dtype=torch.int32)
            self._wait(self._p2p(dist.irecv, alive, 0, PULL_TAG), 0)
            self._set_live([int(r) for r in alive.nonzero().flatten()])
        return loss

    def _between_push_and_pull(self) -> None:
        """Tests: die or stall with the push sent and the pull not yet asked for."""
        if faults.active("ps_kill_before_pull", rank=self.rt.rank, step=self.step_index):
            os.kill(os.getpid(), signal.SIGKILL)
        if faults.active("ps_bad_header", rank=self.rt.rank, step=self.step_index):
            os._exit(0)  # no pull will answer a malformed push
        if faults.active("ps_stall_before_pull", rank=self.rt.rank, step=self.step_index):
            print(
                f"ps: worker rank {self.rt.rank} stalls for {FAULT_STALL_S:g}s before its pull of step "
                f"{self.step_index + 1} (fault injection)",
                flush=True,
            )
            time.sleep(FAULT_STALL_S)

    def _p2p(self, op, buf: torch.Tensor, peer: int, tag: int):
        self.profiler.comm("send" if op is dist.isend else "recv", buf, self.comm_group)
        try:
            return op(buf, peer, group=self.comm_group, tag=tag)
        except RuntimeError as exc:
            raise self._lost(peer, f"is gone: {first_line(exc)}") from None

    def _wait(self, work, peer: int) -> None:
        try:
            with self.profiler.phase("comm"):
                work.wait(self.timeout)
        except RuntimeError as exc:
            if "Timed out" in str(exc):
                raise self._lost(
                    peer, f"did not answer within parallel.timeout_s = {self.timeout.total_seconds():g}s"
                ) from None
            raise self._lost(peer, f"is gone: {first_line(exc)}") from None

    def _lost(self, peer: int, what: str) -> RuntimeError:
        """A lost server fails the run, also when a guarded (expendable) worker is the one to notice."""
        kind = guard.FailsRun if peer in self.servers else RuntimeError
        return kind(f"ps: {self._role(peer)} {what}")

    def _role(self, rank: int) -> str:
        return f"parameter server rank {rank}" if rank in self.servers else f"worker rank {rank}"

    # -- server: sync ----------------------------------------------------------------------------
    def _serve_sync(self) -> torch.Tensor:
        works = {w: self._p2p(dist.irecv, self.recv_bufs[w], w, PUSH_TAG) for w in self.workers}
        for w in self.workers:
            self._wait(works[w], w)
        stacked = torch.stack([self.recv_bufs[w] for w in self.workers])
        self.grad_buf.copy_(stacked.mean(0))
        self._hear_losses(stacked[:, 2])
        self.stats.pushes += len(self.workers)
        self.stats.bytes += len(self.workers) * 2 * self.shard.nbytes
        self.stats.staleness.update({0: len(self.workers)})  # every gradient was computed on the latest version
        self.skipped_step = not self._all_finite(self.grad_buf, stacked[:, 2])
        if not self.skipped_step:
            if self.cfg.train.clip_grad_norm > 0:
                self._clip_over_servers()
            self._update()
        self.param_buf[:HEADER] = torch.tensor([self.version, 0.0, float(self.skipped_step), 0.0])
        sends = [self._p2p(dist.isend, self.param_buf, w, PULL_TAG) for w in self.workers]
        for w, work in zip(self.workers, sends):
            self._wait(work, w)
        return stacked[:, 2].mean()

    def _all_finite(self, grads: torch.Tensor, losses: torch.Tensor) -> bool:
        """Whether the losses and the averaged gradient are finite on every server (each holds
        every worker's loss, and its own shard of the gradient)."""
        ok = torch.tensor([float(bool(torch.isfinite(grads).all() and torch.isfinite(losses).all()))])
        if self.server_group is not None:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.server_group)
        return bool(ok.item())

    def _hear_losses(self, losses: torch.Tensor) -> None:
        self.loss_sums += torch.tensor([losses.double().sum().item(), losses.numel()], dtype=torch.float64)

    def _clip_over_servers(self) -> None:
        """Clip by the norm of the whole averaged gradient, which spans every server's shard."""
        sq = self.grad_buf[HEADER:].double().square().sum()
        if self.server_group is not None:
            dist.all_reduce(sq, group=self.server_group)
        self.grad_buf[HEADER:].mul_(clip_factor(sq.sqrt(), self.cfg.train.clip_grad_norm).float())

    def _update(self) -> None:
        if self.optimizer is not None:
            with self.profiler.phase("optimizer"):
                self.optimizer.step()
        self.version += 1

    # -- server: async and ssp -------------------------------------------------------------------
    # One receive is posted per live worker, and a daemon thread waits on each (gloo's is_completed
    # never turns true before wait(), and a wait that times out breaks the connections), so pushes
    # arrive in a queue in the order they land and the main thread can time out on the queue instead.
    def _serve_async(self, final: bool) -> torch.Tensor:
        """Serve pushes until every live worker has pushed step `step_index` (all steps when final)."""
        target = self.total_steps if final else self.step_index + 1
        now = time.monotonic()  # silence counts only while this server listens
        self.last_heard = {w: max(t, now) for w, t in self.last_heard.items()}
        if self.arrivals is None:
            self.arrivals = queue.Queue()
            for w in sorted(self.live - self.done):
                self._post(w)
        while min(self.clock[w] for w in self.live) < target:
            try:
                w, error = self.arrivals.get(timeout=min(1.0, self.ps.drop_after_s / 4))
            except queue.Empty:
                self._drop_silent()
                continue
            if w not in self.live:
                continue  # a late word from a worker already dropped
            if error is not None:
                self._drop(w, f"it is gone ({error})")
                continue
            buf = self.recv_bufs[w]
            malformed = self._malformed(buf, w)
            if malformed:
                self._drop(w, f"its push is malformed ({malformed})")
                continue
            self._hear_losses(buf[2:3])
            self._apply(buf, w)
            if w not in self.done:
                self._post(w)
        if final:
            self._finish()
        return torch.zeros(())

    def _post(self, w: int) -> None:
        work = self._p2p(dist.irecv, self.recv_bufs[w], w, PUSH_TAG)
        threading.Thread(target=self._land, args=(work, w), daemon=True).start()

    def _land(self, work, w: int) -> None:
        try:
            work.wait()
            self.arrivals.put((w, None))
        except RuntimeError as exc:
            self.arrivals.put((w, first_line(exc)))

    def _drop_silent(self) -> None:
        now = time.monotonic()
        for w in sorted(self.live - self.done):
            if now - self.last_heard[w] > self.ps.drop_after_s:
                self._drop(w, f"silent for {now - self.last_heard[w]:.1f}s (> ps.drop_after_s)")

    def _drop(self, w: int, why: str) -> None:
        self.live.discard(w)
        if w in self.held:
            self.held.remove(w)
        self.stats.dropped.append(w)
        print(
            f"ps: server rank {self.rt.rank} drops worker rank {w}: {why}; training goes on with "
            f"{len(self.live)} workers",
            file=sys.stderr,
            flush=True,
        )
        if not self.live:
            raise RuntimeError("ps: every worker is gone")
        self._release_held()

    def _malformed(self, buf: torch.Tensor, w: int) -> str:
        """What is wrong with a push's header, "" if nothing: its step must be the worker's next,
        its version one this server has had (the loss may be anything: a non-finite one is refused)."""
        step, used = buf[0].item(), buf[1].item()
        if step != self.clock[w]:
            return f"step {step:g}, expected {self.clock[w]}"
        if not (used.is_integer() and 0 <= used <= self.version):
            return f"version {used:g}, this server is at {self.version}"
        return ""

    def _apply(self, buf: torch.Tensor, src: int) -> None:
        step, used = int(buf[0]), int(buf[1])
        self.last_heard[src] = time.monotonic()
        self.stats.pushes += 1
        self.stats.bytes += self.shard.nbytes
        if torch.isfinite(buf).all():
            self.grad_buf[HEADER:].copy_(buf[HEADER:])
            self.stats.staleness[self.version - used] += 1
            self._update()
        else:  # this push alone is refused (another server may hold the finite part of it)
            self.refused.add(src)
            print(
                f"ps: server rank {self.rt.rank} refuses worker rank {src}'s push for step {step + 1}: "
                f"non-finite loss or gradient",
                file=sys.stderr,
                flush=True,
            )
        self.clock[src] = step + 1
        if self.clock[src] >= self.total_steps:
            self.done.add(src)  # its final parameters go out once everyone is done
        elif self.mode == "ssp":
            self.held.append(src)
        else:
            self._reply(src, final=False)
        self._release_held()

    def _release_held(self) -> None:
        """ssp: a worker may start step c only while c - (slowest live worker's step) <= staleness."""
        if not self.live:
            return
        slowest = min(self.clock[w] for w in self.live)
        for w in list(self.held):
            gap = self.clock[w] - slowest
            if gap <= self.ps.staleness:
                self.held.remove(w)
                self.max_gap = max(self.max_gap, gap)
                self._reply(w, final=False)

    def _reply(self, w: int, final: bool) -> None:
        """Send worker w the parameters. A copy goes on the wire (the next update must not change
        it in flight), and a thread waits for it: a worker that stalls before its pull holds up
        no one else, and one that died is dropped (the main thread hears of it from `arrivals`)."""
        refused = w in self.refused
        self.refused.discard(w)
        buf = self.param_buf.clone()
        buf[:HEADER] = torch.tensor([self.version, float(final), float(refused), 0.0])
        self.stats.bytes += self.shard.nbytes
        work = self._p2p(dist.isend, buf, w, PULL_TAG)
        if final:  # the run's end: every other worker is done too
            self._wait(work, w)
        else:
            threading.Thread(target=self._reply_sent, args=(work, w, buf), daemon=True).start()

    def _reply_sent(self, work, w: int, buf: torch.Tensor) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            self.arrivals.put((w, f"its pull failed: {first_line(exc)}"))

    def _finish(self) -> None:
        """Every live worker is done: send the final parameters (a worker that died after its last
        push is dropped), agree on who is alive, tell the workers, narrow the group."""
        for w in sorted(self.live):
            try:
                self._reply(w, final=True)
            except RuntimeError as exc:
                self._drop(w, f"it is gone before its last pull ({exc})")
        alive = torch.zeros(self.rt.world_size, dtype=torch.int32)
        alive[self.servers] = 1
        alive[sorted(self.live)] = 1
        if self.server_group is not None:
            dist.all_reduce(alive, op=dist.ReduceOp.MIN, group=self.server_group)
        live = [int(r) for r in alive.nonzero().flatten()]
        if self.rt.rank == 0:
            for w in live[len(self.servers) :]:
                self._wait(self._p2p(dist.isend, alive, w, PULL_TAG), w)
        self._set_live(live)

    def _set_live(self, live: list[int]) -> None:
        if len(live) < self.rt.world_size:
            self.trainer_group = dist.new_group(live, use_local_synchronization=True)
            self.live_ranks = live
            if self.rt.rank == 0:
                print(
                    f"ps: finished with {len(live) - len(self.servers)} of {len(self.workers)} workers "
                    f"(dropped: {', '.join(str(r) for r in sorted(set(self.workers) - set(live)))})",
                    flush=True,
                )

    # -- metrics --------------------------------------------------------------------------------
    def step_metrics(self) -> dict:
        """Rank 0 logs: staleness of the gradients it applied since the last log, and per server
        pushes/s and bytes moved since the start (gathered over the servers)."""
        if not self.is_server:
            return {}
        elapsed = time.perf_counter() - self.t0
        mine = torch.tensor([self.stats.pushes, self.stats.bytes, elapsed], dtype=torch.float64)
        every = [mine]
        if self.server_group is not None:
            every = [torch.empty_like(mine) for _ in self.servers]
            dist.all_gather(every, mine, group=self.server_group)
        hist = self.stats.staleness
        n = sum(hist.values())
        out = {
            "ps_mode": self.mode,
            "staleness_mean": sum(k * v for k, v in hist.items()) / n if n else 0.0,
            "staleness_max": max(hist) if hist else 0,
            "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
            "pushes_per_s": [t[0].item() / t[2].item() for t in every],
            "bytes_moved": [int(t[1].item()) for t in every],
        }
        if self.mode == "ssp":
            out["ssp_max_gap"] = self.max_gap
        if self.stats.dropped:
            out["dropped_workers"] = list(self.stats.dropped)
        self.stats.staleness = Counter()
        return out

    def reduce_loss(self, sums: torch.Tensor) -> torch.Tensor:
        """Rank 0, a server, already holds every worker's loss: no collective (async must not sync)."""
        out, self.loss_sums = self.loss_sums, torch.zeros_like(self.loss_sums)
        return out

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self):
        """Servers write their shard and its optimizer state; workers hold nothing the servers lack."""
        if not self.is_server:
            return {}, {}
        tensors = {f"model.{n}": p.detach() for n, p in zip(self.own_names, self.shard.params)}
        meta = {"ps": {"version": self.version, "servers": len(self.servers)}}
        if self.optimizer is not None:
            opt_tensors, opt_meta = ckpt.optimizer_to_tensors(self.optimizer, self.own_names)
            tensors.update(opt_tensors)
            meta["optimizer"] = opt_meta
        return tensors, meta

    def load_state_dict(self, reader) -> None:
        """Any number of servers can resume from any other: parameters are found by name."""
        saved_servers = reader.load(rank=0)[1]["ps"]["servers"]
        tensors, metas = {}, []
        for r in range(saved_servers):
            t, m = reader.load(rank=r)
            tensors.update(t)
            metas.append(m)
        named = dict(unique_parameters(self.model))
        missing = [n for n in self.names if f"model.{n}" not in tensors]
        if missing:
            raise ckpt.CheckpointMismatch(
                "resume", "checkpoint does not match the model: missing " + ", ".join(missing)
            )
        with torch.no_grad():
            for n in self.own_names if self.is_server else self.names:
                named[n].copy_(tensors[f"model.{n}"])
        start = reader.step
        self.step_index = start
        if self.is_server:
            self.version = max(m["ps"]["version"] for m in metas)
            self.clock = dict.fromkeys(self.workers, start)
            if self.optimizer is not None:
                groups = [m["optimizer"]["param_groups"] for m in metas if "optimizer" in m]
                scalars = {k: v for m in metas if "optimizer" in m for k, v in m["optimizer"]["scalars"].items()}
                ckpt.optimizer_from_tensors(
                    self.optimizer, self.own_names, tensors, {"param_groups": groups[0], "scalars": scalars}
                )
        else:
            self.versions = [max(m["ps"]["version"] for m in metas)] * len(self.servers)

    def full_model_state(self):
        """Rank 0 gathers every server's shard (and the model's buffers from the first live worker)."""
        live = getattr(self, "live_ranks", list(range(self.rt.world_size)))
        first_worker = next(r for r in live if r not in self.servers)
        buffers = [b for _, b in self.model.named_buffers()]
        if self.rt.rank == 0:
            for s in self.servers[1:]:
                buf = self.shards[s].new_buffer()
                self._wait(self._p2p(dist.irecv, buf, s, EXPORT_TAG), s)
                for p, v in zip(self.shards[s].params, self.shards[s].views(buf)):
                    p.data = v.clone()
            if buffers:
                flat = torch.empty(sum(b.numel() for b in buffers), dtype=torch.float64)
                self._wait(self._p2p(dist.irecv, flat, first_worker, EXPORT_TAG), first_worker)
                offset = 0
                for b in buffers:
                    b.copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.is_server:
            self._wait(self._p2p(dist.isend, self.param_buf, 0, EXPORT_TAG), 0)
        elif self.rt.rank == first_worker and buffers:
            flat = torch.cat([b.detach().double().cpu().reshape(-1) for b in buffers])
            self._wait(self._p2p(dist.isend, flat, 0, EXPORT_TAG), 0)
        return None


class PushStats:
    def __init__(self):
        self.pushes = 0
        self.bytes = 0
        self.staleness: Counter = Counter()
        self.dropped: list[int] = []


def first_line(exc: Exception) -> str:
    """The gist of a gloo error: its first sentence, without the source location in front."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])
    return text.split(". ")[0]
