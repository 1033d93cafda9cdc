"""The tp / pp / hybrid spec: what the (pp, dp, cp, tp) grid accepts and costs (torch-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paratrain.errors import ConfigError
from paratrain.parallel.spec import Spec

if TYPE_CHECKING:
    from paratrain.config import Config


class ModelParallelSpec(Spec):
    """Tensor and pipeline parallelism, one engine under three names: each name allows its degrees,
    and their checkpoints resume under each other."""

    engine_path = "paratrain.parallel.hybrid.engine:ModelParallel"
    footprint = "paratrain.parallel.hybrid.footprint:tensor_and_pipeline"
    replica_footprint = "paratrain.parallel.hybrid.footprint:replica"
    step_time = "paratrain.parallel.hybrid.step_time:model_parallel"
    checkpoint_family = "model_parallel"
    takes_replicas = True  # the mesh's dp copies, declared: what fault.on_failure = "continue" loses

    def __init__(self, name: str, degrees: tuple[str, ...]):
        self.name, self.degrees = name, degrees
        self.searched_as = "mesh" if {"tp", "pp"} <= set(degrees) else ""  # the one name allowing both

    def check_layout(self, cfg: Config, world_size: int) -> None:
        """parallel.replicas names the mesh's dp copies: 1 (not declared), or world / (tp x pp). It
        stands in for no degree: tp and pp say how a replica is split."""
        super().check_layout(cfg, world_size)
        p = cfg.parallel
        split = p.tp * p.pp
        if p.replicas not in (1, world_size // split):
            other = f", or tp x pp = {world_size // p.replicas}" if world_size % p.replicas == 0 else ""
            raise ConfigError(
                "parallel.replicas",
                f"each replica is tp {p.tp} x pp {p.pp} = {split} rank(s): {world_size} ranks make "
                f"{world_size // split} replicas, not {p.replicas} (set 1 or {world_size // split}{other})",
            )

    def check_batch(self, cfg: Config, world_size: int) -> None:
        p = cfg.parallel
        if p.pp == 1:
            return
        per_replica = cfg.data.batch_size // self.data_parallel_degree(cfg, world_size)
        micro = p.microbatches * cfg.train.grad_accum
        if per_replica % micro:
            raise ConfigError(
                "parallel.microbatches",
                f"{p.microbatches} microbatches x train.grad_accum {cfg.train.grad_accum} do not "
                f"divide the per-replica batch of {per_replica} samples",
            )
        if p.schedule == "interleaved" and micro % p.pp:
            raise ConfigError(
                "parallel.microbatches", f"the interleaved schedule needs microbatches ({micro}) divisible by pp {p.pp}"
            )
