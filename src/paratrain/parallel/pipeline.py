"""Pipeline parallelism: the model cut into stages of consecutive layers, and the engine that runs
a schedule over them.

Splitting. The layers are `model.pipeline_layers()` (the built-in gpt: embedding, blocks, head) or
the children of an nn.Sequential. They are cut into p*v contiguous stages (v virtual stages per
rank when interleaved) minimising the most expensive stage, where a layer's cost is its measured
forward+backward time on a sample microbatch (balance = "time", measured by rank 0 and broadcast,
so every rank takes the same decision) or its parameter count (balance = "params"). A cut never
falls between a column-parallel layer and the row-parallel layer that consumes its slices.

Engine. Each rank runs its schedule's actions in order. Before an action it posts the receives of
the next few actions (so their data arrives during this one), computes, and sends its result
without waiting. The last stage computes the loss of each microbatch (scaled by 1/m so that the
summed gradients are those of the whole batch); backward of a stage starts from the gradient of
its output received from the next stage.
"""

from __future__ import annotations

import bisect
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives
from ..models.recompute import run_layers
from ..profile import NULL_PROFILER
from .pipeline_comm import P2P
from .pipeline_schedules import Action

LOOKAHEAD = 4  # actions whose receives are posted ahead of time


def pipeline_layers(model: nn.Module) -> list[nn.Module] | None:
    if hasattr(model, "pipeline_layers"):
        return list(model.pipeline_layers())
    if isinstance(model, nn.Sequential):
        return list(model)  # as forward runs them: children() lists a module used twice once
    return None


def allowed_cuts(model: nn.Module, layers: list[nn.Module], plan: dict, sync_ties: bool = False) -> list[bool]:
    """allowed[i]: may a stage end after layer i? Not inside a colwise -> rowwise pair, and not
    between two layers that share a parameter unless the engine keeps the copies in sync
    (tied_spans)."""
    name_of = {id(m): n for n, m in model.named_modules()}
    sharded, allowed = False, []
    for layer in layers:
        for module in layer.modules():
            style = plan.get(name_of.get(id(module)))
            if style == "colwise":
                sharded = True
            elif style == "rowwise":
                sharded = False
        allowed.append(not sharded)
    for first, last, _ in tied_spans(model, layers, sync_ties):
        for i in range(first, last):
            allowed[i] = False
    allowed[-1] = True
    return allowed


def shared_parameters(model: nn.Module, layers: list[nn.Module]) -> list[tuple[nn.Parameter, str, list[int], bool]]:
    """Each parameter that several layers use, such as an embedding tied to the output projection:
    (the parameter, its name, those layers, whether a module holding it is itself used by several
    layers), in layer order."""
    name_of = {id(t): n for n, t in model.named_parameters()}
    users: dict[int, list[int]] = {}
    owners: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for i, layer in enumerate(layers):
        for module in layer.modules():
            for t in module.parameters(recurse=False):
                params[id(t)] = t
                owners.setdefault(id(t), set()).add(id(module))
                if i not in users.setdefault(id(t), []):
                    users[id(t)].append(i)
    found = [
        (params[k], name_of.get(k, "?"), idx, len(owners[k]) < len(idx)) for k, idx in users.items() if len(idx) > 1
    ]
    return sorted(found, key=lambda f: (f[2], f[1]))


def tied_spans(model: nn.Module, layers: list[nn.Module], sync_ties: bool = False) -> list[tuple[int, int, str]]:
    """(first layer, last layer, parameter name) of each shared parameter whose layers must stay in
    one stage. A parameter that two modules share can be split across stages on different ranks
    when the engine sums its copies' gradients (`sync_ties`: the plain pipeline, one stage per
    rank and no tp); otherwise each stage would train its own copy apart. A module used twice
    always stays whole: moving one use's weights off a rank would take the other's with them."""
    return [
        (idx[0], idx[-1], name) for _, name, idx, reused in shared_parameters(model, layers) if reused or not sync_ties
    ]


def split_ties(
    model: nn.Module, layers: list[nn.Module], bounds: list[int]
) -> list[tuple[nn.Parameter, str, list[int]]]:
    """(parameter, name, the stages holding a copy) for each shared parameter that the cut `bounds`
    splits across stages."""
    found = []
    for param, name, idx, _ in shared_parameters(model, layers):
        stages = sorted({bisect.bisect_right(bounds, i) - 1 for i in idx})
        if len(stages) > 1:
            found.append((param, name, stages))
    return found


def partition(costs: list[float], n_stages: int, allowed: list[bool]) -> list[int]:
    """Stage boundaries [0, b1, ..., n] minimising the largest stage cost (exact, by dynamic
    programming over cut positions); every stage gets at least one layer."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest max-cost of splitting layers[:i] into k stages
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            if not allowed[i - 1]:
                continue
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], choice[k][i] = cost, j
    if best[n_stages][n] == inf:
        raise ValueError(f"cannot cut {n} layers into {n_stages} stages")
    bounds = [n]
    for k in range(n_stages, 0, -1):
        bounds.append(choice[k][bounds[-1]])
    return bounds[::-1]


def splittable_layers(model: nn.Module, plan: dict, sync_ties: bool = False) -> int:
    layers = pipeline_layers(model)
    return sum(allowed_cuts(model, layers, plan, sync_ties)) if layers else 1


def parameter_costs(layers: list[nn.Module]) -> list[float]:
    return [float(sum(p.numel() for p in layer.parameters())) + 1.0 for layer in layers]


def measured_costs(layers: list[nn.Module], sample: torch.Tensor, autocast, repeats: int = 3) -> list[float]:
    """Median forward+backward seconds of each layer on `sample`, fed through the layers in turn."""
    costs, x = [], sample
    for layer in layers:
        times = []
        for attempt in range(repeats + 1):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            with autocast():
                out = layer(inp)
            out.float().sum().backward()
            if attempt:  # the first run warms up allocators and kernels
                times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
        costs.append(statistics.median(times))
        x = out.detach()
    return costs


def decide_split(
    layers, n_stages: int, allowed, balance: str, sample_fn, autocast, device
) -> tuple[list[int], list[float]]:
    """Boundaries and per-layer costs; identical on every rank (rank 0 measures and broadcasts)."""
    if balance == "params":
        costs = parameter_costs(layers)
    else:
        costs = torch.zeros(len(layers), dtype=torch.float64)
        if dist.get_rank() == 0:
            costs = torch.tensor(measured_costs(layers, sample_fn(), autocast), dtype=torch.float64)
        if dist.get_world_size() > 1:
            costs = costs.to(device)
            collectives.broadcast(costs, 0, "pipeline-layer-costs")
        costs = costs.cpu().tolist()
    return partition(costs, n_stages, allowed), costs


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
