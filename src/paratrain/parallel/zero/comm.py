"""ZeRO's pieces of communication: flat units of parameters, and the gradient reduce-scatters.

A *unit* is a group of parameters that is gathered and sharded together: one flat space, padded to a
multiple of the world size, cut into equal contiguous shards, shard r on rank r:

    unit flat space   | p0 ....... | p1 .. | p2 ............ |pad|
    shards            |  rank 0    |  rank 1    |  rank 2    |      (numel / world each)

Stages 1 and 2 make one unit per gradient bucket (dp's `make_buckets`: reverse registration order,
`parallel.bucket_mb` each); stage 3 one per module (see zero/gather.py).

Collectives. On NCCL, reduce-scatter and all-gather are the native ones (in place: the output is the
rank's slice of the input). Gloo has both too, but measured here on a 64 MB flat buffer at world 2
they are the slowest way to do the job and each allocates a full-size temporary (which would undo
the memory ZeRO saves), so on gloo we build them from in-place primitives:
    all-gather      = one broadcast per rank of its chunk, straight into the flat buffer
                      (~80 ms vs ~260 ms for all_gather_into_tensor, no temporary)
    reduce-scatter  = all_reduce of the flat buffer in place, then keep our chunk
                      (~105 ms vs ~240 ms, no temporary; twice the bytes on the wire, which on
                      loopback costs less than gloo's reduce-scatter does)
"""

from __future__ import annotations

import os
from collections import deque
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm import collectives
from paratrain.comm.collectives import Handle
from paratrain.parallel.codecs.basic import CAST_DTYPES
from paratrain.parallel.dp.engine import Bucket, GradientReducer, make_buckets


def from_primitives(backend: str) -> bool:
    """Whether to build reduce-scatter and all-gather from in-place primitives (an all-reduce; one
    broadcast per chunk), as gloo needs. PARATRAIN_NATIVE_COLLECTIVES=1 takes the native ones
    (NCCL's path) on gloo too, so that a CPU test covers that path."""
    return backend == "gloo" and os.environ.get("PARATRAIN_NATIVE_COLLECTIVES", "0") != "1"


def _on_gloo(group) -> bool:
    return from_primitives(dist.get_backend(group))


def reduce_scatter(output: torch.Tensor, flat: torch.Tensor, what: str, group, wire_dtype=None) -> Handle:
    """Async: `output` (this rank's chunk of `flat`, or a tensor of its size) gets the chunk's sum.
    `wire_dtype` (parallel.compression bf16 | fp16): reduce a 16-bit copy, half the bytes."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if wire_dtype is not None and wire_dtype != flat.dtype:
        small = flat.to(wire_dtype)
        own_small = small.chunk(world)[rank]
        return Handle(
            [reduce_scatter(own_small, small, f"{what}-{wire_dtype}", group)], then=lambda: output.copy_(own_small)
        )
    if not _on_gloo(group):
        return Handle([collectives.reduce_scatter(output, flat, what, group=group, async_op=True)])
    own = flat.chunk(world)[rank]
    same = output.data_ptr() == own.data_ptr()
    return Handle(
        [collectives.all_reduce(flat, what, group=group, async_op=True)],
        then=None if same else lambda: output.copy_(own),
    )


def all_gather(flat: torch.Tensor, shard: torch.Tensor, what: str, group) -> Handle:
    """Async: every rank's `shard` into its chunk of `flat` (`shard` may be our chunk of `flat` itself)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if not _on_gloo(group):
        return Handle([collectives.all_gather_into(flat, shard, what, group=group, async_op=True)])
    chunks = flat.chunk(world)
    if chunks[rank].data_ptr() != shard.data_ptr():
        chunks[rank].copy_(shard)
    return Handle(
        [
            collectives.broadcast(
                c,
                dist.get_global_rank(group, i) if group is not None else i,
                f"{what}-from-{i}",
                group=group,
                async_op=True,
            )
            for i, c in enumerate(chunks)
        ]
    )


def working_dtype(cfg, dtype: torch.dtype, stage: int) -> torch.dtype:
    """The dtype of a unit's working parameters and gradients: bf16 under mixed precision
    (train.precision = "bf16", every stage), else the model's own."""
    return torch.bfloat16 if cfg.train.precision == "bf16" and dtype.is_floating_point else dtype


def bucket_groups(params: list[nn.Parameter], cfg, world: int) -> list[list[nn.Parameter]]:
    """Stages 1 and 2: the parameters of each unit, dp's buckets of parallel.bucket_mb of working
    parameters (under mixed precision, the buckets stage 1's reducer makes of the bf16 ones)."""
    if not params:
        return []
    scale = params[0].element_size() / working_dtype(cfg, params[0].dtype, 1).itemsize
    bucket_bytes = int(cfg.parallel.bucket_mb * 2**20 * scale)
    # the parameters given, grouped (dp's buckets hold any tensors: the type checker is told so)
    return [cast(list[nn.Parameter], b.params) for b in make_buckets(params, bucket_bytes, torch.device("meta"), world)]


