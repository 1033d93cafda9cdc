"""`train.recompute`: activation recomputation per block (torch.utils.checkpoint).

    none        autograd keeps what each op saves for backward
    full        a block keeps only its input and runs its whole forward again in backward
    selective   torchtitan's op-level policy: a block keeps its input, its attention's output and
                every other matrix product's (the 1st, 3rd, ... mm/addmm in the order its forward
                runs them; other products, convolutions and bmm, all kept): in backward the cheap
                ops between them (norms, activations, adds) and the other half of the matrix
                products run again. A Llama layer keeps q, v, gate and down and recomputes k, o
                and up: about a third of its forward's matmul FLOPs for half their outputs' memory

A block is a layer that has parameters together with the parameterless layers after it (gpt: the
embedding, each transformer block, the head; mlp: Linear + ReLU; cnn: Conv2d + ReLU (+ pool,
flatten)). A layer alone would save nothing: a ReLU's checkpoint keeps its input, which is what the
ReLU saved anyway. Under recompute a block keeps only its input for backward and runs its forward
again during backward. The same arithmetic runs, so training stays equal to no recompute.

The grouping is by execution only (no wrapper modules), so parameter names, the pipeline's layers
and every strategy's sharding are unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import flop_registry

from paratrain.errors import ConfigError

MODES = ("none", "full", "selective")
# The products selective recompute keeps, whose FLOPs torch's flop counter knows (matmuls,
# convolutions, attention), and the CPU's flash attention, which it counts under another name.
SAVED_OPS = frozenset(flop_registry) | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu}
# ... of which a block keeps every other one, counted in the order its forward runs them
ALTERNATED = frozenset({torch.ops.aten.mm, torch.ops.aten.addmm})

# who is told each decision the policy makes (watch_decisions)
_watchers: list[Callable[[Any, bool, Any], None]] = []


class SelectivePolicy:
    """One checkpointed block's decisions, op by op as its forward runs them (torch replays the
    decisions when backward recomputes the block)."""

    def __init__(self):
        self.products = 0

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        packet = func._overloadpacket
        if packet in ALTERNATED:
            self.products += 1
            keep = self.products % 2 == 1
        else:
            keep = packet in SAVED_OPS
        for watcher in _watchers:
            watcher(func, keep, ctx.op_output)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """checkpoint's context_fn for selective recompute (transformers' switch takes it too): a
    policy of its own for each block it checkpoints."""
    return create_selective_checkpoint_contexts(SelectivePolicy())


@contextlib.contextmanager
def watch_decisions(watcher: Callable[[Any, bool, Any], None]) -> Iterator[None]:
    """The plan's fake runs: watcher(func, kept, output) for each op a checkpointed block runs
    under selective recompute, right after the op ran (a dispatch mode entered outside the block
    has handled it by then); kept False: it runs again in backward. An op no checkpointed block
    runs is never reported: nothing recomputes it."""
    _watchers.append(watcher)
    try:
        yield
    finally:
        _watchers.remove(watcher)


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


def run_layers(layers: list[nn.Module], x, recompute: str):
    """The layers one after another; under recompute ("full", "selective") each block checkpointed."""
    if recompute == "none":
        return _run(layers, x)
    context: dict[str, Any] = {"context_fn": selective_context} if recompute == "selective" else {}
    for block in blocks(layers):
        # non-reentrant: also right for a block whose input needs no gradient (the token ids)
        x = checkpoint(partial(_run, block), x, use_reentrant=False, **context)
    return x


class RecomputedSequential(nn.Sequential):
    """An nn.Sequential model whose forward recomputes per block (same children, same names)."""

    recompute = "full"

    def forward(self, x):
        return run_layers(list(self), x, self.recompute)


def enable_recompute(model: nn.Module, name: str, mode: str = "full") -> None:
    """Switch a built model to recompute per block, `mode` "full" or "selective": models with a
    `recompute` attribute (gpt) set it; a model with a switch of its own uses it (transformers' activation_checkpointing_enable(),
    called gradient_checkpointing_enable() before transformers 5.24 and removed under that name in
    6; timm's set_grad_checkpointing()); an nn.Sequential (mlp, cnn, a user's) runs its children by
    block."""
    # non-reentrant, as ours: right for blocks whose input needs no gradient
    kwargs = {"use_reentrant": False, **({"context_fn": selective_context} if mode == "selective" else {})}
    own: Any = model  # its own attributes: torch's stub types them all Tensor | Module
    if hasattr(model, "recompute"):
        own.recompute = mode
    elif callable(getattr(model, "activation_checkpointing_enable", None)):
        own.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif callable(getattr(model, "gradient_checkpointing_enable", None)):
        own.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    elif callable(getattr(model, "set_grad_checkpointing", None)) and mode == "full":
        own.set_grad_checkpointing(True)
    elif type(model) is nn.Sequential:
        model.__class__ = RecomputedSequential
        own.recompute = mode
    else:
        raise ConfigError(
            "train.recompute",
            f"{name} builds a {type(model).__name__}, which neither is an nn.Sequential nor has a "
            f"`recompute` attribute or activation_checkpointing_enable() to switch recomputation on",
        )
