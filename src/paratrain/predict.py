"""The step-time model of `paratrain plan --cluster`: seconds per optimizer step of a planned
layout on a cluster, from what the engines do.

Compute (Calculon's idea): one microbatch's forward through each pipeline stage is played in fake
tensors (activations.FakeRun) and every operation recorded. A matrix product (matmul, linear, attention:
the ops torch.utils.flop_counter counts) takes its FLOPs at the device's peak times an efficiency
that grows with its size: FLOPs / (peak x gemm_efficiency) plus a fixed product_overhead_us, so a
small matmul reaches a small fraction of peak and a large one gemm_efficiency. Every other op is
memory-bound: it reads and writes its output's bytes at the device's memory bandwidth. Every op
also costs op_overhead_us (the CPU's eager dispatch; 0 on GPUs) (cluster.Device). Backward
takes twice the forward (two products per forward product); `train.recompute = "full"` adds one
forward. Under tp, each device does 1/tp of a stage's work (tp's sharded layers hold 1/tp of every
product; the few replicated ops, layer norms and residual adds, are counted split too).

Communication (alpha-beta): an op of a group of N moves its fewest bytes (profile.min_bytes_sent:
2(N-1)/N of the buffer for a ring all-reduce) at the group's link bandwidth, plus a latency per ring
step. A group within one node uses the intra-node link; one across nodes shares its node's NICs
with the node's other devices, which communicate at the same time.
  * dp's gradient buckets are all-reduced while the last microbatch's backward runs: only what
    exceeds that backward is exposed (and at least one bucket's share); on the CPU nothing hides
    communication (gloo's threads share the cores that compute): all of it is exposed;
  * zero1/2 reduce-scatter the same way and all-gather the parameters after the optimizer step,
    exposed; zero3 gathers each unit before its forward and backward, prefetched while the previous
    unit computes: exposed only where the gathers outrun the compute;
  * tp's all-reduces (activations.tp_all_reduces: their payloads) are on the critical path, in every
    microbatch, and under recompute the forward's half again;
  * pipeline stages send each microbatch's activation forward and its gradient back; the schedule
    idles (pp - 1) / v of a microbatch's work per rank (gpipe and 1f1b: v = 1; interleaved: v
    virtual stages per rank);
  * the optimizer reads and writes its state, the parameters and the gradients once, memory-bound;
  * parameter servers: see predict_ps.
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


def stage_costs(
    cfg: Config, rows: int, bounds: list[int] | None, cluster: Cluster, tp: int
) -> tuple[list[StageCost], int]:
    """Each stage's cost on one device of the cluster (split over tp), and the tokens in a sample."""
    stages, tokens = stage_ops(cfg, rows, bounds)
    d = cluster.device
    out = []
    for ops in stages:
        seconds = 0.0
        for flops, written in ops:
            if flops:
                seconds += flops / tp / (d.peak_tflops * 1e12 * d.gemm_efficiency) + d.product_overhead_us * 1e-6
            else:
                seconds += 2 * written / tp / (d.hbm_GBps * 1e9)
            seconds += d.op_overhead_us * 1e-6
        out.append(StageCost(sum(f for f, _ in ops), seconds))
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


