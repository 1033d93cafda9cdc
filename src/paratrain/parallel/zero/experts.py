"""zero1-3 under parallel.ep: each rank keeps only its ep rank's experts, as dp does (the same split:
parallel/expert/weights.py), and ZeRO shards them over the ranks keeping the same experts, as
FSDP2 does under torchtitan:

    dense parameters   units sharded over the replica's ranks as ever (engine.py)
    kept experts       units of their own, sharded over the expert-data-parallel group: the world / E
                       ranks keeping the same experts (the mesh's expert_replicas: rank w keeps the
                       experts of ep rank w % E and is rank w // E there)

so a rank holds 1/E of the experts' weights, gradients and optimizer state as every rank would
hold of one replicated expert set under the same stage (stage 1: the kept experts whole, their
optimizer state / (world / E); stage 3: their weights too).

Replica groups (parallel.replicas = R, HSDP under stage 3): the experts are sharded as the dense
parameters are, inside a replica: over the S / E ranks of the rank's replica (S = world / R
adjacent ranks) keeping the same experts (E divides S, parallel/spec.py: an ep group lies inside a
replica). The ranks at the same place in every replica keep the same experts and the same shard
of them, so engine.py's average across the replicas takes the experts' shards with the dense ones,
and replica 0, which writes the checkpoints, holds every expert.

The divisor. An expert's gradient on a rank keeping it is the sum over its ep group's tokens (the
dp derivation, dp/experts.py); one process's is the sum over the world / E keepers divided by the
world. So an expert unit's gradients are divided by the world (not its group's size) before they
are summed over its group (with replicas: by S, then averaged over the R replicas). The gradient
norm counts each expert once: the squares of the expert shards' norms summed over their group,
then over the ep group (its ranks keep different experts).

Units come in backward order as ever, the experts' between the dense ones where their parameters
are registered (stage 2 reduces them in that order). Checkpoints stay ZeRO's pieces: every rank
writes its pieces of every unit under the dense model's names, so a run at any ep or world reads
back its own (zero/reshard.py). The export gathers each expert unit over its group and sends each
expert to rank 0 from the first ep group (LocalExperts.chunks).

A Hugging Face experts module keeps its slice of each stack (weights.py: StackCuts), cut on the
meta model before the units are made, so its units hold the slices alone. The values are made with
the stacks whole (the model's initialisation draws every expert's, as one process does: `materialize`
puts them back meanwhile), each stack's value cut to the rank's slice as it is taken. A slice is
contiguous in its stack (experts first), so its pieces sit in a checkpoint at their offsets in the
whole stack (`offsets`, zero/reshard.py), and a resume at any ep reads its slice from them.

Where the experts are not split, every rank keeps every expert in the dense units: ep 1, the
Python API's own loop (its optimizer holds every parameter) and a compressing codec (dp's rule)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.grid import DataMesh
from paratrain.models.materialize import Keep, materialize
from paratrain.parallel.base import unique_parameters
from paratrain.parallel.dp.experts import norm_with_experts
from paratrain.parallel.expert.weights import LocalExperts, StackCuts, expert_owners
from paratrain.parallel.zero.comm import FlatUnit, ShardReducer, bucket_groups, shard_grad, sharded_grad_norm
from paratrain.parallel.zero.export import unit_chunks

# groups(params, world) -> [(module or None, params)]: the units of `params` sharded over `world`
# ranks, in backward order
Groups = Callable[[list[nn.Parameter], int], list[tuple[nn.Module | None, list[nn.Parameter]]]]
# make(index, module, params, expert) -> the unit
Make = Callable[[int, nn.Module | None, list[nn.Parameter], bool], FlatUnit]


def bucket_units(cfg) -> Groups:
    """Stages 1 and 2's units: dp's buckets (zero/comm.py: bucket_groups), no module of their own."""
    return lambda params, world: [(None, g) for g in bucket_groups(params, cfg, world)]


class AllExperts:
    """Every rank keeps every expert: the experts are parameters of the dense units like any other."""

    names: frozenset[str] | set[str] = frozenset()  # the names of the kept experts' parameters
    skipped: frozenset[int] | set[int] = frozenset()  # ids of the (meta) model's tensors this rank drops
    shapes: dict[str, list[int]] = {}  # every expert parameter's name: its dense shape (checkpoints)
    # a stack's name: where this rank's slice starts in the dense stack, flattened (checkpoints)
    offsets: dict[str, int] = {}
    sharing: tuple[int, int, object, int]  # (rank, world, group, divisor) of a kept expert's unit

    def units(self, named: list[tuple[str, nn.Parameter]], world: int, groups: Groups, make: Make) -> list[FlatUnit]:
        """The units of the model's parameters `named`, the dense ones over `world` ranks."""
        return [make(i, module, g, False) for i, (module, g) in enumerate(groups([p for _, p in named], world))]

    def materialize(self, model: nn.Module, seed: int, keep: Keep) -> None:
        """The meta-built model's values, each handed to `keep` (models/materialize.py)."""
        materialize(model, seed, keep)

    def keep(self, model: nn.Module) -> None:
        pass

    def apart(self, units: list[FlatUnit]) -> tuple[list[FlatUnit], list[FlatUnit]]:
        """(the dense units, the kept experts')."""
        return units, []

    def reduce_apart(self, units: list[FlatUnit], make: Callable[..., ShardReducer]) -> None:
        pass

    def prepare(self, micro: int, last: bool) -> None:
        pass

    def finish(self) -> None:
        pass

    def grad_norm(self, units: list[FlatUnit], group) -> torch.Tensor:
        return sharded_grad_norm([shard_grad(u) for u in units], group)

    def layout(self, dense: dict) -> dict:
        return dense

    def chunks(self, units: list[FlatUnit], model: nn.Module, first: bool, gather, release) -> Iterator[dict]:
        """The export (zero/export.py: unit_chunks)."""
        return unit_chunks(units, model, first, gather, release)


