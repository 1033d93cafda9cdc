"""What the user's code finds in p.grad under ZeRO after pt.backward (ShardedGrad), and in p itself
under zero3 outside its module's forward and backward (ShardedParam): tensors of the parameter's
name, shape and dtype over what this rank holds, which answer torch's own tools rightly or refuse
in one line.

ShardedGrad: each parameter's gradient as this rank holds it, whose norm is the global one.

The gradients live in each rank's gradient shard (zero/comm.py): a parameter's gradient is cut
across ranks, and no rank holds it whole. FSDP2 makes them DTensors so that torch's own
`clip_grad_norm_(model.parameters(), c)` clips the global norm; our shards are cut where the flat
units meet the ranks, not along a dimension, so we give each parameter a ShardedGrad: a tensor of the
parameter's shape and dtype holding only this rank's piece of it (a view of the gradient shard,
possibly empty), which answers the operations torch's gradient utilities use:

    torch.linalg.vector_norm(g, p) / g.norm(p)   the global norm of the whole gradient: every
                                                 parameter's at once, in one all-reduce of
                                                 per-parameter sums, the first time a norm is asked
                                                 after the gradients changed (every rank asks the
                                                 same, as torch's clip_grad_norm_ does)
    g.mul_(c), div_, clamp_, zero_, detach, .data   on this rank's piece, in place (scaling the shard
                                                 the optimizer steps), and their _foreach_ forms

so clip_grad_norm_, clip_grads_with_norm_, get_total_norm and clip_grad_value_ are right under every
stage. Any other operation (reading values, arithmetic) is refused in one line: the values are not
all here, and a silent answer from this rank's piece would be wrong.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from paratrain.comm import collectives
from paratrain.parallel.base import refuse, said_by_one

aten = torch.ops.aten

# in place, elementwise, with scalars: the same on each piece as on the whole gradient
IN_PLACE = {
    aten.mul_.Tensor,
    aten.mul_.Scalar,
    aten.div_.Tensor,
    aten.div_.Scalar,
    aten.clamp_.default,
    aten.clamp_.Tensor,
    aten.zero_.default,
    aten.clamp_min_.default,
    aten.clamp_max_.default,
}
FOREACH_IN_PLACE = {
    aten._foreach_mul_.Tensor: aten.mul_.Tensor,
    aten._foreach_mul_.Scalar: aten.mul_.Scalar,
    aten._foreach_clamp_min_.Scalar: aten.clamp_min_.default,
    aten._foreach_clamp_max_.Scalar: aten.clamp_max_.default,
}


class GradShards:
    """The ShardedGrads of one model's parameters (in the same order on every rank), and the
    global norms asked of them since they last changed."""

    def __init__(self, strategy: str, group):
        self.strategy, self.group = strategy, group
        self.grads: list[ShardedGrad] = []
        self.installed = False  # whether a backward has set the parameters' .grad yet
        self.norms: dict[float, torch.Tensor] = {}

    def install(self, params_and_pieces) -> None:
        """(parameter, this rank's piece of its gradient: a 1-D view of the gradient shard) pairs:
        each parameter's .grad becomes the ShardedGrad over its piece; in a group of one, where
        the piece is the whole gradient, a plain view of it, which every tool reads as torch's."""
        self.grads, self.norms, self.installed = [], {}, True
        alone = not dist.is_initialized() or dist.get_world_size(self.group) == 1
        for p, piece in params_and_pieces:
            if alone:
                p.grad = piece.view(p.shape)
                continue
            grad = ShardedGrad(p.shape, piece, len(self.grads), self)
            self.grads.append(grad)
            p.grad = grad

    def changed(self) -> None:
        self.norms = {}

    def norm(self, index: int, ord: float) -> torch.Tensor:
        """The global ord-norm of gradient `index`: every gradient's at once, one all-reduce."""
        ord = float(ord)
        if ord not in self.norms:
            self.norms[ord] = self._global_norms(ord)
        return self.norms[ord][index]

    def _global_norms(self, ord: float) -> torch.Tensor:
        if ord <= 0:
            refuse(
                f"torch.linalg.vector_norm(p.grad, {ord:g}) under {self.strategy}: p.grad holds this rank's shard, "
                f"whose norms of order > 0 only are global; use pt.clip_grad_norm_",
                said_by_one(),
            )
        pieces = [g.piece.detach().float() for g in self.grads]
        if math.isinf(ord):
            local = torch.stack([p.abs().max() if p.numel() else p.new_zeros(()) for p in pieces])
            op = dist.ReduceOp.MAX
        else:
            local = torch.stack([p.abs().pow(ord).sum() for p in pieces])
            op = dist.ReduceOp.SUM
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            collectives.all_reduce(local, "zero-user-grad-norms", group=self.group, op=op)
        return local if math.isinf(ord) else local.pow(1.0 / ord)


class ShardedGrad(torch.Tensor):
    """A parameter's gradient of which this rank holds `piece` (see the module docstring)."""

    piece: torch.Tensor
    index: int  # type: ignore[assignment]  # the parameter's number, over Tensor.index (a method)
    shards: GradShards

    @staticmethod
    def __new__(cls, shape, piece: torch.Tensor, index: int, shards: GradShards):
        grad = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=piece.dtype, device=piece.device)
        grad.piece, grad.index, grad.shards = piece, index, shards
        return grad

    def __repr__(self) -> str:  # type: ignore[override]  # torch's stub: a keyword of its own
        return f"ShardedGrad(shape={tuple(self.shape)}, this rank's piece of {self.piece.numel()} values)"

    @classmethod  # torch's stub types Tensor's as its C stand-in, of another signature
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is aten.linalg_vector_norm.default:
            return _vector_norm(*args, **kwargs)
        if func is aten.detach.default:
            (grad,) = args
            return ShardedGrad(grad.shape, grad.piece, grad.index, grad.shards)
        if func in IN_PLACE:
            grad, *rest = args
            func(grad.piece, *rest, **kwargs)
            grad.shards.changed()
            return grad
        if func in FOREACH_IN_PLACE:
            grads, *rest = args
            for grad in grads:
                FOREACH_IN_PLACE[func](grad.piece, *rest, **kwargs)
                grad.shards.changed()
            return None
        if func is aten._foreach_norm.Scalar:
            grads, *rest = args
            return [_vector_norm(grad, *rest, **kwargs) for grad in grads]
        shards = next(a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, ShardedGrad)).shards
        refuse(
            f"p.grad under {shards.strategy} holds this rank's shard of the gradient: torch's "
            f"{func.overloadpacket.__name__} is not supported on it (norms, torch.nn.utils.clip_grad_norm_ / "
            f"clip_grad_value_ and in-place scaling are); use pt.clip_grad_norm_",
            said_by_one(),
        )


