"""Expert parallelism for Hugging Face MoE models: transformers' experts modules (Mixtral's,
Qwen2-MoE's and most MoE families' `@use_experts_implementation` classes) found by their interface,
no user code.

Such a module holds every expert's weights as 3-D stacks (experts first) and is called by its MoE
block with each token's top-k expert indices and routing weights, as the block's own router chose
and normalized them; it returns each token's weighted sum of its experts' outputs. Under parallel.ep
its forward becomes: the routing slots grouped by expert, sent by all-to-all to the ranks holding
those experts (experts.py), each row through its expert there by the module's own forward (its
experts implementation: eager, grouped_mm, ...) at weight 1, back, then weighted and summed here.
Every family of this interface applies the routing weight as the last factor of an expert's output
(checked in transformers 5.24), so weighting after the trip back is the model's own arithmetic.

The router, its top-k and renormalization, shared experts and the auxiliary load-balancing loss
(output_router_logits) stay the model's, on the rank's own tokens (under parallel.cp the whole
sequences', context/hf_balance.py): parallel.ep changes where the experts compute, nothing the
router sees."""

from __future__ import annotations

from functools import partial
from typing import cast

import torch
from torch import nn


def route_over_ranks(module: nn.Module, exchange) -> None:
    """`module`'s forward sends its routed tokens through `exchange` (ExpertParallel.exchange)."""
    # an instance attribute, so the class's forward (the experts implementation) stays callable
    # for the experts' own compute, and the module, its parameters and names stay the model's
    module.forward = partial(_routed_forward, module, exchange)


def _routed_forward(
    module: nn.Module, exchange, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    k = top_k_index.shape[-1]
    slots = top_k_index.reshape(-1)  # token i's k choices at slots i*k .. i*k+k-1
    order = slots.argsort(stable=True)  # routing slots grouped by expert
    # every expert of the layer (the module's own num_experts is its slice's where dp keeps it alone)
    total = getattr(module, "paratrain_all_experts", module.num_experts)
    counts = torch.bincount(slots, minlength=cast(int, total))  # an int: _is_routed_experts
    token = order // k
    out = exchange(hidden_states[token], counts, partial(_run_local_experts, module), module)
    weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(hidden_states).index_add_(0, token, weighted.to(hidden_states.dtype))


def _run_local_experts(module: nn.Module, rows: torch.Tensor, counts: torch.Tensor, first: int) -> torch.Tensor:
    """`rows` cut by `counts` (experts first, first+1, ...), each through its expert by the module's
    own forward: one routing slot per row, weight 1."""
    if hasattr(module, "paratrain_all_experts"):  # the module keeps these experts alone, from 0 (weights.py)
        first = 0
    expert = first + torch.repeat_interleave(torch.arange(len(counts), device=rows.device), counts)
    ones = rows.new_ones(len(rows), 1)
    return type(module).forward(module, rows, expert.unsqueeze(1), ones)
