"""Stage 3's units and their gathering: one flat unit per module, gathered just before the module
runs (forward and backward) and freed after, with the next unit prefetched.

    module_units       which parameters form a unit (a module's subtree up to parallel.bucket_mb,
                       split into children when bigger; the root unit for shared and loose ones)
    ParameterGatherer  the forward/backward hooks that gather, prefetch and free the units
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.comm.lockstep import BACKWARD, FORWARD, FORWARD_NO_GRAD, LockstepCheck
from paratrain.parallel.zero.comm import FlatUnit, all_gather

CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # never called themselves: their children are


def module_units(model: nn.Module, params: list[nn.Parameter], max_bytes: int) -> list[tuple[nn.Module, list]]:
    """Stage 3's units of `params` (the trainable parameters, or the frozen ones), in registration
    (forward) order: a module whose parameters total at most `max_bytes` is one unit with all of
    them; a bigger one is split into its children, its own direct parameters forming a unit of their
    own. The root's direct parameters, those of containers (ModuleList/ModuleDict, and the wrappers
    a peft model's forward bypasses, are never called, so their hooks would never run) and
    parameters shared by several modules (a tied weight is used outside its own module's forward)
    form the root unit, which stays gathered from the start of forward to the end of its backward."""
    given = {id(p) for p in params}
    bypassed = bypassed_modules(model)
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) in given:
                owners[id(p)] = owners.get(id(p), 0) + 1
    taken: set[int] = {i for i, n in owners.items() if n > 1}
    root_params = [p for p in params if id(p) in taken]
    units: list[tuple[nn.Module, list]] = []

    def subtree(module):
        seen, out = set(), []
        for p in module.parameters():
            if id(p) in given and id(p) not in taken and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def direct(module):
        return [p for p in module._parameters.values() if p is not None and id(p) in given and id(p) not in taken]

    def visit(module, is_root: bool):
        below = subtree(module)
        if not below:
            return
        if (
            not is_root
            and not isinstance(module, CONTAINERS)
            and id(module) not in bypassed
            and sum(p.numel() * p.element_size() for p in below) <= max_bytes
        ):
            units.append((module, below))
            taken.update(id(p) for p in below)
            return
        own = direct(module)
        taken.update(id(p) for p in own)
        if own and not is_root and not isinstance(module, CONTAINERS) and id(module) not in bypassed:
            units.append((module, own))
        else:
            root_params.extend(own)
        for child in module.children():
            visit(child, False)

    visit(model, True)
    order = {id(p): i for i, p in enumerate(params)}
    if root_params:
        units.insert(0, (model, sorted(root_params, key=lambda p: order[id(p)])))
    return units


def bypassed_modules(model: nn.Module) -> set[int]:
    """The modules between a peft model and its base model, which its forward calls directly
    (get_base_model()): never called, like containers, so no unit may be theirs."""
    get_base_model = getattr(model, "get_base_model", None)
    if get_base_model is None:
        return set()
    base = get_base_model()
    path = next(name for name, m in model.named_modules() if m is base).split(".")
    return {id(model.get_submodule(".".join(path[:i]))) for i in range(1, len(path))}


class ParameterGatherer:
    """Stage 3: gathers each unit's full parameters just before its module runs (forward and backward)
    and frees them after, prefetching the next unit in the forward order recorded on the first pass.

    What is gathered plus the full gradients held by `reducer` (a StreamingShardReducer) stays within
    `budget`: twice the largest unit, plus the root unit, which stays gathered through forward and
    backward. A prefetch starts only where it fits, and before a unit's backward, which creates
    gradients the size of the unit, the gradients in flight are reduced first unless they fit beside
    them. With equal units: forward holds a unit and the next one; backward a unit and its gradients,
    then, its parameters freed, its gradients in flight beside the next unit's gather. Smaller units
    keep every overlap of gathers and reductions with compute.

    Before the first gather of each forward and of each backward, `lockstep` checks that every rank
    runs the same call (a rank evaluating alone stops with one line instead of a transport abort).

    `always_gathered` (world 1: each unit's full parameter is its shard): gathered from the start and
    never freed, nothing copied or allocated (the user's model holds its parameters for good)."""

    def __init__(self, units: list[FlatUnit], root: nn.Module, reducer, lockstep: LockstepCheck, always_gathered: bool):
        """Each unit gathered over its own group (FlatUnit.group: under parallel.ep an expert's
        over the ranks keeping it, zero/experts.py)."""
        self.units, self.root, self.reducer, self.lockstep = units, root, reducer, lockstep
        self.backward_checked = False
        # told when a unit's parameters become whole and when they are freed (Zero3's ShardedParams)
        self.on_gathered = self.on_freed = lambda u: None
        self.order: list[FlatUnit] = []
        self.position: dict[int, int] = {}
        self.recording = True
        self.live_bytes = self.peak_bytes = 0  # full parameters gathered at once (for the memory benchmark)
        sizes = [u.full_nbytes() for u in units if u.module is not root]
        self.budget = 2 * max(sizes, default=0) + sum(u.full_nbytes() for u in units if u.module is root)
        self.always_gathered = always_gathered
        root.register_forward_pre_hook(lambda m, args: self._start_of_forward())
        for u in units:
            u.state, u.gather_work = "gathered" if self.always_gathered else "free", None
            assert u.module is not None  # zero3's units are modules
            u.module.register_forward_pre_hook(lambda m, args, u=u: self._pre_forward(u))
            if not u.trains:
                u.module.register_forward_pre_hook(
                    lambda m, args, kwargs, u=u: self._free_after_backward(u, (args, kwargs)), with_kwargs=True
                )
            u.module.register_forward_hook(lambda m, args, out, u=u: self._post_forward(u, out))
        root.register_forward_hook(lambda m, args, out: self._end_of_forward())

    # -- gather and free ------------------------------------------------------------------------
    def _start(self, u: FlatUnit) -> None:
        u.full.untyped_storage().resize_(u.full_nbytes())
        self.live_bytes += u.full_nbytes()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        u.version = u.full._version
        u.gather_work = all_gather(u.full, u.shard.detach(), f"zero3-params-unit-{u.index}", u.group)
        u.state = "gathering"

    def _wait(self, u: FlatUnit) -> None:
        assert u.gather_work is not None  # gathering
        u.gather_work.wait()
        u.gather_work = None
        # Autograd saved these very tensors in forward; refilling them with the same values is not a
        # modification it should see, so the version counter (bumped by the gather, on gloo from its
        # worker thread by the time the work completes) goes back to where it was.
        torch._C._autograd._unsafe_set_version_counter((u.full,), (u.version,))

    def unshard(self, u: FlatUnit) -> None:
        if u.state == "free":
            self._start(u)
        if u.state == "gathering":
            self._wait(u)
            u.state = "gathered"
            self.on_gathered(u)

    def _transient(self) -> int:
        return self.live_bytes + self.reducer.live_bytes

    def _prefetch_within_budget(self, u: FlatUnit | None, reserve: int = 0) -> None:
        """Start gathering `u` if it fits beside what is held and `reserve` bytes about to be."""
        if u is not None and u.state == "free" and self._transient() + reserve + u.full_nbytes() <= self.budget:
            self._start(u)

    def reshard(self, u: FlatUnit) -> None:
        if self.always_gathered:
            return
        if u.state == "gathering":
            self._wait(u)
        if u.state != "free":
            u.full.untyped_storage().resize_(0)
            self.live_bytes -= u.full_nbytes()
            u.state = "free"
            self.on_freed(u)

    def reshard_all(self) -> None:
        for u in self.units:
            self.reshard(u)

    def _neighbour(self, u: FlatUnit, step: int) -> FlatUnit | None:
        i = self.position.get(id(u))
        if i is None or not 0 <= i + step < len(self.order):
            return None
        return self.order[i + step]

    # -- hooks ----------------------------------------------------------------------------------
    def _start_of_forward(self) -> None:
        self.lockstep.check(FORWARD if torch.is_grad_enabled() else FORWARD_NO_GRAD)
        self.backward_checked = False

    def _pre_forward(self, u: FlatUnit) -> None:
        if self.recording and id(u) not in self.position:
            self.position[id(u)] = len(self.order)
            self.order.append(u)
        self.unshard(u)
        if not self.recording:
            self._prefetch_within_budget(self._neighbour(u, +1))

    def _post_forward(self, u: FlatUnit, output) -> None:
        if torch.is_grad_enabled():
            for t in torch.utils._pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, u=u: self._pre_backward(u))
            if u.module is self.root:
                return  # backward starts with it: keep it gathered
        self.reshard(u)

    def _end_of_forward(self) -> None:
        self.recording = False

    def _pre_backward(self, u: FlatUnit) -> None:
        if not self.backward_checked:  # the backward's first gather
            self.backward_checked = True
            self.lockstep.check(BACKWARD)
        gradients = u.full_nbytes() if u.trains else 0  # what u's backward is about to create
        gathering = gradients if u.state == "free" else 0
        if self._transient() + gathering + gradients > self.budget:
            self.reducer.drain()
        self.unshard(u)
        # Backward runs the forward order in reverse; the root's backward is followed by the last unit's.
        self._prefetch_within_budget(self.order[-1] if u.module is self.root else self._neighbour(u, -1), gradients)

    def _free_after_backward(self, u: FlatUnit, inputs) -> None:
        """A frozen unit has no gradients whose reduction would say its backward is over: the
        gradients of its module's inputs do (all of them in: the module's backward has run). A
        module whose inputs take none has its backward last: freed with the rest after it."""
        if torch.is_grad_enabled():
            for t in torch.utils._pytree.tree_leaves(inputs):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, u=u: self.after_backward(u))

    def after_backward(self, u: FlatUnit) -> None:
        """`u`'s gradients are all in and being reduced: free its parameters, and prefetch the unit
        whose backward comes next if it fits now."""
        self.reshard(u)
        if u.module is not self.root:
            self._prefetch_within_budget(self._neighbour(u, -1))
