"""A parameter-server worker rank: forward and backward on its share of each batch, push the
gradient to every server, pull the parameters back (see ps/engine.py for the protocol).

Fault points (PARATRAIN_FAULTS, see paratrain/testing/faults.py), each at one worker's push of one step:
    ps_kill_before_pull@rank=R,step=S    the worker SIGKILLs itself after its push, before its pull
    ps_stall_before_pull@rank=R,step=S   ... stalls there for FAULT_STALL_S seconds
    ps_bad_header@rank=R,step=S          ... pushes NaN as its step, and leaves (exit 0)
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from paratrain.data.batch import feed
from paratrain.parallel.ps.wire import EXPORT_TAG, HEADER, PULL_TAG, PUSH_TAG, EngineState
from paratrain.runtime import fault_points

FAULT_STALL_S = 4.0


def straggle(compute_s: float, factor: float) -> None:
    """Make a step take `factor` times its compute time (experiments: one slow worker)."""
    if factor > 1:
        time.sleep((factor - 1) * compute_s)


class WorkerSide(EngineState):
    """The worker's half of ParameterServer (which mixes it in on ranks ps.servers and up)."""

    # (the rest of what ParameterServer sets up: wire.EngineState)

    is_server = False

    def _init_side(self) -> None:
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
        self.own_names = self.names  # a worker holds every parameter

    # -- the step -------------------------------------------------------------------------------
    def _step(self, batch, final: bool) -> torch.Tensor:
        t0 = time.perf_counter()
        for buf in self.dev_grad_bufs:
            buf.zero_()
        if self.batchnorm is not None:
            self.batchnorm.before_step()
        micro = self.micro_batches(batch)
        total = torch.zeros((), device=self.rt.device)
        for x, y in micro:
            with self.profiler.phase("forward"), self.autocast():
                loss = self.loss_fn(feed(self.model, x), y)
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
            lie = fault_points.fires("ps_bad_header", rank=self.rt.rank, step=self.step_index)
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
        if fault_points.fires("ps_kill_before_pull", rank=self.rt.rank, step=self.step_index):
            os.kill(os.getpid(), signal.SIGKILL)
        if fault_points.fires("ps_bad_header", rank=self.rt.rank, step=self.step_index):
            os._exit(0)  # no pull will answer a malformed push
        if fault_points.fires("ps_stall_before_pull", rank=self.rt.rank, step=self.step_index):
            print(
                f"ps: worker rank {self.rt.rank} stalls for {FAULT_STALL_S:g}s before its pull of step "
                f"{self.step_index + 1} (fault injection)",
                flush=True,
            )
            time.sleep(FAULT_STALL_S)

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self):
        """A worker holds nothing the servers lack."""
        return {}, {}

    def _resume(self, metas: list[dict], tensors: dict) -> None:
        self.versions = [max(m["ps"]["version"] for m in metas)] * len(self.servers)

    def model_chunks(self):
        """The first live worker sends rank 0 the model's buffers (servers hold parameters only)."""
        buffers = [b for _, b in self.model.named_buffers()]
        if self.rt.rank == self._first_live_worker() and buffers:
            flat = torch.cat([b.detach().double().cpu().reshape(-1) for b in buffers])
            self._wait(self._p2p(dist.isend, flat, 0, EXPORT_TAG), 0)
        return iter(())
