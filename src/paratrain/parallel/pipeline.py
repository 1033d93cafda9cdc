"""Pipeline parallelism: the engine that runs a schedule over the stages of a model cut by
pipeline_cut.py.

Each rank runs its schedule's actions in order. Before an action it posts the receives of
the next few actions (so their data arrives during this one), computes, and sends its result
without waiting. The last stage computes the loss of each microbatch (scaled by 1/m so that the
summed gradients are those of the whole batch); backward of a stage starts from the gradient of
its output received from the next stage.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..models.recompute import run_layers
from ..profile import NULL_PROFILER
from .pipeline_comm import P2P
from .pipeline_schedules import Action

LOOKAHEAD = 4  # actions whose receives are posted ahead of time


class StageChunk(nn.Module):
    """Consecutive layers of the model that one rank runs as one virtual stage."""

    def __init__(self, layers: list[nn.Module], recompute: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.recompute = recompute  # train.recompute = "full": each block of the chunk checkpointed

    def forward(self, x):
        return run_layers(list(self.layers), x, self.recompute)


class PipelineEngine:
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
        """Returns, on the last stage, each microbatch's loss (train) or loss_fn's value (eval)."""
        m = len(inputs)
        shapes = [self.boundary_shapes(x) for x in inputs]
        first, last = 0, self.n_stages - 1
        recv_work: dict[tuple, tuple[torch.Tensor, object]] = {}
        saved: dict[tuple[int, int], tuple] = {}
        results: list = [None] * m
        posted = 0
        prof = self.profiler

        def needs_recv(a: Action):
            s = self.stage_ids[a.chunk]
            if a.kind == "F" and s != first:
                shape, dtype = shapes[a.mb][s]
                return self._buffer(shape, dtype), self.stage_rank(s - 1), self.p2p.tag(P2P.ACTIVATION, s - 1, a.mb)
            if a.kind == "B" and s != last:
                shape, dtype = shapes[a.mb][s + 1]
                return self._buffer(shape, dtype), self.stage_rank(s + 1), self.p2p.tag(P2P.GRADIENT, s, a.mb)
            return None

        def post(upto: int, sends: list) -> None:
            nonlocal posted
            recvs, keys = [], []
            while posted < min(upto, len(actions)):
                a = actions[posted]
                if (r := needs_recv(a)) is not None:
                    recvs.append(r)
                    keys.append(a)
                posted += 1
            for t, _, _ in sends:
                prof.comm("send", t)
            for buf, _, _ in recvs:
                prof.comm("recv", buf)
            works = self.p2p.post(sends, recvs)
            for a, (buf, _, _), w in zip(keys, recvs, works):
                recv_work[a] = (buf, w)

        def received(a: Action) -> torch.Tensor:
            buf, work = recv_work.pop(a)
            with prof.phase("idle"):  # the pipeline's bubble: the neighbour has not sent it yet
                work.wait()
            return buf

        t_begin = time.perf_counter()
        post(LOOKAHEAD, [])
        for i, a in enumerate(actions):
            s = self.stage_ids[a.chunk]
            t0 = time.perf_counter()
            if a.kind == "F":
                x = inputs[a.mb] if s == first else received(a)
                t0 = time.perf_counter()
                if train and s != first:
                    x.requires_grad_()
                with prof.phase("forward", a.mb):
                    with autocast():
                        out = self.chunks[a.chunk](x)
                    value = loss_fn(out, targets[a.mb]) if s == last else None
                sends = []
                if s == last:
                    results[a.mb] = value
                    if train:
                        saved[(a.chunk, a.mb)] = (x, value / m)
                else:
                    _, dtype = shapes[a.mb][s + 1]
                    # Sent as it is (P2P only reads it) unless the dtype differs: right after heavy
                    # compute every tensor op costs several microseconds, and actions are many
                    sends.append(
                        (
                            out if out.dtype == dtype else out.to(dtype),
                            self.stage_rank(s + 1),
                            self.p2p.tag(P2P.ACTIVATION, s, a.mb),
                        )
                    )
                    if train:
                        saved[(a.chunk, a.mb)] = (x, out)
            else:
                x, out = saved.pop((a.chunk, a.mb))
                received_grad = grad = None if s == last else received(a)
                if grad is not None and grad.dtype != out.dtype:
                    grad = grad.to(out.dtype)
                t0 = time.perf_counter()
                with prof.phase("backward", a.mb):
                    if before_backward is not None:
                        before_backward(a)
                    torch.autograd.backward(out, grad)
                sends = []
                if s != first:
                    sends.append((x.grad, self.stage_rank(s - 1), self.p2p.tag(P2P.GRADIENT, s - 1, a.mb)))
            if self.timeline is not None:
                self.timeline.append((a.kind, t0, time.perf_counter()))
            post(i + 1 + LOOKAHEAD, sends)
            # After a backward its receive buffers are free: the graph is gone and x.grad is in the
            # neighbour's ring. Not while a torch.distributed send is in flight, which may still be
            # reading a tensor that shares memory with one of them (a stage that returns its input)
            if a.kind == "B" and not self.p2p.sends_in_flight():
                if received_grad is not None:
                    self._give_back(received_grad)
                if s != first:
                    self._give_back(x)
        with prof.phase("comm"):  # the last sends' completion
            self.p2p.finish()
        if self.timeline is not None:
            self.timeline.append(("step", t_begin, time.perf_counter()))
        return results


def boundary_shape_fn(meta_layers: list[list[nn.Module]]):
    """Shapes and dtypes of the activation entering each virtual stage, for a microbatch input,
    found by running the unsplit model on the meta device (no memory, no communication)."""
    cache: dict[tuple, list] = {}

    def shapes(x: torch.Tensor) -> list[tuple[torch.Size, torch.dtype]]:
        key = (tuple(x.shape), x.dtype)
        if key not in cache:
            out, act = [], torch.empty(x.shape, dtype=x.dtype, device="meta")
            with torch.no_grad():
                for layers in meta_layers:
                    out.append((act.shape, act.dtype))
                    for layer in layers:
                        act = layer(act)
            cache[key] = out
        return cache[key]

    return shapes
