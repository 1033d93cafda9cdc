"""Expert parallelism: an MoE layer's n experts split over the E ranks of an ep group (comm/grid.py:
runs of E adjacent data ranks), rank e computing experts e*n/E .. (e+1)*n/E - 1.

One layer's forward on rank e:

    tokens grouped by expert ----all_to_all----> rows from every rank for e's experts
      (each rank the same)         (split sizes:      regrouped expert by expert, through them
                                    rows per rank)   <----all_to_all----  outputs, back in place

Every rank keeps every expert's weights (so a checkpoint and final/ are the dense model's, and a
resume works at any layout): the experts' compute and tokens are split, not yet their memory.
Gradients stay exact with the data-parallel averaging over the world: an expert's gradient is
non-zero only on the ranks that computed it, each the sum over the tokens of its ep group, and the
world's mean of those sums is one process's gradient."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.comm.grid import DataMesh
from paratrain.errors import ConfigError
from paratrain.parallel.expert.all_to_all import all_to_all, exchange_counts


class ExpertParallel:
    """The dispatcher every MoE layer of a model calls (its `paratrain_experts` hook)."""

    def __init__(self, model: nn.Module, mesh: DataMesh):
        self.mesh = mesh
        self.layers = expert_layers(model)
        if not self.layers:
            raise ConfigError("parallel.ep", f"{type(model).__name__} has no mixture-of-experts layers to split")
        for layer in self.layers:
            layer.paratrain_experts = self.dispatch  # type: ignore[assignment]  # torch types a module's attribute as a tensor or module

    def dispatch(self, layer, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`grouped`: this rank's routed rows, expert by expert (`counts` each); returns their outputs
        in the same order, computed on the ranks that hold the experts."""
        ep, rank, group = self.mesh.ep, self.mesh.ep_rank, self.mesh.ep_group
        local = layer.n_experts // ep
        arriving = exchange_counts(counts, group).view(ep, local)  # [source rank, my expert]
        send = counts.view(ep, local).sum(1).tolist()
        receive = arriving.sum(1).tolist()
        rows = all_to_all(grouped, send, receive, group)  # source rank by source rank
        # regroup expert by expert (stable: each expert's rows in source-rank order)
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(arriving.reshape(-1))
        order = expert_of_row.argsort(stable=True)
        out = layer.run_experts(rows[order], arriving.sum(0), layer.experts[rank * local : (rank + 1) * local])
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order), device=order.device)
        return all_to_all(out[back], receive, send, group)


def expert_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(type(m), "paratrain_experts")]


def check_experts(cfg, model: nn.Module) -> None:
    """Before any worker starts (`model` on meta): every MoE layer's experts divide by ep."""
    layers = expert_layers(model)
    if not layers:
        raise ConfigError(
            "parallel.ep", f"{type(model).__name__} has no mixture-of-experts layers to split (gpt: model.n_experts)"
        )
    for layer in layers:
        if layer.n_experts % cfg.parallel.ep:
            raise ConfigError(
                "parallel.ep", f"{cfg.parallel.ep} does not divide the {layer.n_experts} experts (model.n_experts)"
            )


def expert_parallel(model: nn.Module, mesh: DataMesh) -> ExpertParallel | None:
    """The model's MoE layers dispatching over the mesh's ep group (None when ep is 1)."""
    return ExpertParallel(model, mesh) if mesh.ep > 1 else None
