"""The GPU kernel model: how long one microbatch's forward and backward through a stage take on a
GPU, op by op, from the ops recorded in fake tensors (op_counts.Op). Four kinds of work:

  (a) matrix products (mm, addmm, bmm, baddbmm) at a shape-dependent rate: the large GEMM's share
      of peak (`gemm_efficiency`), times wave quantization (a GEMM of few output tiles leaves SMs
      idle in its last wave: NVIDIA's Matrix Multiplication Background guide), and no faster than
      its operands move at the memory bandwidth (a skinny GEMM's low arithmetic intensity: the
      same guide's math- and memory-bound regimes); a fixed `product_overhead_us` each;
  (b) fused attention at FlashAttention's measured rate, by sequence length (a saturating curve
      through the published points: `attention_*_efficiency` of peak at long sequences, half of it at
      `attention_half_seq`, backward `attention_bwd_half_seq`) and head dimension, counted as
      FlashAttention counts (a causal kernel does half the scores); its backward does 2.5 times the
      forward's FLOPs at its own rate;
  (c) memory-bound ops (norms, activations, elementwise, casts, reductions): the bytes they read
      and write at `hbm_GBps` x `hbm_efficiency` (a copy's measured share of the data sheet's);
      under `train.compile` a chain of them between two products is one fused kernel that reads
      what comes from outside the chain and writes what leaves it;
  (d) the host: `launch_us` per kernel (eager PyTorch's dispatch and the CUDA launch); the GPU
      waits for the host only where the host issues kernels slower than the GPU runs them, so a
      pass takes the longer of the two.

Backward: a product's two gradient GEMMs (2x its forward), a memory-bound op's gradient reads and
writes about twice its forward's bytes (2x), attention as above."""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.cost.op_counts import Op

# a cuBLAS tile of output (rows x columns): NVIDIA's Matrix Multiplication Background guide names
# 256x128 and 128x128 the most efficient tiles; 128x128 taken for the wave count
GEMM_TILE = (128, 128)
FLASH_BACKWARD_FLOPS = 2.5  # FlashAttention's backward: 5 matmuls of the forward's 2 (Dao 2023)


@dataclass
class PassTimes:
    """One microbatch through a stage on one device: seconds of each pass, split over tp where the
    work splits (`split` is applied by the caller)."""

    fixed_s: float  # per-kernel costs that do not shrink with tp (overheads)
    forward_s: float  # the forward's variable work (GEMMs, attention, memory traffic)
    backward_s: float
    memory_s: float  # of forward_s, the memory-bound ops'
    again_s: float  # of forward_s, what selective recompute runs again (op_counts.Op.again)
    again_kernels: int  # the kernels of those ops (fused ones count once)
    kernels: int  # every kernel of the forward

    def passes(self, device, tp: int) -> tuple[float, float, float]:
        """(forward, backward, selective recompute's share) seconds on one of tp devices: each
        pass the longer of the GPU's work and the host's launches."""
        launch = device.launch_us * 1e-6
        forward = max(self.fixed_s + self.forward_s / tp, self.kernels * launch)
        backward = max(2 * self.fixed_s + self.backward_s / tp, 2 * self.kernels * launch)
        again = max(self.again_s / tp, self.again_kernels * launch)
        return forward, backward, again


def gemm_s(op: Op, device) -> float:
    """A matrix product's seconds: compute at the large GEMM's rate less the last wave's idle SMs,
    or its operands' traffic at the memory bandwidth, whichever is longer."""
    batch, m, n, _ = op.shape
    tiles = batch * math.ceil(m / GEMM_TILE[0]) * math.ceil(n / GEMM_TILE[1])
    waves = math.ceil(tiles / device.sm_count)
    busy = tiles / (waves * device.sm_count)
    compute = op.flops / (device.peak_tflops * 1e12 * device.gemm_efficiency * busy)
    return max(compute, op.read / hbm_rate(device))


def attention_rate(device, seq: int, head_dim: int, backward: bool) -> float:
    """FLOP/s of a fused attention (FlashAttention's count): a saturating curve in the sequence
    length through the published points, less for head dims other than 128 (the FlashAttention-3
    paper's FlashAttention-2 runs: about 0.9 of head dim 128's at 64 and at 256)."""
    plateau = device.peak_tflops * (device.attention_bwd_efficiency if backward else device.attention_fwd_efficiency)
    by_seq = seq / (seq + (device.attention_bwd_half_seq if backward else device.attention_half_seq))
    by_head = min(head_dim, 128) / (min(head_dim, 128) + 16) * (144 / 128) * (0.9 if head_dim > 128 else 1.0)
    return plateau * 1e12 * by_seq * by_head


