"""The one place that builds process groups (the world's own comes from runtime/process.py):
the (pp, dp, cp, tp) mesh of model parallelism, and the few groups other parts need besides.

    build_mesh    the (pp, dp, cp, tp) DeviceMesh of tp, pp and hybrid
    build_data_mesh  the (dp, cp) grid of dp and zero1-3, with the ep groups that borrow its ranks
    ReplicaLayout   parallel.replicas: which ranks form each replica (the mesh's dp index)
    replica_groups  parallel.replicas: the ranks of one replica, and each shard's ranks across them
    subgroup      some ranks, made by every rank (tied weights across pipeline stages, ps servers)
    host_group    every rank on gloo: host-side agreements (a stop, ps traffic beside NCCL)
    live_group    some ranks, made by them alone: the ones left when others are gone

The mesh (torchtitan's order):

    global rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

tp is the innermost dimension, so the ranks of one tensor-parallel group are adjacent (on a GPU
node they share the fastest links, which tp's per-layer all-reduces need most); cp next, since its
ring passes keys and values at every attention; pipeline stages are outermost, since they only
exchange one activation per microbatch. Every rank knows its coordinates, its sub-groups, and the
global ranks of its pipeline neighbours and of its ring's. With cp = 1 (the usual case) the
formula is (pp_rank * dp + dp_rank) * tp + tp_rank, and dp and zero1-3's (dp, cp) grid below is
the same order with tp = pp = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class Mesh:
    """A rank's place in the (pp, dp, cp, tp) mesh. The cp ranks of a (pp, dp, tp) position read
    the same samples, each its chunks of every sequence (parallel/context/), and hold the same
    parameters: gradients average over `replica_group`, the dp x cp ranks of its (pp, tp) position."""

    device_mesh: DeviceMesh
    pp: int
    dp: int
    tp: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    cp: int = 1
    cp_rank: int = 0
    replica_group: dist.ProcessGroup | None = None  # set by build_mesh (the dp group where cp = 1)

    @property
    def pp_group(self):
        return self.device_mesh.get_group("pp")

    @property
    def dp_group(self):
        return self.device_mesh.get_group("dp")

    @property
    def tp_group(self):
        return self.device_mesh.get_group("tp")

    @property
    def cp_group(self):
        return self.device_mesh.get_group("cp")

    @property
    def ring_next(self) -> int:
        """The global rank after this one in its cp ring (parallel/context/ring.py)."""
        return self.global_rank(self.pp_rank, self.dp_rank, self.tp_rank, (self.cp_rank + 1) % self.cp)

    @property
    def ring_prev(self) -> int:
        return self.global_rank(self.pp_rank, self.dp_rank, self.tp_rank, (self.cp_rank - 1) % self.cp)

    def global_rank(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank of pipeline stage `pp_rank` in this rank's (dp, cp, tp) column: a stage
        passes its chunks of a microbatch to the next stage's rank holding the same chunks."""
        return self.global_rank(pp_rank % self.pp, self.dp_rank, self.tp_rank, self.cp_rank)