def _vector_norm(grad: ShardedGrad, ord=2, dim=None, keepdim=False, *, dtype=None) -> torch.Tensor:
    if dim is not None and len(dim) not in (0, grad.dim()):
        refuse(
            f"torch.linalg.vector_norm(p.grad, dim={dim}) under {grad.shards.strategy}: p.grad holds this rank's "
            f"shard, whose whole norm only is global; use pt.clip_grad_norm_",
            said_by_one(),
        )
    norm = grad.shards.norm(grad.index, ord).to(dtype or grad.dtype)
    return norm.reshape([1] * grad.dim()) if keepdim else norm


class ShardedParam(torch.Tensor):
    """What a zero3 model's module holds in place of a parameter while its unit is not gathered
    (outside the module's forward and backward, under the Python API): a tensor of the
    parameter's name, shape and dtype, which the user's code can list, count, hand to torch's
    gradient utilities (its .grad is a ShardedGrad) and get from state_dict(keep_vars=True), but
    whose values are on no rank whole: reading them is refused in one line. The parameter itself
    (a view of the unit's gathered storage, freed outside its module's calls, where a read would
    be a SIGSEGV) is put back while the unit is gathered: forward, backward and the state dicts."""

    full: torch.nn.Parameter
    param_name: str
    strategy: str

    @staticmethod
    def __new__(cls, full: torch.nn.Parameter, name: str, strategy: str):
        param = torch.Tensor._make_wrapper_subclass(
            cls, full.shape, dtype=full.dtype, device=full.device, requires_grad=full.requires_grad
        )
        param.full, param.param_name, param.strategy = full, name, strategy
        param._is_param = True  # isinstance(param, nn.Parameter), as for FSDP2's DTensor parameters
        return param

    def __repr__(self) -> str:  # type: ignore[override]  # torch's stub: a keyword of its own
        return f"ShardedParam({self.param_name}, shape={tuple(self.shape)}: its values are sharded across ranks)"

    @classmethod  # torch's stub types Tensor's as its C stand-in, of another signature
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is aten.detach.default:  # state_dict(keep_vars=False), `.data`: the same placeholder
            (param,) = args
            return ShardedParam(param.full, param.param_name, param.strategy)
        param = next(a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, ShardedParam))
        refuse(
            f"{param.param_name} under {param.strategy} holds no values outside a forward (they are sharded across "
            f"ranks): torch's {func.overloadpacket.__name__} cannot read it; read model.state_dict() on every rank",
            said_by_one(),
        )
