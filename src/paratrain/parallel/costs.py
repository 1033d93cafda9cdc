"""Each strategy's cost model for `paratrain plan`: what every rank keeps, saves for backward and
sends in a step, counted with the functions the strategy itself runs (its buckets, units, shards and
pipeline cut). A spec names its cost model (registry.py); plan.make_plan calls it with the ranks'
empty plans (plan.RankPlan) and the model on the meta device; each returns the pipeline stages
and the notes."""

from __future__ import annotations

import torch
from torch import nn

from ..activations import saved_activation_bytes, step_memory
from ..config import Config
from ..plan import (
    MIB,
    RankPlan,
    nbytes,
    optimizer_slots,
    padded_bytes,
)
from .base import unique_parameters
from .data_parallel import make_buckets
from .dp_costs import cast_copies, dp_codec, dp_comm
from .dp_costs import zero_comm as zero_messages
from .pipeline_costs import model_parallel
from .ps_wire import HEADER, assign_shards
from .spec import Spec
from .zero import module_units

Planned = tuple[list[dict], list[str]]


def _whole_model_activations(cfg: Config, ranks: list[RankPlan], rows: int) -> int:
    """Every rank runs one microbatch through the whole model at a time: its saved activations on
    each rank; returns the most a microbatch's forward and backward hold at once."""
    activations = saved_activation_bytes(cfg, rows)[0]
    for r in ranks:
        r.activation_bytes = activations
    (m,) = step_memory(cfg, rows)
    return max(m.forward_peak, m.backward_peak)


def data_parallel(spec: Spec, cfg: Config, model: nn.Module, ranks: list[RankPlan], rows: int, device: str) -> Planned:
    params = [t for _, t in unique_parameters(model)]
    total = nbytes(params)
    transient = _whole_model_activations(cfg, ranks, rows)
    for r in ranks:
        r.dp, r.param_bytes, r.grad_bytes, r.optimizer_bytes = r.rank, total, total, optimizer_slots(cfg) * total
        dp_codec(r, cfg, params, len(ranks))
        r.peak_bytes = r.model_state_bytes + max(transient, cast_copies(cfg, params, len(ranks)))
        dp_comm(r, cfg, params, len(ranks))
    return [], []


def zero_state(cfg: Config, stage: int, model: nn.Module, params: list[nn.Parameter], world: int):
    """(parameter, gradient and optimizer bytes, a note on what comes on top for a while, and what
    does at most: (during backward, after it)) of a rank at `stage`. During backward, besides what a
    step of the whole model holds (activations.step_memory, which counts each incoming gradient until
    it is added to the one kept): stage 2, one unit's full gradients, which zero_comm's
    StreamingShardReducer holds while it reduces them; stage 3, the root unit, gathered through
    forward and backward, and the unit whose forward or backward runs (the ParameterGatherer allows
    twice the largest unit besides the root for a prefetch and the gradients in flight, but a step
    peaks where backward starts: the most activations, no gradient in flight yet). After it, the
    gradient norm squares each unit's gradient shard into a temporary (zero.sharded_grad_norm)."""
    bucket_bytes = int(cfg.parallel.bucket_mb * MIB)
    units = module_units(model, params, bucket_bytes) if stage == 3 else []
    if stage == 3:
        groups = [g for _, g in units]
    else:
        groups = [b.params for b in make_buckets(params, bucket_bytes, torch.device("meta"), world)]
    whole, shard = padded_bytes(groups, world)
    biggest = max(padded_bytes([g], world)[0] for g in groups)
    root = sum(padded_bytes([g], world)[0] for module, g in units if module is model)
    largest = max((padded_bytes([g], world)[0] for module, g in units if module is not model), default=0)
    backward = {1: 0, 2: biggest, 3: largest + root}[stage]
    norm = max(padded_bytes([g], world)[1] for g in groups)
    param_bytes = whole if stage < 3 else shard
    grad_bytes = whole if stage == 1 else shard
    transient = {
        1: "",
        2: f"state plus one unit's full gradients while reduced (at most {biggest / MIB:.3g} MiB), counted in the "
        "step's peak",
        3: f"state plus units gathered for their forward and backward and their full gradients while reduced, "
        f"at most twice the largest unit ({biggest / MIB:.3g} MiB) at once; the step's peak counts the root "
        "unit and the running one",
    }[stage]
    return param_bytes, grad_bytes, shard * optimizer_slots(cfg), transient, (backward, norm)


def zero_peak(step: int, on_top: tuple[int, int]) -> int:
    """What a ZeRO rank holds over its state at its peak: the step's own (activations.step_memory)
    with what comes on top during backward, or the gradient norm's temporary after it."""
    during_backward, after = on_top
    return max(step + during_backward, after)


def zero(spec: Spec, cfg: Config, model: nn.Module, ranks: list[RankPlan], rows: int, device: str) -> Planned:
    params = [t for _, t in unique_parameters(model)]
    world = len(ranks)
    step = _whole_model_activations(cfg, ranks, rows)
    param_b, grad_b, opt_b, transient, on_top = zero_state(cfg, spec.stage, model, params, world)
    for r in ranks:
        r.dp, r.param_bytes, r.grad_bytes, r.optimizer_bytes = r.rank, param_b, grad_b, opt_b
        r.peak_bytes = r.model_state_bytes + zero_peak(step, on_top)
        zero_messages(r, cfg, spec.stage, model, params, world, "nccl" if device == "cuda" else "gloo")
    return [], [f"{spec.name}: {transient}"] if transient else []


def parameter_server(
    spec: Spec, cfg: Config, model: nn.Module, ranks: list[RankPlan], rows: int, device: str
) -> Planned:
    params = [t for _, t in unique_parameters(model)]
    world, servers = len(ranks), cfg.ps.servers
    total = nbytes(params)
    step = _whole_model_activations(cfg, ranks, rows)
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
