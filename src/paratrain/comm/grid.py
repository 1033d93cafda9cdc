"""The one place that builds process groups (the world's own comes from runtime/process.py):
the (pp, dp, tp) mesh of model parallelism, and the few groups other parts need besides.

    build_mesh    the (pp, dp, tp) DeviceMesh of tp, pp and hybrid
    replica_groups  parallel.replicas: the ranks of one replica, and each shard's ranks across them
    subgroup      some ranks, made by every rank (tied weights across pipeline stages, ps servers)
    host_group    every rank on gloo: host-side agreements (a stop, ps traffic beside NCCL)
    live_group    some ranks, made by them alone: the ones left when others are gone

The mesh:

    global rank = (pp_rank * dp + dp_rank) * tp + tp_rank

tp is the innermost dimension, so the ranks of one tensor-parallel group are adjacent (on a GPU
node they share the fastest links, which tp's per-layer all-reduces need most); pipeline stages are
outermost, since they only exchange one activation per microbatch. Every rank knows its
coordinates, its three sub-groups, and the global ranks of its pipeline neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class Mesh:
    device_mesh: DeviceMesh
    pp: int
    dp: int
    tp: int
    pp_rank: int
    dp_rank: int
    tp_rank: int

    @property
    def pp_group(self):
        return self.device_mesh.get_group("pp")

    @property
    def dp_group(self):
        return self.device_mesh.get_group("dp")

    @property
    def tp_group(self):
        return self.device_mesh.get_group("tp")

    def global_rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank of pipeline stage `pp_rank` in this rank's (dp, tp) column."""
        return self.global_rank(pp_rank % self.pp, self.dp_rank, self.tp_rank)

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps around: interleaved chunks need it)."""
        return self.stage_rank(self.pp_rank - 1)

    @property
    def next_rank(self) -> int:
        return self.stage_rank(self.pp_rank + 1)


def build_mesh(tp: int, pp: int, device_type: str) -> Mesh:
    """Collective: every rank builds the same mesh from parallel.tp, parallel.pp and the world size."""
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"tp {tp} x pp {pp} does not divide the world size {world}")
    dp = world // (tp * pp)
    mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, tp_rank = mesh.get_coordinate()
    return Mesh(mesh, pp, dp, tp, pp_rank, dp_rank, tp_rank)


@dataclass
class Replicas:
    """parallel.replicas = R over a world of W ranks: replica r is ranks r*S .. r*S+S-1 (S = W/R,
    adjacent like tp's ranks, so that the frequent traffic inside a replica stays on a node's fast
    links); a strategy shards over `inner` and averages each shard over `across`, the ranks at the
    same place in every replica. Both are None when R is 1 (the world is the one replica)."""

    count: int
    size: int
    replica: int  # this rank's replica
    inner: object = None
    across: object = None


def replica_groups(replicas: int) -> Replicas:
    """Collective over the world: every rank makes every replica's groups, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    size = world // replicas
    if replicas == 1:
        return Replicas(1, world, 0)
    inner = [dist.new_group(list(range(r * size, (r + 1) * size))) for r in range(replicas)]
    across = [dist.new_group(list(range(i, world, size))) for i in range(size)]
    return Replicas(replicas, size, rank // size, inner[rank // size], across[rank % size])


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
