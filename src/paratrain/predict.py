"""The step-time model of `paratrain plan --cluster`: seconds per optimizer step of a planned
layout on a cluster, from what the engines do.

Compute. One microbatch's forward through each pipeline stage is played in fake tensors
(activations.FakeRun) and every operation recorded. On a GPU (Calculon's idea) a matrix product
(matmul, linear, attention: the ops torch.utils.flop_counter counts) takes its FLOPs at the
device's peak times gemm_efficiency plus a fixed product_overhead_us; every other op is
memory-bound: it reads and writes its output's bytes at the device's memory bandwidth; backward
takes twice the forward (two products per forward product). On a calibrated cpu cluster
(`time_layers`, this machine) the model's layers are timed here instead, forward and backward
(layer_times: on a CPU eager dispatch, not arithmetic, sets a small model's pace), at the thread
count a worker gets, and stretched by the measured cpu_contention as much as the ranks are busy
together and, where ranks synchronize, by the measured sync_skew (Step.replica).
`train.recompute = "full"` adds one forward. Under tp, each device does 1/tp of a stage's arithmetic (the few replicated ops, layer
norms and residual adds, are counted split too) and all of its ops' dispatch (timed layers: the
layer on 1/tp of the rows, the same ops on the same share of the work).

Communication (alpha-beta): an op of a group of N moves its fewest bytes (profile.min_bytes_sent:
2(N-1)/N of the buffer for a ring all-reduce) at the group's link bandwidth, plus a latency per ring
step. A group within one node uses the intra-node link; one across nodes shares its node's NICs
with the node's other devices, which communicate at the same time.
  * tp's all-reduces (activations.tp_all_reduces: their payloads) are on the critical path, in every
    microbatch, and under recompute the forward's half again;
  * pipeline stages send each microbatch's activation forward and its gradient back (within a node
    at p2p_latency_us a message); a step takes m microbatches at the slowest rank's pace plus,
    warming up and cooling down, one microbatch's work on every other rank, over v (gpipe and
    1f1b: v = 1; interleaved: v virtual stages per rank): (pp - 1) / v microbatches when balanced,
    slowed by the contention of the half of the ranks that work then on average;
  * the optimizer reads and writes its state, the parameters and the gradients once, memory-bound;
  * what each strategy communicates besides (dp's buckets, ZeRO's gathers, the parameter servers'
    push and pull) is its own time model: its spec's `time_model`, in parallel/step_costs.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from .cluster import Cluster
from .config import Config
from .op_costs import OpRecorder
from .profile import min_bytes_sent


@dataclass
class StageCost:
    forward_flops: int  # one microbatch's forward through the stage, the whole (unsplit) stage
    forward_s: float  # the same on one device of the cluster, split over tp
    backward_s: float

    def work_s(self, recompute: bool) -> float:
        """Forward, backward and, under recompute, the forward again."""
        return self.forward_s * (2 if recompute else 1) + self.backward_s


def stage_ops(cfg: Config, rows: int, bounds: list[int] | None) -> tuple[list[list[tuple[int, int]]], int]:
    """Each stage's ops in one microbatch's forward, as (FLOPs, bytes written) of the whole
    (unsplit) stage, and the tokens in a sample (a sequence model's positions; else 1)."""
    from .activations import FakeRun
    from .optim import build_loss

    run = FakeRun.build(cfg, rows, bounds)
    recorders: list[OpRecorder] = []

    @contextlib.contextmanager
    def recording(s: int):
        recorder = OpRecorder()
        recorders.append(recorder)
        with recorder:
            yield

    run.forward(build_loss(cfg), recording)
    tokens = run.x[0].numel() if not run.x.is_floating_point() else 1
    return [recorder.ops for recorder in recorders], tokens


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
        from .layer_times import layer_times

        threads = worker_threads(cluster)
        # a tp shard runs every op of its layer on 1/tp of the arithmetic: timed as the layer on
        # 1/tp of the rows (the same ops, the same share of the work)
        timed_rows = max(1, rows // tp)
        forward_flops = sum(f for ops in stages for f, _ in ops) // tp
        measured = layer_times(cfg, timed_rows, threads, forward_flops, cluster.times_file)
    out = []
    for s, ops in enumerate(stages):
        flops_s = sum(flops / (d.peak_tflops * 1e12 * d.gemm_efficiency) for flops, _ in ops)
        memory_s = sum(2 * written / (d.hbm_GBps * 1e9) for flops, written in ops if not flops)
        fixed_s = sum(d.product_overhead_us * 1e-6 for flops, _ in ops if flops) + len(ops) * d.op_overhead_us * 1e-6
        split = fixed_s + (flops_s + memory_s) / tp
        if measured is None:
            forward_s, backward_s = split, 2 * split
        else:
            # the measured time (and where the rows do not split evenly over tp, its arithmetic's
            # remainder as modelled); how the processes slow each other is Step.replica's
            layers = measured if bounds is None else measured[bounds[s] : bounds[s + 1]]
            scale = split / (fixed_s + (flops_s + memory_s) * timed_rows / rows)
            forward_s = scale * sum(t.forward_s for t in layers)
            backward_s = scale * sum(t.backward_s for t in layers)
        out.append(StageCost(sum(f for f, _ in ops), forward_s, backward_s))
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
    """What a strategy's time model (its spec's `time_model`) reads: the config, the model on the
    meta device, the plan of its ranks and the cluster; and the figures every model shares."""

    cfg: Config
    model: object
    plan: dict
    cluster: Cluster

    @property
    def recompute(self) -> bool:
        return self.cfg.train.recompute == "full"

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
            from .layer_times import optimizer_step_s

            timed = optimizer_step_s(self.cfg, worker_threads(self.cluster), self.cluster.times_file)
            if timed is not None:
                total, slots = self.plan["model"]["bytes"], self.plan["optimizer"]["state_tensors_per_parameter"]
                stepped = rank["optimizer_bytes"] / slots if slots else rank["param_bytes"]  # what it updates
                share = stepped / max(1, total)
                return d.cpu_contention * share * timed[1 if flat else 0]
        return optimizer_time(self.plan, rank, self.cluster)

    def replica(self) -> Replica:
        """One model replica's microbatches through its tp x pp grid (tp = pp = 1: one device)."""
        from .parallel.hybrid import virtual_stages

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
            from .activations import tp_all_reduces
            from .parallel.tensor_parallel import plan_for

            payloads = tp_all_reduces(cfg, rows, bounds, plan_for(self.model, p.tp_plan)) or [[] for _ in stages]
            bw, lat = self.link(tp)
            tp_s = [
                sum(collective_s("all_reduce", x, tp, bw, lat) for x in stage) * (1.5 if recompute else 1)
                for stage in payloads
            ]
        # pp: a microbatch's activation to the next stage, its gradient back
        p2p_s = [0.0] * len(stages)
        if pp > 1:
            from .activations import boundary_bytes

            boundary = boundary_bytes(cfg, self.model, bounds, rows)
            neighbours = dp * tp + 1  # a stage's neighbour is dp x tp ranks on
            bw, lat = self.link(neighbours)
            if neighbours <= cluster.devices_per_node and cluster.device.p2p_latency_us:
                lat = cluster.device.p2p_latency_us * 1e-6
            for s in range(len(stages)):
                out = boundary[s + 1] if s + 1 < len(stages) else 0
                back = boundary[s] if s > 0 else 0
                p2p_s[s] = sum(x / bw + lat for x in (out, back) if x)

        # processes computing at once slow each other (cpu_contention, measured with all of them
        # busy), as much as they are busy together: a pipeline's light stages leave their share
        # of the cores to the heavy ones; ranks that meet at collectives (dp's, tp's) wait besides
        # for the last to arrive, more the longer they computed since (sync_skew, per second of
        # compute); a pipeline's stages pass microbatches on without meeting, a late one's
        # neighbour waiting in its bubble instead
        compute = [sum(stages[c * pp + r].work_s(recompute) for c in range(v)) for r in range(pp)]
        busy = sum(compute) / (pp * max(compute)) if max(compute) > 0 else 1.0
        skew = cluster.device.sync_skew if dp > 1 or tp > 1 else 0.0
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
            compute = sum(stages[s].work_s(recompute) for s in held)
            backward = sum(stages[s].work_s(recompute) - stages[s].forward_s for s in held)
            per_rank.append((compute + sum(tp_s[s] + p2p_s[s] for s in held), backward, compute))
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
        forward_flops = sum(s.forward_flops for s in stages) * m * dp
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


def predict(cfg: Config, model, plan: dict, cluster: Cluster) -> tuple[dict, dict]:
    """(the "predicted" figures, the breakdown of one step in seconds) for the plan of `cfg`
    (`model` on the meta device) on the cluster, by its strategy's own time model."""
    from .parallel.registry import spec
    from .parallel.spec import load

    step = Step(cfg, model, plan, cluster)
    step_s, parts, forward_flops, tokens_per_sample = load(spec(cfg.parallel.strategy).time_model)(step)
    return figures(plan, cluster, step_s, forward_flops, tokens_per_sample, parts)


def optimizer_time(plan: dict, busiest: dict, cluster: Cluster) -> float:
    """The optimizer reads and writes its state, the parameters and the gradients once."""
    slots = plan["optimizer"]["state_tensors_per_parameter"]
    shard = busiest["optimizer_bytes"] / slots if slots else busiest["param_bytes"]
    return (2 * busiest["optimizer_bytes"] + 3 * shard) / (cluster.device.hbm_GBps * 1e9)


def figures(
    plan: dict, cluster: Cluster, step_s: float, forward_flops: float, tokens_per_sample: int, parts: dict
) -> tuple[dict, dict]:
    """The contract's "predicted" figures from the step time and the forward FLOPs of a step (all
    replicas), and the breakdown with the busiest rank's memory headroom."""
    samples = plan["batch"]["global"]
    per_device = forward_flops * 3 / step_s / plan["world_size"] / 1e12  # the model's forward + backward
    peak_memory = max(
        r["peak_bytes"] if r["peak_bytes"] is not None else r["model_state_bytes"] + (r["activation_bytes"] or 0)
        for r in plan["ranks"]
    )
    predicted = {
        "step_s": step_s,
        "samples_per_s": samples / step_s,
        "tokens_per_s": samples * tokens_per_sample / step_s,
        "tflops_per_device": per_device,
        "mfu": per_device / cluster.device.peak_tflops,
        "peak_memory_gib": peak_memory / 2**30,
    }
    return predicted, {**parts, "memory_headroom_gib": cluster.device.memory_gib - peak_memory / 2**30}
