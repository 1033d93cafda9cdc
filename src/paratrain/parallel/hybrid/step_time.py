"""The tp x pp grid's step time."""

from __future__ import annotations

from paratrain.cost.step_time import Step, collective_s
from paratrain.parallel.dp.step_time import all_reduce
from paratrain.parallel.tensor.layers import plan_for


def model_parallel(step: Step) -> tuple[float, dict, float, int]:
    """tp x pp x dp: dp's gradient buckets as `all_reduce`, and the gradient norm's sum of squares
    all-reduced over the whole world every step (hybrid.py), a latency-bound message."""
    if step.cfg.parallel.tp > 1:
        step.tp_plan = plan_for(step.model, step.cfg.parallel.tp_plan)
    total, parts, forward_flops, tokens = all_reduce(step)
    world = step.plan["world_size"]
    norm_s = collective_s("all_reduce", 8, world, *step.link(world))
    parts["exposed_dp_comm_s"] += norm_s
    return total + norm_s, parts, forward_flops, tokens
