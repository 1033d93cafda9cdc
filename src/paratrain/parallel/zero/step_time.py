"""ZeRO's step time."""

from __future__ import annotations

from paratrain.cost.step_time import Step, bucketed_s, buckets, codec_s, collective_s, finish


def zero(step: Step) -> tuple[float, dict, float, int]:
    """ZeRO 1-3 over dp (tp = pp = 1); with parallel.replicas, sharded over the ranks of one replica,
    whose gradient shards are then all-reduced across the replicas after backward (engine.py)."""
    from paratrain.parallel.zero.comm import from_primitives

    replica = step.replica()
    p = step.cfg.parallel
    dp = step.plan["mesh"]["dp"] // p.replicas  # the ranks that shard the state
    across_s = 0.0
    if p.replicas > 1:  # the replicas' ranks lie the world's span apart; not overlapped with backward
        shard = step.plan["model"]["bytes"] / dp  # in full precision: no codec crosses replicas
        across_s = collective_s("all_reduce", shard, p.replicas, *step.link(step.plan["mesh"]["dp"]))
    if dp == 1:
        return finish(step, replica, across_s, flat=True)
    bw, lat = step.link(dp)
    primitives = from_primitives("nccl" if step.cluster.is_gpu else "gloo")

    def reduce_scatter_s(size: float, count: int = 1) -> float:
        """On gloo ZeRO reduce-scatters by an all-reduce of the whole buffer (zero/comm.py)."""
        return bucketed_s("all_reduce" if primitives else "reduce_scatter", size, dp, bw, lat, count)

    def all_gather_s(size: float, hidden_s: float = 0.0) -> float:
        """On gloo ZeRO all-gathers by one broadcast of each rank's shard (zero/comm.py), started
        together: after the first, each costs the stream latency, where a busy machine's is less
        than a broadcast's own. Their latency elapses behind `hidden_s` of compute (the bytes are
        moved on the cores that compute: not hidden)."""
        if primitives:
            each = min(step.cluster.device.stream_latency_us * 1e-6 or lat, lat)
            latency_s = lat + (dp - 1) * each
            return dp * collective_s("send", size / dp, dp, bw, 0.0) + max(latency_s - hidden_s, 0.0)
        bytes_s = collective_s("all_gather", size, dp, bw, 0.0)
        return bytes_s + max(collective_s("all_gather", size, dp, bw, lat) - bytes_s - hidden_s, 0.0)

    if p.strategy == "zero3":  # its own stages: zero1, zero2, zero3
        # one gather before each unit's forward and again before its backward (the root unit,
        # kept through both, once) and one reduce-scatter each: a latency per unit, not per model
        from paratrain.parallel.base import unique_parameters
        from paratrain.parallel.zero.gather import module_units

        model = step.model
        params = [t for _, t in unique_parameters(model)]
        groups = module_units(model, params, int(p.bucket_mb * 2**20))
        units = [
            (-(-sum(t.numel() for t in g) // dp) * dp * g[0].element_size(), 1 if unit is model else 2)
            for unit, g in groups
        ]
        if primitives:
            # gloo: each gradient all-reduced where it lies (zero/comm.py's in-place path), started as
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
        full = working_param_bytes(step, dp)
        reduce_s = reduce_scatter_s(full * step.wire, buckets(full, p.bucket_mb))
        # the gathers start after the optimizer step and are waited for in the next forward,
        # layer by layer (zero.py): their latency elapses behind it
        exposed_s = replica.overlapped(reduce_s, full, p.bucket_mb) + all_gather_s(full, replica.forward_s)
    exposed_s += collective_s("all_reduce", 8, dp, bw, lat)  # the gradient norm's sum of squares (zero.py)
    exposed_s += across_s
    return finish(step, replica, exposed_s, flat=True, compress_s=codec_s(step, step.plan["model"]["bytes"]))


def working_param_bytes(step: Step, dp: int) -> float:
    """Stages 1 and 2: the bytes of the parameters every rank holds whole, which are all-gathered.
    Under mixed precision a rank's param_bytes also hold its fp32 master shard (footprint.zero_state:
    whole * w + whole_fp32 / dp, w the working dtype's share of the full precision's bytes)."""
    from paratrain.parallel.base import unique_parameters
    from paratrain.parallel.zero.footprint import mixed_working_dtype

    held = step.busiest["param_bytes"]
    params = [t for _, t in unique_parameters(step.model)]
    working = mixed_working_dtype(step.cfg, params, 1)
    if working is None:
        return held
    w = working.itemsize / params[0].element_size()
    return held * w / (w + 1 / dp)
