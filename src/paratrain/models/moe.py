"""A mixture-of-experts feed-forward layer (the built-in gpt's `n_experts`): a token-choice top-k
router, no capacity limit (no token is ever dropped, so the layer equals its dense evaluation at
any layout), and Switch/Mixtral's auxiliary load-balancing loss.

    tokens --router--> top-k experts per token --(grouped by expert)--> experts --weighted sum--> out

The experts run on whatever `paratrain_experts` says: None runs every expert here; parallel.ep
sets it to a dispatcher that sends each expert's tokens to the rank holding it (parallel/expert/).

The load-balancing loss is taken per sequence (DeepSeek-V3's sequence-wise form) and averaged over
the batch: with f_se the share of sequence s's routing slots that chose expert e and P_se its mean
router probability, aux = n_experts * mean_s sum_e f_se * P_se, times `moe_aux_loss`. Per sequence,
it is a mean over samples, as the task loss is: any split of the batch over data-parallel ranks or
micro-batches averages back to one process's value (under parallel.cp, whose ranks each hold part
of a sequence, the shares are summed over the ring: `_balance_loss`). `paratrain_aux_loss` holds the last training
forward's weighted value; models/__init__'s loss wrapper adds it to the loss."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake


class MixtureOfExperts(nn.Module):
    paratrain_experts = None  # parallel.ep: (layer, tokens grouped by expert, counts) -> their outputs
    # parallel.cp: (C, sum over the ring) where this rank holds 1/C of each sequence (parallel/context)
    paratrain_sequence_split = None

    def __init__(self, d_model: int, n_experts: int, top_k: int, aux_weight: float, expert):
        super().__init__()
        self.n_experts, self.top_k, self.aux_weight = n_experts, top_k, aux_weight
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(expert() for _ in range(n_experts))
        self.paratrain_aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        tokens = x.reshape(-1, D)
        probs = self.router(tokens).softmax(-1)  # (N, E)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.top_k > 1:  # Mixtral: the chosen weights sum to 1 (top-1 keeps Switch's raw probability)
            weights = weights / weights.sum(-1, keepdim=True)
        slots = chosen.reshape(-1)  # token i's k choices at rows i*k .. i*k+k-1
        order = slots.argsort(stable=True)  # routing slots grouped by expert
        counts = self._counts(slots)
        grouped = tokens[order // self.top_k]
        if self.paratrain_experts is None:
            out = self.run_experts(grouped, counts, self.experts)
        else:
            out = self.paratrain_experts(self, grouped, counts)
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        # under autocast the experts' outputs are bf16 and the residual stream is not: summed in its dtype
        combined = torch.zeros_like(tokens).index_add_(0, order // self.top_k, out.to(tokens.dtype))
        self.paratrain_aux_loss = self._balance_loss(probs, slots, B) if self.training and self.aux_weight else None
        return combined.view(B, T, D)

    def _counts(self, slots: torch.Tensor) -> torch.Tensor | list[int]:
        """How many routing slots chose each expert. In `paratrain plan`'s fake tensors there are no
        values to count: the plan assumes routing in balance, as a list (no tensor to read)."""
        if is_fake(slots) or slots.device.type == "meta":
            base, extra = divmod(slots.numel(), self.n_experts)
            return [base + (e < extra) for e in range(self.n_experts)]
        return torch.bincount(slots, minlength=self.n_experts)

    @staticmethod
    def run_experts(grouped: torch.Tensor, counts, experts) -> torch.Tensor:
        """`grouped` rows cut by `counts` (one count per expert of `experts`), each part through its
        expert; the outputs in the same row order."""
        parts = grouped.split(counts if isinstance(counts, list) else counts.tolist())
        return torch.cat([expert(part) for expert, part in zip(experts, parts)])

    def _balance_loss(self, probs: torch.Tensor, slots: torch.Tensor, batch: int) -> torch.Tensor:
        """Under parallel.cp a rank holds 1/C of each sequence: the shares f_se are summed over the
        ring (counts: no gradient), P_se is this rank's part of the sum, and the loss is taken C
        times, so that the mean over the ring (the gradient's and the logged loss's) is the whole
        sequence's."""
        E = self.n_experts
        chosen = probs.new_zeros(len(slots), E).scatter_(1, slots.unsqueeze(1), 1.0).view(batch, -1, E)  # (B, T*k, E)
        split, ring_sum = self.paratrain_sequence_split or (1, None)
        share = chosen.sum(1) / (chosen.shape[1] * split)  # f_se over the whole sequence
        if ring_sum is not None:
            share = ring_sum(share)
        part_prob = probs.view(batch, -1, E).sum(1) / (probs.shape[0] // batch * split)  # this rank's part of P_se
        return self.aux_weight * E * split * (share * part_prob).sum(-1).mean()


def auxiliary_losses(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that leave an auxiliary loss after a training forward."""
    return [m for m in model.modules() if hasattr(m, "paratrain_aux_loss")]


def with_auxiliary_losses(loss_fn, model: nn.Module):
    """`loss_fn` plus the auxiliary losses the model's last forward left (none: `loss_fn` itself)."""
    layers = auxiliary_losses(model)
    if not layers:
        return loss_fn

    def loss(output, target):
        total = loss_fn(output, target)
        for layer in layers:
            if layer.paratrain_aux_loss is not None:
                total = total + layer.paratrain_aux_loss.to(total.dtype)
                layer.paratrain_aux_loss = None  # type: ignore[assignment]  # torch types a module's attribute as a tensor or module; once: the next forward leaves its own
        return total

    return loss


def expert_layers(model: nn.Module) -> list[nn.Module]:
    """The model's layers with parallel.ep's hook (MixtureOfExperts and its kind)."""
    return [m for m in model.modules() if hasattr(type(m), "paratrain_experts")]
