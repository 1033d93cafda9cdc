"""`parallel.verify_plan` under cp: the ring verified on the first training step, not trusted.

The ring computes causal attention from pieces: each rank's two chunks, blocks picked by the chunk
layout, outputs merged by log-sum-exp (attention.py). A wrong block, a chunk out of place or a
wrong merge gives outputs of the right shape and the wrong values, and training goes on, silently
wrong. So the first training forward checks one attention of each kind (its module's class: the
gpt's `Attention`, a transformers decoder's `LlamaAttention`, ...) where the ring computes it:

    ring     the attention's output on this rank's chunks, as the step computes it
    whole    the step's own (q, k, v) all-gathered over the cp group, put back in sequence order,
             and causal attention over the whole sequence (torch's sdpa, in fp32), no gradient;
             this rank's chunks of it
    verdict  parallel/verify: a relative error above the equivalence tolerance exits 2 naming the
             module and parallel.cp, on every rank (one agreed line); a pass is said once. The
             verdict agrees over the world, so it comes where every rank is at the same point: at
             the check where every rank runs the same layers; under pp, whose stages run theirs at
             different times (a verdict inside stage 0's forward would wait for stage 1, which
             waits for its activations), after the step, on every stage's checks at once

Its cost: per kind (under pp, per kind and stage), once, three all-gathers of one layer's (q, k, v)
and one attention over the whole sequence (the memory of one process's, for that layer alone)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.comm import collectives
from paratrain.comm.grid import DataMesh, Mesh
from paratrain.parallel.verify.verdict import FirstOfKind, how_far, relative_error, tolerance, verdict


class RingVerifier(FirstOfKind):
    """Checks the first ring attention of each kind of attention module against the whole one."""

    def __init__(
        self,
        model: nn.Module,
        modules: list[nn.Module],
        mesh: DataMesh | Mesh,
        precision: str,
        positions,
        after_step: bool = False,
    ):
        super().__init__(model, modules, precision)
        # `positions(seq_len, cp, cp_rank)`: a rank's tokens' global positions (attention.py's layout)
        self.mesh, self.positions = mesh, positions
        self.after_step = after_step  # the verdict left to verdict(), called after the step
        self.checked: list[tuple[float, str]] = []  # (relative error, '<module name>' (<kind>)) awaiting the verdict

    @torch.compiler.disable  # once, eagerly: a compiled block breaks its graph here until then
    def check(self, module: nn.Module, q, k, v, scale: float, out: torch.Tensor) -> None:
        """On the first training forward of each kind: collective over the cp group, and then, unless
        the verdict comes after the step, over the world (every rank runs the same layers in the
        same order). ConfigError naming the module and parallel.cp."""
        kind = self.first(module)
        if kind is None:
            return
        with torch.no_grad(), collectives.unprofiled():  # once, not the step's traffic
            err = relative_error(out, self._whole(q, k, v, scale))
        self.checked.append((err, self.where(module, kind)))
        if not self.after_step:
            self.verdict(out.device)

    def verdict(self, device: torch.device) -> None:
        """Collective over the world: one verdict on the checks made since the last (none where this
        rank's stage holds no attention); rank 0 names its own on a pass."""
        limit = tolerance(self.precision)
        checked, self.checked = self.checked, []
        failing = next(((err, where) for err, where in checked if not err <= limit), None)  # NaN fails too
        err = failing[0] if failing else max((err for err, _ in checked), default=0.0)
        where = failing[1] if failing else " and ".join(where for _, where in checked) or "every pipeline stage"
        verdict(
            "parallel.cp",
            err,
            limit,
            f"the ring does not compute {where} as attention over the whole sequence does "
            f"({how_far(err)} on the first step, tolerance {limit:g}): the ring's chunks, blocks "
            f"or merge are wrong for this attention; parallel.verify_plan = false skips this check",
            f"parallel.cp's ring attention in {where} equals attention over the whole sequence",
            device,
        )

    def _whole(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """This rank's rows of causal attention over the whole sequence of (q, k, v) (heads at
        dimension 1, tokens at 2), computed in fp32 from every rank's chunks."""
        cp, rank = self.mesh.cp, self.mesh.cp_rank
        length = q.shape[-2] * cp
        places = [self.positions(length, cp, r).to(q.device) for r in range(cp)]
        q, k, v = (self._gathered(t, places) for t in (q, k, v))
        groups = q.shape[1] // k.shape[1]  # grouped-query attention: each key/value head serves a group
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return whole.index_select(-2, places[rank])

    def _gathered(self, t: torch.Tensor, places: list[torch.Tensor]) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in places]
        collectives.all_gather(parts, t.detach().contiguous(), "verify-plan-cp", self.mesh.cp_group)
        whole = t.new_empty((*t.shape[:-2], t.shape[-2] * len(places), t.shape[-1]), dtype=torch.float32)
        for part, place in zip(parts, places):
            whole.index_copy_(-2, place, part.float())
        return whole
