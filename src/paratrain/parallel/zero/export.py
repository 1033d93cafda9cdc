"""ZeRO's consolidated model for the export: unit by unit, parameters in full precision."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from paratrain.parallel.zero.comm import FlatUnit


def full_precision_layout(units: list[FlatUnit], model: nn.Module) -> dict:
    """The user's model: parameters in their full precision (the masters'), even where the
    working copy is bf16."""
    master = {id(p): u.master.dtype for u in units for p in u.params}
    return {k: (master.get(id(v), v.dtype), v.shape) for k, v in model.state_dict(keep_vars=True).items()}


def unit_chunks(
    units: list[FlatUnit],
    model: nn.Module,
    first: bool,
    gather: Callable[[FlatUnit], torch.Tensor],
    release: Callable[[FlatUnit], None],
) -> Iterator[dict[str, torch.Tensor]]:
    """Unit by unit, its whole flat parameter in full precision (`gather`, a collective) handed
    over on the first rank, then `release`d; then what every rank holds whole (buffers, stages 1
    and 2's frozen parameters)."""
    names: dict[int, list[str]] = {}  # a tied parameter has several
    for k, v in model.state_dict(keep_vars=True).items():
        names.setdefault(id(v), []).append(k)
    whole = dict(names)
    for u in units:
        flat = gather(u)
        if first:
            yield {k: v for p, v in zip(u.params, u.views(flat)) for k in names.get(id(p), ())}
        release(u)
        for p in u.params:
            whole.pop(id(p), None)
    if first:  # keep_vars: the user's state_dict() would gather units, a collective
        state = model.state_dict(keep_vars=True)
        yield {k: state[k].detach() for keys in whole.values() for k in keys}