class SplitExperts(AllExperts):
    """This rank's ep rank's experts, in units of their own over the ranks keeping them."""

    def __init__(self, model: nn.Module, mesh: DataMesh, replica_size: int):
        """`replica_size`: the ranks of a replica (the world where parallel.replicas is 1).
        `model` as built, maybe on meta (its values not made yet: the gpt's initialisation replays
        every expert's, so the others' experts are dropped once it has run, `keep`; a Hugging Face
        experts module's stacks are cut to this rank's slices now, for the units, and made whole
        while the values are made, `materialize`)."""
        self.mesh = mesh
        owner = expert_owners(model, mesh.ep)
        self.names = {n for n, o in owner.items() if o == mesh.ep_rank}
        self.skipped = {id(p) for n, p in unique_parameters(model) if n in owner and n not in self.names}
        self.shapes = {n: list(p.shape) for n, p in unique_parameters(model) if n in owner}
        self.cuts = StackCuts(model, mesh.ep, mesh.ep_rank)
        self.offsets = {}
        for name, (*_, whole, part) in self.cuts.stacks.items():
            self.names.add(name)
            self.shapes[name] = list(whole.shape)
            self.offsets[name] = mesh.ep_rank * part.numel()  # experts first: the slice is contiguous
        self.world = replica_size  # the divisor (the module docstring)
        self.group = keepers_group(mesh, replica_size)
        self.sharing = dist.get_rank(self.group), dist.get_world_size(self.group), self.group, self.world
        self.reducer: ShardReducer | None = None  # stage 1's, over the experts' group (engine.py)

    def units(self, named: list[tuple[str, nn.Parameter]], world: int, groups: Groups, make: Make) -> list[FlatUnit]:
        """The dense parameters' units and the kept experts' (over their group; the others' left
        out), merged in backward order: by the last registered parameter of each, latest first."""
        order = {id(p): i for i, (_, p) in enumerate(named)}
        dense = [p for n, p in named if n not in self.names and id(p) not in self.skipped]
        kept = [p for n, p in named if n in self.names]
        tagged = [(m, g, False) for m, g in groups(dense, world)]
        tagged += [(m, g, True) for m, g in groups(kept, self.sharing[1])]
        tagged.sort(key=lambda t: -max(order[id(p)] for p in t[1]))
        return [make(i, module, g, expert) for i, (module, g, expert) in enumerate(tagged)]

    def materialize(self, model: nn.Module, seed: int, keep: Keep) -> None:
        """The values made with the stacks whole (so every initialisation draws what one process's
        does), each stack's handed to `keep` as this rank's slice, under the slice's (meta) tensor."""
        slices = {id(whole): part for *_, whole, part in self.cuts.stacks.values()}

        def keep_slice(meta_tensor: torch.Tensor, value: torch.Tensor) -> None:
            part = slices.get(id(meta_tensor))
            if part is None:
                keep(meta_tensor, value)
            else:
                first = self.mesh.ep_rank * len(part)
                keep(part, value[first : first + len(part)])

        with self.cuts.undone():
            materialize(model, seed, keep_slice)

    def keep(self, model: nn.Module) -> None:
        """Once the model holds its values: the other ranks' experts dropped from it (weights.py;
        the stacks were cut before)."""
        self.local: LocalExperts = LocalExperts(model, self.mesh, self.cuts)
        del self.cuts  # they hold the whole stacks (a real model's too), needed no more

    def apart(self, units: list[FlatUnit]) -> tuple[list[FlatUnit], list[FlatUnit]]:
        return [u for u in units if u.group is not self.group], [u for u in units if u.group is self.group]

    def reduce_apart(self, units: list[FlatUnit], make: Callable[..., ShardReducer]) -> None:
        """Stage 1: the experts' buckets in a reducer of their own, over their group."""
        _, experts = self.apart(units)
        self.reducer = make(experts, self.group, self.world) if experts else None

    def prepare(self, micro: int, last: bool) -> None:
        """Stage 1, before each micro-batch's backward: zeroed before the first, reduced in the last."""
        if self.reducer is not None:
            if micro == 0:
                self.reducer.zero_grad()
            self.reducer.prepare(sync=last)

    def finish(self) -> None:
        if self.reducer is not None:
            self.reducer.finish()

    def grad_norm(self, units: list[FlatUnit], group) -> torch.Tensor:
        """The dense shards' norm (over `group`) with each expert's once (the module docstring)."""
        dense, experts = self.apart(units)
        dense_norm = sharded_grad_norm([shard_grad(u) for u in dense], group)
        experts_norm = sharded_grad_norm([shard_grad(u) for u in experts], self.group)
        return norm_with_experts(dense_norm, experts_norm, self.mesh.ep_group)

    def layout(self, dense: dict) -> dict:
        """The dense model's layout, in its order: the units' parameters in full precision, a
        stack's shape the whole one's."""
        return {k: (dense.get(k, v)[0], v[1]) for k, v in self.local.layout.items()}

    def chunks(self, units: list[FlatUnit], model: nn.Module, first: bool, gather, release) -> Iterator[dict]:
        """Collective over the world: the dense units' (less what rank 0 holds of its experts, whole
        beside them), then the experts': each of this rank's gathered over its group (at once: this
        rank's 1/E of the experts' weights), sent to rank 0 from the first ep group, released."""
        dense, experts = self.apart(units)
        for chunk in unit_chunks(dense, model, first, gather, release):
            yield {k: v for k, v in chunk.items() if k not in self.names}
        own = {name: t for u in experts for name, t in zip(u.names, u.views(gather(u)))}
        yield from self.local.chunks(only_experts=True, state=own)
        for u in experts:
            release(u)


def keepers_group(mesh: DataMesh, replica_size: int):
    """Collective over the world: the group of the ranks of this rank's replica (runs of
    `replica_size` adjacent ranks, comm/grid.py's ReplicaLayout) keeping its experts, its ep rank's
    in every ep group there: the mesh's expert_replicas where the world is the one replica, else
    made (every rank makes every replica's, in the same order; a group of one rank too)."""
    world, ep = dist.get_world_size(), mesh.ep
    if replica_size == world and mesh.expert_replicas is not None:
        return mesh.expert_replicas
    starts = range(0, world, replica_size)
    groups = [dist.new_group(list(range(start + e, start + replica_size, ep))) for start in starts for e in range(ep)]
    return groups[dist.get_rank() // replica_size * ep + mesh.ep_rank]


def zero_experts(cfg, model: nn.Module, mesh: DataMesh | None, own_loop: bool) -> AllExperts:
    """How zero1-3 keep the model's experts (the module docstring: where they are not split)."""
    p = cfg.parallel
    if mesh is None or own_loop or p.compression != "none":
        return AllExperts()
    return SplitExperts(model, mesh, dist.get_world_size() // p.replicas)
