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

Hugging Face experts modules (3-D stacks, hf_experts.py) keep every expert on every rank for now."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.grid import DataMesh
from paratrain.parallel.expert.experts import expert_layers


class LocalExperts:
    """Which of the model's expert parameters this rank keeps; the dense model's layout and export."""

    def __init__(self, model: nn.Module, mesh: DataMesh):
        self.mesh = mesh
        self.model = model
        self.layout = {k: (v.dtype, v.shape) for k, v in model.state_dict().items()}
        self.owner = expert_owners(model, mesh.ep)  # every expert parameter's name: the ep rank keeping it
        for layer in expert_layers(model):
            experts = cast(nn.ModuleList, layer.experts)  # the gpt's MixtureOfExperts (torch types it loosely)
            per_rank = len(experts) // mesh.ep
            for index, expert in enumerate(experts):
                if index // per_rank != mesh.ep_rank:
                    _drop_parameters(expert)
        self.kept = {n for n, o in self.owner.items() if o == mesh.ep_rank}
        self.dropped = set(self.owner) - self.kept

    def chunks(self) -> Iterator[dict[str, torch.Tensor]]:
        """Collective over the first ep group (ranks 0..E-1, whose ep rank is their global rank):
        the dense model's tensors in its order, yielded on rank 0, each expert's sent there by the
        rank keeping it. Other ranks take no part."""
        rank = dist.get_rank()
        if rank >= self.mesh.ep:
            return
        state = self.model.state_dict()
        for name, (dtype, shape) in self.layout.items():
            owner = self.owner.get(name, 0)
            if rank == 0 and owner == 0:
                yield {name: state[name]}
            elif rank == 0:
                tensor = torch.empty(shape, dtype=dtype, device=_device(self.model))
                dist.recv(tensor, src=owner)
                yield {name: tensor}
            elif owner == rank:
                dist.send(state[name].contiguous(), dst=0)


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


def keep_local_experts(model: nn.Module, mesh: DataMesh) -> LocalExperts | None:
    """The model's experts split over the mesh's ep groups: None where the model has no built-in
    gpt MoE layers (a Hugging Face model's experts stay whole on every rank)."""
    return LocalExperts(model, mesh) if expert_layers(model) else None
