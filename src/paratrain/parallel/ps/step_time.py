"""The parameter servers' step time."""

from __future__ import annotations

from paratrain.cost.step_time import Step


def parameter_server(step: Step) -> tuple[float, dict, float, int]:
    """A sync step: every worker runs its microbatches through the whole model, pushes each server
    its shard's gradients and pulls the shard back once the server has applied its optimizer to
    the sum. Each server's link carries its shard to and from every worker (the plan's send and
    receive bytes, a latency a message); the step waits for the slowest server, and for a worker's
    own link, which carries every shard both ways. Async and ssp workers run ahead instead of
    waiting: the figure is a sync step's."""
    from paratrain.cost.step_time import stage_costs

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
