"""A parameter-server rank: holds one shard of the parameters and its optimizer, and serves the
workers' pushes (see ps/engine.py for the protocol).

Faults: async/ssp servers drop a worker whose connection breaks or that stays silent for
ps.drop_after_s (and say so), and the trainer's collectives then run over the live ranks only;
checkpoints are the servers' alone. A worker that dies or stalls after its push, before it takes
its pull, is dropped (dead) or served late (stalled) without holding up the others: each reply is
sent and waited for off the server's main thread. A push whose header is not one a worker sends
(a step other than the worker's next, a version the server never had, NaN) drops that worker.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from paratrain import checkpoint as ckpt
from paratrain.errors import say
from paratrain.fault.guard import drop_worker
from paratrain.optim import build_optimizer
from paratrain.parallel.base import clip_factor, whole_model_chunks
from paratrain.parallel.ps.wire import EXPORT_TAG, HEADER, PULL_TAG, PUSH_TAG, EngineState, first_line


class ServerSide(EngineState):
    """The server's half of ParameterServer (which mixes it in on ranks below ps.servers)."""

    # (the rest of what ParameterServer sets up: wire.EngineState)
    server_group: Any
    loss_sums: torch.Tensor
    t0: float | None

    is_server = True

    def _init_side(self) -> None:
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
        self.stats = PushStats()

    def _step(self, batch, final: bool) -> torch.Tensor:
        return self._serve_sync() if self.mode == "sync" else self._serve_async(final)

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
        try:
            work = self._p2p(dist.irecv, self.recv_bufs[w], w, PUSH_TAG)
        except RuntimeError as exc:  # its connection is gone already (a reset): dropped, as in _land
            assert self.arrivals is not None  # async: made by _serve_async
            self.arrivals.put((w, first_line(exc)))
            return
        threading.Thread(target=self._land, args=(work, w), daemon=True).start()

    def _land(self, work, w: int) -> None:
        try:
            work.wait()
            assert self.arrivals is not None  # async: made by _serve_async
            self.arrivals.put((w, None))
        except RuntimeError as exc:
            assert self.arrivals is not None  # async: made by _serve_async
            self.arrivals.put((w, first_line(exc)))

    def _drop_silent(self) -> None:
        now = time.monotonic()
        for w in sorted(self.live - self.done):
            if now - self.last_heard[w] > self.ps.drop_after_s:
                self._drop(w, f"silent for {now - self.last_heard[w]:.1f}s (> ps.drop_after_s)")

    def _drop(self, w: int, why: str) -> None:
        if w in self.held:
            self.held.remove(w)
        self.stats.dropped.append(w)
        drop_worker(
            self.live,
            w,
            lambda left: (
                f"ps: server rank {self.rt.rank} drops worker rank {w}: {why}; training goes on with {left} workers"
            ),
        )
        self._release_held()

    def _malformed(self, buf: torch.Tensor, w: int) -> str:
        """What is wrong with a push's header, "" if nothing: its step must be the worker's next,
        its version one this server has had (the loss may be anything: a non-finite one is refused)."""
        step, used = buf[0].item(), buf[1].item()
        if step != self.clock[w]:
            return f"step {step:g}, expected {self.clock[w]}"
        if not (float(used).is_integer() and 0 <= used <= self.version):
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
            say(
                f"ps: server rank {self.rt.rank} refuses worker rank {src}'s push for step {step + 1}: "
                f"non-finite loss or gradient"
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
        try:
            work = self._p2p(dist.isend, buf, w, PULL_TAG)
        except RuntimeError as exc:
            if final:  # _finish drops it
                raise
            # a worker killed between its push and its pull can reset the connection before the
            # send is even posted (seen under load): dropped like one whose pull fails later
            assert self.arrivals is not None  # async: made by _serve_async
            self.arrivals.put((w, f"its pull failed: {first_line(exc)}"))
            return
        if final:  # the run's end: every other worker is done too
            self._wait(work, w)
        else:
            threading.Thread(target=self._reply_sent, args=(work, w, buf), daemon=True).start()

    def _reply_sent(self, work, w: int, buf: torch.Tensor) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            assert self.arrivals is not None  # async: made by _serve_async
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

    # -- metrics --------------------------------------------------------------------------------
    def step_metrics(self) -> dict:
        """Rank 0 logs: staleness of the gradients it applied since the last log, and per server
        pushes/s and bytes moved since the start (gathered over the servers)."""
        assert self.t0 is not None  # set by the first step
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

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self):
        """The server's shard and its optimizer state."""
        tensors = {f"model.{n}": p.detach() for n, p in zip(self.own_names, self.shard.params)}
        meta = {"ps": {"version": self.version, "servers": len(self.servers)}}
        if self.optimizer is not None:
            opt_tensors, opt_meta = ckpt.optimizer_to_tensors(self.optimizer, self.own_names)
            tensors.update(opt_tensors)
            meta["optimizer"] = opt_meta
        return tensors, meta

    def _resume(self, metas: list[dict], tensors: dict) -> None:
        self.version = max(m["ps"]["version"] for m in metas)
        self.clock = dict.fromkeys(self.workers, self.step_index)
        if self.optimizer is not None:
            groups = [m["optimizer"]["param_groups"] for m in metas if "optimizer" in m]
            scalars = {k: v for m in metas if "optimizer" in m for k, v in m["optimizer"]["scalars"].items()}
            ckpt.optimizer_from_tensors(
                self.optimizer, self.own_names, tensors, {"param_groups": groups[0], "scalars": scalars}
            )

    def model_chunks(self):
        """Rank 0 gathers every server's shard (and the model's buffers from the first live worker)."""
        buffers = [b for _, b in self.model.named_buffers()]
        if self.rt.rank != 0:
            self._wait(self._p2p(dist.isend, self.param_buf, 0, EXPORT_TAG), 0)
            return iter(())
        for s in self.servers[1:]:
            buf = self.shards[s].new_buffer()
            self._wait(self._p2p(dist.irecv, buf, s, EXPORT_TAG), s)
            for p, v in zip(self.shards[s].params, self.shards[s].views(buf)):
                p.data = v.clone()
        if buffers:
            first_worker = self._first_live_worker()
            flat = torch.empty(sum(b.numel() for b in buffers), dtype=torch.float64)
            self._wait(self._p2p(dist.irecv, flat, first_worker, EXPORT_TAG), first_worker)
            offset = 0
            for b in buffers:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
        return whole_model_chunks(self.model)


class PushStats:
    def __init__(self):
        self.pushes = 0
        self.bytes = 0
        self.staleness: Counter = Counter()
        self.dropped: list[int] = []
