"""A model as a sequence of layers: what pipeline parallelism cuts, recomputation wraps block by
block and the planner plays stage by stage, and the model's structure on the meta device."""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn

from paratrain.data.batch import feed, tensors_in, tree_map
from paratrain.models.hf_pipeline import transformers_layers


def pipeline_layers(model: nn.Module) -> list[nn.Module] | None:
    """The model's own pipeline_layers(), an nn.Sequential's children, or a transformers decoder's
    layers from its base_model_pp_plan (models/hf_pipeline.py); None: the model cannot be cut."""
    if hasattr(model, "pipeline_layers"):
        return list(cast(Any, model).pipeline_layers())  # its own method: torch's stub says Tensor | Module
    if isinstance(model, nn.Sequential):
        return list(model)  # as forward runs them: children() lists a module used twice once
    return transformers_layers(model)


def layers_of(model: nn.Module) -> list[nn.Module]:
    """pipeline_layers(model) of a model already known to be cut (parallel.pp > 1 was checked)."""
    layers = pipeline_layers(model)
    assert layers is not None, f"{type(model).__name__} cannot be cut into layers"
    return layers


def meta_copy(model: nn.Module) -> nn.Module:
    """The model's structure with every tensor on the meta device (no copy of the weights)."""
    memo: dict[int, torch.Tensor] = {
        id(t): nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad) for t in model.parameters()
    }
    memo.update({id(t): torch.empty_like(t, device="meta") for t in model.buffers()})
    return copy.deepcopy(model, memo)


def boundary_shape_fn(meta_layers: list[list[nn.Module]]):
    """Shapes and dtypes of the activation entering each virtual stage, for a microbatch input,
    found by running the unsplit model on the meta device (no memory, no communication). The
    first stage's entry is the input's first tensor (a batch may be a dict: data/batch.py); the
    last stage's layers are not run, their output going nowhere (so without pp nothing runs)."""
    cache: dict[tuple, list] = {}

    def shapes(x) -> list[tuple[torch.Size, torch.dtype]]:
        key = tuple((tuple(t.shape), t.dtype) for t in tensors_in(x))
        if key not in cache:
            out, act = [], tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), x)
            with torch.no_grad():
                for s, layers in enumerate(meta_layers):
                    lead = tensors_in(act)[0]
                    out.append((lead.shape, lead.dtype))
                    if s == len(meta_layers) - 1:
                        break
                    for i, layer in enumerate(layers):
                        # eval: batch norm's momentum=None counts batches with .item(), which a
                        # meta tensor has not; the shapes are the same
                        act = feed(layer.eval(), act) if s == 0 and i == 0 else layer.eval()(act)
            cache[key] = out
        return cache[key]

    return shapes
