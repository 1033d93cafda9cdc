"""What a tp model's modules hold for each split parameter once the model is the user's (the Python
API's own loop, pp = 1): outside the model's forward, a SplitParam of the unsplit parameter's shape
and dtype in the slot of this rank's slice, as zero3's ShardedParam stands for its sharded ones
(zero/user_tensors.py).

Tensor parallelism replaces each planned Linear / Embedding by a module holding this rank's slice
as its `weight` / `bias`; left there, `model.named_parameters()` shows the slices' shapes, and a
user's code reading p.shape or p.numel() (a parameter count, a checkpoint's layout check) is
silently wrong. So, once the model is the user's:

    outside a forward   each split parameter's slot holds a SplitParam: the unsplit name, shape and
                        dtype (`_is_param`: an nn.Parameter to isinstance, as FSDP2's DTensors);
                        named_parameters(), numel(), state_dict(keep_vars=True) and torch's
                        gradient utilities take it; reading its values is refused in one line
    in a forward        the real slices are back (a pre-hook on the model and on each module holding
                        one, the hook after it puts the SplitParams back, exception or not): the
                        computation and autograd use the real Parameters, whose .grad the dp
                        reducer and the optimizer pt.setup returned use
    p.grad              after pt.backward, a ShardedGrad of the unsplit shape over the real slice's
                        gradient (flattened), whose norm is the whole gradient's across the tp
                        group: torch's clip_grad_norm_(model.parameters(), c) clips the global norm
    the state dicts,    `real()`: the slices in place while paratrain reads or loads them
    checkpoints, the
    plan's verification
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from paratrain.parallel.base import refuse, said_by_one
from paratrain.parallel.zero.user_tensors import GradShards

aten = torch.ops.aten


class SplitParam(torch.Tensor):
    """Stands for the unsplit parameter `name` (shape `shape`) whose slice `real` this rank holds
    (as `.local`: a tensor's `.real` is its real part)."""

    local: nn.Parameter
    param_name: str
    strategy: str

    @staticmethod
    def __new__(cls, real: nn.Parameter, name: str, shape: torch.Size, strategy: str):
        param = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=real.dtype, device=real.device, requires_grad=real.requires_grad
        )
        param.local, param.param_name, param.strategy = real, name, strategy
        param._is_param = True  # isinstance(param, nn.Parameter), as for zero3's ShardedParam
        return param

    def __repr__(self) -> str:  # type: ignore[override]  # torch's stub: a keyword of its own
        return (
            f"SplitParam({self.param_name}, shape={tuple(self.shape)}: this rank holds the slice "
            f"{tuple(self.local.shape)})"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is aten.detach.default:  # `.data`, state_dict's detach: the same placeholder
            (param,) = args
            return SplitParam(param.local, param.param_name, param.shape, param.strategy)
        param = next(a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, SplitParam))
        refuse(
            f"{param.param_name} under {param.strategy} holds this rank's slice: torch's "
            f"{func.overloadpacket.__name__} cannot read the whole {tuple(param.shape)} parameter outside a "
            f"forward; read model.state_dict() on every rank",
            said_by_one(),
        )


class SplitParams:
    """Installs the SplitParams of `model`'s split parameters (`split`: name -> (the real slice, the
    unsplit shape)) and swaps the real slices in and out (see the module docstring)."""

    def __init__(self, model: nn.Module, split: dict[str, tuple[nn.Parameter, torch.Size]], strategy: str, tp_group):
        self.reals = [real for real, _ in split.values()]
        self.placeholder = {id(real): SplitParam(real, name, shape, strategy) for name, (real, shape) in split.items()}
        self.places: dict[int, list[tuple[nn.Module, str]]] = {}  # several for a tied parameter
        for module in model.modules():
            for attr, p in module._parameters.items():
                if p is not None and id(p) in self.placeholder:
                    self.places.setdefault(id(p), []).append((module, attr))
        self.grads = GradShards(strategy, tp_group)
        self.depth = 0  # how many calls that need the real slices are under way (they nest)
        holders = {id(m): m for places in self.places.values() for m, _ in places}
        for module in [model, *holders.values()]:
            module.register_forward_pre_hook(lambda *_: self.enter())
            module.register_forward_hook(lambda *_: self.leave(), always_call=True)
        self._put(real=False)

    def _put(self, real: bool) -> None:
        for p in self.reals:
            for module, attr in self.places[id(p)]:
                # (a SplitParam is an nn.Parameter by _is_param, not by its class: torch's type)
                module._parameters[attr] = p if real else self.placeholder[id(p)]  # type: ignore[assignment]

    def enter(self) -> None:
        if self.depth == 0:
            self._put(real=True)
        self.depth += 1

    def leave(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self._put(real=False)

    @contextlib.contextmanager
    def real(self):
        """The real slices in the modules: paratrain's own reads and loads of the model."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    # -- gradients --------------------------------------------------------------------------------
    def grads_let_go(self) -> bool:
        """Whether the user's model.zero_grad() set a SplitParam's gradient to None since the last
        backward (its real slice's gradient is still there: the next backward must not add to it)."""
        return any(self.placeholder[id(p)].grad is None for p in self.reals if p.grad is not None)

    def show_grads(self) -> None:
        """After a backward: each SplitParam's .grad, a ShardedGrad over its slice's gradient."""
        held = [p for p in self.reals if p.grad is not None]
        for p in self.reals:
            if p.grad is None:
                self.placeholder[id(p)].grad = None
        self.grads.install((self.placeholder[id(p)], p.grad.view(-1)) for p in held if p.grad is not None)

    def grads_changed(self) -> None:
        """The slices' gradients were scaled (pt.clip_grad_norm_): the norms asked before are stale."""
        self.grads.changed()
