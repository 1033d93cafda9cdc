"""The tensor x pipeline (x data) parallel grid's cost model for `paratrain plan`: which stages and
which tp shard of each parameter every rank holds, the activations and step peak each rank's
schedule plays out, the pipeline's messages and receive buffers, and the grid's dp gradient
averaging (dp_costs.py), with the functions the engines themselves run (the pipeline cut, the
schedules, the tp plan's shard ranges)."""

from __future__ import annotations

import torch
from torch import nn

from ..activations import StageMemory, boundary_bytes, saved_activation_bytes, step_memory, tp_all_reduces
from ..config import Config
from ..plan import RankPlan, nbytes, optimizer_slots
from .dp_costs import cast_copies, dp_codec, dp_comm


def peak_in_schedule(actions, stage_of_chunk: list[int], stage_bytes: list[int]) -> int:
    """The most activation bytes alive at once while a rank plays its actions: a forward adds its
    stage's, the backward of the same (chunk, microbatch) drops them."""
    alive = peak = 0
    for a in actions:
        alive += stage_bytes[stage_of_chunk[a.chunk]] * (1 if a.kind == "F" else -1)
        peak = max(peak, alive)
    return peak


def step_peak(actions, stage_of_chunk: list[int], memories: list[StageMemory]) -> int:
    """The most bytes alive at once, over the model state, while a rank plays its actions (one
    microbatch's forward, backward, forward, ... without pp): a forward peaks at what is alive
    plus its stage's forward peak and leaves its kept bytes; its backward peaks at what the other
    microbatches keep plus its own backward peak, and frees its kept bytes."""
    alive = peak = 0
    for a in actions:
        m = memories[stage_of_chunk[a.chunk]]
        if a.kind == "F":
            peak = max(peak, alive + m.forward_peak)
            alive += m.kept
        else:
            alive -= m.kept
            peak = max(peak, alive + m.backward_peak)
    return peak


def receive_buffers(actions, stages: list[int], boundary: list[int]) -> int:
    """Bytes of the pipeline engine's receive buffers on a rank playing `actions` (`stages`: the
    virtual stage of each chunk): each action's receive (a later stage's input for a forward, an
    earlier stage's output gradient for a backward) is posted LOOKAHEAD actions ahead and its
    buffer taken back after the microbatch's backward; buffers taken back serve later receives of
    the same size and are kept between steps, so the pool is the most of each size in use at once."""
    from .pipeline import LOOKAHEAD

    last = len(boundary) - 1  # boundary[s]: what enters stage s
    in_use: dict[int, int] = {}
    most: dict[int, int] = {}
    held: dict[tuple[int, int], list[int]] = {}  # (chunk, microbatch) -> sizes of its buffers

    def post(a) -> None:
        s = stages[a.chunk]
        size = boundary[s] if a.kind == "F" and s > 0 else boundary[s + 1] if a.kind == "B" and s < last else 0
        if size:
            in_use[size] = in_use.get(size, 0) + 1
            most[size] = max(most.get(size, 0), in_use[size])
            held.setdefault((a.chunk, a.mb), []).append(size)

    posted = 0
    for i in range(-1, len(actions)):
        for a in actions[posted : i + 1 + LOOKAHEAD]:
            post(a)
        posted = max(posted, min(i + 1 + LOOKAHEAD, len(actions)))
        if i >= 0 and actions[i].kind == "B":
            for size in held.pop((actions[i].chunk, actions[i].mb), []):
                in_use[size] -= 1
    return sum(size * n for size, n in most.items())


def pipeline_comm(r: RankPlan, actions, boundary: list[int], n_stages: int, world: int) -> None:
    """Each forward sends its output to the next stage and each backward its input's gradient to
    the previous one (receives mirror them); the profiler counts them on the world group."""
    for a in actions:
        s = r.stages[a.chunk]
        if a.kind == "F":
            if s > 0:
                r.add_comm("recv", boundary[s], world)
            if s < n_stages - 1:
                r.add_comm("send", boundary[s + 1], world)
        else:
            if s < n_stages - 1:
                r.add_comm("recv", boundary[s + 1], world)
            if s > 0:
                r.add_comm("send", boundary[s], world)


