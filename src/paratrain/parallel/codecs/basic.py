"""Gradient compression: the codecs that average one bucket of gradients across a group.

The seam every codec fills is codecs/base.py's Codec.

    parallel.compression   what crosses the wire per bucket           exact?
    none                   the fp32 buffer, one all-reduce            yes (the equivalence promise)
    bf16 | fp16            the buffer cast to 16 bits, one all-reduce   rounding only
    topk                   the largest topk_ratio of |grad + error|     no: error feedback keeps what
                           as (value, index) pairs, one all-gather      was not sent for later steps
    powersgd               per matrix M (n x m): P = M Q (n x r) and     no: error feedback, and Q is
                           Q = M^T P (m x r), two all-reduces; 1-D       warm-started from the last
                           tensors and matrices too small to gain go     step (Vogels et al. 2019)
                           uncompressed, in P's all-reduce

Codecs with memory save it per rank through state_dict() / load_state_dict(tensors) (keys start
with the codec's name, so a checkpoint of another codec is ignored): a resumed run continues with
the same error feedback and warm start as an uninterrupted one. Memory saved for other buckets
(another parallel.bucket_mb, or powersgd_rank) is dropped: that run's codec starts empty.

PowerSGD's own arithmetic: powersgd.py.
"""

from __future__ import annotations

import math

import torch

from paratrain.comm import collectives
from paratrain.comm.collectives import Handle
from paratrain.config import ParallelConfig
from paratrain.parallel.codecs.base import Codec
from paratrain.parallel.codecs.powersgd import PowerSGD, arithmetic_dtype, block_numel, power_layout, round_numels


class Uncompressed(Codec):
    """Average in the buffer's own dtype: divide, then sum (what dp always did)."""

    def start(self, key, flat: torch.Tensor, shapes, group, profiler, world: int) -> Handle:
        flat.div_(world)
        return Handle([collectives.all_reduce(flat, f"grad-bucket-{key}", group=group, async_op=True)])


class Cast(Codec):
    """Send 16-bit floats: half the bytes, rounding error only (divided after the cast, on half the
    memory, as torch's hooks do; fp16 saturates only for gradients above 65504)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def start(self, key, flat: torch.Tensor, shapes, group, profiler, world: int) -> Handle:
        with profiler.phase("compress"):
            small = flat.to(self.dtype).div_(world)
        work = collectives.all_reduce(small, f"grad-bucket-{key}-{self.dtype}", group=group, async_op=True)

        def unpack():
            with profiler.phase("compress"):
                flat.copy_(small)

        return Handle([work], unpack)


class TopK(Codec):
    """Send the k largest entries of gradient + error as (value, index); keep the rest as error.

    Exact top-k of a large bucket costs more than the all-reduce it saves (torch.topk of 10M
    entries: ~0.7 s on one core), so big buckets pick by a threshold estimated from a random sample
    (as Deep Gradient Compression does), then trim or zero-pad to exactly k so every rank sends the
    same count. Padding is (index 0, value 0): it adds nothing."""

    EXACT_BELOW = 1 << 16
    SAMPLE = 1 << 14

    def __init__(self, ratio: float, seed: int = 0):
        self.ratio = ratio
        self.error: dict = {}
        self.gen = torch.Generator().manual_seed(seed)

    def reset(self, key, flat: torch.Tensor, shapes) -> None:
        error = self.error.get(key)
        if error is None or error.shape != flat.shape:  # none yet, or restored for other buckets
            self.error.pop(key, None)
            flat.zero_()
        else:
            flat.copy_(error)

    def discard(self, key) -> None:
        self.error.pop(key, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"topk.{key}.error": error for key, error in self.error.items()}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            kind, key, field = name.split(".")
            if kind == "topk" and field == "error":
                self.error[int(key)] = t.clone()

    def select(self, magnitude: torch.Tensor, k: int) -> torch.Tensor:
        n = magnitude.numel()
        if n <= self.EXACT_BELOW:
            return torch.topk(magnitude, k, sorted=False).indices
        picks = torch.randint(0, n, (self.SAMPLE,), generator=self.gen).to(magnitude.device)
        sample = magnitude[picks]
        keep = max(1, round(self.SAMPLE * k / n))
        threshold = torch.topk(sample, keep, sorted=False).values.min()
        idx = (magnitude >= threshold).nonzero().squeeze(1)
        if idx.numel() > k:
            idx = idx[torch.topk(magnitude[idx], k, sorted=False).indices]
        return idx

    def start(self, key, flat: torch.Tensor, shapes, group, profiler, world: int) -> Handle:
        k = max(1, math.ceil(self.ratio * flat.numel()))
        with profiler.phase("compress"):
            error = self.error.get(key)
            if error is None:
                error = self.error[key] = torch.zeros_like(flat)
            idx = self.select(flat.abs(), k)
            values = torch.zeros(k, dtype=flat.dtype, device=flat.device)
            indices = torch.zeros(k, dtype=torch.int32, device=flat.device)
            values[: idx.numel()] = flat[idx]
            indices[: idx.numel()] = idx.to(torch.int32)
            error.copy_(flat)
            error.index_fill_(0, idx, 0)  # what is sent leaves the error; the rest waits for later steps
        all_values = torch.empty(world * k, dtype=flat.dtype, device=flat.device)
        all_indices = torch.empty(world * k, dtype=torch.int32, device=flat.device)
        works = [
            collectives.all_gather_into(all_values, values, f"topk-values-{key}", group, async_op=True),
            collectives.all_gather_into(all_indices, indices, f"topk-indices-{key}", group, async_op=True),
        ]

        def unpack():
            with profiler.phase("compress"):
                flat.zero_()
                flat.index_add_(0, all_indices.long(), all_values)
                flat.div_(world)

        return Handle(works, unpack)


def kept_bytes(p: ParallelConfig, buckets: list, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes a codec keeps between steps for buckets of tensors of the given shapes and dtype on
    `device`: top-k each bucket's error; PowerSGD each bucket's averaged result, P with the
    uncompressed tensors, and Q (the error lives in the bucket itself), and where it computes in a
    narrower dtype (arithmetic_dtype) a copy of its matrices and one block of P Q^T in that dtype."""
    element_size = dtype.itemsize
    numels = [sum(math.prod(shape) for shape in shapes) for shapes in buckets]
    if p.compression == "topk":
        return sum(numels) * element_size
    if p.compression != "powersgd" or not buckets:
        return 0
    arithmetic = arithmetic_dtype(device, dtype)
    copy_size = arithmetic.itemsize if arithmetic != dtype else 0
    total, block = 0, 0
    for shapes, numel in zip(buckets, numels):
        matrices, _ = power_layout(shapes, p.powersgd_rank)
        first, second = round_numels(shapes, p.powersgd_rank)
        total += (numel + first + second) * element_size + sum(n * m for _, n, m, _ in matrices) * copy_size
        block = max(block, block_numel(matrices))
    return total + block * copy_size


CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the 16-bit codecs' wire dtypes


def build_codec(p: ParallelConfig, seed: int = 0):
    """The codec parallel.compression names (the config has checked the name and its options)."""
    if p.compression == "none":
        return Uncompressed()
    if p.compression in CAST_DTYPES:
        return Cast(CAST_DTYPES[p.compression])
    if p.compression == "topk":
        return TopK(p.topk_ratio, seed)
    return PowerSGD(p.powersgd_rank, p.powersgd_warm_start, seed, p.timeout_s)
