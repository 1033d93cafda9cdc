"""The strategies paratrain knows, by name: the one list of them. Torch-free (config.py and
`paratrain --help` read it); each spec names its engine, imported only when a run builds it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ConfigError
from .federated.keys import FederatedSpec
from .spec import Spec

if TYPE_CHECKING:
    from ..config import Config


class DataParallelSpec(Spec):
    name = "dp"
    engine_path = "data_parallel:DataParallel"
    cost_model = "costs:data_parallel"
    checkpoint_family = "dp"
    codecs = ("none", "bf16", "fp16", "topk", "powersgd")
    searched_as = "replica"


class ZeroSpec(Spec):
    """ZeRO stage 1, 2 or 3: one replica's state sharded over every rank."""

    cost_model = "costs:zero"
    time_model = "step_costs:zero"
    codecs = ("none", "bf16", "fp16")  # a reduce-scatter sums shards: no codec of whole gradients
    materializes_models = True
    searched_as = "replica"

    def __init__(self, stage: int):
        self.stage = stage
        self.name = self.checkpoint_family = f"zero{stage}"
        self.engine_path = f"zero:Zero{stage}"

    def codec_refusal(self, compression: str) -> str:
        return (
            f"{compression!r} needs an all-reduce of whole gradients; {self.name}'s reduce-scatter "
            f"takes {', '.join(map(repr, self.codecs[:-1]))} or {self.codecs[-1]!r}"
        )


class ModelParallelSpec(Spec):
    """Tensor and pipeline parallelism, one engine under three names: each name allows its degrees,
    and their checkpoints resume under each other."""

    engine_path = "hybrid:ModelParallel"
    cost_model = "costs:tensor_and_pipeline"
    time_model = "step_costs:model_parallel"
    checkpoint_family = "model_parallel"

    def __init__(self, name: str, degrees: tuple[str, ...]):
        self.name, self.degrees = name, degrees
        self.searched_as = "mesh" if degrees == ("tp", "pp") else ""  # the one name allowing both

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


class ParameterServerSpec(Spec):
    """The first ps.servers ranks hold the parameters; the others are workers reading data."""

    name = "ps"
    engine_path = "parameter_server:ParameterServer"
    cost_model = "costs:parameter_server"
    time_model = "step_costs:parameter_server"
    checkpoint_family = "ps"

    def check_layout(self, cfg: Config, world_size: int) -> None:
        ps = cfg.ps
        if ps.servers >= world_size:
            raise ConfigError("ps.servers", f"{ps.servers} servers leave no worker among {world_size} processes")
        if ps.straggler_rank != -1 and not ps.servers <= ps.straggler_rank < world_size:
            raise ConfigError(
                "ps.straggler_rank", f"{ps.straggler_rank} is not a worker rank ({ps.servers}..{world_size - 1}) nor -1"
            )

    def data_parallel_degree(self, cfg: Config, world_size: int) -> int:
        return world_size - cfg.ps.servers  # the servers read no data

    def role_of(self, cfg: Config, rank: int) -> str:
        return "parameter server" if rank < cfg.ps.servers else "ps worker"

    def expendable(self, cfg: Config, rank: int) -> bool:
        return cfg.ps.mode != "sync" and rank >= cfg.ps.servers

    def mesh(self, cfg: Config, world_size: int) -> dict[str, int]:
        return {"servers": cfg.ps.servers, "workers": world_size - cfg.ps.servers}


DEFAULT = "dp"  # parallel.strategy when a config names none

SPECS: dict[str, Spec] = {
    spec.name: spec
    for spec in (
        DataParallelSpec(),
        *(ZeroSpec(stage) for stage in (1, 2, 3)),
        ModelParallelSpec("tp", ("tp",)),
        ModelParallelSpec("pp", ("pp",)),
        ModelParallelSpec("hybrid", ("tp", "pp")),
        ParameterServerSpec(),
        FederatedSpec(),
    )
}


def spec(name: str) -> Spec:
    """The spec of strategy `name` (config.py has checked it is one of SPECS)."""
    return SPECS[name]


def checkpoint_family(name: str) -> str | None:
    """The family of strategy `name`'s checkpoints; None for a name this version does not know."""
    return SPECS[name].checkpoint_family if name in SPECS else None
