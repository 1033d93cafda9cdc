"""Data parallelism: every rank holds the whole model; gradients are averaged across ranks.

How the all-reduce hides behind backward:
  * gradients live in flat bucket buffers (p.grad is a view into its bucket, so no copy in or out);
  * buckets are filled in reverse registration order, roughly the order backward produces them;
  * a post-accumulate-grad hook counts each bucket down; when a bucket's last gradient lands, its
    all-reduce starts asynchronously while backward carries on with earlier layers;
  * buckets are launched strictly in index order on every rank (gloo and NCCL match collectives by
    order), so a bucket with a parameter that got no gradient this step simply waits until
    backward ends and goes then, its unused slice still zero: no hang, no corruption;
  * with gradient accumulation the hooks stay quiet until the last micro-batch: gradients add up
    locally and only the final backward communicates.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import checkpoint as ckpt
from .. import collectives
from ..optim import build_optimizer
from .base import Strategy, broadcast_tensors, clip_factor, unique_parameters


class Bucket:
    def __init__(self, index: int, params: list[nn.Parameter], device: torch.device):
        self.index = index
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=device)
        self.pending = len(params)
        self.work = None

    def bind_grads(self) -> None:
        offset = 0
        for p in self.params:
            p.grad = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()


def make_buckets(params: list[nn.Parameter], bucket_bytes: int, device: torch.device) -> list[Bucket]:
    """Reverse registration order, cut when a bucket passes `bucket_bytes` or the dtype changes."""
    groups: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        current = groups[-1]
        if current and (size + p.numel() * p.element_size() > bucket_bytes or current[0].dtype != p.dtype):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    return [Bucket(i, g, device) for i, g in enumerate(groups) if g]


class GradientReducer:
    """Bucketed, backward-overlapped gradient averaging over a process group."""

    def __init__(self, params: list[nn.Parameter], bucket_mb: float, device: torch.device, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.buckets = make_buckets(params, int(bucket_mb * 2**20), device)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.next_to_launch = 0
        self.sync = False
        for b in self.buckets:
            b.bind_grads()
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()

    def prepare(self, sync: bool) -> None:
        """Before a backward: `sync` says whether this backward should communicate."""
        self.sync = sync
        if sync:
            self.next_to_launch = 0
            for b in self.buckets:
                b.pending, b.work = len(b.params), None

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync:
            return
        bucket = self.bucket_of[id(p)]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(until=len(self.buckets), only_ready=True)

    def _launch(self, until: int, only_ready: bool) -> None:
        while self.next_to_launch < until:
            b = self.buckets[self.next_to_launch]
            if only_ready and b.pending:
                return
            if self.world > 1:
                b.buffer.div_(self.world)
                b.work = collectives.all_reduce(b.buffer, f"grad-bucket-{b.index}", group=self.group, async_op=True)
            self.next_to_launch += 1

    def finish(self) -> torch.Tensor:
        """After the syncing backward: launch what is left (unused parameters), wait for all, and
        return the global gradient norm. Each bucket's norm is taken while later buckets are still
        on the wire; every rank holds the same averaged gradients, so every rank gets the same norm
        and takes the same decisions from it (clip, skip a non-finite step) without talking."""
        self._launch(until=len(self.buckets), only_ready=False)
        norms = []
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            norms.append(torch.linalg.vector_norm(b.buffer))
        self.sync = False
        return torch.linalg.vector_norm(torch.stack(norms))

    def scale_(self, factor: torch.Tensor) -> None:
        for b in self.buckets:
            b.buffer.mul_(factor)


class DataParallel(Strategy):
    name = "dp"

    def __init__(self, model, loss_fn, cfg, rt, group=None):
        super().__init__(model.to(rt.device), loss_fn, cfg, rt)
        self.group = group
        broadcast_tensors(list(model.parameters()) + list(model.buffers()), src=0, group=group)
        named = unique_parameters(model)
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.reducer = GradientReducer(self.params, cfg.parallel.bucket_mb, rt.device, group)
        self.optimizer = build_optimizer(self.params, cfg.train)

    def train_step(self, batch) -> torch.Tensor:
        self.reducer.zero_grad()
        micro = self.micro_batches(batch)
        total = torch.zeros((), device=self.rt.device)
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            self.reducer.prepare(sync=last)
            with self.autocast():
                loss = self.loss_fn(self.model(x), y)
            (loss / len(micro)).backward()
            total += loss.detach()
        norm = self.reducer.finish()
        self.skipped_step = not bool(torch.isfinite(norm))
        if not self.skipped_step:
            if self.cfg.train.clip_grad_norm > 0:
                self.reducer.scale_(clip_factor(norm, self.cfg.train.clip_grad_norm))
            self.optimizer.step()
        return total / len(micro)

    # -- state: every rank holds the same model and optimizer, so rank 0 writes them ----------
    def state_dict(self):
        if self.rt.rank != 0:
            return {}, {}
        tensors = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        opt_tensors, opt_meta = ckpt.optimizer_to_tensors(self.optimizer, self.param_names)
        tensors.update(opt_tensors)
        return tensors, {"optimizer": opt_meta}

    def load_state_dict(self, reader) -> None:
        tensors, meta = reader.load(rank=0)
        model_state = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
        ckpt.load_model_state(self.model, model_state)
        ckpt.optimizer_from_tensors(self.optimizer, self.param_names, tensors, meta["optimizer"])

    def full_model_state(self):
        if self.rt.rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
