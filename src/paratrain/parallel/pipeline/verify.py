"""`parallel.verify_plan` under pp: the pipeline's cuts verified before training, not trusted.

A pipeline runs the model as its `pipeline_layers()` one after another, each stage sending the last
one's output on. A model whose own forward does something between those layers (a scale, an
activation, a residual the layer list forgets) trains silently wrong when cut there. So before the
layers are cut (every rank still holds them all), on the first microbatch of the training data:

    whole    the model's own forward, no gradient, in eval mode (no dropout: both runs alike); the
             input each stage's first layer receives there, where the model calls it (a forward
             pre-hook: layers that wrap the model's modules, as transformers' are, are not called
             by it and are checked by the output alone)
    chained  the layers one after another, as the stages run them
    verdict  at each cut the chain's activation against the whole forward's, and at the end the
             chain's output against the model's: relative error above the equivalence tolerance
             exits 2 naming the cut (the layer it starts at) or the end

Its cost: two forwards of the whole model on one microbatch, once, before the first step."""

from __future__ import annotations

import functools

import torch
from torch import nn

from paratrain.data.batch import feed, tensors_in
from paratrain.errors import ConfigError
from paratrain.parallel.verify.verdict import how_far, relative_error, tolerance

TOLERANCE = tolerance("fp32")  # the same layers on the same input, in fp32: summation order at most


def _lead(out) -> torch.Tensor | None:
    """The tensor an output stands for: its logits where it has them, else its first tensor."""
    from paratrain.optim import output_logits

    try:
        return output_logits(out)
    except TypeError:
        found = tensors_in(out)
        return found[0] if found else None


def _relative_error(got, want) -> float:
    a, b = _lead(got), _lead(want)
    return float("inf") if a is None or b is None else relative_error(a, b)


def check_cuts(model: nn.Module, layers: list[nn.Module], bounds: list[int], x) -> None:
    """ConfigError naming the first cut (or the end) where the chained layers differ from the
    model's own forward on `x` (module docstring); every rank computes the same verdict."""
    names = {id(m): n for n, m in model.named_modules()}
    seen: dict[int, object] = {}

    def capture(b: int, module, args):
        seen.setdefault(b, args[0] if args else None)

    cuts = bounds[1:-1]
    handles = [layers[b].register_forward_pre_hook(functools.partial(capture, b)) for b in cuts]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole = feed(model, x)
            for handle in handles:
                handle.remove()
            act = x
            for s in range(len(bounds) - 1):
                b = bounds[s]
                if s > 0 and seen.get(b) is not None and (err := _relative_error(act, seen[b])) > TOLERANCE:
                    name = names.get(id(layers[b]), f"layer {b}")
                    _mismatch(f"the cut before layer {b} ({name!r})", err)
                for i, layer in enumerate(layers[bounds[s] : bounds[s + 1]]):
                    act = feed(layer, act) if s == 0 and i == 0 else layer(act)
        err = _relative_error(act, whole)
        if err > TOLERANCE:
            _mismatch("the end of the last stage", err)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)


def _mismatch(where: str, err: float) -> None:
    how = how_far(err)
    raise ConfigError(
        "parallel.pp",
        f"the pipeline does not compute the model's forward at {where} ({how} on the first "
        f"microbatch): the model's forward does something between or after its pipeline_layers() "
        f"that the stages would drop; give pipeline_layers() that carry it (parallel.verify_plan = "
        f"false skips this check)",
    )
