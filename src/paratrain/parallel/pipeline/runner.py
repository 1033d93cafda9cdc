"""Pipeline parallelism: the runner of a schedule over the stages of a model cut by
pipeline/cut.py.

Each rank runs its schedule's actions in order. Before an action it posts the receives of
the next few actions (so their data arrives during this one), computes, and sends its result
without waiting. The last stage computes the loss of each microbatch (scaled by 1/m so that the
summed gradients are those of the whole batch); backward of a stage starts from the gradient of
its output received from the next stage.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from paratrain.data.batch import feed
from paratrain.models.recompute import run_layers
from paratrain.parallel.pipeline.comm import P2P
from paratrain.parallel.pipeline.schedules import Action
from paratrain.profile import NULL_PROFILER

LOOKAHEAD = 4  # actions whose receives are posted ahead of time


class StageChunk(nn.Module):
    """Consecutive layers of the model that one rank runs as one virtual stage."""

    def __init__(self, layers: list[nn.Module], recompute: str = "none"):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.recompute = recompute  # train.recompute: "full" or "selective" checkpoints each block

    def forward(self, x):
        layers = list(self.layers)
        if not isinstance(x, torch.Tensor):  # the first stage's batch, as the model would take it
            x, layers = feed(layers[0], x), layers[1:]
        return run_layers(layers, x, self.recompute)


class PipelineRunner:
    """Runs a schedule's actions over this rank's chunks, moving tensors to and from neighbours."""

    def __init__(
        self,
        chunks: list[nn.Module],
        stage_ids: list[int],
        n_stages: int,
        stage_rank,
        group,
        boundary_shapes,
        device: torch.device,
        timeout_s: float,
    ):
        self.chunks, self.stage_ids, self.n_stages = chunks, stage_ids, n_stages
        self.stage_rank = stage_rank  # virtual stage -> global rank holding it
        self.boundary_shapes = boundary_shapes  # microbatch input -> [(shape, dtype) entering stage s]
        self.device = device
        neighbours = {stage_rank(t) for s in stage_ids for t in (s - 1, s + 1) if 0 <= t < n_stages}
        self.p2p = P2P(group, n_stages, neighbours, timeout_s)
        self.timeline: list[tuple[str, float, float]] | None = None  # (F | B | step, start, end) if recording
        self.profiler = NULL_PROFILER  # forward/backward per microbatch, idle = waiting on a neighbour
        # Receive buffers that are done with, by (shape, dtype), for the next receives: taking one
        # costs a few microseconds where torch.empty right after heavy compute costs 10-20
        self.spare_buffers: dict[tuple, list[torch.Tensor]] = {}

    def _buffer(self, shape, dtype) -> torch.Tensor:
        spare = self.spare_buffers.get((shape, dtype))
        return spare.pop() if spare else torch.empty(shape, dtype=dtype, device=self.device)

    def _give_back(self, buf: torch.Tensor) -> None:
        """`buf` (a receive buffer) is referenced by nothing that will read it again."""
        buf.grad = None
        buf.requires_grad_(False)  # an activation's buffer may next receive a gradient
        self.spare_buffers.setdefault((buf.shape, buf.dtype), []).append(buf)

    def run(
        self,
        actions: list[Action],
        inputs: list[torch.Tensor],
        targets: list[torch.Tensor],
        loss_fn,
        autocast,
        train: bool,
        before_backward=None,
    ) -> list:
        """Returns, on the last stage, each microbatch's loss (train) or loss_fn's value (eval).

        One pass over the schedule's actions, in three phases:
            warm-up     post the receives of the first LOOKAHEAD actions
            steady      per action: wait for its input, compute, send without waiting, post the
                        receives LOOKAHEAD actions ahead, free what a backward is done with
            cool-down   wait for the last sends
        """
        step = _StepRun(self, actions, inputs, targets, loss_fn, autocast, train, before_backward)
        t_begin = time.perf_counter()
        step.post(LOOKAHEAD, [])  # warm-up
        for i, a in enumerate(actions):  # steady
            t0, sends, freed = step.forward(a) if a.kind == "F" else step.backward(a)
            if self.timeline is not None:
                self.timeline.append((a.kind, t0, time.perf_counter()))
            step.post(i + 1 + LOOKAHEAD, sends)
            # After a backward its receive buffers are free: the graph is gone and x.grad is in the
            # neighbour's ring. Not while a torch.distributed send is in flight, which may still be
            # reading a tensor that shares memory with one of them (a stage that returns its input)
            if freed and not self.p2p.sends_in_flight():
                for buf in freed:
                    self._give_back(buf)
        with self.profiler.phase("comm"):  # cool-down: the last sends' completion
            self.p2p.finish()
        if self.timeline is not None:
            self.timeline.append(("step", t_begin, time.perf_counter()))
        return step.results


class _StepRun:
    """One step's state on one rank: the receives posted ahead, the activations saved for
    backward, the last stage's results."""

    def __init__(self, runner: PipelineRunner, actions, inputs, targets, loss_fn, autocast, train, before_backward):
        self.runner, self.actions, self.inputs, self.targets = runner, actions, inputs, targets
        self.loss_fn, self.autocast, self.train, self.before_backward = loss_fn, autocast, train, before_backward
        self.shapes = [runner.boundary_shapes(x) for x in inputs]
        self.first, self.last = 0, runner.n_stages - 1
        self.recv_work: dict[Action, tuple[torch.Tensor, Any]] = {}  # (buffer, its pending receive)
        self.saved: dict[tuple[int, int], tuple] = {}
        self.results: list = [None] * len(inputs)
        self.posted = 0

    def _needs_recv(self, a: Action):
        r, s = self.runner, self.runner.stage_ids[a.chunk]
        if a.kind == "F" and s != self.first:
            shape, dtype = self.shapes[a.mb][s]
            return r._buffer(shape, dtype), r.stage_rank(s - 1), r.p2p.tag(P2P.ACTIVATION, s - 1, a.mb)
        if a.kind == "B" and s != self.last:
            shape, dtype = self.shapes[a.mb][s + 1]
            return r._buffer(shape, dtype), r.stage_rank(s + 1), r.p2p.tag(P2P.GRADIENT, s, a.mb)
        return None

    def post(self, upto: int, sends: list) -> None:
        """Start `sends` and the receives of the actions before `upto` not posted yet."""
        recvs, keys = [], []
        while self.posted < min(upto, len(self.actions)):
            a = self.actions[self.posted]
            if (r := self._needs_recv(a)) is not None:
                recvs.append(r)
                keys.append(a)
            self.posted += 1
        prof = self.runner.profiler
        for t, _, _ in sends:
            prof.comm("send", t)
        for buf, _, _ in recvs:
            prof.comm("recv", buf)
        works = self.runner.p2p.post(sends, recvs)
        for a, (buf, _, _), w in zip(keys, recvs, works):
            self.recv_work[a] = (buf, w)

    def _received(self, a: Action) -> torch.Tensor:
        buf, work = self.recv_work.pop(a)
        with self.runner.profiler.phase("idle"):  # the pipeline's bubble: the neighbour has not sent it yet
            work.wait()
        return buf

    def forward(self, a: Action) -> tuple[float, list, list]:
        """(its start, the sends, the buffers freed: none)."""
        r, s = self.runner, self.runner.stage_ids[a.chunk]
        x = self.inputs[a.mb] if s == self.first else self._received(a)
        t0 = time.perf_counter()
        if self.train and s != self.first:
            x.requires_grad_()
        with r.profiler.phase("forward", a.mb):
            with self.autocast():
                chunk = r.chunks[a.chunk]  # the whole model without pp: it takes the batch as given
                out = chunk(x) if isinstance(chunk, StageChunk) else feed(chunk, x)
            value = self.loss_fn(out, self.targets[a.mb]) if s == self.last else None
        if s == self.last:
            self.results[a.mb] = value
            if self.train:
                assert value is not None  # the last stage computed the loss
                self.saved[(a.chunk, a.mb)] = (x, value / len(self.inputs))
            return t0, [], []
        if self.train:
            self.saved[(a.chunk, a.mb)] = (x, out)
        _, dtype = self.shapes[a.mb][s + 1]
        # Sent as it is (P2P only reads it) unless the dtype differs: right after heavy compute
        # every tensor op costs several microseconds, and actions are many
        sent = out if out.dtype == dtype else out.to(dtype)
        return t0, [(sent, r.stage_rank(s + 1), r.p2p.tag(P2P.ACTIVATION, s, a.mb))], []

    def backward(self, a: Action) -> tuple[float, list, list]:
        """(its start, the sends, the receive buffers it is done with)."""
        r, s = self.runner, self.runner.stage_ids[a.chunk]
        x, out = self.saved.pop((a.chunk, a.mb))
        received_grad = grad = None if s == self.last else self._received(a)
        if grad is not None and grad.dtype != out.dtype:
            grad = grad.to(out.dtype)
        t0 = time.perf_counter()
        with r.profiler.phase("backward", a.mb):
            if self.before_backward is not None:
                self.before_backward(a)
            torch.autograd.backward(out, grad)
        sends = [] if s == self.first else [(x.grad, r.stage_rank(s - 1), r.p2p.tag(P2P.GRADIENT, s - 1, a.mb))]
        freed = [buf for buf in (received_grad, None if s == self.first else x) if buf is not None]
        return t0, sends, freed
