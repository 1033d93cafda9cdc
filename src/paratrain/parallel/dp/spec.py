"""dp's spec: what data parallelism accepts and costs (torch-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paratrain.parallel.spec import Spec

if TYPE_CHECKING:
    from paratrain.config import Config


class DataParallelSpec(Spec):
    name = "dp"
    engine_path = "paratrain.parallel.dp.engine:DataParallel"
    footprint = "paratrain.parallel.dp.footprint:data_parallel"
    replica_footprint = "paratrain.parallel.dp.footprint:replica"
    step_time = "paratrain.parallel.dp.step_time:all_reduce"
    checkpoint_family = "dp"
    codecs = ("none", "bf16", "fp16", "topk", "powersgd")
    searched_as = "replica"
    takes_replicas = True
    degrees = ("cp", "ep")

    def replica_size(self, cfg: Config, world_size: int) -> int:
        """Every rank holds the whole model: each is a replica unless parallel.replicas groups them."""
        return world_size // cfg.parallel.replicas if cfg.parallel.replicas > 1 else 1
