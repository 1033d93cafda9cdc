"""The tp / pp / hybrid spec: what the (pp, dp, tp) grid accepts and costs (torch-free)."""

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

    def __init__(self, name: str, degrees: tuple[str, ...]):
        self.name, self.degrees = name, degrees
        self.searched_as = "mesh" if degrees == ("tp", "pp") else ""  # the one name allowing both

    def check_config(self, cfg: Config) -> None:
        super().check_config(cfg)
        if cfg.parallel.pp > 1 and cfg.train.loss == "model":
            # the last stage ends at the model's logits: the model's own loss is computed by no stage
            raise ConfigError(
                "train.loss",
                "'model' takes the loss the whole model computes, which no pipeline stage does: "
                "under pp name one (cross_entropy, mse or module:function)",
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
