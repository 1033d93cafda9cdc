"""dp's step time."""

from __future__ import annotations

from paratrain.cost.step_time import Step, bucketed_s, buckets, codec_s, finish


def all_reduce(step: Step) -> tuple[float, dict, float, int]:
    """dp (and tp x pp x dp): each replica's gradients all-reduced over dp x cp (a context rank holds
    every parameter, its gradients its chunks'), bucket by bucket, through the codec, whose own
    arithmetic (`codec_s`) is on the critical path."""
    replica = step.replica()
    p = step.cfg.parallel
    ranks = step.plan["mesh"]["dp"] * p.cp
    exposed_s = 0.0
    if ranks > 1:
        bw, lat = step.link(ranks * p.tp)
        grads, bucket_mb = step.busiest["grad_bytes"], p.bucket_mb
        reduce_s = bucketed_s("all_reduce", grads * step.wire, ranks, bw, lat, buckets(grads, bucket_mb))
        exposed_s = replica.overlapped(reduce_s, grads, bucket_mb)
        return finish(step, replica, exposed_s, compress_s=codec_s(step, grads))
    return finish(step, replica, exposed_s)
