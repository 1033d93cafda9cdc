"""The tp x pp (x cp x dp) grid's footprint for `paratrain plan`. Under parallel.cp a rank runs its
chunks of each sequence (1/C of the tokens: activations, stage boundaries and tp's all-reduces
played on them, cost/planned_batch.context_chunks) and averages gradients over the dp x cp ranks
of its (pp, tp) position; the ring's exchanges are step time (cost/context_expert.py)."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import Config
from paratrain.cost.activations import boundary_bytes, saved_activation_bytes, step_memory, tp_all_reduces
from paratrain.cost.ranks import RankPlan, nbytes, optimizer_slots
from paratrain.parallel.base import unique_parameters
from paratrain.parallel.dp.footprint import Planned, cast_copies, dp_codec, dp_comm
from paratrain.parallel.pipeline.footprint import peak_in_schedule, pipeline_comm, receive_buffers, step_peak
from paratrain.parallel.spec import Spec


def model_parallel(cfg: Config, model: nn.Module, world: int, ranks: list[RankPlan], rows: int) -> list[dict]:
    """Tensor and pipeline parallelism: which stages and which tp shard of each parameter every rank
    holds; the stages."""
    from paratrain.config import virtual_stages
    from paratrain.parallel.tensor.comm import shard_range
    from paratrain.parallel.tensor.layers import plan_for, planned_shard_dims, planned_sharding

    p = cfg.parallel
    dp = world // (p.tp * p.pp * p.cp)
    replicas = dp * p.cp  # the ranks a gradient averages over (comm/grid.py's replica_group)
    v = virtual_stages(cfg)
    n_stages = p.pp * v
    tp_plan = plan_for(model, p.tp_plan) if p.tp > 1 else {}
    bounds, stage_layers, ties = _cut(cfg, model, tp_plan, n_stages)
    # the dimension each planned module's tensors are split along, by parameter name
    shard_dims = planned_shard_dims(model, tp_plan)
    name_of = {id(t): n for n, t in model.named_parameters()}

    def shard_of(t: torch.Tensor, tp_rank: int) -> torch.Tensor:
        """Parameter t as tp rank `tp_rank` holds it (a meta tensor of its shard's shape)."""
        shape, dim = list(t.shape), shard_dims.get(name_of[id(t)])
        if dim is not None:
            start, end = shard_range(t.shape[dim], p.tp, tp_rank)
            shape[dim] = end - start
        return torch.empty(shape, dtype=t.dtype, device="meta")

    def stage_params(s: int, tp_rank: int) -> list[torch.Tensor]:
        """The parameters of stage s as tp rank `tp_rank` holds them."""
        seen, out = set(), []
        for layer in stage_layers[s]:
            for _, t in unique_parameters(layer):
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(shard_of(t, tp_rank))
        return out

    from paratrain.config import microbatch_count
    from paratrain.parallel.pipeline.schedules import SCHEDULES, one_f_one_b

    slots = optimizer_slots(cfg)
    cut = bounds if p.pp > 1 else None
    boundary = boundary_bytes(cfg, model, bounds, rows) if p.pp > 1 else []
    activations = saved_activation_bytes(cfg, rows, cut) if p.tp == 1 else None
    memories = step_memory(cfg, rows, cut, tp_plan, p.tp, sharding=planned_sharding(tp_plan, p.tp))
    tp_payloads = tp_all_reduces(cfg, rows, cut, tp_plan) if p.tp > 1 else [[] for _ in stage_layers]
    # without pp the engine plays one_f_one_b: each microbatch's forward, then its backward
    schedule, m = SCHEDULES[p.schedule] if p.pp > 1 else one_f_one_b, microbatch_count(cfg)
    # A rank's counts depend on its (pp, tp) position alone: its dp replicas hold and send the same
    # (a Megatron row's 512 ranks are 16 positions; counting each rank took most of its plan).
    counted: dict[tuple[int, int], RankPlan] = {}
    for r in ranks:  # comm/grid.py's order: ((pp * dp + dp) * cp + cp) * tp + tp
        r.pp, rest = divmod(r.rank, replicas * p.tp)
        column, r.tp = divmod(rest, p.tp)
        r.dp, r.cp = divmod(column, p.cp)
        r.stages = [c * p.pp + r.pp for c in range(v)]
        twin = counted.setdefault((r.pp, r.tp), r)
        if twin is not r:
            for name in ("param_bytes", "grad_bytes", "optimizer_bytes", "codec_bytes", "activation_bytes"):
                setattr(r, name, getattr(twin, name))
            r.peak_bytes = twin.peak_bytes
            r.comm = None if twin.comm is None else {op: dict(entry) for op, entry in twin.comm.items()}
            continue
        held = {s: stage_params(s, r.tp) for s in r.stages}
        r.param_bytes = r.grad_bytes = sum(nbytes(t) for t in held.values())
        r.optimizer_bytes = slots * r.param_bytes
        actions = schedule(p.pp, r.pp, m, v)
        if activations is not None:
            r.activation_bytes = peak_in_schedule(actions, r.stages, activations)
        for s in r.stages:
            dp_codec(r, cfg, held[s], replicas)
        if memories is not None:
            pool = receive_buffers(actions, r.stages, boundary) if p.pp > 1 else 0
            wire = sum(cast_copies(cfg, held[s], replicas) for s in r.stages)
            r.peak_bytes = r.model_state_bytes + pool + max(step_peak(actions, r.stages, memories), wire)
        if tp_payloads is None:  # a user loss on a sharded output: its gathers are not modelled
            continue
        pipeline_comm(r, actions, boundary, n_stages, world)
        for s in r.stages:
            for payload in tp_payloads[s]:
                r.add_comm("all_reduce", payload, p.tp, times=m)
            dp_comm(r, cfg, held[s], replicas)  # each chunk's gradients, averaged over dp x cp
        for t, holders in ties:
            if r.pp in holders:
                r.add_comm("all_reduce", nbytes([shard_of(t, r.tp)]), len(holders))
        if world > 1:
            r.add_comm("all_reduce", 8, world)  # the global gradient norm (float64)
    return _stages(cfg, bounds, stage_layers) if p.pp > 1 else []


def _cut(cfg: Config, model: nn.Module, tp_plan: dict, n_stages: int):
    """The pipeline's stage boundaries over the model's layers (balanced by parameters, as the
    engine's `balance = "params"`), each stage's layers, and the parameters that layers of different
    stages share with the stages holding them (each holder sums its copy's gradient)."""
    from paratrain.models.layers import layers_of
    from paratrain.parallel.hybrid.parallelize import sync_ties
    from paratrain.parallel.pipeline.cut import allowed_cuts, parameter_costs, partition, split_ties

    if cfg.parallel.pp == 1:
        return [0, 1], [[model]], []
    layers = layers_of(model)
    bounds = partition(parameter_costs(layers), n_stages, allowed_cuts(model, layers, tp_plan, sync_ties(cfg)))
    stage_layers = [layers[bounds[s] : bounds[s + 1]] for s in range(n_stages)]
    return bounds, stage_layers, [(t, stages) for t, _, stages in split_ties(model, layers, bounds)]


def _stages(cfg: Config, bounds: list[int], stage_layers: list) -> list[dict]:
    """The plan's rows of the pipeline's stages."""
    return [
        {
            "stage": s,
            "pp_rank": s % cfg.parallel.pp,
            "layers": [bounds[s], bounds[s + 1] - 1],
            "parameters": sum(t.numel() for layer in layers for _, t in unique_parameters(layer)),
        }
        for s, layers in enumerate(stage_layers)
    ]


def tensor_and_pipeline(
    spec: Spec, cfg: Config, model: nn.Module, ranks: list[RankPlan], rows: int, device: str
) -> Planned:
    p, notes = cfg.parallel, []
    stages = model_parallel(cfg, model, len(ranks), ranks, rows)
    if p.tp > 1:
        notes.append("activations not estimated under tp")
    if p.pp > 1 and p.balance == "time":
        notes.append(
            "pipeline cut shown by parameter count; the run times each layer at start "
            "(parallel.balance = 'time') and may cut elsewhere"
        )
    return stages, notes


def replica(spec: Spec, cfg: Config, model: nn.Module, world: int, rows: int, cluster) -> tuple[list[RankPlan], list]:
    """Replica 0 for `plan --search`: on GPUs only the busiest rank of each stage counts, and tp
    rank 0 holds the most (shard_sizes: the first shards are the larger); a CPU node's ranks add
    up, so each of the replica's counts there."""
    p, nproc = cfg.parallel, cluster.devices_per_node
    per_stage = world // p.pp  # dp x cp x tp ranks
    shards = 1 if cluster.is_gpu else p.tp
    ranks = [
        RankPlan(r, r // nproc, r % nproc, "worker")
        for pp in range(p.pp)
        for r in range(pp * per_stage, pp * per_stage + shards)
    ]
    return ranks, model_parallel(cfg, model, world, ranks, rows)