def predict(cfg: Config, model, plan: dict, cluster: Cluster) -> tuple[dict | None, dict]:
    """(the "predicted" figures, the breakdown of one step in seconds) for the plan of `cfg`
    (`model` on the meta device) on the cluster."""
    from .parallel.hybrid import virtual_stages
    from .parallel.registry import ParameterServerSpec, spec

    p = cfg.parallel
    strategy = spec(p.strategy)
    if isinstance(strategy, ParameterServerSpec):
        return predict_ps(cfg, plan, cluster)
    tp, pp = p.tp, p.pp
    dp = plan["mesh"]["dp"]
    v = virtual_stages(cfg) if pp > 1 else 1
    b = plan["batch"]
    m, rows = b["microbatches"], b["rows_per_microbatch"]
    bounds = [0, *[s["layers"][1] + 1 for s in plan["stages"]]] if pp > 1 else None
    stages, tokens_per_sample = stage_costs(cfg, rows, bounds, cluster, tp)
    recompute = cfg.train.recompute == "full"

    # tp: all-reduces within each stage, every microbatch; recompute repeats the forward's half
    tp_s = [0.0] * len(stages)
    if tp > 1:
        from .activations import tp_all_reduces
        from .parallel.tensor_parallel import plan_for

        payloads = tp_all_reduces(cfg, rows, bounds, plan_for(model, p.tp_plan)) or [[] for _ in stages]
        bw, lat = link(cluster, tp)
        tp_s = [
            sum(collective_s("all_reduce", x, tp, bw, lat) for x in stage) * (1.5 if recompute else 1)
            for stage in payloads
        ]
    # pp: a microbatch's activation to the next stage, its gradient back
    p2p_s = [0.0] * len(stages)
    if pp > 1:
        from .activations import boundary_bytes

        boundary = boundary_bytes(cfg, model, bounds, rows)
        bw, lat = link(cluster, dp * tp + 1)
        for s in range(len(stages)):
            out = boundary[s + 1] if s + 1 < len(stages) else 0
            back = boundary[s] if s > 0 else 0
            p2p_s[s] = sum(x / bw + lat for x in (out, back) if x)

    compute_passes = 3 + (1 if recompute else 0)  # forward, backward (2x), recompute's forward
    per_rank = []  # one microbatch's work on each pp rank: (total, backward only)
    for r in range(pp):
        held = [c * pp + r for c in range(v)]
        work = sum(stages[s].forward_s * compute_passes + tp_s[s] + p2p_s[s] for s in held)
        backward = sum(stages[s].forward_s * (compute_passes - 1) for s in held)
        per_rank.append((work, backward))
    slowest, backward = max(per_rank)
    bubble_s = (pp - 1) / v * slowest
    pipeline_s = m * slowest + bubble_s

    # data-parallel gradient reduction, parameter gathers, the optimizer: on the busiest rank
    busiest = max(plan["ranks"], key=lambda r: r["param_bytes"] + r["optimizer_bytes"])
    bw, lat = link(cluster, dp * tp)
    wire = 0.5 if p.compression in ("bf16", "fp16") else 1.0
    exposed_s = 0.0
    # what communication can hide behind: on a GPU the compute of the same microbatch; on the CPU
    # nothing, since gloo's threads run on the cores that compute
    backward, hiding = (backward, slowest) if cluster.is_gpu else (0.0, 0.0)
    if dp > 1:
        from .parallel.zero_comm import from_primitives

        primitives = from_primitives("nccl" if cluster.is_gpu else "gloo")

        def reduce_scatter_s(size: float) -> float:
            """On gloo ZeRO reduce-scatters by an all-reduce of the whole buffer (zero_comm)."""
            return collective_s("all_reduce" if primitives else "reduce_scatter", size, dp, bw, lat)

        def all_gather_s(size: float) -> float:
            """On gloo ZeRO all-gathers by one broadcast of each rank's shard (zero_comm)."""
            if primitives:
                return dp * collective_s("send", size / dp, dp, bw, lat)
            return collective_s("all_gather", size, dp, bw, lat)

        def overlapped(reduce: float, numbers: float) -> float:
            """Buckets reduced while the backward runs: what outlasts it, at least the last bucket."""
            return max(reduce - backward, reduce * min(1.0, p.bucket_mb * 2**20 / max(numbers, 1)))

        zero_stage = getattr(strategy, "stage", 0)  # a ZeroSpec's
        if zero_stage == 3:
            # one gather before each unit's forward and again before its backward (the root unit,
            # kept through both, once) and one reduce-scatter each: a latency per unit, not per model
            from .parallel.base import unique_parameters
            from .parallel.zero import module_units

            params = [t for _, t in unique_parameters(model)]
            units = [
                (-(-sum(t.numel() for t in g) // dp) * dp * g[0].element_size(), 1 if unit is model else 2)
                for unit, g in module_units(model, params, int(p.bucket_mb * 2**20))
            ]
            reduce = sum(reduce_scatter_s(size * wire) for size, _ in units)
            gathers = sum(times * all_gather_s(size) for size, times in units)
            exposed_s = m * (max(reduce - backward, 0) + max(gathers - hiding, 0))
        elif zero_stage in (1, 2):
            full = busiest["param_bytes"]
            exposed_s = overlapped(reduce_scatter_s(full * wire), full) + all_gather_s(full)
        else:
            grads = busiest["grad_bytes"]
            exposed_s = overlapped(collective_s("all_reduce", grads * wire, dp, bw, lat), grads)
    optimizer_s = optimizer_time(plan, busiest, cluster)
    step_s = pipeline_s + exposed_s + optimizer_s
    compute_s = m * max(
        sum(stages[s].forward_s * compute_passes for s in [c * pp + r for c in range(v)]) for r in range(pp)
    )
    parts = {
        "compute_s": compute_s,
        "bubble_s": bubble_s,
        "tp_comm_s": m * max(tp_s),
        "p2p_s": m * max(p2p_s),
        "exposed_dp_comm_s": exposed_s,
        "optimizer_s": optimizer_s,
    }
    return figures(plan, cluster, step_s, sum(s.forward_flops for s in stages) * m * dp, tokens_per_sample, parts)


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


def predict_ps(cfg: Config, plan: dict, cluster: Cluster) -> tuple[dict, dict]:
    """Parameter servers, a sync step: every worker runs its microbatches through the whole model,
    pushes each server its shard's gradients and pulls the shard back once the server has applied
    its optimizer to the sum. Each server's link carries its shard to and from every worker (the
    plan's send and receive bytes, a latency a message); the step waits for the slowest server,
    and for a worker's own link, which carries every shard both ways. Async and ssp workers run
    ahead instead of waiting: the figure is a sync step's."""
    b = plan["batch"]
    m = b["microbatches"]
    (stage,), tokens_per_sample = stage_costs(cfg, b["rows_per_microbatch"], None, cluster, 1)
    compute_s = m * stage.forward_s * (4 if cfg.train.recompute == "full" else 3)
    bw, lat = link(cluster, plan["world_size"])

    def on_the_wire(rank: dict, messages: int) -> float:
        return sum(e["payload"] for e in (rank["comm"] or {}).values()) / bw + messages * lat

    servers = [r for r in plan["ranks"] if r["role"] == "parameter server"]
    worker = next(r for r in plan["ranks"] if r["role"] != "parameter server")
    push_pull_s = max(
        max(on_the_wire(r, 2 * plan["mesh"]["workers"]) for r in servers), on_the_wire(worker, 2 * len(servers))
    )
    busiest = max(servers, key=lambda r: r["optimizer_bytes"])
    optimizer_s = optimizer_time(plan, busiest, cluster)
    step_s = compute_s + push_pull_s + optimizer_s
    parts = {"compute_s": compute_s, "push_pull_s": push_pull_s, "optimizer_s": optimizer_s}
    return figures(plan, cluster, step_s, stage.forward_flops * m * plan["mesh"]["workers"], tokens_per_sample, parts)
