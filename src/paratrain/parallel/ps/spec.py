"""The parameter servers' spec: roles, layout checks and costs (torch-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paratrain.errors import ConfigError
from paratrain.parallel.spec import Spec

if TYPE_CHECKING:
    from paratrain.config import Config


class ParameterServerSpec(Spec):
    """The first ps.servers ranks hold the parameters; the others are workers reading data."""

    name = "ps"
    engine_path = "paratrain.parallel.ps.engine:ParameterServer"
    footprint = "paratrain.parallel.ps.footprint:parameter_server"
    step_time = "paratrain.parallel.ps.step_time:parameter_server"
    checkpoint_family = "ps"
    counts_global_batch = False  # servers read no data; async workers step at their own pace

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
