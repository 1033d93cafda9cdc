"""Each strategy's step-time model (its spec's `time_model`), from what its engine does; the
shared pieces (a replica's microbatches through its tp x pp grid, links, alpha-beta collectives,
the optimizer) are predict.py's. Each returns (step seconds, the breakdown, forward FLOPs of a
step over all replicas, tokens in a sample).

  * dp and the model-parallel grid: gradient buckets all-reduced over dp while the last
    microbatch's backward runs: only what exceeds that backward is exposed (and at least one
    bucket's share); on the CPU nothing hides communication: all of it is exposed;
  * tp and pp: besides, the gradient norm's all-reduce over the world, every step;
  * zero1/2: reduce-scatter the same way, and all-gather the parameters after the optimizer step,
    waited for in the next forward: their latency hides behind it, their bytes do not; zero3 gathers each unit before its forward and backward, prefetched while the previous
    unit computes: exposed only where the gathers outrun the compute; it reduce-scatters each
    unit's gradients (on gloo: all-reduces each gradient where it lies, asynchronously as backward
    makes it: a stream latency a tensor); each stage all-reduces the gradient norm;
  * parameter servers: compute, then every shard pushed to and pulled from its server;
  * every strategy: a codec's own arithmetic (codec_s) and the framework's cost of a step
    (the cluster's step_overhead_us), besides the optimizer.
"""

from __future__ import annotations

import math

from ..predict import Step, bucketed_s, collective_s


def all_reduce(step: Step) -> tuple[float, dict, float, int]:
    """dp (and tp x pp x dp): each replica's gradients all-reduced over dp, bucket by bucket, through
    the codec, whose own arithmetic (`codec_s`) is on the critical path."""
    replica = step.replica()
    dp, tp = step.plan["mesh"]["dp"], step.cfg.parallel.tp
    exposed_s = 0.0
    if dp > 1:
        bw, lat = step.link(dp * tp)
        grads, bucket_mb = step.busiest["grad_bytes"], step.cfg.parallel.bucket_mb
        reduce_s = bucketed_s("all_reduce", grads * step.wire, dp, bw, lat, buckets(grads, bucket_mb))
        exposed_s = replica.overlapped(reduce_s, grads, bucket_mb)
        return finish(step, replica, exposed_s, compress_s=codec_s(step, grads))
    return finish(step, replica, exposed_s)