class FlatUnit:
    """Parameters gathered and sharded together (see the module docstring for the layout)."""

    # set by the stage that uses them: zero3's gatherer (gather.py), the engine's parameter sync,
    # stage 2's reducer (below)
    state: str  # "free", "gathering" or "gathered"
    gather_work: Handle | None
    version: int  # of the gathered storage, kept across its frees
    sync_work: Handle
    grad_shard: torch.Tensor

    def __init__(
        self,
        index: int,
        params: list[nn.Parameter],
        names: list[str],
        rank: int,
        world: int,
        device: torch.device,
        module: nn.Module | None = None,
        group=None,
        divisor: int = 0,
    ):
        """`group`: the ranks sharing the unit (`rank` of `world` there; None: the default group);
        its gradients are summed there, each divided by `divisor` first (0: by `world`, a mean)."""
        self.index, self.params, self.names, self.module = index, params, names, module
        self.group, self.divisor = group, divisor or world
        self.trains = True  # False: zero3's frozen parameters, gathered like any but given no gradient
        self.dtype, self.device = params[0].dtype, device
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        used = sum(self.numels)
        self.numel = -(-used // world) * world
        self.shard_numel = self.numel // world
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        # set by the engine's allocation, before any other use:
        self.full: torch.Tensor  # the whole flat parameter (views: the module's params)
        self.shard: nn.Parameter  # this rank's slice of the working parameters
        # what the optimizer steps: the shard itself, or its full-precision master copy (mixed precision)
        self.master: torch.Tensor
        # what the optimizer updates: (param index, start, end, at as in own_pieces, the piece of
        # the master as a parameter of its own), so an optimizer's param groups can follow the model's
        self.pieces: list[tuple[int, int, int, int, nn.Parameter]] = []
        self.grad_held = True  # whether the gradient shard has storage (a reducer lets it go between steps)
        self.grad_full: torch.Tensor | None = None  # the whole flat gradient, while it is being reduced
        self.grads: list[torch.Tensor | None] = [None] * len(params)  # or each gradient, reduced in place
        self.pending = len(params)
        self.work: Handle | None = None

    def own_pieces(self):
        """(param index, start, end within the flattened parameter, start within the shard) of what this rank owns."""
        for i, (offset, numel) in enumerate(zip(self.offsets, self.numels)):
            start, end = max(self.lo, offset), min(self.hi, offset + numel)
            if start < end:
                yield i, start - offset, end - offset, start - self.lo

    def copy_own(self, target: torch.Tensor, i: int, flat: torch.Tensor) -> None:
        """This rank's pieces of parameter i (`flat`: the whole of it, flattened) into `target`, a
        tensor the size of the rank's shard."""
        for j, start, end, at in self.own_pieces():
            if j == i:
                with torch.no_grad():
                    target[at : at + end - start].copy_(flat[start:end])

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def full_nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class ShardReducer(GradientReducer):
    """Stage 1: dp's reducer (persistent buckets, p.grad views, in-order overlapped launch), but each
    bucket is reduce-scattered in place: afterwards this rank's slice of it holds the average (the
    rest is whatever the collective left there, and unused)."""

    def __init__(self, params, bucket_mb, device, group=None, wire_dtype=None, divisor: int = 0):
        """`divisor`: of each gradient before the sum (0: the group's size, a mean; FlatUnit's)."""
        super().__init__(params, bucket_mb, device, group, pad_to=dist.get_world_size(group))
        self.rank = dist.get_rank(group)
        self.wire_dtype = wire_dtype
        self.divisor = divisor or self.world

    def own_slice(self, b: Bucket) -> torch.Tensor:
        size = b.numel // self.world
        assert b.buffer is not None  # allocated for this backward
        return b.buffer[self.rank * size : (self.rank + 1) * size]

    def finish(self) -> torch.Tensor:
        """Alone nothing is reduce-scattered (GradientReducer), but a divisor other than the group's
        size (an expert's: zero/experts.py) still applies."""
        if self.world == 1 and self.divisor != 1 and self.sync:
            for b in self.buckets:
                assert b.buffer is not None  # allocated for this backward
                b.buffer.div_(self.divisor)
        return super().finish()

    def _communicate(self, b: Bucket):
        assert b.buffer is not None  # allocated for this backward
        b.buffer.div_(self.divisor)
        return reduce_scatter(self.own_slice(b), b.buffer, f"zero-grad-bucket-{b.index}", self.group, self.wire_dtype)


class StreamingShardReducer:
    """Stages 2 and 3: full gradients exist only briefly, per unit, while they are reduce-scattered.

        backward:  grad of p ready -> copy into its unit's flat gradient, p.grad = None -> unit complete
                   -> async reduce-scatter, which overlaps the backward compute of the next unit's
                   gradients -> the next unit's first gradient arrives: wait, add into the grad shard,
                   free, and only then allocate the next unit's flat gradient
    so at most one full unit of gradients exists at a time (besides autograd's own temporary).
    Every micro-batch of an accumulation reduces (the shard accumulates), so no full gradient
    outlives its unit's backward. `in_order` (stage 2) launches units strictly by index like dp, which
    keeps unused parameters from hanging; stage 3 launches as units complete (its per-module units
    have no fixed backward order), which is the same order on every rank since the graph is.
    `on_launch(unit)` runs when a unit's gradients are all in (stage 3 frees its parameters then).

    `in_place` (stage 3), where the reduce-scatter is an all-reduce anyway (gloo, see the module
    docstring): no flat copy. Each gradient is all-reduced where autograd left it and this rank's
    pieces are taken from it, so a unit's gradients take their own bytes once instead of twice
    while they are copied. `live_bytes` counts the gradients held; `drain()` completes what is in
    flight (stage 3's gatherer calls it when a unit's backward would not fit beside them).
    """

    def __init__(
        self,
        units: list[FlatUnit],
        group=None,
        in_order: bool = True,
        on_launch=None,
        wire_dtype=None,
        in_place: bool = False,
    ):
        self.units, self.in_order = units, in_order
        self.wire_dtype = wire_dtype
        # `group`: the default one of the units', for its backend (each unit reduces over its own)
        self.in_place = in_place and _on_gloo(group)
        self.slot_of = {id(p): (u, i) for u in units for i, p in enumerate(u.params)}
        self.on_launch = on_launch or (lambda unit: None)
        self.launched: deque[FlatUnit] = deque()
        self.live_bytes = self.peak_bytes = 0  # full gradients alive at once (for the memory benchmark)
        self.next_to_launch = 0
        self.accumulate = False
        for u in units:
            u.grad_shard = torch.zeros(u.shard_numel, dtype=u.dtype, device=u.device)
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def zero_grad(self) -> None:
        """The gradient shards go until backward makes them again (_hold_shard, as each unit's
        reduction completes): from a step to the next backward, the units the forward gathers do
        not sit beside them (under zero3, the model's gradient shards at once: its peak in the
        forward, and in the backward all but the shards still to come). Their views (the
        optimizer's pieces' gradients, a user's ShardedGrads) stay bound, as a unit's full
        parameters' do to its freed storage."""
        for u in self.units:
            u.grad_shard.untyped_storage().resize_(0)
            u.grad_held = False

    @staticmethod
    def _hold_shard(unit: FlatUnit) -> None:
        """The unit's gradient shard, zeros, before a backward's first reduction into it."""
        if not unit.grad_held:
            unit.grad_shard.untyped_storage().resize_(unit.grad_shard.numel() * unit.grad_shard.element_size())
            unit.grad_shard.zero_()
            unit.grad_held = True

    def prepare(self, accumulate: bool) -> None:
        """Before each backward: `accumulate` adds to the grad shards instead of overwriting them."""
        self.accumulate = accumulate
        self.next_to_launch = 0
        for u in self.units:
            u.pending, u.work, u.grad_full, u.grads = len(u.params), None, None, [None] * len(u.params)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        unit, i = self.slot_of[id(p)]
        if self.in_place:
            if unit.pending == len(unit.params):  # the unit's first gradient: hand the previous ones over
                self.drain()
            assert p.grad is not None  # its gradient is ready
            unit.grads[i] = p.grad
            self._count(p.grad.nbytes)
        else:
            if unit.grad_full is None:
                self._allocate(unit)
            assert unit.grad_full is not None and p.grad is not None
            unit.grad_full[unit.offsets[i] : unit.offsets[i] + unit.numels[i]].copy_(p.grad.reshape(-1))
        p.grad = None
        unit.pending -= 1
        if unit.pending == 0:
            if self.in_order:
                self._launch_in_order(only_ready=True)
            else:
                self._launch(unit)

    def _launch_in_order(self, only_ready: bool) -> None:
        while self.next_to_launch < len(self.units):
            unit = self.units[self.next_to_launch]
            if only_ready and unit.pending:
                return
            self._launch(unit)
            self.next_to_launch += 1

    def _launch(self, unit: FlatUnit) -> None:
        if self.in_place:
            unit.work = self._all_reduce_each(unit)
        else:
            if unit.grad_full is None:  # no gradient reached this unit in this backward (same on all ranks)
                self._allocate(unit)
            assert unit.grad_full is not None
            unit.grad_full.div_(unit.divisor)
            own = unit.grad_full[unit.lo : unit.hi]
            unit.work = reduce_scatter(
                own,
                unit.grad_full,
                f"zero-grad-unit-{unit.index}",
                unit.group,  # in place
                self.wire_dtype,
            )
        self.on_launch(unit)
        self.launched.append(unit)

    def _all_reduce_each(self, unit: FlatUnit) -> Handle:
        """Average each gradient of `unit` where it lies; a parameter no gradient reached in this
        backward (the same on every rank: the graph is) contributes zeros and sends nothing."""
        works = []
        for i, g in enumerate(unit.grads):
            if g is None:
                continue
            g.div_(unit.divisor)
            if self.wire_dtype is not None and self.wire_dtype != g.dtype:
                unit.grads[i] = small = g.to(self.wire_dtype)
                self._count(small.nbytes - g.nbytes)  # the full-precision gradient is freed
                g = small
            works.append(collectives.all_reduce(g, f"zero-grad-unit-{unit.index}-{i}", group=unit.group, async_op=True))
        return Handle(works)

    def _count(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _allocate(self, unit: FlatUnit) -> None:
        self.drain()  # hand the previous unit over first: one full gradient at a time
        unit.grad_full = torch.zeros(unit.numel, dtype=unit.dtype, device=unit.device)
        self._count(unit.full_nbytes())

    def _complete(self, unit: FlatUnit) -> None:
        assert unit.work is not None  # launched
        unit.work.wait()
        self._hold_shard(unit)
        if self.in_place:
            self._take_own_pieces(unit)
            self._count(-sum(g.nbytes for g in unit.grads if g is not None))
            unit.grads = [None] * len(unit.params)
        else:
            assert unit.grad_full is not None
            own = unit.grad_full[unit.lo : unit.hi]
            if self.accumulate:
                unit.grad_shard.add_(own)
            else:
                unit.grad_shard.copy_(own)
            unit.grad_full = None
            self._count(-unit.full_nbytes())
        unit.work = None

    def _take_own_pieces(self, unit: FlatUnit) -> None:
        """This rank's pieces of the unit's averaged gradients into (or onto) its gradient shard."""
        for i, start, end, at in unit.own_pieces():
            own, g = unit.grad_shard[at : at + end - start], unit.grads[i]
            if g is not None:
                piece = g.reshape(-1)[start:end]
                own.add_(piece) if self.accumulate else own.copy_(piece)
            elif not self.accumulate:
                own.zero_()

    def drain(self) -> None:
        """Wait for the launched reductions and take their results: their gradients are freed."""
        while self.launched:
            self._complete(self.launched.popleft())

    def finish(self) -> None:
        """After each backward: reduce what is left (units with unused parameters) and wait for all."""
        if self.in_order:
            self._launch_in_order(only_ready=False)
        else:
            for unit in self.units:
                if unit.pending:
                    unit.pending = 0
                    self._launch(unit)
        self.drain()


def sharded_grad_norm(grads: list[torch.Tensor], group) -> torch.Tensor:
    """The global gradient norm of gradients sharded across ranks: the square root of the all-reduced
    sum of each rank's squared shard norms (padding is zero)."""
    squares = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
    if dist.get_world_size(group) > 1:
        collectives.all_reduce(squares, "zero-grad-norm", group=group)
    return squares.sqrt()


def wire_dtype(cfg) -> torch.dtype | None:
    """parallel.compression for ZeRO: bf16 / fp16 reduce-scatter a 16-bit copy of each gradient
    bucket (the other codecs need an all-reduce of every rank's whole gradient: config rejects them)."""
    return CAST_DTYPES.get(cfg.parallel.compression)


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters())


def shard_grad(u: FlatUnit) -> torch.Tensor:
    """The unit's gradient shard: bound by the reducer before any backward ends."""
    assert u.shard.grad is not None
    return u.shard.grad


def average_across_replicas(units: list[FlatUnit], grads: list[torch.Tensor], replicas) -> None:
    """Each unit's gradient shard, the mean of its replica's slices of the batch, becomes the mean
    of every replica's: all-reduced over the ranks that hold the same shard in the others
    (`replicas`: comm/grid.py's replica_groups)."""
    if replicas.count == 1:
        return
    works = []
    for u, g in zip(units, grads):
        g.div_(replicas.count)
        works.append(collectives.all_reduce(g, f"zero-grad-replicas-{u.index}", group=replicas.across, async_op=True))
    for work in works:
        work.wait()
