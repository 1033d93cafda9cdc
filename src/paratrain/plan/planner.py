"""`paratrain plan`: how a run would be laid out, before any worker starts.

From the config and the process count alone (the model is built on the meta device and in fake
tensors: no memory, no arithmetic), the plan gives the rank grid (node, local rank, pp/dp/tp
coordinates, role), the pipeline cut, the batch each replica and microbatch gets, and per rank:
  * the bytes of model state the strategy keeps for good: parameters, gradients, optimizer state,
    and what a top-k or PowerSGD codec keeps (error feedback, factors, result);
  * the peak bytes of activations saved for backward, and the peak of a whole step (model state,
    activations and every transient: one microbatch's forward and backward per stage played in
    fake tensors, in the rank's own schedule; activations.step_memory);
  * the bytes its collectives and messages carry in a step, by op, with the fewest it must send,
    exactly as the profiler accounts them (profile.min_bytes_sent).
This module holds the rank plan, the fit against the machine's memory and the rendering; what each
rank holds, saves and sends is its strategy's cost model (its spec's `footprint`:
parallel/*/footprint.py, with dp/footprint.py and pipeline/footprint.py), and its step time its `step_time`
(predict.py, parallel/*/step_time.py).

The layout comes from the functions the strategies themselves call (dp's buckets, ZeRO's units and
their padding, the pipeline's partition and schedules, the tp plan's shard dimensions, the
parameter servers' dealing), so the plan is what the run does: tests/test_plan.py builds every
rank's strategy on a fake process group and counts what it holds, saves and sends, and
tests/test_profile.py holds the bytes to real runs' profile.jsonl.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict

import torch
from torch import nn

from paratrain.config import Config
from paratrain.cost.ranks import MIB, RankPlan, nbytes, optimizer_slots, peak_bytes
from paratrain.errors import ConfigError
from paratrain.parallel import registry


def capacity(ranks: list[RankPlan], device: str, cluster=None) -> dict:
    """Whether the plan fits this machine (every node taken to be like it): on a GPU, the busiest
    rank against its GPU's memory; on CPU, the busiest node's ranks together against host memory.
    With a GPU cluster description, the busiest rank against its device's memory."""

    def need(r: RankPlan) -> int:
        return peak_bytes(r)

    if cluster is not None and cluster.is_gpu:
        worst = max(ranks, key=need)
        have, where, needed = cluster.memory_bytes, f"rank {worst.rank}", need(worst)
        kind = f"{cluster.device_name} memory"
    elif device == "cuda":
        worst = max(ranks, key=need)
        have, where, needed = torch.cuda.get_device_properties(0).total_memory, f"rank {worst.rank}", need(worst)
        kind = "GPU memory"
    else:
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[r.node] = per_node.get(r.node, 0) + need(r)
        node = max(per_node, key=per_node.__getitem__)
        have, where, needed = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), f"node {node}", per_node[node]
        kind = "host memory"
    return {
        "kind": kind,
        "bytes": have,
        "where": where,
        "needed": needed,
        "fits": needed <= have,
        "activations_counted": all(r.peak_bytes is not None for r in ranks),
    }


def make_plan(cfg: Config, model: nn.Module, nproc: int, nnodes: int, device: str, cluster=None) -> dict:
    """The layout of a run of `cfg` on nnodes x nproc processes (`model` on the meta device), and
    its predicted step time on `cluster` (None: machines like this one)."""
    from paratrain.plan.traces import memoised_traces

    with memoised_traces():  # the footprint and the prediction play the same traces
        return _make_plan(cfg, model, nproc, nnodes, device, cluster)