def codec_s(step: Step, grad_bytes: float) -> float:
    """The codec's arithmetic on a step's gradients (compression.py, powersgd.py): bf16 / fp16
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


def model_parallel(step: Step) -> tuple[float, dict, float, int]:
    """tp x pp x dp: dp's gradient buckets as `all_reduce`, and the gradient norm's sum of squares
    all-reduced over the whole world every step (hybrid.py), a latency-bound message."""
    total, parts, forward_flops, tokens = all_reduce(step)
    world = step.plan["world_size"]
    norm_s = collective_s("all_reduce", 8, world, *step.link(world))
    parts["exposed_dp_comm_s"] += norm_s
    return total + norm_s, parts, forward_flops, tokens


def zero(step: Step) -> tuple[float, dict, float, int]:
    """ZeRO 1-3 over dp (tp = pp = 1)."""
    from .registry import spec
    from .zero_comm import from_primitives

    replica = step.replica()
    dp, p = step.plan["mesh"]["dp"], step.cfg.parallel
    if dp == 1:
        return finish(step, replica, 0.0, flat=True)
    bw, lat = step.link(dp)
    primitives = from_primitives("nccl" if step.cluster.is_gpu else "gloo")

    def reduce_scatter_s(size: float, count: int = 1) -> float:
        """On gloo ZeRO reduce-scatters by an all-reduce of the whole buffer (zero_comm)."""
        return bucketed_s("all_reduce" if primitives else "reduce_scatter", size, dp, bw, lat, count)

    def all_gather_s(size: float, hidden_s: float = 0.0) -> float:
        """On gloo ZeRO all-gathers by one broadcast of each rank's shard (zero_comm), started
        together: after the first, each costs the stream latency, where a busy machine's is less
        than a broadcast's own. Their latency elapses behind `hidden_s` of compute (the bytes are
        moved on the cores that compute: not hidden)."""
        if primitives:
            each = min(step.cluster.device.stream_latency_us * 1e-6 or lat, lat)
            latency_s = lat + (dp - 1) * each
            return dp * collective_s("send", size / dp, dp, bw, 0.0) + max(latency_s - hidden_s, 0.0)
        bytes_s = collective_s("all_gather", size, dp, bw, 0.0)
        return bytes_s + max(collective_s("all_gather", size, dp, bw, lat) - bytes_s - hidden_s, 0.0)

    if spec(p.strategy).stage == 3:
        # one gather before each unit's forward and again before its backward (the root unit,
        # kept through both, once) and one reduce-scatter each: a latency per unit, not per model
        from .base import unique_parameters
        from .zero import module_units

        model = step.model
        params = [t for _, t in unique_parameters(model)]
        groups = module_units(model, params, int(p.bucket_mb * 2**20))
        units = [
            (-(-sum(t.numel() for t in g) // dp) * dp * g[0].element_size(), 1 if unit is model else 2)
            for unit, g in groups
        ]
        if primitives:
            # gloo: each gradient all-reduced where it lies (zero_comm's in-place path), started as
            # backward makes it: a stream of asynchronous collectives beside the compute, each
            # adding the stream latency --calibrate measures
            grads = [t.numel() * t.element_size() * step.wire for _, g in groups for t in g]
            each = step.cluster.device.stream_latency_us * 1e-6 or 2 * (dp - 1) * lat
            reduce = sum(collective_s("all_reduce", size, dp, bw, 0.0) + each for size in grads)
        else:
            reduce = sum(reduce_scatter_s(size * step.wire) for size, _ in units)
        gathers = sum(times * all_gather_s(size) for size, times in units)
        exposed_s = replica.microbatches * (max(reduce - replica.backward_s, 0) + max(gathers - replica.hiding_s, 0))
    else:
        full = step.busiest["param_bytes"]
        reduce_s = reduce_scatter_s(full * step.wire, buckets(full, p.bucket_mb))
        # the gathers start after the optimizer step and are waited for in the next forward,
        # layer by layer (zero.py): their latency elapses behind it
        exposed_s = replica.overlapped(reduce_s, full, p.bucket_mb) + all_gather_s(full, replica.forward_s)
    exposed_s += collective_s("all_reduce", 8, dp, bw, lat)  # the gradient norm's sum of squares (zero.py)
    return finish(step, replica, exposed_s, flat=True, compress_s=codec_s(step, step.plan["model"]["bytes"]))


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


def parameter_server(step: Step) -> tuple[float, dict, float, int]:
    """A sync step: every worker runs its microbatches through the whole model, pushes each server
    its shard's gradients and pulls the shard back once the server has applied its optimizer to
    the sum. Each server's link carries its shard to and from every worker (the plan's send and
    receive bytes, a latency a message); the step waits for the slowest server, and for a worker's
    own link, which carries every shard both ways. Async and ssp workers run ahead instead of
    waiting: the figure is a sync step's."""
    from ..predict import stage_costs

    plan, cluster = step.plan, step.cluster
    b = plan["batch"]
    m = b["microbatches"]
    (stage,), tokens_per_sample = stage_costs(step.cfg, b["rows_per_microbatch"], None, cluster, 1)
    # the workers compute at once, the servers hardly: busy as the workers' share of the processes
    busy = plan["mesh"]["workers"] / plan["world_size"]
    compute_s = m * stage.work_s(step.recompute) * max(1.0, cluster.device.cpu_contention * busy)
    bw, lat = step.link(plan["world_size"])

    def on_the_wire(rank: dict, messages: int) -> float:
        return sum(e["payload"] for e in (rank["comm"] or {}).values()) / bw + messages * lat

    servers = [r for r in plan["ranks"] if r["role"] == "parameter server"]
    worker = next(r for r in plan["ranks"] if r["role"] != "parameter server")
    push_pull_s = max(
        max(on_the_wire(r, 2 * plan["mesh"]["workers"]) for r in servers), on_the_wire(worker, 2 * len(servers))
    )
    optimizer_s = step.optimizer_s(max(servers, key=lambda r: r["optimizer_bytes"]))
    parts = {"compute_s": compute_s, "push_pull_s": push_pull_s, "optimizer_s": optimizer_s}
    forward_flops = stage.forward_flops * m * plan["mesh"]["workers"]
    return compute_s + push_pull_s + optimizer_s, parts, forward_flops, tokens_per_sample
