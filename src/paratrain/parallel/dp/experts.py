"""dp's gradient averaging where parallel.ep splits the experts' weights (parallel/expert/weights.py):
the dense parameters average over the world as ever; each rank's experts over the ranks keeping the
same experts (the group's same ep rank in every ep group: `expert_replicas`, world / E ranks).

The divisor. One process's gradient is the mean over the world's ranks of their gradients (each
rank's loss is the mean over its share of the batch). A rank that does not keep expert x adds
nothing to x's gradient; the rank of each ep group that keeps x holds the sum over that group's
tokens. So x's gradient is (sum over the world / E keepers) / world = (the keepers' mean) / E.

The gradient norm (clipping, the skip of a non-finite step) counts each expert once: the squares of
the experts' norms are summed over the ep group (its ranks keep different experts), then added to
the dense parameters' square."""

from __future__ import annotations

import torch

from paratrain.comm import collectives
from paratrain.comm.grid import DataMesh
from paratrain.profile import NULL_PROFILER


class SplitExpertsReducer:
    """Two reducers behind dp's one interface: the dense parameters' (with the run's codec) and the
    kept experts' (uncompressed, over `expert_replicas`; alone where ep is the world)."""

    def __init__(self, dense, experts, mesh: DataMesh):
        """`dense`: a GradientReducer over the world (the run's codec); `experts`: the kept experts'
        (uncompressed), a GradientReducer over `mesh.expert_replicas`, or a LoneReducer where ep is
        the world (dp/engine.py builds both: this module sits beside it, not above)."""
        self.mesh, self.dense, self.experts = mesh, dense, experts
        self.codec = dense.codec  # the dense parameters': the only one that may remember gradients
        self._profiler = NULL_PROFILER

    @property
    def profiler(self):
        return self._profiler

    @profiler.setter
    def profiler(self, profiler) -> None:
        self._profiler = self.dense.profiler = self.experts.profiler = profiler

    def zero_grad(self, rebind: bool = False) -> None:
        self.dense.zero_grad(rebind)
        self.experts.zero_grad(rebind)

    def prepare(self, sync: bool) -> None:
        self.dense.prepare(sync)
        self.experts.prepare(sync)

    def finish(self) -> torch.Tensor:
        dense = self.dense.finish()
        experts = self.experts.finish() / self.mesh.ep
        self.experts.scale_(dense.new_tensor(1.0 / self.mesh.ep))  # the keepers' mean / E: the world's mean (above)
        return norm_with_experts(dense, experts, self.mesh.ep_group)

    def discard(self) -> None:
        self.dense.discard()
        self.experts.discard()

    def scale_(self, factor: torch.Tensor) -> None:
        self.dense.scale_(factor)
        self.experts.scale_(factor)


def norm_with_experts(dense: torch.Tensor, experts: torch.Tensor, ep_group) -> torch.Tensor:
    """Collective over the ep group: the gradient norm counting each expert once (the module
    docstring), from this rank's dense parameters' norm and its kept experts' (zero/experts.py's too)."""
    squares = (experts * experts).reshape(1).to(torch.float32)
    collectives.all_reduce(squares, "expert-grad-norm", group=ep_group)
    return torch.sqrt(dense.to(torch.float32) ** 2 + squares[0]).to(dense.dtype)