def attention_s(op: Op, device, masks_are_causal: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of a fused attention: a causal kernel computes half its scores.
    `masks_are_causal`: a square attention given a mask is a decoder's causal one (transformers
    builds its causal mask as a tensor only while tracing, fake tensors included, and on a GPU run
    without padding passes is_causal to sdpa instead: masking_utils' _ignore_causal_mask_sdpa)."""
    seq_q, seq_k, head_dim, causal, masked = op.shape
    causal = causal or (masked and masks_are_causal and seq_q == seq_k)
    work = op.flops / 2 if causal else op.flops
    seq = max(seq_q, seq_k)
    forward = work / attention_rate(device, seq, head_dim, backward=False)
    backward = FLASH_BACKWARD_FLOPS * work / attention_rate(device, seq, head_dim, backward=True)
    return forward, backward


def hbm_rate(device) -> float:
    return device.hbm_GBps * 1e9 * device.hbm_efficiency


def fused_chains(ops: list[Op]) -> list[tuple[int, int, bool]]:
    """The bytes (read, written) of each fused kernel a compiler makes of the runs of memory-bound
    ops between products: a run reads the tensors it did not make and writes those it made that a
    later op reads (or its last op's outputs); what it makes and uses itself stays in registers.
    Third: whether selective recompute runs the chain again (its ops run again)."""
    last_read: dict[int, int] = {}
    for i, read in enumerate(ops):
        for t, _ in read.inputs:
            last_read[t] = i
    chains, run = [], []
    ends: list[Op | None] = [*ops, None]  # None: the end, which closes the last run
    for i, op in enumerate(ends):
        if op is not None and op.kind == "none":  # no kernel: the chain goes on past it
            continue
        if op is not None and op.kind == "memory":
            run.append((i, op))
        elif run:
            chains.append(_chain_bytes(run, last_read))
            run = []
    return chains


def _chain_bytes(run: list[tuple[int, Op]], last_read: dict[int, int]) -> tuple[int, int, bool]:
    made: set[int] = set()
    outside: dict[int, int] = {}
    for _, op in run:
        outside.update((t, size) for t, size in op.inputs if t not in made)
        made.update(t for t, _ in op.outputs)
    end = run[-1][0]
    leaving = {t: size for i, op in run for t, size in op.outputs if i == end or last_read.get(t, -1) > end}
    return sum(outside.values()), sum(leaving.values()), any(op.again for _, op in run)


def stage_kernel_times(ops: list[Op], device, compiled: bool, masks_are_causal: bool = False) -> PassTimes:
    """One microbatch's forward and backward through a stage of `ops` (unsplit) on the device;
    `masks_are_causal`: as attention_s's."""
    fixed = forward = backward = again = 0.0
    kernels = again_kernels = 0
    rate = hbm_rate(device)
    for op in ops:
        if op.kind == "gemm":
            seconds = gemm_s(op, device)
            forward, backward = forward + seconds, backward + 2 * seconds
        elif op.kind == "attention":
            seconds, b = attention_s(op, device, masks_are_causal)
            forward, backward = forward + seconds, backward + b
        elif op.kind == "product":  # convolutions and the like: the large GEMM's rate
            seconds = op.flops / (device.peak_tflops * 1e12 * device.gemm_efficiency)
            forward, backward = forward + seconds, backward + 2 * seconds
        else:
            continue
        fixed += device.product_overhead_us * 1e-6
        kernels += 1
        if op.again:
            again, again_kernels = again + seconds + device.product_overhead_us * 1e-6, again_kernels + 1
    # memory-bound kernels: (bytes moved, runs again); under compile one per fused chain
    if compiled:
        moved = [(r + w, chain_again) for r, w, chain_again in fused_chains(ops)]
    else:
        moved = [(op.read + op.written, op.again) for op in ops if op.kind == "memory"]
    memory = sum(size for size, _ in moved) / rate
    again += sum(size for size, runs in moved if runs) / rate
    again_kernels += sum(1 for _, runs in moved if runs)
    kernels += len(moved)
    return PassTimes(fixed, forward + memory, backward + 2 * memory, memory, again, again_kernels, kernels)
