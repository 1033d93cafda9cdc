"""`parallel.verify_plan` under ep: the expert dispatch verified on the first training step, not
trusted.

The dispatch sends each routed row to the rank holding its expert and brings its output back into
place (experts.py): split sizes, a regrouping by expert and its inverse, two all-to-alls. A row sent
to the wrong expert, or brought back to the wrong place, gives outputs of the right shape and the
wrong values. So the first training forward checks one MoE layer of each kind (its class: the
gpt's `MixtureOfExperts`, a transformers experts module's) where the dispatch runs:

    dispatched  the layer's routed rows' outputs, as the step computes them (all-to-all and back)
    whole       the same rows through every expert of the layer here, by the layer's own compute,
                no gradient; where this rank keeps only its experts' weights (dp, weights.py) the
                layer's expert weights are gathered over the ep group first, for this layer alone,
                and let go after
    verdict     parallel/verify: a relative error above the equivalence tolerance exits 2 naming the
                module and parallel.ep, on every rank (one agreed line); a pass is said once

Its cost: per kind, once, one layer's experts run on this rank's rows, and (dp) one all-gather of
that layer's expert weights."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import cast

import torch
from torch import nn

from paratrain.comm import collectives
from paratrain.comm.grid import DataMesh
from paratrain.parallel.expert.weights import expert_stacks
from paratrain.parallel.verify.verdict import FirstOfKind, how_far, relative_error, tolerance, verdict


class DispatchVerifier(FirstOfKind):
    """Checks the first dispatch of each kind of MoE layer against its experts all run here."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], mesh: DataMesh, precision: str):
        super().__init__(model, layers, precision)
        self.mesh = mesh

    @torch.compiler.disable  # once, eagerly: a compiled block breaks its graph here until then
    def check(self, layer: nn.Module, grouped: torch.Tensor, counts, run: Callable, out: torch.Tensor) -> None:
        """Collective over the world, on the first training forward of each kind (every rank runs
        the same layers in the same order). `grouped`, `counts`, `run`: ExpertParallel.exchange's;
        `out`: what it returned. ConfigError naming the module and parallel.ep."""
        kind = self.first(layer)
        if kind is None:
            return
        with torch.no_grad(), collectives.unprofiled(), self._whole(layer):  # once, not the step's traffic
            err = relative_error(out, run(grouped.detach(), counts, 0))  # every expert, from the first
        where, limit = self.where(layer, kind), tolerance(self.precision)
        verdict(
            "parallel.ep",
            err,
            limit,
            f"the expert dispatch does not compute {where} as its experts all run on one rank do "
            f"({how_far(err)} on the first step, tolerance {limit:g}): rows go to the wrong experts or come "
            f"back to the wrong places; parallel.verify_plan = false skips this check",
            f"parallel.ep's expert dispatch in {where} equals its experts all run here",
            out.device,
        )

    def _whole(self, layer: nn.Module) -> contextlib.AbstractContextManager:
        if hasattr(layer, "paratrain_all_experts"):  # a transformers experts module keeping its slice
            return self._whole_stacks(layer)
        if isinstance(getattr(layer, "experts", None), nn.ModuleList):  # the gpt's, maybe some dropped
            return self._whole_modules(cast(nn.ModuleList, layer.experts))
        return contextlib.nullcontext()  # every expert's weights are here (zero1-3)

    @contextlib.contextmanager
    def _whole_stacks(self, module: nn.Module) -> Iterator[None]:
        """The module's stacks whole (each rank's slice gathered, in ep-rank order) and its
        num_experts every expert's, for the check alone."""
        ep, kept = self.mesh.ep, cast(int, module.num_experts)
        stacks = expert_stacks(module, kept)
        for attr, part in stacks:
            parts = [torch.empty_like(part) for _ in range(ep)]
            collectives.all_gather(parts, part.detach().contiguous(), "verify-plan-ep", self.mesh.ep_group)
            setattr(module, attr, nn.Parameter(torch.cat(parts), requires_grad=False))
        setattr(module, "num_experts", kept * ep)  # noqa: B010  a plain int (torch types module attributes)
        try:
            yield
        finally:
            for attr, part in stacks:
                setattr(module, attr, part)
            setattr(module, "num_experts", kept)  # noqa: B010

    @contextlib.contextmanager
    def _whole_modules(self, experts: nn.ModuleList) -> Iterator[None]:
        """Every expert's parameters present: those of the experts this rank dropped (weights.py:
        all of an expert's, registered as None) filled from the ranks keeping them (one all-gather
        of each rank's experts, flat, in order), for the check alone."""
        ep, rank = self.mesh.ep, self.mesh.ep_rank
        local = len(experts) // ep
        dropped = [e for e, expert in enumerate(experts) if not any(True for _ in expert.parameters())]
        if not dropped:  # every rank keeps every expert (zero1-3, a codec): the same on every rank
            yield
            return
        mine = experts[rank * local : (rank + 1) * local]
        flat = torch.cat([p.detach().reshape(-1) for expert in mine for p in expert.parameters()])
        parts = [torch.empty_like(flat) for _ in range(ep)]
        collectives.all_gather(parts, flat, "verify-plan-ep", self.mesh.ep_group)
        # every expert is the same module (the layer's `expert()`): where this rank's first keeps a
        # parameter, each keeps one of its shape, in the same order
        shapes = [p.shape for p in mine[0].parameters()]
        width = sum(shape.numel() for shape in shapes)
        places = _places(mine[0])
        used = [i for i, (sub, key) in enumerate(places) if sub._parameters[key] is not None]  # a bias=False's not
        slots = {e: [_places(experts[e])[i] for i in used] for e in dropped}
        try:
            for e in dropped:
                offset = (e % local) * width
                for (sub, key), shape in zip(slots[e], shapes):
                    value = parts[e // local][offset : offset + shape.numel()].view(shape)
                    sub._parameters[key] = nn.Parameter(value, requires_grad=False)
                    offset += shape.numel()
            yield
        finally:
            for e in dropped:
                for sub, key in slots[e]:
                    sub._parameters[key] = None


def _places(expert: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of each parameter place `expert` registers, held (a tensor) or not (None)."""
    return [(sub, key) for sub in expert.modules() for key in sub._parameters]
