"""`paratrain plan`: how a run would be laid out, before any worker starts.

From the config and the process count alone (the model is built on the meta device and in fake
tensors: no memory, no arithmetic), the plan gives the rank grid (node, local rank, pp/dp/tp
coordinates, role), the pipeline cut, the batch each replica and microbatch gets, and per rank:
  * the bytes of model state the strategy keeps for good: parameters, gradients, optimizer state,
    and what a top-k or PowerSGD codec keeps (error feedback, factors, result);
  * the peak bytes of activations saved for backward: one microbatch's forward through each stage
    in fake tensors (activations.FakeRun) under autograd's saved-tensor hooks, each tensor once; a pipeline
    rank's peak plays its own schedule out, adding a stage's activations at each forward and
    dropping them at its backward;
  * the bytes its collectives and messages carry in a step, by op, with the fewest it must send,
    exactly as the profiler accounts them (profile.min_bytes_sent).
Not counted: temporaries inside an operation, the short-lived buffers of communication (ZeRO's
units while gathered or reduced, named in a note), and activations under tp (its sharded layers need a process group to run).

The layout comes from the functions the strategies themselves call (dp's buckets, ZeRO's units and
their padding, the pipeline's partition and schedules, the tp plan's shard dimensions, the
parameter servers' dealing), so the plan is what the run does: tests/test_plan.py builds every
rank's strategy on a fake process group and counts what it holds, saves and sends, and
tests/test_profile.py holds the bytes to real runs' profile.jsonl.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .activations import StageMemory, boundary_bytes, saved_activation_bytes, step_memory, tp_all_reduces
from .config import Config, ConfigError
from .parallel import registry

MIB = 2**20


@dataclass
class RankPlan:
    rank: int
    node: int
    local_rank: int
    role: str
    pp: int = 0
    dp: int = 0
    tp: int = 0
    stages: list[int] = field(default_factory=list)  # virtual pipeline stages held
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    codec_bytes: int = 0  # what a top-k or PowerSGD codec keeps between steps
    activation_bytes: int | None = None  # peak saved for backward; None: not estimated (tp)
    # the most bytes allocated at once in a step: model state, the activations, what the step makes
    # and frees (activation gradients, logits, incoming gradients, communication buffers); None: not
    # estimated
    peak_bytes: int | None = None
    # per step, by collective: {"payload": bytes handed to it, "min_sent": bytes this rank must send},
    # as the profiler accounts them (ps: a sync step; async and ssp move as much per worker step);
    # None: not estimated (tp with a user loss on its sharded output)
    comm: dict[str, dict[str, int]] | None = None

    def add_comm(self, op: str, payload: int, group_size: int, times: int = 1) -> None:
        from .profile import min_bytes_sent

        if self.comm is None:
            self.comm = {}
        entry = self.comm.setdefault(op, {"payload": 0, "min_sent": 0.0})
        entry["payload"] += payload * times
        entry["min_sent"] += min_bytes_sent(op, payload, group_size) * times

    def as_dict(self) -> dict:
        """With the minimum bytes in whole bytes, as profile.jsonl has them."""
        out = asdict(self)
        if self.comm is not None:
            out["comm"] = {op: {"payload": e["payload"], "min_sent": int(e["min_sent"])} for op, e in self.comm.items()}
        out["model_state_bytes"] = self.model_state_bytes
        out["comm_min_bytes"] = None if self.comm is None else sum(e["min_sent"] for e in out["comm"].values())
        return out

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.codec_bytes


def optimizer_slots(cfg: Config) -> int:
    """Tensors of optimizer state per parameter: AdamW's two moments, SGD's momentum buffer."""
    if cfg.train.optimizer == "adamw":
        return 2
    return 1 if cfg.train.momentum > 0 else 0


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _padded_numel(params: list[nn.Parameter], world: int) -> int:
    """A flat unit's numbers, padded to a multiple of `world` as FlatUnit and Bucket pad them."""
    return -(-sum(p.numel() for p in params) // world) * world


def padded_bytes(groups: list[list[nn.Parameter]], world: int) -> tuple[int, int]:
    """(whole, per-rank shard) bytes of flat units padded to a multiple of `world`."""
    whole = sum(_padded_numel(params, world) * params[0].element_size() for params in groups)
    return whole, whole // world


def _wire_bytes(numel: int, dtype_bytes: int, cfg: Config) -> int:
    """A gradient buffer's bytes on the wire: bf16 / fp16 compression sends 2 bytes a number."""
    return numel * (2 if cfg.parallel.compression in ("bf16", "fp16") else dtype_bytes)


def dp_comm(r: RankPlan, cfg: Config, params: list[nn.Parameter], group_size: int) -> None:
    """dp's gradient buckets, each averaged once a step (the last microbatch's backward) as the
    codec does it: one all-reduce (bf16/fp16: of 16-bit numbers); top-k: all-gathers of each rank's
    k values and k int32 indices; PowerSGD: all-reduces of P with the uncompressed tensors, then Q."""
    from .parallel.compression import round_numels
    from .parallel.data_parallel import make_buckets

    if group_size == 1 or not params:
        return
    p = cfg.parallel
    buckets = make_buckets(params, int(p.bucket_mb * MIB), torch.device("meta"))
    for b in buckets:
        size = b.params[0].element_size()
        if p.compression == "topk":
            k = max(1, math.ceil(p.topk_ratio * b.numel))
            r.add_comm("all_gather", k * size * group_size, group_size)
            r.add_comm("all_gather", k * 4 * group_size, group_size)
        elif p.compression == "powersgd":
            first, second = round_numels(b.shapes, p.powersgd_rank)
            r.add_comm("all_reduce", first * size, group_size)
            if second:
                r.add_comm("all_reduce", second * size, group_size)
        else:
            r.add_comm("all_reduce", _wire_bytes(b.numel, size, cfg), group_size)


def dp_codec(r: RankPlan, cfg: Config, params: list[nn.Parameter], group_size: int) -> None:
    """What a top-k or PowerSGD codec keeps between steps for dp's gradient buckets."""
    from .parallel.compression import kept_bytes
    from .parallel.data_parallel import make_buckets

    if group_size == 1 or not params:
        return
    p = cfg.parallel
    buckets = make_buckets(params, int(p.bucket_mb * MIB), torch.device("meta"))
    r.codec_bytes += kept_bytes(
        p, [b.shapes for b in buckets], params[0].dtype, torch.device("cuda" if cfg.train.device == "cuda" else "cpu")
    )


def cast_copies(cfg: Config, params: list[nn.Parameter], group_size: int) -> int:
    """bf16 / fp16 on the wire: the 16-bit copy of each dp bucket, made as the bucket is launched and
    copied back once the backward is over (compression.Cast), so all of them at once after it."""
    from .parallel.data_parallel import make_buckets

    if group_size == 1 or not params or cfg.parallel.compression not in ("bf16", "fp16"):
        return 0
    buckets = make_buckets(params, int(cfg.parallel.bucket_mb * MIB), torch.device("meta"))
    return sum(_wire_bytes(b.numel, 2, cfg) for b in buckets)


def zero_comm(
    r: RankPlan, cfg: Config, stage: int, model: nn.Module, params: list[nn.Parameter], world: int, backend: str
) -> None:
    """Per unit: its gradients reduce-scattered (stage 1 once a step, 2 and 3 every microbatch) and
    its parameters all-gathered (stages 1 and 2 after the step; stage 3 before each module's forward
    and again before its backward, the root unit, kept gathered through both, once); plus the
    squared gradient norm, one float32 all-reduced. On gloo, as zero_comm builds them: each
    reduce-scatter an all-reduce of the whole unit (stage 3: of each gradient), each all-gather a
    broadcast from every rank."""
    from .parallel.data_parallel import make_buckets
    from .parallel.zero import module_units
    from .parallel.zero_comm import from_primitives

    if world == 1:
        return
    micro = cfg.train.grad_accum
    bucket_bytes = int(cfg.parallel.bucket_mb * MIB)
    if stage == 3:
        units = [(g, 1 if module is model else 2) for module, g in module_units(model, params, bucket_bytes)]
    else:
        units = [(b.params, 0) for b in make_buckets(params, bucket_bytes, torch.device("meta"), world)]
    primitives = from_primitives(backend)
    for group, gathers in units:
        numel = _padded_numel(group, world)
        size = group[0].element_size()
        reduces, gathers = 1 if stage == 1 else micro, gathers * micro if stage == 3 else 1
        wire = _wire_bytes(numel, size, cfg)
        if primitives:
            # stage 3 all-reduces each gradient where autograd left it, stages 1-2 the flat unit
            for n in [p.numel() for p in group] if stage == 3 else [numel]:
                r.add_comm("all_reduce", _wire_bytes(n, size, cfg), world, times=reduces)
            r.add_comm("broadcast", numel // world * size, world, times=gathers * world)
        else:
            r.add_comm("reduce_scatter", wire, world, times=reduces)
            r.add_comm("all_gather", numel * size, world, times=gathers)
    r.add_comm("all_reduce", 4, world)


def peak_in_schedule(actions, stage_of_chunk: list[int], stage_bytes: list[int]) -> int:
    """The most activation bytes alive at once while a rank plays its actions: a forward adds its
    stage's, the backward of the same (chunk, microbatch) drops them."""
    alive = peak = 0
    for a in actions:
        alive += stage_bytes[stage_of_chunk[a.chunk]] * (1 if a.kind == "F" else -1)
        peak = max(peak, alive)
    return peak


def step_peak(actions, stage_of_chunk: list[int], memories: list[StageMemory]) -> int:
    """The most bytes alive at once, over the model state, while a rank plays its actions (one
    microbatch's forward, backward, forward, ... without pp): a forward peaks at what is alive
    plus its stage's forward peak and leaves its kept bytes; its backward peaks at what the other
    microbatches keep plus its own backward peak, and frees its kept bytes."""
    alive = peak = 0
    for a in actions:
        m = memories[stage_of_chunk[a.chunk]]
        if a.kind == "F":
            peak = max(peak, alive + m.forward_peak)
            alive += m.kept
        else:
            alive -= m.kept
            peak = max(peak, alive + m.backward_peak)
    return peak


def receive_buffers(actions, stages: list[int], boundary: list[int]) -> int:
    """Bytes of the pipeline engine's receive buffers on a rank playing `actions` (`stages`: the
    virtual stage of each chunk): each action's receive (a later stage's input for a forward, an
    earlier stage's output gradient for a backward) is posted LOOKAHEAD actions ahead and its
    buffer taken back after the microbatch's backward; buffers taken back serve later receives of
    the same size and are kept between steps, so the pool is the most of each size in use at once."""
    from .parallel.pipeline import LOOKAHEAD

    last = len(boundary) - 1  # boundary[s]: what enters stage s
    in_use: dict[int, int] = {}
    most: dict[int, int] = {}
    held: dict[tuple[int, int], list[int]] = {}  # (chunk, microbatch) -> sizes of its buffers

    def post(a) -> None:
        s = stages[a.chunk]
        size = boundary[s] if a.kind == "F" and s > 0 else boundary[s + 1] if a.kind == "B" and s < last else 0
        if size:
            in_use[size] = in_use.get(size, 0) + 1
            most[size] = max(most.get(size, 0), in_use[size])
            held.setdefault((a.chunk, a.mb), []).append(size)

    posted = 0
    for i in range(-1, len(actions)):
        for a in actions[posted : i + 1 + LOOKAHEAD]:
            post(a)
        posted = max(posted, min(i + 1 + LOOKAHEAD, len(actions)))
        if i >= 0 and actions[i].kind == "B":
            for size in held.pop((actions[i].chunk, actions[i].mb), []):
                in_use[size] -= 1
    return sum(size * n for size, n in most.items())


def pipeline_comm(r: RankPlan, actions, boundary: list[int], n_stages: int, world: int) -> None:
    """Each forward sends its output to the next stage and each backward its input's gradient to
    the previous one (receives mirror them); the profiler counts them on the world group."""
    for a in actions:
        s = r.stages[a.chunk]
        if a.kind == "F":
            if s > 0:
                r.add_comm("recv", boundary[s], world)
            if s < n_stages - 1:
                r.add_comm("send", boundary[s + 1], world)
        else:
            if s < n_stages - 1:
                r.add_comm("recv", boundary[s + 1], world)
            if s > 0:
                r.add_comm("send", boundary[s], world)


def model_parallel(cfg: Config, model: nn.Module, world: int, ranks: list[RankPlan], rows: int) -> list[dict]:
    """Tensor and pipeline parallelism: which stages and which tp shard of each parameter every rank
    holds; the stages."""
    from .parallel.base import unique_parameters
    from .parallel.hybrid import sync_ties, virtual_stages
    from .parallel.pipeline_cut import allowed_cuts, parameter_costs, partition, pipeline_layers, split_ties
    from .parallel.tensor_parallel import STYLES, plan_for
    from .parallel.tp_comm import shard_range

    p = cfg.parallel
    dp = world // (p.tp * p.pp)
    v = virtual_stages(cfg)
    n_stages = p.pp * v
    tp_plan = plan_for(model, p.tp_plan) if p.tp > 1 else {}
    if p.pp > 1:
        layers = pipeline_layers(model)
        bounds = partition(parameter_costs(layers), n_stages, allowed_cuts(model, layers, tp_plan, sync_ties(cfg)))
        stage_layers = [layers[bounds[s] : bounds[s + 1]] for s in range(n_stages)]
        # parameters shared by layers of different stages: each holder sums its copy's gradient
        ties = [(t, stages) for t, _, stages in split_ties(model, layers, bounds)]
    else:
        bounds, stage_layers, ties = [0, 1], [[model]], []
    # the dimension each planned module's tensors are split along, by parameter name
    shard_dims = {f"{name}.{t}": d for name, style in tp_plan.items() for t, d in STYLES[style].shard_dims.items()}
    name_of = {id(t): n for n, t in model.named_parameters()}

    def shard_of(t: torch.Tensor, tp_rank: int) -> torch.Tensor:
        """Parameter t as tp rank `tp_rank` holds it (a meta tensor of its shard's shape)."""
        shape, dim = list(t.shape), shard_dims.get(name_of[id(t)])
        if dim is not None:
            start, end = shard_range(t.shape[dim], p.tp, tp_rank)
            shape[dim] = end - start
        return torch.empty(shape, dtype=t.dtype, device="meta")

    def stage_params(s: int, tp_rank: int) -> list[torch.Tensor]:
        """The parameters of stage s as tp rank `tp_rank` holds them."""
        seen, out = set(), []
        for layer in stage_layers[s]:
            for _, t in unique_parameters(layer):
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(shard_of(t, tp_rank))
        return out

    from .parallel.hybrid import microbatch_count
    from .parallel.pipeline_schedules import SCHEDULES, one_f_one_b

    slots = optimizer_slots(cfg)
    cut = bounds if p.pp > 1 else None
    boundary = boundary_bytes(cfg, model, bounds, rows) if p.pp > 1 else []
    activations = saved_activation_bytes(cfg, rows, cut) if p.tp == 1 else None
    memories = step_memory(cfg, rows, cut, tp_plan, p.tp)
    tp_payloads = tp_all_reduces(cfg, rows, cut, tp_plan) if p.tp > 1 else [[] for _ in stage_layers]
    # without pp the engine plays one_f_one_b: each microbatch's forward, then its backward
    schedule, m = SCHEDULES[p.schedule] if p.pp > 1 else one_f_one_b, microbatch_count(cfg)
    for r in ranks:
        r.pp, rest = divmod(r.rank, dp * p.tp)
        r.dp, r.tp = divmod(rest, p.tp)
        r.stages = [c * p.pp + r.pp for c in range(v)]
        held = {s: stage_params(s, r.tp) for s in r.stages}
        r.param_bytes = r.grad_bytes = sum(nbytes(t) for t in held.values())
        r.optimizer_bytes = slots * r.param_bytes
        actions = schedule(p.pp, r.pp, m, v)
        if activations is not None:
            r.activation_bytes = peak_in_schedule(actions, r.stages, activations)
        for s in r.stages:
            dp_codec(r, cfg, held[s], dp)
        if memories is not None:
            pool = receive_buffers(actions, r.stages, boundary) if p.pp > 1 else 0
            wire = sum(cast_copies(cfg, held[s], dp) for s in r.stages)
            r.peak_bytes = r.model_state_bytes + pool + max(step_peak(actions, r.stages, memories), wire)
        if tp_payloads is None:  # a user loss on a sharded output: its gathers are not modelled
            continue
        pipeline_comm(r, actions, boundary, n_stages, world)
        for s in r.stages:
            for payload in tp_payloads[s]:
                r.add_comm("all_reduce", payload, p.tp, times=m)
            dp_comm(r, cfg, held[s], dp)  # each chunk's gradients, averaged over the dp group
        for t, holders in ties:
            if r.pp in holders:
                r.add_comm("all_reduce", nbytes([shard_of(t, r.tp)]), len(holders))
        if world > 1:
            r.add_comm("all_reduce", 8, world)  # the global gradient norm (float64)
    if p.pp == 1:
        return []
    return [
        {
            "stage": s,
            "pp_rank": s % p.pp,
            "layers": [bounds[s], bounds[s + 1] - 1],
            "parameters": sum(t.numel() for layer in stage_layers[s] for _, t in unique_parameters(layer)),
        }
        for s in range(n_stages)
    ]


def peak_bytes(r: RankPlan) -> int:
    """A rank's predicted peak; where it is not estimated, its model state and activations."""
    return r.peak_bytes if r.peak_bytes is not None else r.model_state_bytes + (r.activation_bytes or 0)


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
        node = max(per_node, key=per_node.get)
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
    from .parallel.base import unique_parameters
    from .parallel.hybrid import microbatch_count

    spec = registry.spec(cfg.parallel.strategy)
    if not spec.cost_model:
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
    from .cluster import this_machine
    from .predict import predict

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
    if "servers" in mesh:
        lines.append(f"ranks: {mesh['servers']} parameter server(s), {mesh['workers']} worker(s)")
    else:
        lines.append(
            f"mesh: dp {mesh['dp']} x tp {mesh['tp']} x pp {mesh['pp']} "
            f"(global rank = (pp * {mesh['dp']} + dp) * {mesh['tp']} + tp)"
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
    lines.append(
        f"{'rank':>5}{'node':>5}{'local':>6}{'pp':>4}{'dp':>4}{'tp':>4}  {'role':<17}{'stages':<9}"
        f"{'params MiB':>11}{'grads MiB':>10}{'optim MiB':>10}{'state MiB':>10}{'activ MiB':>10}"
        f"{'sent MiB':>10}"
    )
    for r in plan["ranks"]:
        stages = ",".join(map(str, r["stages"])) if r["stages"] else "-"
        if len(stages) > 8:
            stages = stages[:5] + "..."
        activations = "-" if r["activation_bytes"] is None else _mib(r["activation_bytes"])
        sent = "-" if r["comm_min_bytes"] is None else _mib(r["comm_min_bytes"])
        lines.append(
            f"{r['rank']:>5}{r['node']:>5}{r['local_rank']:>6}{r['pp']:>4}{r['dp']:>4}{r['tp']:>4}  "
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


def emit(plan: dict, json_dest: str | None, more: list[str] = ()) -> None:
    """The table and `more` lines after it, and with `--json` the plan as JSON: alone on stdout for
    "-", else to that file."""
    from .bench.common import emit_json

    if json_dest != "-":
        print("\n".join([render(plan), *more]))
    emit_json(plan, json_dest)
