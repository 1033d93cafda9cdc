"""Batch norm over the global batch: the statistics of every data-parallel rank's samples at once.

A batch-norm layer normalises by its batch's mean and variance, so a rank that sees 1/N of the
global batch would normalise differently from one process seeing all of it (and keep running
statistics of its own shard only). torch's SyncBatchNorm is CUDA-only; this is the same arithmetic
through paratrain's collectives, on gloo as on NCCL:

  forward   each rank sums its samples per channel (sum, sum of squares, count, in float64: one
            message); the global mean and biased variance normalise, and the running statistics move
            as one process's would (the unbiased variance, torch's momentum rule);
  backward  each rank sums dy and dy * x_hat per channel (one message); the input's gradient is
            what one process computes on the global batch. The weight's and bias's gradients stay
            this rank's own sums: the strategy averages gradients over the ranks like any other.

The layers keep their class, names and state dict: only their forward is replaced (train mode
only; eval uses the running statistics, which every rank holds alike). With
`parallel.sync_batchnorm = false` each rank normalises over its own samples and every step starts
from rank 0's buffers (DDP's broadcast_buffers), so the ranks agree and `final/` holds rank 0's;
validation starts from them too (Strategy.before_eval), as DDP's eval forward does.
Once per step, not per microbatch, as DDP does under gradient accumulation: it broadcasts before a
forward that follows a synchronised backward, and the microbatches of a step but the last run under
no_sync() (tests/test_user_models.py compares the two with train.grad_accum = 2). Rank 0's own
buffers never change by a broadcast, so neither do the weights nor what `final/` holds.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm import collectives
from paratrain.parallel.base import broadcast_tensors


def batchnorm_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


class _GlobalBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, group):
        dims = [0] + list(range(2, x.dim()))
        xd = x.double()
        local = torch.cat(
            [xd.sum(dims), (xd * xd).sum(dims), torch.full((1,), x.numel() / x.shape[1], dtype=torch.float64)]
        )
        collectives.all_reduce(local, "batchnorm-stats", group=group)
        c = x.shape[1]
        count = local[-1]
        mean = local[:c] / count
        var = (local[c : 2 * c] / count - mean * mean).clamp_min(0)
        _update_running_stats(layer, mean, var, count)
        shape = [1, c] + [1] * (x.dim() - 2)
        invstd = torch.rsqrt(var + layer.eps)
        x_hat = ((xd - mean.view(shape)) * invstd.view(shape)).to(x.dtype)
        ctx.save_for_backward(x_hat, invstd.float(), weight)
        ctx.count, ctx.group, ctx.shape, ctx.dims = count, group, shape, dims
        out = x_hat
        if weight is not None:
            out = out * weight.view(shape) + bias.view(shape)
        return out

    @staticmethod
    def backward(ctx, dy):
        x_hat, invstd, weight = ctx.saved_tensors
        shape, dims = ctx.shape, ctx.dims
        local_dy, local_dy_xhat = dy.sum(dims), (dy * x_hat).sum(dims)
        sums = torch.cat([local_dy, local_dy_xhat]).double()
        collectives.all_reduce(sums, "batchnorm-grads", group=ctx.group)
        c = x_hat.shape[1]
        mean_dy = (sums[:c] / ctx.count).to(dy.dtype).view(shape)
        mean_dy_xhat = (sums[c:] / ctx.count).to(dy.dtype).view(shape)
        scale = invstd if weight is None else invstd * weight
        dx = (dy - mean_dy - x_hat * mean_dy_xhat) * scale.view(shape)
        if weight is None:
            return dx, None, None, None, None
        return dx, local_dy_xhat, local_dy, None, None


@torch.no_grad()
def _update_running_stats(layer, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
    """torch's rule: momentum, or a cumulative average when momentum is None; unbiased variance."""
    if not layer.track_running_stats or layer.running_mean is None:
        return
    layer.num_batches_tracked.add_(1)
    factor = 1.0 / float(layer.num_batches_tracked) if layer.momentum is None else layer.momentum
    unbiased = var * (count / (count - 1).clamp_min(1))
    layer.running_mean.mul_(1 - factor).add_(mean.to(layer.running_mean.dtype), alpha=factor)
    layer.running_var.mul_(1 - factor).add_(unbiased.to(layer.running_var.dtype), alpha=factor)


def _global_forward(self, x):
    # Like torch's own layer: batch statistics in training (or without running ones), else these.
    if not (self.training or self.running_mean is None):
        return self._local_forward(x)
    self._check_input_dim(x)
    return _GlobalBatchNorm.apply(x, self.weight, self.bias, self, self.dp_group)


def synchronise_batchnorm(layers: Sequence[nn.Module], group=None) -> None:
    """Each of these batch-norm layers normalises over `group`'s samples together."""
    for layer in layers:
        layer._local_forward = layer.forward  # type: ignore[assignment]  # torch's stub: attributes are Tensor | Module
        layer.dp_group = group
        layer.forward = types.MethodType(_global_forward, layer)


class BatchNormPolicy:
    """What a data-parallel strategy does about its model's batch-norm layers (parallel.sync_batchnorm):
    synchronise them, or hand every rank rank 0's buffers before each step as DDP does."""

    def __init__(self, model: nn.Module, sync: bool, group=None):
        self.group = group
        alone = not dist.is_initialized() or dist.get_world_size(group) == 1
        self.src = 0 if alone or group is None else dist.get_global_rank(group, 0)
        layers = [] if alone else batchnorm_layers(model)
        if sync:
            synchronise_batchnorm(layers, group)
        self.broadcast = [] if sync else [t for m in layers for t in m.buffers()]

    def before_step(self) -> None:
        if self.broadcast:
            broadcast_tensors(self.broadcast, self.src, self.group)
