"""Parameter servers: the first `ps.servers` ranks hold the parameters and run the optimizer, the
other ranks are workers that compute gradients on their share of each batch.

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

Code: this module is what both roles share (setup, the step's frame, the point-to-point calls and
their failures, resume); ps/server.py and ps/worker.py are each role's half, mixed in by
ParameterServer on the ranks of that role; ps/wire.py is the messages' layout.

Faults: async/ssp servers drop workers that die or fall silent (ps/server.py); a worker process that
crashes is kept from failing the whole job by `guard_worker` (its parent reports the death and
leaves cleanly, so the elastic agent lets the others go on). A sync server, or a worker whose server does not answer within parallel.timeout_s,
fails with a message naming the missing rank.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from paratrain import checkpoint as ckpt
from paratrain.comm import grid
from paratrain.fault import guard
from paratrain.optim import set_lr
from paratrain.parallel.base import Strategy, unique_parameters
from paratrain.parallel.dp.batchnorm import BatchNormPolicy
from paratrain.parallel.ps.server import ServerSide
from paratrain.parallel.ps.wire import FlatShard, assign_shards, first_line
from paratrain.parallel.ps.worker import WorkerSide
from paratrain.runtime import fault_points


class ParameterServer(Strategy):
    name = "ps"
    # each side's own (ps/server.py, ps/worker.py), mixed in by _ServerRank and _WorkerRank below
    is_server: bool
    own_names: list[str]
    _init_side: Callable[[], None]
    _step: Callable[[Any, bool], torch.Tensor]
    _resume: Callable[[list[dict], dict], None]

    def __new__(cls, model, loss_fn, cfg, rt):
        """A rank is a server or a worker for the whole run: the class of its side is picked here."""
        return super().__new__(_ServerRank if rt.rank < cfg.ps.servers else _WorkerRank)

    def __init__(self, model, loss_fn, cfg, rt):
        # Servers keep their shard and optimizer in host memory, the classic design; workers compute
        # on their device. All ps traffic is gloo point-to-point on host buffers (NCCL has no
        # receive that can be waited on from a thread), so on GPUs it gets a gloo group of its own.
        super().__init__(model if self.is_server else model.to(rt.device), loss_fn, cfg, rt)
        self.comm_group = None if rt.backend == "gloo" else grid.host_group()
        self.ps = cfg.ps
        self.mode = cfg.ps.mode
        self.servers = list(range(cfg.ps.servers))
        self.workers = list(range(cfg.ps.servers, rt.world_size))
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
        self.server_group = grid.subgroup(self.servers, backend="gloo") if len(self.servers) > 1 else None
        if self.mode != "sync":
            # Only servers hold state, and async workers must not wait for a checkpoint (nor for a
            # dropped worker at one): the servers write it among themselves.
            self.checkpoint_ranks, self.checkpoint_group = len(self.servers), self.server_group
            self.lockstep = False
        # sync: the workers step together, so their batch norm spans the global batch (dp/batchnorm.py)
        if self.mode == "sync" and len(self.workers) > 1:
            group = grid.subgroup(self.workers)
            if not self.is_server:
                self.batchnorm = BatchNormPolicy(model, cfg.parallel.sync_batchnorm, group)
        self.step_index = 0  # the trainer step the next train_step is for
        self.total_steps = cfg.train.steps
        self.t0: float | None = None  # first step: pushes/s count from there
        self._init_side()

    def set_lr(self, lr: float) -> None:
        if self.optimizer is not None:
            set_lr(self.optimizer, lr)

    # -- the step -------------------------------------------------------------------------------
    def train_step(self, batch) -> torch.Tensor:
        self.t0 = self.t0 or time.perf_counter()
        if fault_points.fires("ps_vanish", rank=self.rt.rank, step=self.step_index):  # tests: leave with exit 0
            print(f"ps: {self._role(self.rt.rank)} vanishes at step {self.step_index} (fault injection)", flush=True)
            os._exit(0)
        if fault_points.fires("ps_kill", rank=self.rt.rank, step=self.step_index):  # tests: a crash
            os.kill(os.getpid(), signal.SIGKILL)
        final = self.step_index == self.total_steps - 1
        loss = self._step(batch, final)
        self.step_index += 1
        return loss

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

    def _set_live(self, live: list[int]) -> None:
        if len(live) < self.rt.world_size:
            self.trainer_group = grid.live_group(live)
            self.live_ranks = live
            if self.rt.rank == 0:
                print(
                    f"ps: finished with {len(live) - len(self.servers)} of {len(self.workers)} workers "
                    f"(dropped: {', '.join(str(r) for r in sorted(set(self.workers) - set(live)))})",
                    flush=True,
                )

    def reduce_loss(self, sums: torch.Tensor) -> torch.Tensor:
        """Rank 0, a server, already holds every worker's loss: no collective (async must not sync)."""
        out, self.loss_sums = self.loss_sums, torch.zeros_like(self.loss_sums)
        return out

    # -- state ----------------------------------------------------------------------------------
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
            for n in self.own_names:
                named[n].copy_(tensors[f"model.{n}"])
        self.step_index = reader.step
        self._resume(metas, tensors)

    def _first_live_worker(self) -> int:
        """The worker that hands rank 0 the model's buffers at the export."""
        live = getattr(self, "live_ranks", list(range(self.rt.world_size)))
        return next(r for r in live if r not in self.servers)


class _ServerRank(ServerSide, ParameterServer):
    """A rank below ps.servers."""


class _WorkerRank(WorkerSide, ParameterServer):
    """A rank from ps.servers on."""
