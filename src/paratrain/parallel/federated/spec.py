"""The federated strategy's spec: checks of the [federated] table that need neither torch nor the
dataset (see paratrain.parallel.spec). The partition's own feasibility (alpha against min_samples)
needs the labels: `engine.Federated.check_model` checks it before any worker starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paratrain.errors import ConfigError
from paratrain.parallel.spec import Spec

if TYPE_CHECKING:
    from paratrain.config import Config


class FederatedSpec(Spec):
    name = "federated"
    engine_path = "paratrain.parallel.federated.engine:Federated"
    # no cost model of rounds: `paratrain plan` shows each rank holding and averaging the whole model
    footprint = "paratrain.parallel.hybrid.footprint:tensor_and_pipeline"
    step_time = "paratrain.parallel.dp.step_time:all_reduce"
    checkpoint_family = "federated"
    counts_global_batch = False  # each client trains on its own data between rounds

    def check_config(self, cfg: Config) -> None:
        fed = cfg.federated
        if fed.clients_per_round > fed.clients:
            raise ConfigError(
                "federated.clients_per_round",
                f"{fed.clients_per_round} is more than the {fed.clients} federated.clients",
            )
        if fed.mu and fed.algorithm != "fedprox":
            raise ConfigError("federated.mu", f"is fedprox's proximal weight; algorithm {fed.algorithm!r} takes 0")
        if cfg.train.grad_accum != 1:
            raise ConfigError(
                "train.grad_accum",
                "must be 1 for strategy 'federated': a client's local step is one batch of data.batch_size samples",
            )
        super().check_config(cfg)

    def data_parallel_degree(self, cfg: Config, world_size: int) -> int:
        """data.batch_size is one client's local batch: no rank splits it."""
        return 1

    def role_of(self, cfg: Config, rank: int) -> str:
        return "federated server" if rank == 0 else "federated client worker"

    def expendable(self, cfg: Config, rank: int) -> bool:
        return rank > 0
