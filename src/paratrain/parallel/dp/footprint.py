"""What dp and ZeRO send and keep besides their model state, for `paratrain plan` (their cost
models in costs.py): dp's buckets as its codec averages them, a codec's kept buffers, the 16-bit
copies of bf16 / fp16 on the wire, and ZeRO's reduce-scatters and gathers, each counted with the
functions the engines themselves run. The model-parallel grid's dp dimension (pipeline/footprint.py)
counts its gradient averaging with them too."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from paratrain.config import Config
from paratrain.cost.activations import saved_activation_bytes, step_memory, whole_model_activations
from paratrain.cost.ranks import MIB, RankPlan, nbytes, optimizer_slots
from paratrain.parallel.base import unique_parameters
from paratrain.parallel.dp.engine import make_buckets
from paratrain.parallel.spec import Spec


def wire_bytes(numel: int, dtype_bytes: int, cfg: Config) -> int:
    """A gradient buffer's bytes on the wire: bf16 / fp16 compression sends 2 bytes a number."""
    return numel * (2 if cfg.parallel.compression in ("bf16", "fp16") else dtype_bytes)


def dp_comm(r: RankPlan, cfg: Config, params: Sequence[torch.Tensor], group_size: int) -> None:
    """dp's gradient buckets, each averaged once a step (the last microbatch's backward) as the
    codec does it: one all-reduce (bf16/fp16: of 16-bit numbers); top-k: all-gathers of each rank's
    k values and k int32 indices; PowerSGD: all-reduces of P with the uncompressed tensors, then Q."""
    from paratrain.parallel.codecs.powersgd import round_numels

    if group_size == 1 or not params:
        return
    p = cfg.parallel
    buckets = make_buckets(params, int(p.bucket_mb * MIB), torch.device("meta"))
    for b in buckets:
        size = b.params[0].element_size()
        if p.compression == "topk":
            k = max(1, math.ceil(p.topk_ratio * b.numel))
            r.add_comm("all_gather", k * size * group_size, group_size)
            r.add_comm("all_gather", k * 4 * group_size, group_size)
        elif p.compression == "powersgd":
            first, second = round_numels(b.shapes, p.powersgd_rank)
            r.add_comm("all_reduce", first * size, group_size)
            if second:
                r.add_comm("all_reduce", second * size, group_size)
        else:
            r.add_comm("all_reduce", wire_bytes(b.numel, size, cfg), group_size)


def dp_codec(r: RankPlan, cfg: Config, params: Sequence[torch.Tensor], group_size: int) -> None:
    """What a top-k or PowerSGD codec keeps between steps for dp's gradient buckets."""
    from paratrain.parallel.codecs.basic import kept_bytes

    if group_size == 1 or not params:
        return
    p = cfg.parallel
    buckets = make_buckets(params, int(p.bucket_mb * MIB), torch.device("meta"))
    r.codec_bytes += kept_bytes(
        p, [b.shapes for b in buckets], params[0].dtype, torch.device("cuda" if cfg.train.device == "cuda" else "cpu")
    )


def cast_copies(cfg: Config, params: Sequence[torch.Tensor], group_size: int) -> int:
    """bf16 / fp16 on the wire: the 16-bit copy of each dp bucket, made as the bucket is launched and
    copied back once the backward is over (compression.Cast), so all of them at once after it."""

    if group_size == 1 or not params or cfg.parallel.compression not in ("bf16", "fp16"):
        return 0
    buckets = make_buckets(params, int(cfg.parallel.bucket_mb * MIB), torch.device("meta"))
    return sum(wire_bytes(b.numel, 2, cfg) for b in buckets)


Planned = tuple[list[dict], list[str]]


def data_parallel(spec: Spec, cfg: Config, model: nn.Module, ranks: list[RankPlan], rows: int, device: str) -> Planned:
    named = unique_parameters(model)
    params = [t for _, t in named]
    dense, experts = split_experts(cfg, model, named)
    kept = nbytes(dense) + nbytes(experts)  # the whole model, or its dense part and 1/E of the experts
    transient = whole_model_activations(cfg, ranks, rows)
    for r in ranks:
        (r.dp, r.cp), r.param_bytes = divmod(r.rank, cfg.parallel.cp), kept  # comm/grid.py's DataMesh
        r.grad_bytes, r.optimizer_bytes = kept, optimizer_slots(cfg) * kept
        dp_codec(r, cfg, dense, len(ranks))
        r.peak_bytes = r.model_state_bytes + max(transient, cast_copies(cfg, params, len(ranks)))
        dp_comm(r, cfg, dense, len(ranks))
        dp_comm(r, cfg, experts, len(ranks) // cfg.parallel.ep)  # over the ranks keeping the same experts
    return [], []


def split_experts(cfg: Config, model: nn.Module, named) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """dp's parameters as parallel.ep keeps them (dp/engine.py): every dense one, and one ep rank's
    experts (1/E of them, the same bytes on every rank: the gpt's experts, a Hugging Face experts
    module's stacks' slices); none apart where every rank keeps every expert (ep 1, a compressing
    codec)."""
    from paratrain.parallel.expert.weights import expert_owners, stack_slices

    ep = cfg.parallel.ep
    if not splits_experts(cfg):
        return [p for _, p in named], []
    owners, slices = expert_owners(model, ep), stack_slices(model, ep)
    dense = [p for n, p in named if n not in owners and n not in slices]
    return dense, [p for n, p in named if owners.get(n) == 0] + list(slices.values())


def splits_experts(cfg: Config) -> bool:
    """Whether a rank keeps its ep rank's experts alone (else every expert: ep 1, a compressing codec)."""
    return cfg.parallel.ep > 1 and cfg.parallel.compression == "none"


def replica(spec: Spec, cfg: Config, model: nn.Module, world: int, rows: int, cluster) -> tuple[list[RankPlan], list]:
    """Replica 0 for `plan --search`: one rank holding the whole model, as every rank does (under
    parallel.ep its dense part and 1/E of the experts, as data_parallel plans it)."""
    named = unique_parameters(model)
    params = [t for _, t in named]
    dense, experts = split_experts(cfg, model, named)
    total = nbytes(dense) + nbytes(experts)
    one = RankPlan(0, 0, 0, "worker", activation_bytes=saved_activation_bytes(cfg, rows)[0])
    memory = step_memory(cfg, rows)
    assert memory is not None  # None only under tp
    (step,) = memory
    one.param_bytes, one.grad_bytes, one.optimizer_bytes = total, total, optimizer_slots(cfg) * total
    one.peak_bytes = one.model_state_bytes + max(step.forward_peak, step.backward_peak, cast_copies(cfg, params, world))
    return [one], []
