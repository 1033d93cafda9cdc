"""The experts' weights split over an ep group (dp): each rank keeps only the parameters of the
experts it computes (experts.py: rank e of the group, experts e*n/E .. (e+1)*n/E - 1 of each
layer), so expert memory (weights, gradients, optimizer state) divides by E.

    the built-in gpt's MoE layer     experts.0 .. experts.n-1 (a ModuleList)
    rank e keeps                     experts.{e*n/E} .. experts.{(e+1)*n/E - 1}; the others' parameters
                                     are dropped from their modules (registered as None: gone from
                                     parameters() and state_dict(), the names of the rest unchanged)

The dense model stays what a user sees of the run: `layout` is the model's state_dict as it was
(every expert, in order), `chunks` sends each expert's tensors from the rank holding it to rank 0
for the export, and a checkpoint's ranks 0..E-1 (the first ep group) each write their own experts
(dp/engine.py): together the dense model, which a run at any ep reads whole and keeps its part of.

    a Hugging Face experts module   3-D stacks, experts first (hf_experts.py)
    rank e keeps                    the slice [e*n/E, (e+1)*n/E) of each, the module's num_experts
                                    its slice's (StackCuts; zero1-3 cut them on the meta model);
                                    the export and a checkpoint get the stacks whole on rank 0
                                    (each rank's slice sent there) and a resume cuts them"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.grid import DataMesh
from paratrain.models.hf import hf_experts
from paratrain.models.moe import expert_layers


class LocalExperts:
    """Which of the model's expert parameters this rank keeps; the dense model's layout and export."""

    def __init__(self, model: nn.Module, mesh: DataMesh, cuts: StackCuts | None = None):
        """`cuts`: the Hugging Face stacks already cut to this rank's slices (zero1-3 cut them before
        their units are made: zero/experts.py); else they are cut here."""
        self.mesh = mesh
        self.model = model
        with cuts.undone() if cuts else contextlib.nullcontext():
            self.layout = {k: (v.dtype, v.shape) for k, v in model.state_dict().items()}
        self.owner = expert_owners(model, mesh.ep)  # every expert parameter's name: the ep rank keeping it
        for layer in expert_layers(model):
            experts = cast(nn.ModuleList, layer.experts)  # the gpt's MixtureOfExperts (torch types it loosely)
            per_rank = len(experts) // mesh.ep
            for index, expert in enumerate(experts):
                if index // per_rank != mesh.ep_rank:
                    _drop_parameters(expert)
        # a Hugging Face experts module's stacks: their full sizes (the cuts not kept: they hold
        # the whole stacks)
        self.stacks = (cuts or StackCuts(model, mesh.ep, mesh.ep_rank)).totals
        self.kept = {n for n, o in self.owner.items() if o == mesh.ep_rank} | set(self.stacks)
        self.dropped = set(self.owner) - self.kept

    def chunks(self, only_experts: bool = False, state: dict | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Collective over the first ep group (ranks 0..E-1, whose ep rank is their global rank):
        the dense model's tensors in its order, yielded on rank 0, each expert's sent there by the
        rank keeping it. Other ranks take no part. zero1-3 (zero/experts.py) ask for the experts
        alone (`only_experts`), each rank's given as `state` (gathered from their shards)."""
        rank = dist.get_rank()
        if rank >= self.mesh.ep:
            return
        state = state if state is not None else self.model.state_dict()
        experts = set(self.owner) | set(self.stacks)
        for name, (dtype, shape) in self.layout.items():
            if only_experts and name not in experts:
                continue
            owner = self.owner.get(name, 0)
            if name in self.stacks:  # each rank's slice, in ep-rank order
                whole = self._gather(state[name])
                if whole is not None:
                    yield {name: whole}
            elif rank == 0 and owner == 0:
                yield {name: state[name]}
            elif rank == 0:
                tensor = torch.empty(shape, dtype=dtype, device=_device(self.model))
                dist.recv(tensor, src=owner)
                yield {name: tensor}
            elif owner == rank:
                dist.send(state[name].contiguous(), dst=0)

    def _gather(self, part: torch.Tensor) -> torch.Tensor | None:
        """Collective over ranks 0..E-1: the stack whose slice `part` is on each, whole on rank 0."""
        if dist.get_rank() != 0:
            dist.send(part.contiguous(), dst=0)
            return None
        parts = [part] + [torch.empty_like(part) for _ in range(1, self.mesh.ep)]
        for rank in range(1, self.mesh.ep):
            dist.recv(parts[rank], src=rank)
        return torch.cat(parts)

    def _stack_of(self, key: str) -> str | None:
        """The stack a checkpoint key (model.NAME, optim.NAME.STATE) belongs to, if any."""
        name = key.split(".", 1)[1]
        if key.startswith("optim."):
            name = name.rsplit(".", 1)[0]
        return name if name in self.stacks else None

    def gather_stacks(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Collective over ranks 0..E-1 (a checkpoint's state_dict): the stacks' slices in `tensors`
        (model.NAME and their optimizer state of the same shape) whole on rank 0, gone elsewhere;
        the same keys on every rank (the same optimizer over the same names), sorted."""
        out = dict(tensors)
        for key in sorted(k for k in tensors if self._stack_of(k)):
            part = tensors[key]
            if part.dim() == 0:  # a count (adamw's step), the same on every rank
                continue
            whole = self._gather(part)
            if whole is None:
                del out[key]
            else:
                out[key] = whole
        return out

    def local_slices(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint's whole stacks (and their optimizer state) cut to this rank's slice."""
        out = dict(tensors)
        for key, tensor in tensors.items():
            name = self._stack_of(key)
            if name is not None and tensor.dim() and tensor.shape[0] == self.stacks[name]:
                per_rank = self.stacks[name] // self.mesh.ep
                out[key] = tensor[self.mesh.ep_rank * per_rank : (self.mesh.ep_rank + 1) * per_rank]
        return out


class StackCuts:
    """Each Hugging Face experts module (hf_experts.py) cut to ep rank `rank`'s slice of every 3-D
    stack (experts first): it computes experts e*n/E .. under their local indices, its `num_experts`
    the slice's (as the experts implementations index and count them); `paratrain_all_experts` keeps
    n for the routing. On a real model or on meta (zero1-3 and `paratrain plan` cut the meta model)."""

    def __init__(self, model: nn.Module, ep: int, rank: int):
        self.totals: dict[str, int] = {}  # each stack's name: its number of experts
        self.stacks: dict[str, tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = {}  # (module, attr, whole, slice)
        self.modules: list[tuple[nn.Module, int, int]] = []  # (module, its experts, those of a rank)
        for prefix, module, total in _experts_modules(model):
            per_rank = total // ep
            first = rank * per_rank
            for name, p in expert_stacks(module, total):
                kept = nn.Parameter(p.detach()[first : first + per_rank].clone(), requires_grad=p.requires_grad)
                self.stacks[f"{prefix}.{name}"] = module, name, p, kept
                self.totals[f"{prefix}.{name}"] = total
            self.modules.append((module, total, per_rank))
        self.put(whole=False)

    def put(self, whole: bool) -> None:
        """The modules as built (`whole`), or cut."""
        for module, attr, stack, part in self.stacks.values():
            setattr(module, attr, stack if whole else part)
        for module, total, per_rank in self.modules:
            # plain ints on the module (setattr: torch types a module's attributes as tensors or modules)
            setattr(module, "num_experts", total if whole else per_rank)  # noqa: B010
            if whole:
                delattr(module, "paratrain_all_experts")
            else:
                setattr(module, "paratrain_all_experts", total)  # noqa: B010

    @contextlib.contextmanager
    def undone(self) -> Iterator[None]:
        """The modules as built meanwhile (their values made, the dense layout read)."""
        self.put(whole=True)
        try:
            yield
        finally:
            self.put(whole=False)


@contextlib.contextmanager
def stacks_cut(model: nn.Module, ep: int) -> Iterator[StackCuts]:
    """The (meta) model holding ep rank 0's slices of its stacks meanwhile, as a rank's does
    (`paratrain plan`: stage 3's units are the modules holding them)."""
    cuts = StackCuts(model, ep, 0)
    try:
        yield cuts
    finally:
        cuts.put(whole=True)


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """The model's Hugging Face experts modules (hf_experts.py): name, module, number of experts."""
    modules = set(hf_experts(model))
    return [(n, m, cast(int, m.num_experts)) for n, m in model.named_modules() if m in modules]


def expert_stacks(module: nn.Module, total: int) -> list[tuple[str, nn.Parameter]]:
    """An experts module's own parameters that stack its `total` experts (experts first)."""
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() and p.shape[0] == total]


def stack_slices(model: nn.Module, ep: int) -> dict[str, torch.Tensor]:
    """Each Hugging Face experts stack's name: the slice an ep rank keeps (`paratrain plan`, on the
    meta device): the model's own where it holds the slices already (stacks_cut)."""
    return {
        f"{prefix}.{name}": p if hasattr(module, "paratrain_all_experts") else p[: total // ep]
        for prefix, module, total in _experts_modules(model)
        for name, p in expert_stacks(module, total)
    }


def expert_owners(model: nn.Module, ep: int) -> dict[str, int]:
    """The name of every parameter of the model's built-in gpt experts: the ep rank keeping it
    (`paratrain plan` counts a rank's share with it, on the meta device)."""
    owners = {}
    for prefix, layer in model.named_modules():
        if hasattr(type(layer), "paratrain_experts"):
            per_rank = len(layer.experts) // ep
            for index, expert in enumerate(layer.experts):
                for name, _ in expert.named_parameters():
                    owners[f"{prefix}.experts.{index}.{name}"] = index // per_rank
    return owners


def _drop_parameters(module: nn.Module) -> None:
    for sub in module.modules():
        for key in sub._parameters:
            sub._parameters[key] = None


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def keep_local_experts(model: nn.Module, mesh: DataMesh) -> LocalExperts:
    """The model's experts (the gpt's, a Hugging Face model's stacks) split over the mesh's ep groups."""
    return LocalExperts(model, mesh)
