"""The parameter servers' footprint for `paratrain plan`."""

from __future__ import annotations

from torch import nn

from paratrain.config import Config
from paratrain.cost.activations import whole_model_activations
from paratrain.cost.ranks import RankPlan, nbytes, optimizer_slots
from paratrain.parallel.base import unique_parameters
from paratrain.parallel.dp.footprint import Planned
from paratrain.parallel.ps.wire import HEADER, assign_shards
from paratrain.parallel.spec import Spec


def parameter_server(
    spec: Spec, cfg: Config, model: nn.Module, ranks: list[RankPlan], rows: int, device: str
) -> Planned:
    params = [t for _, t in unique_parameters(model)]
    world, servers = len(ranks), cfg.ps.servers
    total = nbytes(params)
    step = whole_model_activations(cfg, ranks, rows)
    shards = assign_shards([t.numel() for t in params], servers)
    header = HEADER * 4  # each flat shard buffer starts with a small float32 header
    message = [nbytes([params[i] for i in shard]) + header for shard in shards]  # a push or pull
    workers = world - servers
    for r in ranks:
        if r.rank < servers:
            own = nbytes([params[i] for i in shards[r.rank]])
            r.role, r.activation_bytes = "parameter server", 0
            # gradients: its shard's, and a receive buffer for each worker's pushes
            r.param_bytes, r.grad_bytes, r.optimizer_bytes = (
                own + header,
                (own + header) * (1 + workers),
                optimizer_slots(cfg) * own,
            )
            r.add_comm("recv", message[r.rank], world, times=workers)  # every worker's push
            r.add_comm("send", message[r.rank], world, times=workers)  # and its pull
            r.peak_bytes = r.model_state_bytes
        else:
            r.role, r.dp = "ps worker", r.rank - servers
            r.param_bytes = r.grad_bytes = total + header * servers
            r.peak_bytes = r.model_state_bytes + step
            for size in message:  # a push to every server, and its reply
                r.add_comm("send", size, world)
                r.add_comm("recv", size, world)
    return [], []
