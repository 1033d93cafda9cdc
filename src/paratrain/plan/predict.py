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
`train.recompute = "full"` adds one forward, "selective" the ops its policy runs again (every other
matrix product and the ops between the products: each op's launch and its time). Under tp, each device does 1/tp of a stage's arithmetic (the few replicated ops, layer
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
    push and pull) is its own time model: its spec's `step_time`, in parallel/*/step_time.py.
"""

from __future__ import annotations

from paratrain.config import Config
from paratrain.cost.cluster import Cluster
from paratrain.cost.step_time import Step


def predict(cfg: Config, model, plan: dict, cluster: Cluster) -> tuple[dict, dict]:
    """(the "predicted" figures, the breakdown of one step in seconds) for the plan of `cfg`
    (`model` on the meta device) on the cluster, by its strategy's own time model."""
    from paratrain.parallel.registry import spec
    from paratrain.parallel.spec import load

    step = Step(cfg, model, plan, cluster)
    step_s, parts, forward_flops, tokens_per_sample = load(spec(cfg.parallel.strategy).step_time)(step)
    return figures(plan, cluster, step_s, forward_flops, tokens_per_sample, parts)


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
