"""Expert parallelism: an MoE layer's n experts (the built-in gpt's, or a Hugging Face model's:
hf_experts.py) split over the E ranks of an ep group (comm/grid.py: runs of E adjacent data
ranks), rank e computing experts e*n/E .. (e+1)*n/E - 1.

One layer's forward on rank e:

    tokens grouped by expert ----all_to_all----> rows from every rank for e's experts
      (each rank the same)         (split sizes:      regrouped expert by expert, through them
                                    rows per rank)   <----all_to_all----  outputs, back in place

An expert's gradient is non-zero only on the ranks that computed it, each the sum over the tokens
of its ep group; the world's mean of those sums is one process's gradient.

Under dp (`paratrain run`) each rank keeps only its own experts' weights (weights.py: the gpt's
experts, a Hugging Face experts module's slices of its stacks): expert memory (weights, gradients,
optimizer state) divides by E, their gradients averaged over the ranks keeping the same experts
with the world's divisor (dp/experts.py); checkpoints and final/ stay the dense model's, resumable
at any ep. zero1-3 keep the same split, ZeRO-sharded over the ranks keeping the same experts
(zero/experts.py). Every rank keeps every expert where the weights are not split, the world's
mean then giving the same gradient: a compressing codec, the Python API's own loop."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from paratrain.comm.grid import DataMesh
from paratrain.errors import ConfigError
from paratrain.models.hf import hf_experts
from paratrain.models.moe import expert_layers
from paratrain.parallel.expert.all_to_all import all_to_all, exchange_counts
from paratrain.parallel.expert.hf_experts import route_over_ranks
from paratrain.parallel.expert.verify import DispatchVerifier


class ExpertParallel:
    """The dispatcher of a model's MoE layers: the built-in gpt's (their `paratrain_experts` hook)
    and transformers' experts modules (hf_experts.py, their forward). `verify`: train.precision
    where parallel.verify_plan checks the dispatch on the first step (verify.py), else None."""

    def __init__(self, model: nn.Module, mesh: DataMesh, verify: str | None = None):
        self.mesh = mesh
        self.layers = expert_layers(model)
        self.hf_experts = hf_experts(model)
        if not self.layers and not self.hf_experts:
            raise ConfigError("parallel.ep", no_experts(model))
        for layer in self.layers:
            layer.paratrain_experts = self.dispatch  # type: ignore[assignment]  # torch types a module's attribute as a tensor or module
        for module in self.hf_experts:
            route_over_ranks(module, self.exchange)
        layers = [*self.layers, *self.hf_experts]
        self.verifier = DispatchVerifier(model, layers, mesh, verify) if verify else None

    def dispatch(self, layer, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The gpt's hook: `grouped`, this rank's routed rows expert by expert (`counts` each), through
        the layer's experts on the ranks that hold them."""

        def run(rows, local_counts, first: int):
            return layer.run_experts(rows, local_counts, layer.experts[first : first + len(local_counts)])

        return self.exchange(grouped, counts, run, layer)

    def exchange(self, grouped: torch.Tensor, counts: torch.Tensor, run: Callable, layer: nn.Module) -> torch.Tensor:
        """`grouped`: this rank's routed rows, expert by expert (`counts` each, one per expert of the
        layer); returns their outputs in the same order, computed on the ranks that hold the experts
        by `run(rows, counts, first)`: rows grouped by this rank's experts first, first+1, ...
        `layer`: the MoE layer or experts module it runs for (what parallel.verify_plan checks)."""
        out = self._exchange(grouped, counts, run)
        if self.verifier is not None:
            self.verifier.check(layer, grouped, counts, run, out)
            if self.verifier.done():  # every kind checked: nothing more runs, compiled or not
                self.verifier = None
        return out

    def _exchange(self, grouped: torch.Tensor, counts: torch.Tensor, run: Callable) -> torch.Tensor:
        ep, rank, group = self.mesh.ep, self.mesh.ep_rank, self.mesh.ep_group
        local = len(counts) // ep
        arriving = exchange_counts(counts, group).view(ep, local)  # [source rank, my expert]
        send = counts.view(ep, local).sum(1).tolist()
        receive = arriving.sum(1).tolist()
        rows = all_to_all(grouped, send, receive, group)  # source rank by source rank
        # regroup expert by expert (stable: each expert's rows in source-rank order)
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(arriving.reshape(-1))
        order = expert_of_row.argsort(stable=True)
        out = run(rows[order], arriving.sum(0), rank * local)
        if rows.requires_grad and not out.requires_grad:
            # no row arrived and the experts left their empty output unconnected: the backward's
            # exchange must still run on this rank, as on every rank of the group
            out = out + rows.sum() * 0
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order), device=order.device)
        return all_to_all(out[back], receive, send, group)


def no_experts(model: nn.Module) -> str:
    return (
        f"{type(model).__name__} has no mixture-of-experts layers to split (gpt: model.n_experts; Hugging Face: "
        "experts modules called with top_k_index and top_k_weights, as Mixtral's and Qwen2-MoE's)"
    )


def check_experts(cfg, model: nn.Module) -> None:
    """Before any worker starts (`model` on meta): every MoE layer's experts divide by ep."""
    counts = [(layer.n_experts, "model.n_experts") for layer in expert_layers(model)]
    counts += [(m.num_experts, f"{type(m).__name__}'s") for m in hf_experts(model)]
    if not counts:
        raise ConfigError("parallel.ep", no_experts(model))
    for n, whose in counts:
        if n % cfg.parallel.ep:
            raise ConfigError("parallel.ep", f"{cfg.parallel.ep} does not divide the {n} experts ({whose})")


def expert_parallel(model: nn.Module, mesh: DataMesh, verify: str | None = None) -> ExpertParallel | None:
    """The model's MoE layers dispatching over the mesh's ep group (None when ep is 1); `verify`:
    ExpertParallel's."""
    return ExpertParallel(model, mesh, verify) if mesh.ep > 1 else None
