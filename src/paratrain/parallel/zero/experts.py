"""zero1-3 under parallel.ep: each rank keeps only its ep rank's experts, as dp does (the same split:
parallel/expert/weights.py), so expert memory (weights, gradients, optimizer state) divides by E.

    dense parameters   ZeRO's units, sharded over the replica's ranks as ever (engine.py)
    kept experts       whole on the E-th of the ranks that compute them, outside the units: their
                       gradients averaged over the ranks keeping the same experts (dp's reducer and
                       divisor, dp/experts.py), stepped by the same optimizer as the shards' pieces

The experts are kept whole on their holders, not ZeRO-sharded again over the expert-data-parallel
group (the world / E ranks keeping the same experts, as FSDP2 under torchtitan shards them): that
would give ZeRO's reducers and gatherer a process group per unit. Their memory divides by E; what
the second sharding would save besides (a further world / E) is left for later.

The checkpoint stays ZeRO's (zero/reshard.py): every parameter in pieces keyed by name with offsets
in the dense model's parameter, so the first ep group (ranks 0..E-1) writes each expert as one
piece (a Hugging Face stack's slice: its rows' offsets) and a run at any ep or world reads back its
own. The export is the dense model: the units' parameters from their shards, the experts each from
the rank keeping it (LocalExperts.chunks)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.grid import DataMesh
from paratrain.parallel.base import unique_parameters
from paratrain.parallel.dp.engine import experts_reducer
from paratrain.parallel.dp.experts import finish_experts
from paratrain.parallel.expert.weights import LocalExperts, expert_owners, keep_local_experts, stack_slices

Piece = tuple[str, int, int, torch.Tensor]  # name, [start, end) in the flattened dense parameter, the tensor


class AllExperts:
    """Every rank keeps every expert (ep 1, a compressing codec, the Python API's own loop): the
    experts are parameters of ZeRO's units like any other, nothing is apart."""

    names: frozenset[str] | set[str] = frozenset()  # the names of the experts' parameters, kept apart
    skipped: frozenset[int] | set[int] = frozenset()  # ids of the meta model's tensors this rank drops
    params: list[nn.Parameter] = []  # the kept experts' parameters, stepped beside the units' pieces
    shapes: dict[str, list[int]] = {}  # every expert parameter's name: its dense shape
    pieces: list[Piece] = []  # the kept experts' pieces, for the checkpoint
    writes = False  # whether this rank writes its experts' pieces into the checkpoint

    def dense(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """The parameters ZeRO shards in its units."""
        return unique_parameters(model)

    def keep(self, model: nn.Module) -> list[nn.Parameter]:
        return []

    def prepare(self, micro: int, last: bool) -> None:
        pass

    def finish(self) -> None:
        pass

    def norm(self, dense: torch.Tensor) -> torch.Tensor:
        return dense

    def scale_(self, factor: torch.Tensor) -> None:
        pass

    def layout(self, dense: dict) -> dict:
        return dense

    def chunks(self, dense: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        return dense


class SplitExperts(AllExperts):
    """This rank's ep rank's experts, whole, apart from ZeRO's units."""

    def __init__(self, model: nn.Module, mesh: DataMesh, bucket_mb: float, device: torch.device):
        """`model` as built, maybe on meta: which parameters are experts, and which of the gpt's
        this rank drops (their values need not be kept when materialized)."""
        self.mesh, self.bucket_mb, self.device = mesh, bucket_mb, device
        owner = expert_owners(model, mesh.ep)
        self.names = set(owner) | set(stack_slices(model, mesh.ep))
        self.skipped = {id(p) for n, p in unique_parameters(model) if owner.get(n, mesh.ep_rank) != mesh.ep_rank}
        self.writes = dist.get_rank() < mesh.ep  # the first ep group holds every expert once
        self.squares = torch.zeros(())

    def dense(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in unique_parameters(model) if n not in self.names]

    def keep(self, model: nn.Module) -> list[nn.Parameter]:
        """Once the model holds its values (the dense model's, materialized: its initialisation
        replayed whole): the other ranks' experts dropped, Hugging Face stacks cut to this rank's
        slice (weights.py); returns the kept experts' parameters."""
        self.local: LocalExperts = keep_local_experts(model, self.mesh)
        named = [(n, p) for n, p in unique_parameters(model) if n in self.local.kept]
        self.params = [p for _, p in named]
        self.reducer = experts_reducer(self.params, self.mesh, self.bucket_mb, self.device)
        self.shapes = {n: list(self.local.layout[n][1]) for n in self.names}
        self.pieces = []
        for name, p in named:  # a stack's slice: rows ep_rank * n/E .. of the dense stack
            start = self.mesh.ep_rank * p.numel() if name in self.local.stacks else 0
            self.pieces.append((name, start, start + p.numel(), p))
        return self.params

    def prepare(self, micro: int, last: bool) -> None:
        """Before each micro-batch's backward: gradients zeroed before the first, averaged in the last."""
        if micro == 0:
            self.reducer.zero_grad()
        self.reducer.prepare(sync=last)

    def finish(self) -> None:
        """After the last backward: the experts' gradients, the world's mean, and their norm's square."""
        self.squares = finish_experts(self.reducer, self.mesh)

    def norm(self, dense: torch.Tensor) -> torch.Tensor:
        """The global gradient norm: the dense shards' (over the replica) with each expert's once."""
        return torch.sqrt(dense.to(torch.float32) ** 2 + self.squares).to(dense.dtype)

    def scale_(self, factor: torch.Tensor) -> None:
        self.reducer.scale_(factor)

    def layout(self, dense: dict) -> dict:
        """The dense model's layout, in its order: the units' parameters in full precision."""
        return {k: v if k in self.names else dense[k] for k, v in self.local.layout.items()}

    def chunks(self, dense: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        """Collective over the world: the units' (every rank; what rank 0 holds whole besides them
        less its own experts, a Hugging Face stack there its slice), then the experts' (ranks 0..E-1)."""
        for chunk in dense:
            yield {k: v for k, v in chunk.items() if k not in self.names}
        yield from self.local.chunks(only_experts=True)


def zero_experts(cfg, model: nn.Module, mesh: DataMesh | None, own_loop: bool, device: torch.device) -> AllExperts:
    """Where zero1-3 keep the experts apart, split over the ep groups: under parallel.ep, but not
    in the Python API's own loop (its optimizer holds every parameter) nor with a compressing codec
    (dp's rule: the experts' gradients would travel uncompressed)."""
    if mesh is None or mesh.ep == 1 or own_loop or cfg.parallel.compression != "none":
        return AllExperts()
    return SplitExperts(model, mesh, cfg.parallel.bucket_mb, device)
