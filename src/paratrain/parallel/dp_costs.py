"""What dp and ZeRO send and keep besides their model state, for `paratrain plan` (their cost
models in costs.py): dp's buckets as its codec averages them, a codec's kept buffers, the 16-bit
copies of bf16 / fp16 on the wire, and ZeRO's reduce-scatters and gathers, each counted with the
functions the engines themselves run. The model-parallel grid's dp dimension (pipeline_costs.py)
counts its gradient averaging with them too."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import Config
from ..plan import MIB, RankPlan, _padded_numel


def _wire_bytes(numel: int, dtype_bytes: int, cfg: Config) -> int:
    """A gradient buffer's bytes on the wire: bf16 / fp16 compression sends 2 bytes a number."""
    return numel * (2 if cfg.parallel.compression in ("bf16", "fp16") else dtype_bytes)


def dp_comm(r: RankPlan, cfg: Config, params: list[nn.Parameter], group_size: int) -> None:
    """dp's gradient buckets, each averaged once a step (the last microbatch's backward) as the
    codec does it: one all-reduce (bf16/fp16: of 16-bit numbers); top-k: all-gathers of each rank's
    k values and k int32 indices; PowerSGD: all-reduces of P with the uncompressed tensors, then Q."""
    from .compression import round_numels
    from .data_parallel import make_buckets

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
            r.add_comm("all_reduce", _wire_bytes(b.numel, size, cfg), group_size)


def dp_codec(r: RankPlan, cfg: Config, params: list[nn.Parameter], group_size: int) -> None:
    """What a top-k or PowerSGD codec keeps between steps for dp's gradient buckets."""
    from .compression import kept_bytes
    from .data_parallel import make_buckets

    if group_size == 1 or not params:
        return
    p = cfg.parallel
    buckets = make_buckets(params, int(p.bucket_mb * MIB), torch.device("meta"))
    r.codec_bytes += kept_bytes(
        p, [b.shapes for b in buckets], params[0].dtype, torch.device("cuda" if cfg.train.device == "cuda" else "cpu")
    )


def cast_copies(cfg: Config, params: list[nn.Parameter], group_size: int) -> int:
    """bf16 / fp16 on the wire: the 16-bit copy of each dp bucket, made as the bucket is launched and
    copied back once the backward is over (compression.Cast), so all of them at once after it."""
    from .data_parallel import make_buckets

    if group_size == 1 or not params or cfg.parallel.compression not in ("bf16", "fp16"):
        return 0
    buckets = make_buckets(params, int(cfg.parallel.bucket_mb * MIB), torch.device("meta"))
    return sum(_wire_bytes(b.numel, 2, cfg) for b in buckets)


def zero_comm(
    r: RankPlan, cfg: Config, stage: int, model: nn.Module, params: list[nn.Parameter], world: int, backend: str
) -> None:
    """Per unit: its gradients reduce-scattered (stage 1 once a step, 2 and 3 every microbatch) and
    its parameters all-gathered (stages 1 and 2 after the step; stage 3 before each module's forward
    and again before its backward, the root unit, kept gathered through both, once); plus the
    squared gradient norm, one float32 all-reduced. On gloo, as zero_comm builds them: each
    reduce-scatter an all-reduce of the whole unit (stage 3: of each gradient), each all-gather a
    broadcast from every rank."""
    from .data_parallel import make_buckets
    from .zero import module_units
    from .zero_comm import from_primitives

    if world == 1:
        return
    micro = cfg.train.grad_accum
    bucket_bytes = int(cfg.parallel.bucket_mb * MIB)
    if stage == 3:
        units = [(g, 1 if module is model else 2) for module, g in module_units(model, params, bucket_bytes)]
    else:
        units = [(b.params, 0) for b in make_buckets(params, bucket_bytes, torch.device("meta"), world)]
    primitives = from_primitives(backend)
    for group, gathers in units:
        numel = _padded_numel(group, world)
        size = group[0].element_size()
        reduces, gathers = 1 if stage == 1 else micro, gathers * micro if stage == 3 else 1
        wire = _wire_bytes(numel, size, cfg)
        if primitives:
            # stage 3 all-reduces each gradient where autograd left it, stages 1-2 the flat unit
            for n in [p.numel() for p in group] if stage == 3 else [numel]:
                r.add_comm("all_reduce", _wire_bytes(n, size, cfg), world, times=reduces)
            r.add_comm("broadcast", numel // world * size, world, times=gathers * world)
        else:
            r.add_comm("reduce_scatter", wire, world, times=reduces)
            r.add_comm("all_gather", numel * size, world, times=gathers)
    r.add_comm("all_reduce", 4, world)
