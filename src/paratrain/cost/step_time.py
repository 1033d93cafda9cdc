"""The seconds of a step: the pieces every strategy's step time (its spec's `step_time`) shares.
Stages timed or modelled (stage_costs), a replica's microbatches through its tp x pp grid
(Step.replica), links and alpha-beta collectives, the optimizer, a codec's own arithmetic, and the
framework's cost of a step (finish). Each strategy's own model lives in its folder
(parallel/*/step_time.py) and returns (step seconds, the breakdown, forward FLOPs of a step over
all replicas, tokens in a sample):

  * dp and the model-parallel grid: gradient buckets all-reduced over dp while the last
    microbatch's backward runs: only what exceeds that backward is exposed (and at least one
    bucket's share); on the CPU nothing hides communication: all of it is exposed;
  * tp and pp: besides, the gradient norm's all-reduce over the world, every step;
  * zero1/2: reduce-scatter the same way, and all-gather the parameters after the optimizer step,
    waited for in the next forward: their latency hides behind it, their bytes do not; zero3
    gathers each unit before its forward and backward, prefetched while the previous unit
    computes: exposed only where the gathers outrun the compute;
  * parameter servers: compute, then every shard pushed to and pulled from its server."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paratrain.config import Config
from paratrain.cost.cluster import Cluster
from paratrain.cost.context_expert import all_to_all_s, ring_attention_ops, ring_bytes, ring_s
from paratrain.cost.op_counts import Op, OpRecorder
from paratrain.profile import min_bytes_sent

if TYPE_CHECKING:
    from torch import nn


@dataclass
class StageCost:
    forward_flops: int  # one microbatch's forward through the stage, the whole (unsplit) stage
    forward_s: float  # the same on one device of the cluster, split over tp
    backward_s: float
    again_s: float  # of forward_s, what selective recompute runs again (op_counts.Op.again)
    ring_bytes: int = 0  # parallel.cp: the keys and values a pass around the ring carries (context_expert.py)
    attentions: int = 0  # the stage's fused attentions

    def work_s(self, recompute: str) -> float:
        """Forward, backward and, under recompute, the forward again: all of it ("full") or the
        ops its policy does not keep ("selective": models/recompute.py)."""
        again = {"none": 0.0, "full": self.forward_s, "selective": self.again_s}[recompute]
        return self.forward_s + again + self.backward_s


def stage_ops(cfg: Config, rows: int, bounds: list[int] | None) -> tuple[list[list[Op]], int]:
    """Each stage's ops in one microbatch's forward (op_counts.Op: FLOPs, bytes, shapes) of the
    whole (unsplit) stage, and the tokens in a sample (a sequence model's positions; else 1).
    Under parallel.cp the forward runs this rank's share of each sequence, its attentions as the
    ring runs them (context_expert.py); the tokens are still the whole sample's."""
    from paratrain.cost.activations import FakeRun
    from paratrain.models.recompute import watch_decisions

    run = FakeRun.build(cfg, rows, bounds)
    recorders: list[OpRecorder] = []

    @contextlib.contextmanager
    def recording(s: int):
        recorder = OpRecorder()
        recorders.append(recorder)
        # selective recompute's policy marks the ops it runs again (Op.again) as it decides
        decided = watch_decisions(recorder.recomputed) if run.recompute == "selective" else contextlib.nullcontext()
        with recorder, decided:
            yield

    run.forward(run.loss_fn, recording)
    first = run.held()[0]  # token ids come first (a dict batch's input_ids)
    tokens = first[0].numel() * cfg.parallel.cp if not first.is_floating_point() else 1
    return [ring_attention_ops(recorder.ops, cfg.parallel.cp) for recorder in recorders], tokens


def worker_threads(cluster: Cluster) -> int:
    """The threads each of a node's processes gets on this machine: the launcher's share of the
    cores (launch.py)."""
    import os

    return max(1, (os.cpu_count() or 1) // cluster.devices_per_node)


def stage_costs(
    cfg: Config, rows: int, bounds: list[int] | None, cluster: Cluster, tp: int
) -> tuple[list[StageCost], int]:
    """Each stage's cost on one device of the cluster (split over tp), and the tokens in a sample:
    on a calibrated cpu cluster (`time_layers`) its layers timed here (layer_times) where they are
    small enough to run, else modelled; split over tp as the model splits it."""
    stages, tokens = stage_ops(cfg, rows, bounds)
    d = cluster.device
    measured = None
    if d.time_layers:
        from paratrain.cost.layer_times import layer_times

        threads = worker_threads(cluster)
        # a tp shard runs every op of its layer on 1/tp of the arithmetic: timed as the layer on
        # 1/tp of the rows (the same ops, the same share of the work)
        timed_rows = max(1, rows // tp)
        forward_flops = sum(op.flops for ops in stages for op in ops) // tp
        measured = layer_times(cfg, timed_rows, threads, forward_flops, cluster.times_file)
    out = []
    for s, ops in enumerate(stages):
        if cluster.is_gpu:  # the kernel model: GEMMs by shape, attention, memory traffic, launches
            from paratrain.cost.kernels import stage_kernel_times

            decoder = cfg.model.factory == "hf" and cfg.model.kwargs.get("task", "causal-lm") == "causal-lm"
            times = stage_kernel_times(ops, d, cfg.train.compile, masks_are_causal=decoder)
            forward_s, backward_s, again_s = times.passes(d, tp)
            out.append(StageCost(sum(op.flops for op in ops), forward_s, backward_s, again_s, *ring_bytes(ops)))
            continue
        flops_s = sum(op.flops / (d.peak_tflops * 1e12 * d.gemm_efficiency) for op in ops)
        memory_s = sum(2 * op.written / (d.hbm_GBps * 1e9) for op in ops if not op.flops)
        fixed_s = sum(d.product_overhead_us * 1e-6 for op in ops if op.flops) + len(ops) * d.op_overhead_us * 1e-6
        split = fixed_s + (flops_s + memory_s) / tp
        # what selective recompute runs again (Op.again): its products and the memory-bound ops,
        # each its launch
        again_ops = [op for op in ops if op.again]
        again = (
            sum(d.op_overhead_us * 1e-6 + (d.product_overhead_us * 1e-6 if op.flops else 0.0) for op in again_ops)
            + sum(op.flops / (d.peak_tflops * 1e12 * d.gemm_efficiency) for op in again_ops) / tp
            + sum(2 * op.written / (d.hbm_GBps * 1e9) for op in again_ops if not op.flops) / tp
        )
        if measured is None:
            forward_s, backward_s = split, 2 * split
        else:
            # the measured time (and where the rows do not split evenly over tp, its arithmetic's
            # remainder as modelled); how the processes slow each other is Step.replica's
            layers = measured if bounds is None else measured[bounds[s] : bounds[s + 1]]
            scale = split / (fixed_s + (flops_s + memory_s) * timed_rows / rows)
            forward_s = scale * sum(t.forward_s for t in layers)
            backward_s = scale * sum(t.backward_s for t in layers)
        again_s = forward_s * again / split
        out.append(StageCost(sum(op.flops for op in ops), forward_s, backward_s, again_s, *ring_bytes(ops)))
    return out, tokens


def link(cluster: Cluster, span: int) -> tuple[float, float]:
    """(bytes/s per device, seconds per message) of a group whose ranks lie `span` consecutive
    ranks apart at most (span <= devices per node: within one node)."""
    d = cluster.device
    if span <= cluster.devices_per_node or cluster.nodes == 1:
        return d.intra_node_GBps * 1e9, d.intra_latency_us * 1e-6
    return d.inter_node_Gbps / 8 * 1e9 / cluster.devices_per_node, d.latency_us * 1e-6


def collective_s(op: str, payload: float, n: int, bandwidth: float, latency: float) -> float:
    """alpha-beta: the fewest bytes sent at the link's rate, plus a latency per ring step."""
    if n <= 1:
        return 0.0
    steps = {"all_reduce": 2 * (n - 1), "send": 1}.get(op, n - 1)
    return min_bytes_sent(op, payload, n) / bandwidth + steps * latency


@dataclass
class Step:
    """What a strategy's step time (its spec's `step_time`) reads: the config, the model on the
    meta device, the plan of its ranks and the cluster; and the figures every model shares.
    `tp_plan`: module name -> style, which the tensor layers resolve (hybrid's step time sets it)."""

    cfg: Config
    model: nn.Module
    plan: dict
    cluster: Cluster
    tp_plan: dict = field(default_factory=dict)

    @property
    def recompute(self) -> str:
        return self.cfg.train.recompute

    @property
    def wire(self) -> float:
        """The share of a gradient's bytes a codec puts on the wire (bf16/fp16: half)."""
        return 0.5 if self.cfg.parallel.compression in ("bf16", "fp16") else 1.0

    @property
    def busiest(self) -> dict:
        """The rank holding the most parameters and optimizer state."""
        return max(self.plan["ranks"], key=lambda r: r["param_bytes"] + r["optimizer_bytes"])

    def link(self, span: int) -> tuple[float, float]:
        return link(self.cluster, span)

    def optimizer_s(self, rank: dict | None = None, flat: bool = False) -> float:
        """The optimizer's step on `rank` (default the busiest), which holds its share of the
        parameters as the model's tensors or (`flat`) as one flat shard: timed on a calibrated
        cpu cluster (layer_times.optimizer_step_s, the whole model's, by the share it holds),
        else modelled (optimizer_time)."""
        rank = rank or self.busiest
        d = self.cluster.device
        if d.time_layers:
            from paratrain.cost.layer_times import optimizer_step_s

            timed = optimizer_step_s(self.cfg, worker_threads(self.cluster), self.cluster.times_file)
            if timed is not None:
                total, slots = self.plan["model"]["bytes"], self.plan["optimizer"]["state_tensors_per_parameter"]
                stepped = rank["optimizer_bytes"] / slots if slots else rank["param_bytes"]  # what it updates
                share = stepped / max(1, total)
                return d.cpu_contention * share * timed[1 if flat else 0]
        return optimizer_time(self.plan, rank, self.cluster)

    def replica(self) -> Replica:
        """One model replica's microbatches through its tp x pp grid (tp = pp = 1: one device)."""
        from paratrain.config import virtual_stages

        cfg, cluster, p = self.cfg, self.cluster, self.cfg.parallel
        tp, pp = p.tp, p.pp
        dp = self.plan["mesh"]["dp"]
        v = virtual_stages(cfg) if pp > 1 else 1
        b = self.plan["batch"]
        m, rows = b["microbatches"], b["rows_per_microbatch"]
        bounds = [0, *[s["layers"][1] + 1 for s in self.plan["stages"]]] if pp > 1 else None
        stages, tokens_per_sample = stage_costs(cfg, rows, bounds, cluster, tp)
        recompute = self.recompute

        # tp: all-reduces within each stage, every microbatch; recompute repeats the forward's half
        tp_s = [0.0] * len(stages)
        if tp > 1:
            from paratrain.cost.activations import tp_all_reduces

            payloads = tp_all_reduces(cfg, rows, bounds, self.tp_plan) or [[] for _ in stages]
            bw, lat = self.link(tp)
            tp_s = [
                sum(collective_s("all_reduce", x, tp, bw, lat) for x in stage) * (1.5 if recompute != "none" else 1)
                for stage in payloads
            ]
        # pp: a microbatch's activation to the next stage, its gradient back
        p2p_s = [0.0] * len(stages)
        if pp > 1:
            from paratrain.cost.activations import boundary_bytes

            assert bounds is not None  # set with pp > 1
            boundary = boundary_bytes(cfg, self.model, bounds, rows)
            neighbours = dp * p.cp * tp + 1  # a stage's neighbour is dp x cp x tp ranks on
            bw, lat = self.link(neighbours)
            if neighbours <= cluster.devices_per_node and cluster.device.p2p_latency_us:
                lat = cluster.device.p2p_latency_us * 1e-6
            for s in range(len(stages)):
                out = boundary[s + 1] if s + 1 < len(stages) else 0
                back = boundary[s] if s > 0 else 0
                p2p_s[s] = sum(x / bw + lat for x in (out, back) if x)

        # cp: the ring's keys and values, every microbatch; ep: the tokens to their experts and back
        ring = [ring_s(self, stage.ring_bytes, stage.attentions) for stage in stages]
        element = next(self.model.parameters()).element_size()
        routed = all_to_all_s(self, rows * tokens_per_sample // p.cp, element)  # this rank's tokens
        spread = [ring[s] + routed / len(stages) for s in range(len(stages))]

        # processes computing at once slow each other (cpu_contention, measured with all of them
        # busy), as much as they are busy together: a pipeline's light stages leave their share
        # of the cores to the heavy ones; ranks that meet at collectives (dp's, tp's) wait besides
        # for the last to arrive, more the longer they computed since (sync_skew, per second of
        # compute; a ring's ranks meet at every attention); a pipeline's stages pass microbatches
        # on without meeting, a late one's
        # neighbour waiting in its bubble instead
        compute = [sum(stages[c * pp + r].work_s(recompute) for c in range(v)) for r in range(pp)]
        busy = sum(compute) / (pp * max(compute)) if max(compute) > 0 else 1.0
        skew = cluster.device.sync_skew if dp > 1 or tp > 1 or p.cp > 1 else 0.0
        stretch = max(1.0, cluster.device.cpu_contention * busy) * (1 + skew)
        # warming up and cooling down, half the stages work on average (1, 2 ... pp - 1 of pp):
        # the idle ones leave them their cores
        bubble_stretch = max(1.0, cluster.device.cpu_contention * busy / 2) * (1 + skew)
        for stage in stages:
            stage.forward_s *= stretch
            stage.backward_s *= stretch
        per_rank = []  # one microbatch's work on each pp rank: (total, backward only, compute only)
        for r in range(pp):
            held = [c * pp + r for c in range(v)]
            compute_s = sum(stages[s].work_s(recompute) for s in held)
            backward = sum(stages[s].work_s(recompute) - stages[s].forward_s for s in held)
            per_rank.append((compute_s + sum(tp_s[s] + p2p_s[s] + spread[s] for s in held), backward, compute_s))
        slowest, backward, _ = max(per_rank)
        # the warm-up and cool-down: each microbatch passes every other rank once before the
        # slowest rank's steady pace sets in ((pp - 1) / v of a microbatch's work when balanced)
        bubble_s = (sum(work for work, _, _ in per_rank) - slowest) / v * bubble_stretch / stretch
        # what communication can hide behind: on a GPU the compute of the same microbatch; on the
        # CPU nothing, since gloo's threads run on the cores that compute
        backward, hiding = (backward, slowest) if cluster.is_gpu else (0.0, 0.0)
        parts = {
            "compute_s": m * max(c for _, _, c in per_rank),
            "bubble_s": bubble_s,
            "tp_comm_s": m * max(tp_s),
            "p2p_s": m * max(p2p_s),
        }
        if cfg.parallel.cp > 1:
            parts["cp_comm_s"] = m * max(ring)
        if cfg.parallel.ep > 1:
            parts["ep_comm_s"] = m * routed
        forward_flops = sum(s.forward_flops for s in stages) * m * dp * p.cp  # a cp rank: its share of each sequence
        forward_s = m * max(sum(stages[c * pp + r].forward_s for c in range(v)) for r in range(pp))
        return Replica(m * slowest + bubble_s, m, backward, hiding, forward_s, parts, forward_flops, tokens_per_sample)


@dataclass
class Replica:
    pipeline_s: float  # every microbatch through the grid, the bubble included
    microbatches: int
    backward_s: float  # the last microbatch's backward on the slowest rank, which buckets overlap (GPU)
    hiding_s: float  # a microbatch's work a prefetch hides behind (GPU; 0 on the CPU)
    forward_s: float  # the step's forwards on the slowest rank, which a wait at its start hides behind
    parts: dict
    forward_flops: float  # of a step, all replicas
    tokens_per_sample: int

    def overlapped(self, reduce_s: float, numbers: float, bucket_mb: float) -> float:
        """Buckets reduced while the backward runs: what outlasts it, at least the last bucket."""
        return max(reduce_s - self.backward_s, reduce_s * min(1.0, bucket_mb * 2**20 / max(numbers, 1)))


def bucketed_s(op: str, payload: float, n: int, bandwidth: float, latency: float, buckets: int) -> float:
    """The same bytes as `buckets` collectives: a latency each."""
    return buckets * collective_s(op, payload / buckets, n, bandwidth, latency)


def optimizer_time(plan: dict, busiest: dict, cluster: Cluster) -> float:
    """The optimizer reads and writes its state, the parameters and the gradients once."""
    slots = plan["optimizer"]["state_tensors_per_parameter"]
    shard = busiest["optimizer_bytes"] / slots if slots else busiest["param_bytes"]
    d = cluster.device
    rate = d.hbm_GBps * 1e9 * (d.hbm_efficiency if cluster.is_gpu else 1.0)
    return (2 * busiest["optimizer_bytes"] + 3 * shard) / rate


def codec_s(step: Step, grad_bytes: float) -> float:
    """The codec's arithmetic on a step's gradients (codecs/basic.py, powersgd.py): bf16 / fp16
    cast them down and the sums back (12 bytes moved a 4-byte number); top-k finds and gathers its
    entries and keeps the error feedback (some 4 passes); PowerSGD multiplies each matrix by its
    rank-r factors three times (P = MQ, Q = M^T P, M ~ P Q^T: 6 r FLOPs a number) besides the
    error feedback's passes."""
    p, d = step.cfg.parallel, step.cluster.device
    memory_s = grad_bytes / (d.hbm_GBps * 1e9)
    if p.compression in ("bf16", "fp16"):
        return 3 * memory_s
    if p.compression == "topk":
        return 4 * memory_s
    if p.compression == "powersgd":
        flops = 6 * p.powersgd_rank * grad_bytes / 4
        return flops / (d.peak_tflops * 1e12 * d.gemm_efficiency) + 4 * memory_s
    return 0.0


def buckets(grad_bytes: float, bucket_mb: float) -> int:
    """How many buckets the gradients fill (make_buckets: bucket_mb each, the last one short)."""
    return max(1, math.ceil(grad_bytes / (bucket_mb * 2**20)))


def finish(
    step: Step, replica, exposed_s: float, flat: bool = False, compress_s: float = 0.0
) -> tuple[float, dict, float, int]:
    """`flat`: the optimizer steps a flat shard (ZeRO); `compress_s`: a codec's arithmetic."""
    optimizer_s = step.optimizer_s(flat=flat)
    parts = {**replica.parts, "exposed_dp_comm_s": exposed_s}
    if compress_s:
        parts["compress_s"] = compress_s
    parts["optimizer_s"] = optimizer_s
    overhead_s = step.cluster.device.step_overhead_us * 1e-6
    if overhead_s:
        parts["framework_s"] = overhead_s
    total = replica.pipeline_s + exposed_s + compress_s + optimizer_s + overhead_s
    return total, parts, replica.forward_flops, replica.tokens_per_sample
