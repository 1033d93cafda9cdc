"""Turn a model built on the meta device into real values one module at a time.

A sharded strategy builds the model under `torch.device("meta")` (shapes only, no memory) and then
asks for the values module by module, keeping only its shard of each before the next one is made,
so no rank ever holds the whole model. The values must be exactly those of a normal build with the
same seed, so the construction's random-number stream is replayed in the same order:

  phase 1  every module's `reset_parameters()`, in construction (registration, pre-order) order:
           this is all the initialisation of mlp and cnn;
  phase 2  the model's own pass after construction, if it has one: gpt re-initialises its Linear and
           Embedding weights with `self.apply(self._init_weights)` (post-order). A tensor that the pass
           leaves alone keeps its phase-1 value; which ones it touched is seen by pre-filling with NaN.

This holds for models whose initialisation is made of such steps, the built-ins; a user's model
with other initialisation code is built normally and sharded afterwards.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

# keep(meta_tensor, value): called for every parameter and buffer of the meta model (identified by
# its meta tensor) as soon as its value is final; called again for a tensor that phase 2 overwrites.
Keep = Callable[[torch.Tensor, torch.Tensor], None]


def _direct_tensors(module: nn.Module) -> dict[str, dict]:
    return {"_parameters": {k: v for k, v in module._parameters.items() if v is not None},
            "_buffers": {k: v for k, v in module._buffers.items() if v is not None}}


def _with_real_tensors(module: nn.Module, fill: float | None, device: torch.device, run: Callable[[], None],
                       keep: Keep, only_changed: bool) -> None:
    """Give `module` real (empty or `fill`ed) direct tensors, `run`, hand the values to `keep`, undo."""
    originals = _direct_tensors(module)
    for kind, tensors in originals.items():
        for name, t in tensors.items():
            real = torch.empty(t.shape, dtype=t.dtype, device=device)
            if fill is not None and real.is_floating_point():
                real.fill_(fill)
            getattr(module, kind)[name] = nn.Parameter(real, t.requires_grad) if kind == "_parameters" else real
    try:
        with torch.no_grad():
            run()
        for kind, tensors in originals.items():
            for name, meta_tensor in tensors.items():
                value = getattr(module, kind)[name].detach()
                if only_changed and value.is_floating_point() and torch.isnan(value).all():
                    continue
                keep(meta_tensor, value)
    finally:
        for kind, tensors in originals.items():
            getattr(module, kind).update(tensors)


def materialize(model: nn.Module, seed: int, keep: Keep, device: torch.device | str = "cpu") -> None:
    """Replay the initialisation of the meta-device `model` built with `seed`; `model` stays on meta."""
    device = torch.device(device)
    post_init = getattr(model, "_init_weights", None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in model.modules():  # phase 1
            if any(_direct_tensors(module).values()):
                reset = getattr(module, "reset_parameters", None) or (lambda: None)
                _with_real_tensors(module, None, device, reset, keep, only_changed=False)
        if post_init is not None:  # phase 2, in the order of nn.Module.apply (children first)
            order: list[nn.Module] = []
            model.apply(order.append)
            for module in order:
                if any(_direct_tensors(module).values()):
                    _with_real_tensors(module, float("nan"), device, lambda m=module: post_init(m), keep,
                                       only_changed=True)