def _make_plan(cfg: Config, model: nn.Module, nproc: int, nnodes: int, device: str, cluster) -> dict:
    from paratrain.config import microbatch_count
    from paratrain.parallel.base import unique_parameters

    spec = registry.spec(cfg.parallel.strategy)
    if not spec.footprint:
        raise ConfigError("parallel.strategy", f"`paratrain plan` has no cost model of strategy {spec.name!r}")
    world = nproc * nnodes
    dp = spec.data_parallel_degree(cfg, world)
    per_replica, micro = cfg.data.batch_size // dp, microbatch_count(cfg)
    rows = per_replica // micro
    params = [t for _, t in unique_parameters(model)]
    ranks = [RankPlan(r, r // nproc, r % nproc, "worker") for r in range(world)]
    total = nbytes(params)
    stages, notes = spec.plan_ranks(cfg, model, ranks, rows, device)
    if device == "cuda":
        notes.append("activations counted with the CPU's kernels: CUDA's attention kernels may save other tensors")
    from paratrain.cost.cluster import this_machine
    from paratrain.plan.predict import predict

    cluster = cluster or this_machine(nnodes, nproc)
    plan = {
        "capacity": capacity(ranks, device, cluster),
        "name": cfg.name,
        "strategy": spec.name,
        "device": device,
        "world_size": world,
        "nnodes": nnodes,
        "nproc_per_node": nproc,
        "mesh": spec.mesh(cfg, world),
        "model": {"factory": cfg.model.factory, "parameters": sum(t.numel() for t in params), "bytes": total},
        "batch": {
            "global": cfg.data.batch_size,
            "per_replica": per_replica,
            "microbatches": micro,
            "rows_per_microbatch": rows,
        },
        "optimizer": {"name": cfg.train.optimizer, "state_tensors_per_parameter": optimizer_slots(cfg)},
        "stages": stages,
        "ranks": [r.as_dict() for r in ranks],
        "notes": notes,
        "cluster": {
            "nodes": cluster.nodes,
            "devices_per_node": cluster.devices_per_node,
            "device": cluster.device_name,
            **asdict(cluster.device),
        },
    }
    plan["predicted"], plan["step_breakdown"] = predict(cfg, model, plan, cluster)
    return plan


def _mib(n: int) -> str:
    return f"{n / MIB:.2f}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def render(plan: dict) -> str:
    m, b = plan["model"], plan["batch"]
    lines = [
        f"plan: {plan['name']}, strategy {plan['strategy']}, {plan['world_size']} processes "
        f"({plan['nnodes']} node(s) x {plan['nproc_per_node']}), device {plan['device']}",
        f"model: {m['factory']}, {m['parameters']:,} parameters, {_mib(m['bytes'])} MiB; optimizer "
        f"{plan['optimizer']['name']} ({plan['optimizer']['state_tensors_per_parameter']} state tensor(s) "
        f"per parameter)",
    ]
    mesh = plan["mesh"]
    cp = mesh.get("cp", 1)
    if "servers" in mesh:
        lines.append(f"ranks: {mesh['servers']} parameter server(s), {mesh['workers']} worker(s)")
    elif mesh["tp"] == mesh["pp"] == 1 and (cp > 1 or mesh.get("ep", 1) > 1):  # comm/grid.py's DataMesh
        experts = f", ep groups of {mesh['ep']} adjacent ranks" if mesh.get("ep", 1) > 1 else ""
        lines.append(f"mesh: dp {mesh['dp']} x cp {cp} (global rank = dp * {cp} + cp){experts}")
    else:  # comm/grid.py's (pp, dp, cp, tp) Mesh; cp shown where it splits sequences
        lines.append(
            f"mesh: dp {mesh['dp']} x cp {cp} x tp {mesh['tp']} x pp {mesh['pp']} "
            f"(global rank = ((pp * {mesh['dp']} + dp) * {cp} + cp) * {mesh['tp']} + tp)"
            if cp > 1
            else f"mesh: dp {mesh['dp']} x tp {mesh['tp']} x pp {mesh['pp']} "
            f"(global rank = (pp * {mesh['dp']} + dp) * {mesh['tp']} + tp)"
        )
        if mesh.get("replicas", 1) > 1:  # (comm/grid.py's ReplicaLayout: a replica is one dp index)
            size = plan["world_size"] // mesh["replicas"]
            which = f"rank // {size}" if mesh["pp"] == 1 else f"rank // {size // mesh['pp']} % {mesh['replicas']}"
            lines.append(
                f"replicas {mesh['replicas']} of {size} ranks (replica = {which}): state sharded or split "
                "inside a replica, gradients averaged across them"
            )
    lines.append(
        f"batch: {b['global']} samples per step, {b['per_replica']} per data-parallel replica, "
        f"{b['microbatches']} microbatch(es) of {b['rows_per_microbatch']}"
    )
    for s in plan["stages"]:
        lines.append(
            f"  stage {s['stage']} on pp rank {s['pp_rank']}: layers {s['layers'][0]}-{s['layers'][1]}, "
            f"{s['parameters']:,} parameters"
        )
    cp_column = f"{'cp':>4}" if cp > 1 else ""  # the ring's place, where sequences are split
    lines.append(
        f"{'rank':>5}{'node':>5}{'local':>6}{'pp':>4}{'dp':>4}{cp_column}{'tp':>4}  {'role':<17}{'stages':<9}"
        f"{'params MiB':>11}{'grads MiB':>10}{'optim MiB':>10}{'state MiB':>10}{'activ MiB':>10}"
        f"{'sent MiB':>10}"
    )
    for r in plan["ranks"]:
        stages = ",".join(map(str, r["stages"])) if r["stages"] else "-"
        if len(stages) > 8:
            stages = stages[:5] + "..."
        activations = "-" if r["activation_bytes"] is None else _mib(r["activation_bytes"])
        sent = "-" if r["comm_min_bytes"] is None else _mib(r["comm_min_bytes"])
        ring = f"{r.get('cp', 0):>4}" if cp > 1 else ""
        lines.append(
            f"{r['rank']:>5}{r['node']:>5}{r['local_rank']:>6}{r['pp']:>4}{r['dp']:>4}{ring}{r['tp']:>4}  "
            f"{r['role']:<17}{stages:<9}{_mib(r['param_bytes']):>11}{_mib(r['grad_bytes']):>10}"
            f"{_mib(r['optimizer_bytes']):>10}{_mib(r['model_state_bytes']):>10}{activations:>10}"
            f"{sent:>10}"
        )
    codec = max(r["codec_bytes"] for r in plan["ranks"])
    if codec:
        lines.append(f"state includes the gradient codec's buffers: {_mib(codec)} MiB a rank")
    lines.append(
        "state = parameters + gradients + optimizer state (+ codec), kept for good; activ = the peak of "
        "activations saved for backward; sent = the fewest bytes a step's collectives and messages need "
        "this rank to send; the fit and the predicted peak memory take each rank's peak in a step "
        "(peak_bytes): state, activations and what the step makes and frees"
    )
    c = plan["capacity"]
    what = "a step's peak" if c["activations_counted"] else "model state + activations (a step's peak not estimated)"
    lines.append(
        f"{'fits' if c['fits'] else 'DOES NOT FIT'}: {c['where']} needs {_gib(c['needed'])} GiB for "
        f"{what} of this machine's {_gib(c['bytes'])} GiB of {c['kind']}"
    )
    lines += render_prediction(plan)
    lines += [f"note: {n}" for n in plan["notes"]]
    return "\n".join(lines)


def render_prediction(plan: dict) -> list[str]:
    c, p, parts = plan["cluster"], plan["predicted"], plan["step_breakdown"]
    where = f"{c['nodes']} node(s) x {c['devices_per_node']} {c['device']} ({c['peak_tflops']:.4g} TFLOP/s peak)"
    if p is None:
        return [f"predicted on {where}: {parts['note']}"]
    return [
        f"predicted on {where}: step {p['step_s']:.4g} s, {p['samples_per_s']:.4g} samples/s, "
        f"{p['tokens_per_s']:.4g} tokens/s, {p['tflops_per_device']:.4g} TFLOP/s per device, "
        f"MFU {p['mfu']:.1%}, peak memory {p['peak_memory_gib']:.3g} GiB",
        "  step = " + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.3g} s" for k, v in parts.items() if k.endswith("_s")),
    ]


def emit(plan: dict, json_dest: str | None, more: Sequence[str] = ()) -> None:
    """The table and `more` lines after it, and with `--json` the plan as JSON: alone on stdout for
    "-", else to that file."""
    from paratrain.runtime.machine import emit_json

    if json_dest != "-":
        print("\n".join([render(plan), *more]))
    emit_json(plan, json_dest)
