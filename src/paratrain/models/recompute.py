"""`train.recompute = "full"`: activation recomputation per block (torch.utils.checkpoint).

A block is a layer that has parameters together with the parameterless layers after it (gpt: the
embedding, each transformer block, the head; mlp: Linear + ReLU; cnn: Conv2d + ReLU (+ pool,
flatten)). A layer alone would save nothing: a ReLU's checkpoint keeps its input, which is what the
ReLU saved anyway. Under recompute a block keeps only its input for backward and runs its forward
again during backward. The same arithmetic runs, so training stays equal to no recompute.

The grouping is by execution only (no wrapper modules), so parameter names, the pipeline's layers
and every strategy's sharding are unchanged.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.errors import ConfigError


def blocks(layers: list[nn.Module]) -> list[list[nn.Module]]:
    """Consecutive layers grouped so that each group starts at a layer with parameters."""
    groups: list[list[nn.Module]] = []
    for layer in layers:
        has_params = next(layer.parameters(), None) is not None
        if has_params or not groups:
            groups.append([layer])
        else:
            groups[-1].append(layer)
    return groups


def _run(layers: list[nn.Module], x):
    for layer in layers:
        x = layer(x)
    return x


def run_layers(layers: list[nn.Module], x, recompute: bool):
    """The layers one after another; under recompute each block checkpointed."""
    if not recompute:
        return _run(layers, x)
    for block in blocks(layers):
        # non-reentrant: also right for a block whose input needs no gradient (the token ids)
        x = checkpoint(partial(_run, block), x, use_reentrant=False)
    return x


class RecomputedSequential(nn.Sequential):
    """An nn.Sequential model whose forward recomputes per block (same children, same names)."""

    recompute = True

    def forward(self, x):
        return run_layers(list(self), x, True)


def enable_recompute(model: nn.Module, name: str) -> None:
    """Switch a built model to recompute per block: models with a `recompute` attribute (gpt) set
    it; a model with a switch of its own uses it (transformers' activation_checkpointing_enable(),
    called gradient_checkpointing_enable() before transformers 5.24 and removed under that name in
    6; timm's set_grad_checkpointing()); an nn.Sequential (mlp, cnn, a user's) runs its children by
    block."""
    if hasattr(model, "recompute"):
        model.recompute = True
    elif callable(getattr(model, "activation_checkpointing_enable", None)):
        # non-reentrant, as ours: right for blocks whose input needs no gradient
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif callable(getattr(model, "gradient_checkpointing_enable", None)):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif callable(getattr(model, "set_grad_checkpointing", None)):
        model.set_grad_checkpointing(True)
    elif type(model) is nn.Sequential:
        model.__class__ = RecomputedSequential
    else:
        raise ConfigError(
            "train.recompute",
            f"{name} builds a {type(model).__name__}, which neither is an nn.Sequential nor has a "
            f"`recompute` attribute or activation_checkpointing_enable() to switch recomputation on",
        )
