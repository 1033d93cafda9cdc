"""What a strategy declares about itself, without importing torch.

A strategy is two classes: its engine (a `base.Strategy`, torch) and its spec (a `Spec`, here),
registered under its name in `registry.py`. config.py, the CLI, the trainer, the checkpoints and
the planner ask the spec, never the strategy's name: a new strategy is a new spec and engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from paratrain.errors import ConfigError

if TYPE_CHECKING:  # config.py imports the registry: a spec only reads the Config it is handed
    from paratrain.config import Config
    from paratrain.parallel.base import Strategy


def load(path: str):
    """A spec's `package.module:attribute`, imported when first asked for (engines, footprints and
    step times import torch; the specs must not)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


class Spec:
    """One strategy's declarations. Every hook has the default most strategies want."""

    name: str = ""
    engine_path: str = ""  # "package.module:Class" of its engine (a base.Strategy)
    footprint: str = ""  # "package.module:function": what each rank keeps and sends (plan/planner.py)
    step_time: str = ""  # "package.module:function": the seconds of its step (plan/predict.py)
    # "package.module:function": replica 0's ranks for `plan --search` (searched strategies only)
    replica_footprint: str = ""
    checkpoint_family: str = ""  # a checkpoint resumes under any strategy of the family that wrote it
    codecs: tuple[str, ...] = ("none",)  # the parallel.compression values it accepts
    degrees: tuple[str, ...] = ()  # which of parallel.tp, pp, cp and ep it may set above 1
    materializes_models = False  # builds the model on meta and materialises it shard by shard
    # every rank takes each step's batch together: the step counts the global batch's label tokens
    # (token_mean.py), which ranks that run at their own pace or on their own data cannot
    counts_global_batch = True
    gives_freed_memory_back = False  # on CPU, its workers' malloc hands freed memory back (runtime.process)
    takes_replicas = False  # whether parallel.replicas may split the world into replica groups
    # where `plan --search` tries it: "replica" (every device holds the whole model: tp = pp = 1),
    # "mesh" (the tp x pp grids), "" (not searched)
    searched_as = ""

    def engine(self) -> type[Strategy]:
        return load(self.engine_path)

    # -- config checks, before any worker starts --------------------------------------------------
    def check_config(self, cfg: Config) -> None:
        """Checks of its own keys that need no world size and no dataset."""
        compression = cfg.parallel.compression
        if compression not in self.codecs:
            raise ConfigError("parallel.compression", self.codec_refusal(compression))

    def codec_refusal(self, compression: str) -> str:
        return f"compresses dp's and zero's gradient averaging; strategy {self.name!r} takes only 'none'"

    def check_layout(self, cfg: Config, world_size: int) -> None:
        """Its degrees against the world size."""
        p = cfg.parallel
        for degree in ("tp", "pp"):
            if degree not in self.degrees and getattr(p, degree) != 1:
                raise ConfigError(f"parallel.{degree}", f"must be 1 for strategy {self.name!r}")
        if world_size % (p.tp * p.pp):  # name the degree that is set (pp when tp is 1)
            raise ConfigError(
                "parallel.pp" if p.tp == 1 else "parallel.tp",
                f"tp {p.tp} x pp {p.pp} does not divide the world size {world_size}",
            )
        if world_size % (p.tp * p.pp * p.cp):
            raise ConfigError(
                "parallel.cp", f"cp {p.cp} x tp {p.tp} x pp {p.pp} does not divide the world size {world_size}"
            )
        data_ranks = world_size // (p.tp * p.pp)  # dp x cp: the ranks experts borrow
        if data_ranks % p.ep:
            raise ConfigError(
                "parallel.ep",
                f"{p.ep} does not divide dp x cp = {data_ranks} (experts borrow the data and context ranks)",
            )
        if (world_size // p.replicas) % p.ep:  # each replica keeps every expert once (zero/experts.py)
            raise ConfigError(
                "parallel.ep", f"{p.ep} does not divide the {world_size // p.replicas} ranks of a replica"
            )

    def check_batch(self, cfg: Config, world_size: int) -> None:
        """Its cut of each replica's batch, once the batch divides among the replicas."""

    # -- the ranks ----------------------------------------------------------------------------------
    def data_parallel_degree(self, cfg: Config, world_size: int) -> int:
        """How many model replicas read different data: the divisor of the global batch."""
        return world_size // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)

    def replica_size(self, cfg: Config, world_size: int) -> int:
        """The ranks of one replica: what fault.on_failure = "continue" loses and restarts together."""
        return world_size // cfg.parallel.replicas

    def role_of(self, cfg: Config, rank: int) -> str:
        """What a rank does, for messages about it."""
        return "worker"

    def expendable(self, cfg: Config, rank: int) -> bool:
        """Whether the run goes on without this rank should its process die (see fault/guard.py)."""
        return False

    def mesh(self, cfg: Config, world_size: int) -> dict[str, int]:
        """The rank grid the plan shows."""
        p = cfg.parallel
        mesh = {"dp": self.data_parallel_degree(cfg, world_size), "tp": p.tp, "pp": p.pp, "replicas": p.replicas}
        mesh.update({k: getattr(p, k) for k in ("cp", "ep") if getattr(p, k) > 1})
        return mesh

    def plan_ranks(self, cfg: Config, model, ranks: list, rows: int, device: str) -> tuple[list[dict], list[str]]:
        """Fill in each rank's plan (`ranks`: plan.RankPlan, `model` on meta, `rows` per microbatch);
        the pipeline stages and the notes."""
        return load(self.footprint)(self, cfg, model, ranks, rows, device)

    def plan_replica(self, cfg: Config, model, world: int, rows: int, cluster) -> tuple[list, list[dict]]:
        """The plans of data-parallel replica 0's ranks (every replica holds and computes the same)
        at `world` devices of `cluster`, and the pipeline stages: what `plan --search` fits."""
        return load(self.replica_footprint)(self, cfg, model, world, rows, cluster)