def build_mesh(tp: int, pp: int, device_type: str, cp: int = 1) -> Mesh:
    """Collective: every rank builds the same mesh from parallel.tp, parallel.pp, parallel.cp and
    the world size."""
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"cp {cp} x tp {tp} x pp {pp} does not divide the world size {world}")
    dp = world // (tp * pp * cp)
    mesh = init_device_mesh(device_type, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # None only for a rank outside the mesh, and the mesh spans the world
    pp_rank, dp_rank, cp_rank, tp_rank = coordinate
    out = Mesh(mesh, pp, dp, tp, pp_rank, dp_rank, tp_rank, cp, cp_rank)
    if cp == 1:
        out.replica_group = out.dp_group
    else:  # every (pp, tp) position's dp x cp ranks, made by every rank in one order
        groups = {
            (q, t): dist.new_group([out.global_rank(q, d, t, c) for d in range(dp) for c in range(cp)])
            for q in range(pp)
            for t in range(tp)
        }
        out.replica_group = groups[pp_rank, tp_rank]
    return out


@dataclass
class DataMesh:
    """parallel.cp and parallel.ep under dp and zero1-3 (tp = pp = 1): the world as a (dp, cp) grid,

        global rank = dp_rank * cp + cp_rank

    the (pp, dp, cp, tp) mesh above with tp = pp = 1: the ranks of one ring are adjacent, on one
    node's fast links.
    Every rank of a cp group reads the same samples (its dp_rank's share), each a slice of the
    sequence; every dense parameter is replicated over all dp x cp ranks, so its gradients average
    over the world (a rank's kept experts' over the ranks keeping the same: dp/experts.py, zero/experts.py).
    The ep groups borrow those ranks: the world cut into runs of `ep` adjacent ranks; rank
    w holds expert slice w % ep, and `expert_replicas` are the ranks holding the same slice."""

    dp: int
    cp: int
    ep: int
    dp_rank: int
    cp_rank: int
    cp_ranks: list[int]  # this rank's ring, in ring order
    cp_group: dist.ProcessGroup | None = None
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    expert_replicas: object = None  # None where ep = world: each expert slice lives on one rank

    @property
    def ring_next(self) -> int:
        return self.cp_ranks[(self.cp_rank + 1) % self.cp]

    @property
    def ring_prev(self) -> int:
        return self.cp_ranks[(self.cp_rank - 1) % self.cp]


def build_data_mesh(cp: int, ep: int = 1) -> DataMesh:
    """Collective over the world: every rank makes every ring's and every expert group's group, in
    the same order (a group of one rank is not made)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % cp or world % ep:
        raise ValueError(f"cp {cp} and ep {ep} must divide the world size {world}")
    rings = [list(range(d * cp, d * cp + cp)) for d in range(world // cp)]
    mesh = DataMesh(world // cp, cp, ep, rank // cp, rank % cp, rings[rank // cp], ep_rank=rank % ep)
    if cp > 1:
        groups = [dist.new_group(ranks) for ranks in rings]
        mesh.cp_group = groups[mesh.dp_rank]
    if ep > 1:
        slices = [dist.new_group(list(range(g * ep, g * ep + ep))) for g in range(world // ep)]
        mesh.ep_group = slices[rank // ep]
        if world > ep:
            across = [dist.new_group(list(range(e, world, ep))) for e in range(ep)]
            mesh.expert_replicas = across[mesh.ep_rank]
    return mesh


@dataclass(frozen=True)
class ReplicaLayout:
    """Which global ranks form each replica, where parallel.replicas splits a world of `world` ranks
    into replicas of `size` ranks, each cut into `stages` pipeline stages (1 but under pp).

    A replica is one dp index of the (pp, dp, tp) mesh above, read with dp = the replica count and
    tp = size / stages (tp's ranks, or the ranks a zero replica shards over). Without pipeline
    stages a replica is adjacent ranks, r*size .. r*size+size-1 (so the frequent traffic inside it
    stays on a node's fast links); with them, each stage's slice of it is. The supervisor of
    fault.on_failure = "continue" loses and restarts these ranks together (fault/supervise.py)."""

    world: int
    size: int
    stages: int = 1

    @property
    def count(self) -> int:
        return self.world // self.size

    def replica_of(self, rank: int) -> int:
        return rank // (self.size // self.stages) % self.count

    def ranks(self, replica: int) -> list[int]:
        """The replica's ranks, ascending: stage by stage, as the mesh numbers them."""
        inner = self.size // self.stages
        return [(q * self.count + replica) * inner + i for q in range(self.stages) for i in range(inner)]


@dataclass
class Replicas:
    """parallel.replicas = R over a world of W ranks, in ReplicaLayout's ranks; a strategy shards
    over `inner` (the S = W/R ranks of its replica) and averages each shard over `across`, the ranks
    at the same place in every replica. Both are None when R is 1 (the world is the one replica)."""

    count: int
    size: int
    replica: int  # this rank's replica
    inner: dist.ProcessGroup | None = None
    across: dist.ProcessGroup | None = None


def replica_groups(replicas: int) -> Replicas:
    """Collective over the world: every rank makes every replica's groups, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = ReplicaLayout(world, world // replicas)
    if replicas == 1:
        return Replicas(1, world, 0)
    members = [layout.ranks(r) for r in range(replicas)]
    inner = [dist.new_group(ranks) for ranks in members]
    across = [dist.new_group([ranks[i] for ranks in members]) for i in range(layout.size)]
    mine = layout.replica_of(rank)
    return Replicas(replicas, layout.size, mine, inner[mine], across[members[mine].index(rank)])


def subgroup(ranks: list[int], backend: str | None = None):
    """Collective over the world (every rank calls it, in the same order): a group of `ranks`."""
    return dist.new_group(ranks, backend=backend)


def host_group(timeout=None):
    """Collective over the world: every rank, on gloo, for agreements on host memory (on a GPU
    run beside the NCCL world group)."""
    return dist.new_group(backend="gloo", timeout=timeout)


def live_group(ranks: list[int]):
    """A group of `ranks` made by those ranks alone (the others may be gone: dropped parameter-server
    workers, a federated rank's own trainer group)."""
    return dist.new_group(ranks, use_local_synchronization=True)