def model_parallel(cfg: Config, model: nn.Module, world: int, ranks: list[RankPlan], rows: int) -> list[dict]:
    """Tensor and pipeline parallelism: which stages and which tp shard of each parameter every rank
    holds; the stages."""
    from .base import unique_parameters
    from .hybrid import sync_ties, virtual_stages
    from .pipeline_cut import allowed_cuts, parameter_costs, partition, pipeline_layers, split_ties
    from .tensor_parallel import STYLES, plan_for
    from .tp_comm import shard_range

    p = cfg.parallel
    dp = world // (p.tp * p.pp)
    v = virtual_stages(cfg)
    n_stages = p.pp * v
    tp_plan = plan_for(model, p.tp_plan) if p.tp > 1 else {}
    if p.pp > 1:
        layers = pipeline_layers(model)
        bounds = partition(parameter_costs(layers), n_stages, allowed_cuts(model, layers, tp_plan, sync_ties(cfg)))
        stage_layers = [layers[bounds[s] : bounds[s + 1]] for s in range(n_stages)]
        # parameters shared by layers of different stages: each holder sums its copy's gradient
        ties = [(t, stages) for t, _, stages in split_ties(model, layers, bounds)]
    else:
        bounds, stage_layers, ties = [0, 1], [[model]], []
    # the dimension each planned module's tensors are split along, by parameter name
    shard_dims = {f"{name}.{t}": d for name, style in tp_plan.items() for t, d in STYLES[style].shard_dims.items()}
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

    from .hybrid import microbatch_count
    from .pipeline_schedules import SCHEDULES, one_f_one_b

    slots = optimizer_slots(cfg)
    cut = bounds if p.pp > 1 else None
    boundary = boundary_bytes(cfg, model, bounds, rows) if p.pp > 1 else []
    activations = saved_activation_bytes(cfg, rows, cut) if p.tp == 1 else None
    memories = step_memory(cfg, rows, cut, tp_plan, p.tp)
    tp_payloads = tp_all_reduces(cfg, rows, cut, tp_plan) if p.tp > 1 else [[] for _ in stage_layers]
    # without pp the engine plays one_f_one_b: each microbatch's forward, then its backward
    schedule, m = SCHEDULES[p.schedule] if p.pp > 1 else one_f_one_b, microbatch_count(cfg)
    for r in ranks:
        r.pp, rest = divmod(r.rank, dp * p.tp)
        r.dp, r.tp = divmod(rest, p.tp)
        r.stages = [c * p.pp + r.pp for c in range(v)]
        held = {s: stage_params(s, r.tp) for s in r.stages}
        r.param_bytes = r.grad_bytes = sum(nbytes(t) for t in held.values())
        r.optimizer_bytes = slots * r.param_bytes
        actions = schedule(p.pp, r.pp, m, v)
        if activations is not None:
            r.activation_bytes = peak_in_schedule(actions, r.stages, activations)
        for s in r.stages:
            dp_codec(r, cfg, held[s], dp)
        if memories is not None:
            pool = receive_buffers(actions, r.stages, boundary) if p.pp > 1 else 0
            wire = sum(cast_copies(cfg, held[s], dp) for s in r.stages)
            r.peak_bytes = r.model_state_bytes + pool + max(step_peak(actions, r.stages, memories), wire)
        if tp_payloads is None:  # a user loss on a sharded output: its gathers are not modelled
            continue
        pipeline_comm(r, actions, boundary, n_stages, world)
        for s in r.stages:
            for payload in tp_payloads[s]:
                r.add_comm("all_reduce", payload, p.tp, times=m)
            dp_comm(r, cfg, held[s], dp)  # each chunk's gradients, averaged over the dp group
        for t, holders in ties:
            if r.pp in holders:
                r.add_comm("all_reduce", nbytes([shard_of(t, r.tp)]), len(holders))
        if world > 1:
            r.add_comm("all_reduce", 8, world)  # the global gradient norm (float64)
    if p.pp == 1:
        return []
    return [
        {
            "stage": s,
            "pp_rank": s % p.pp,
            "layers": [bounds[s], bounds[s + 1] - 1],
            "parameters": sum(t.numel() for layer in stage_layers[s] for _, t in unique_parameters(layer)),
        }
        for s in range(n_stages)
    ]
