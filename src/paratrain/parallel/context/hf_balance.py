"""parallel.cp for a Hugging Face MoE decoder's load-balancing loss (`output_router_logits`): the
whole sequences' loss, as one process computes it.

transformers' `load_balancing_loss_func` (Mixtral's, copied as it is by Qwen2-MoE, OLMoE and most
MoE families) is a statistic of the rows one forward sees: E * sum_e f_e * P_e, with f_e the share
of the routing slots that chose expert e and P_e expert e's mean router probability, pooled over
the layers. A rank of a ring sees 1/C of each sequence; a product of its chunks' shares and
probabilities is not the product of the whole sequences' (a tiny Mixtral at cp 2 drifted 1.3e-2
from one process in 10 steps).

So under cp the model computes no auxiliary loss of its own (`output_router_logits` turned off for
the call), its routers' logits are recorded by hooks on the router class that transformers' own
OutputRecorder names, and after the forward every rank gathers the ring's logits and runs the
family's own `load_balancing_loss_func` over the whole sequences' rows: one process's value on each
rank. Only the rank's own rows carry a gradient there, 1/C of the whole's on average over the ring
(where every gradient is averaged): the gradient is scaled by C, the value left as it is. The
model's weight (`router_aux_loss_coef`) times it is added to the loss, where the model adds its
own, when the model computes a loss (labels given).

Under data parallelism the loss stays a statistic of the batch a data rank holds, as without cp."""

from __future__ import annotations

import inspect
import sys
from typing import Any, cast

import torch
from torch import nn

from paratrain.comm import collectives

# the arguments of Mixtral's load_balancing_loss_func, which the forwards of its family call it with
SIGNATURE = ["gate_logits", "num_experts", "top_k", "attention_mask"]
ATTRIBUTES = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")  # what those forwards pass


def _parts(model: nn.Module) -> tuple[type[nn.Module], int, Any] | None:
    """(the router class, the index of its logits in its output, the family's loss function) where
    the model computes its auxiliary loss as Mixtral does, else None."""
    recorder: Any = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    loss_func = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    # one OutputRecorder naming the router class (not a class name, nor one layer's name)
    if not isinstance(getattr(recorder, "target_class", None), type) or getattr(recorder, "layer_name", None):
        return None
    if loss_func is None or list(inspect.signature(loss_func).parameters) != SIGNATURE:
        return None
    if not all(hasattr(model, name) for name in ATTRIBUTES):
        return None
    return recorder.target_class, recorder.index, loss_func


def refusal(model: nn.Module) -> str | None:
    """Why the model's load-balancing loss cannot be made the whole sequences' (None where it can,
    or where the model computes none)."""
    if not getattr(cast(Any, model).config, "output_router_logits", False) or _parts(model) is not None:
        return None
    return (
        f"{type(model).__name__}'s router load-balancing loss is not transformers' Mixtral form, which "
        "paratrain takes over the ring (set output_router_logits = false)"
    )


class RingBalance:
    """The hooks of the module's docstring on `model`, over the cp group of `mesh`: `router`'s
    output[`index`] recorded, the family's `loss_func` run over the ring's rows."""

    def __init__(self, model: nn.Module, mesh, router: type[nn.Module], index: int, loss_func):
        self.index, self.loss_func = index, loss_func
        self.model, self.mesh = model, mesh
        self.logits: list[torch.Tensor] | None = None  # during a forward that asked for the loss
        for module in model.modules():
            if isinstance(module, router):
                module.register_forward_hook(self.record)
        model.register_forward_pre_hook(self.start, with_kwargs=True)
        model.register_forward_hook(self.finish)

    def start(self, _module, args, kwargs):
        wanted = kwargs.get("output_router_logits")
        wanted = cast(Any, self.model.config).output_router_logits if wanted is None else wanted
        self.logits = [] if wanted else None
        if wanted:
            kwargs["output_router_logits"] = False  # the loss is added after the forward, over the ring
        return args, kwargs

    def record(self, _module, _args, output) -> None:
        # recomputed layers (train.recompute) run their routers again in backward: not recorded
        if self.logits is not None:
            self.logits.append(output[self.index])

    def finish(self, _module, _args, output) -> None:
        logits, self.logits = self.logits, None
        if logits is None or getattr(output, "loss", None) is None:  # no labels: the model adds none either
            return
        model = cast(Any, self.model)
        aux = self.whole_sequences(logits, model.num_experts, model.num_experts_per_tok)
        output.loss = output.loss + model.router_aux_loss_coef * aux.to(output.loss.device)

    def whole_sequences(self, logits: list[torch.Tensor], experts: int, top_k: int) -> torch.Tensor:
        """The family's loss over the ring's rows of every layer, this rank's own rows in place; its
        gradient C times theirs (the module's docstring): the value is unchanged, as x - x is 0."""
        cp, me = self.mesh.cp, self.mesh.cp_rank
        mine = torch.stack(logits)  # (layers, rows, experts): every layer routes the same tokens
        gathered = mine.new_empty((cp * len(mine), *mine.shape[1:]))  # concatenated in rank order
        collectives.all_gather_into(gathered, mine.detach().contiguous(), "cp-router-balance", self.mesh.cp_group)
        gathered = gathered.view(cp, *mine.shape)
        rows = [
            torch.cat([mine[layer] if r == me else gathered[r, layer] for r in range(cp)])
            for layer in range(len(logits))
        ]
        # no attention_mask: cp stops at a mask with padding (hf.py), and a mask of ones weighs each row 1
        aux = self.loss_func(tuple(rows), experts, top_k, None)
        return aux + (cp - 1) * (aux - aux.detach())


def install(model: nn.Module, mesh) -> None:
    """The hooks where the model computes a load-balancing loss paratrain can take over the ring."""
    if (parts := _parts(model)) is not None:
        RingBalance(model, mesh, *parts)
