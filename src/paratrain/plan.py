"""`paratrain plan`: how a run would be laid out, before any worker starts.

From the config and the process count alone (the model is built on the meta device and in fake
tensors: no memory, no arithmetic), the plan gives the rank grid (node, local rank, pp/dp/tp
coordinates, role), the pipeline cut, the batch each replica and microbatch gets, and per rank:
  * the bytes of model state the strategy keeps for good: parameters, gradients, optimizer state,
    and what a top-k or PowerSGD codec keeps (error feedback, factors, result);
  * the peak bytes of activations saved for backward: one microbatch's forward through each stage
    in fake tensors (FakeRun) under autograd's saved-tensor hooks, each tensor once; a pipeline
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

import contextlib
import math
import os
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .config import Config, data_parallel_degree
from .models.recompute import blocks, run_layers

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


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _padded_numel(params: list[nn.Parameter], world: int) -> int:
    """A flat unit's numbers, padded to a multiple of `world` as FlatUnit and Bucket pad them."""
    return -(-sum(p.numel() for p in params) // world) * world


def _padded_bytes(groups: list[list[nn.Parameter]], world: int) -> tuple[int, int]:
    """(whole, per-rank shard) bytes of flat units padded to a multiple of `world`."""
    whole = sum(_padded_numel(params, world) * params[0].element_size() for params in groups)
    return whole, whole // world


def _zero_state(cfg: Config, model: nn.Module, params: list[nn.Parameter], world: int) -> tuple[int, int, int, str]:
    from .parallel.data_parallel import make_buckets
    from .parallel.zero import module_units

    stage = int(cfg.parallel.strategy[-1])
    bucket_bytes = int(cfg.parallel.bucket_mb * MIB)
    if stage == 3:
        groups = [g for _, g in module_units(model, params, bucket_bytes)]
    else:
        groups = [b.params for b in make_buckets(params, bucket_bytes, torch.device("meta"), world)]
    whole, shard = _padded_bytes(groups, world)
    biggest = max(_padded_bytes([g], world)[0] for g in groups)
    param_bytes = whole if stage < 3 else shard
    grad_bytes = whole if stage == 1 else shard
    transient = {
        1: "",
        2: f"plus one unit's full gradients while reduced (at most {biggest / MIB:.3g} MiB)",
        3: f"plus units gathered for their forward and backward and their full gradients while reduced, "
        f"at most twice the largest unit ({biggest / MIB:.3g} MiB) at once",
    }[stage]
    return param_bytes, grad_bytes, shard * optimizer_slots(cfg), transient


def _wire_bytes(numel: int, dtype_bytes: int, cfg: Config) -> int:
    """A gradient buffer's bytes on the wire: bf16 / fp16 compression sends 2 bytes a number."""
    return numel * (2 if cfg.parallel.compression in ("bf16", "fp16") else dtype_bytes)


def dp_comm(r: RankPlan, cfg: Config, params: list[nn.Parameter], group_size: int) -> None:
    """dp's gradient buckets, each averaged once a step (the last microbatch's backward) as the
    codec does it: one all-reduce (bf16/fp16: of 16-bit numbers); top-k: all-gathers of each rank's
    k values and k int32 indices; PowerSGD: all-reduces of P with the uncompressed tensors, then Q."""
    from .parallel.compression import kept_bytes, round_numels
    from .parallel.data_parallel import make_buckets

    if group_size == 1 or not params:
        return
    p = cfg.parallel
    buckets = make_buckets(params, int(p.bucket_mb * MIB), torch.device("meta"))
    r.codec_bytes += kept_bytes(
        p, [b.shapes for b in buckets], params[0].dtype, torch.device("cuda" if cfg.train.device == "cuda" else "cpu")
    )
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


def zero_comm(r: RankPlan, cfg: Config, model: nn.Module, params: list[nn.Parameter], world: int, backend: str) -> None:
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
    stage, micro = int(cfg.parallel.strategy[-1]), cfg.train.grad_accum
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


@dataclass
class FakeRun:
    """The model and one microbatch in fake tensors (torch's FakeTensorMode: shapes, dtypes and the
    CPU's own choice of kernels, no memory and no arithmetic; the meta device would run attention by
    its math path, which saves other tensors than the CPU's flash attention), cut into stages."""

    mode: object
    model: nn.Module
    stages: list[list[nn.Module]]
    x: torch.Tensor
    y: torch.Tensor
    autocast: object  # the strategies' own autocast for train.precision = "bf16" (on the CPU, like the tensors)
    recompute: bool  # train.recompute = "full": each block keeps only its input

    def block_starts(self, s: int) -> list[nn.Module]:
        """The first layer of each recomputed block of stage s (whose input the block keeps)."""
        layers = self.stages[s]
        if layers == [self.model]:
            from .parallel.pipeline import pipeline_layers

            layers = pipeline_layers(self.model) or [self.model]
        return [block[0] for block in blocks(layers)]

    @classmethod
    def build(cls, cfg: Config, rows: int, bounds: list[int] | None) -> FakeRun:
        """`bounds` over pipeline_layers; None: the whole model as one stage."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        from .data import build_dataset, load_batch
        from .models import build_model
        from .parallel.pipeline import pipeline_layers

        dataset = build_dataset(cfg, "train")
        x, y = load_batch(dataset, torch.arange(rows))
        mode = FakeTensorMode()
        with mode:
            model = build_model(cfg, dataset)
        if bounds is None:
            stages = [[model]]
        else:
            layers = pipeline_layers(model)
            stages = [layers[a:b] for a, b in zip(bounds, bounds[1:])]
        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16) if cfg.train.precision == "bf16" else contextlib.nullcontext()
        )
        return cls(
            mode, model, stages, mode.from_tensor(x), mode.from_tensor(y), autocast, cfg.train.recompute == "full"
        )

    def forward(self, loss_fn=None, around_stage=lambda s: contextlib.nullcontext()) -> None:
        """One forward through the stages as the pipeline engine runs them: a stage after the first
        starts from a detached input that needs its gradient; the loss (if given) in the last
        stage. `around_stage(s)` is a context each stage's compute runs in."""
        with self.mode, self.autocast:
            act = self.x
            for s, layers in enumerate(self.stages):
                act = act if s == 0 else act.detach().requires_grad_(act.is_floating_point())
                with around_stage(s):
                    act = run_layers(layers, act, self.recompute)
                    if loss_fn is not None and s == len(self.stages) - 1:
                        loss_fn(act, self.y)


def saved_activation_bytes(cfg: Config, rows: int, bounds: list[int] | None = None) -> list[int]:
    """Bytes autograd saves for backward in the forward of one microbatch of `rows` samples through
    each pipeline stage, the loss in the last stage's; each tensor once (views count as their
    base), parameters and the batch never (the batch is the data, held anyway)."""
    from .optim import build_loss

    run = FakeRun.build(cfg, rows, bounds)
    params = {id(t) for t in run.model.parameters()} | {id(run.x), id(run.y)}
    out: list[int] = []

    @contextlib.contextmanager
    def counting(s: int):
        seen: dict[int, torch.Tensor] = {}  # keeps what it counted alive, so no id is reused

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = t._base if t._base is not None else t
            if id(base) not in params and id(base) not in seen:
                seen[id(base)] = base
            return t

        def keep_block_input(module, args):
            pack(args[0])

        # under recompute autograd's hooks never see a checkpointed block's tensors: the block keeps
        # its input instead, counted as its first layer receives it
        handles = [m.register_forward_pre_hook(keep_block_input) for m in run.block_starts(s)] if run.recompute else []
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            for h in handles:
                h.remove()
        out.append(sum(t.numel() * t.element_size() for t in seen.values()))

    run.forward(build_loss(cfg), counting)
    return out


def peak_in_schedule(actions, stage_of_chunk: list[int], stage_bytes: list[int]) -> int:
    """The most activation bytes alive at once while a rank plays its actions: a forward adds its
    stage's, the backward of the same (chunk, microbatch) drops them."""
    alive = peak = 0
    for a in actions:
        alive += stage_bytes[stage_of_chunk[a.chunk]] * (1 if a.kind == "F" else -1)
        peak = max(peak, alive)
    return peak


def _boundary_bytes(cfg: Config, model: nn.Module, bounds: list[int], rows: int) -> list[int]:
    """Bytes of one microbatch's activation entering each stage, as the engine sends it (its dtype
    from the same meta-device pass the engine uses)."""
    from .data import build_dataset, load_batch
    from .parallel.hybrid import meta_copy
    from .parallel.pipeline import boundary_shape_fn, pipeline_layers

    meta = pipeline_layers(meta_copy(model))
    x, _ = load_batch(build_dataset(cfg, "train"), torch.arange(rows))
    shapes = boundary_shape_fn([meta[a:b] for a, b in zip(bounds, bounds[1:])])(x)
    return [shape.numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in shapes]


def tp_all_reduces(cfg: Config, rows: int, bounds: list[int] | None, tp_plan: dict) -> list[list[int]] | None:
    """Per stage, the payloads of the all-reduces tensor parallelism runs for one microbatch
    (tp_comm's paired operators): a row-parallel layer's output in forward, a column-parallel
    layer's input gradient in backward (when that input needs one), a vocabulary-parallel
    embedding's rows, and the vocabulary-parallel cross-entropy's per-token max and sums. Their
    shapes and dtypes are the unsplit layers' own, from one forward in fake tensors. None when a
    user loss takes a sharded output (it gathers the output first; not modelled)."""
    from .optim import build_loss, cross_entropy

    run = FakeRun.build(cfg, rows, bounds)
    modules = dict(run.model.named_modules())
    last_linear = [n for n, m in modules.items() if isinstance(m, nn.Linear)][-1]
    sharded_output = tp_plan.get(last_linear) == "colwise"
    if sharded_output and build_loss(cfg) is not cross_entropy:
        return None
    stage_of = {id(m): s for s, layers in enumerate(run.stages) for layer in layers for m in layer.modules()}
    payloads: list[list[int]] = [[] for _ in run.stages]

    def record(style: str):
        def hook(module, args, out):
            if style in ("rowwise", "vocab"):
                payloads[stage_of[id(module)]].append(out.numel() * out.element_size())
            elif args[0].requires_grad:
                payloads[stage_of[id(module)]].append(args[0].numel() * args[0].element_size())

        return hook

    handles = [modules[name].register_forward_hook(record(style)) for name, style in tp_plan.items()]
    try:
        run.forward()
    finally:
        for h in handles:
            h.remove()
    if sharded_output:  # the vocabulary-parallel cross-entropy: max, then (sum of exp, target logit)
        tokens = run.y.numel()
        payloads[-1] += [tokens * 4, 2 * tokens * 4]
    return payloads


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


def _model_parallel(cfg: Config, model: nn.Module, world: int, ranks: list[RankPlan], rows: int) -> list[dict]:
    """tp, pp, hybrid: which stages and which tp shard of each parameter every rank holds."""
    from .parallel.base import unique_parameters
    from .parallel.hybrid import sync_ties, virtual_stages
    from .parallel.pipeline import allowed_cuts, parameter_costs, partition, pipeline_layers, split_ties
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
    boundary = _boundary_bytes(cfg, model, bounds, rows) if p.pp > 1 else []
    activations = saved_activation_bytes(cfg, rows, cut) if p.tp == 1 else None
    tp_payloads = tp_all_reduces(cfg, rows, cut, tp_plan) if p.tp > 1 else [[] for _ in stage_layers]
    # without pp the engine plays one_f_one_b: each microbatch's forward, then its backward
    schedule, m = SCHEDULES[p.schedule] if p.pp > 1 else one_f_one_b, microbatch_count(cfg)
    for r in ranks:
        r.pp, rest = divmod(r.rank, dp * p.tp)
        r.dp, r.tp = divmod(rest, p.tp)
        r.stages = [c * p.pp + r.pp for c in range(v)]
        held = {s: stage_params(s, r.tp) for s in r.stages}
        r.param_bytes = r.grad_bytes = sum(_nbytes(t) for t in held.values())
        r.optimizer_bytes = slots * r.param_bytes
        actions = schedule(p.pp, r.pp, m, v)
        if activations is not None:
            r.activation_bytes = peak_in_schedule(actions, r.stages, activations)
        if tp_payloads is None:  # a user loss on a sharded output: its gathers are not modelled
            continue
        pipeline_comm(r, actions, boundary, n_stages, world)
        for s in r.stages:
            for payload in tp_payloads[s]:
                r.add_comm("all_reduce", payload, p.tp, times=m)
            dp_comm(r, cfg, held[s], dp)  # each chunk's gradients, averaged over the dp group
        for t, holders in ties:
            if r.pp in holders:
                r.add_comm("all_reduce", _nbytes([shard_of(t, r.tp)]), len(holders))
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


def capacity(ranks: list[RankPlan], device: str, cluster=None) -> dict:
    """Whether the plan fits this machine (every node taken to be like it): on a GPU, the busiest
    rank against its GPU's memory; on CPU, the busiest node's ranks together against host memory.
    With a GPU cluster description, the busiest rank against its device's memory."""

    def need(r: RankPlan) -> int:
        return r.model_state_bytes + (r.activation_bytes or 0)

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
        "activations_counted": all(r.activation_bytes is not None for r in ranks),
    }


def make_plan(cfg: Config, model: nn.Module, nproc: int, nnodes: int, device: str, cluster=None) -> dict:
    """The layout of a run of `cfg` on nnodes x nproc processes (`model` on the meta device), and
    its predicted step time on `cluster` (None: machines like this one)."""
    from .parallel.base import unique_parameters
    from .parallel.hybrid import microbatch_count

    world = nproc * nnodes
    p = cfg.parallel
    dp = data_parallel_degree(cfg, world)
    per_replica, micro = cfg.data.batch_size // dp, microbatch_count(cfg)
    rows = per_replica // micro
    params = [t for _, t in unique_parameters(model)]
    ranks = [RankPlan(r, r // nproc, r % nproc, "worker") for r in range(world)]
    total = _nbytes(params)
    slots = optimizer_slots(cfg)
    stages, notes = [], []
    if p.strategy in ("dp", "zero1", "zero2", "zero3", "ps"):  # one microbatch through the whole model
        activations = saved_activation_bytes(cfg, rows)[0]
        for r in ranks:
            r.activation_bytes = activations
    if p.strategy == "dp":
        for r in ranks:
            r.dp, r.param_bytes, r.grad_bytes, r.optimizer_bytes = r.rank, total, total, slots * total
            dp_comm(r, cfg, params, world)
    elif p.strategy.startswith("zero"):
        param_b, grad_b, opt_b, transient = _zero_state(cfg, model, params, world)
        for r in ranks:
            r.dp, r.param_bytes, r.grad_bytes, r.optimizer_bytes = r.rank, param_b, grad_b, opt_b
            zero_comm(r, cfg, model, params, world, "nccl" if device == "cuda" else "gloo")
        if transient:
            notes.append(f"{p.strategy}: {transient}")
    elif p.strategy == "ps":
        from .parallel.parameter_server import HEADER, assign_shards

        shards = assign_shards([t.numel() for t in params], cfg.ps.servers)
        header = HEADER * 4  # each flat shard buffer starts with a small float32 header
        message = [_nbytes([params[i] for i in shard]) + header for shard in shards]  # a push or pull
        workers = world - cfg.ps.servers
        for r in ranks:
            if r.rank < cfg.ps.servers:
                own = _nbytes([params[i] for i in shards[r.rank]])
                r.role, r.activation_bytes = "parameter server", 0
                # gradients: its shard's, and a receive buffer for each worker's pushes
                r.param_bytes, r.grad_bytes, r.optimizer_bytes = (
                    own + header,
                    (own + header) * (1 + workers),
                    slots * own,
                )
                r.add_comm("recv", message[r.rank], world, times=workers)  # every worker's push
                r.add_comm("send", message[r.rank], world, times=workers)  # and its pull
            else:
                r.role, r.dp = "ps worker", r.rank - cfg.ps.servers
                r.param_bytes = r.grad_bytes = total + header * cfg.ps.servers
                for size in message:  # a push to every server, and its reply
                    r.add_comm("send", size, world)
                    r.add_comm("recv", size, world)
    else:
        stages = _model_parallel(cfg, model, world, ranks, rows)
        if p.tp > 1:
            notes.append("activations not estimated under tp")
        if p.pp > 1 and p.balance == "time":
            notes.append(
                "pipeline cut shown by parameter count; the run times each layer at start "
                "(parallel.balance = 'time') and may cut elsewhere"
            )
    if device == "cuda":
        notes.append("activations counted with the CPU's kernels: CUDA's attention kernels may save other tensors")
    from .cluster import this_machine
    from .predict import predict

    cluster = cluster or this_machine(nnodes, nproc)
    plan = {
        "capacity": capacity(ranks, device, cluster),
        "name": cfg.name,
        "strategy": p.strategy,
        "device": device,
        "world_size": world,
        "nnodes": nnodes,
        "nproc_per_node": nproc,
        "mesh": {"dp": dp, "tp": p.tp, "pp": p.pp}
        if p.strategy != "ps"
        else {"servers": cfg.ps.servers, "workers": world - cfg.ps.servers},
        "model": {"factory": cfg.model.factory, "parameters": sum(t.numel() for t in params), "bytes": total},
        "batch": {
            "global": cfg.data.batch_size,
            "per_replica": per_replica,
            "microbatches": micro,
            "rows_per_microbatch": rows,
        },
        "optimizer": {"name": cfg.train.optimizer, "state_tensors_per_parameter": slots},
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
    if plan["strategy"] == "ps":
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
        "activations saved for backward (communication buffers come on top); sent = the fewest bytes "
        "a step's collectives and messages need this rank to send"
    )
    c = plan["capacity"]
    what = "model state + activations" if c["activations_counted"] else "model state (activations not estimated)"
    lines.append(
        f"{'fits' if c['fits'] else 'DOES NOT FIT'}: {c['where']} needs {_gib(c['needed'])} GiB for "
        f"{what} of this machine's {_gib(c['bytes'])} GiB of {c['kind']}"
    )
    lines += render_prediction(plan)
    lines += [f"note: {n}" for n in plan["notes"]]
    if "layouts" in plan:
        from .search import render_search

        lines += render_search(plan["layouts"])
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


def emit(plan: dict, json_dest: str | None) -> None:
    """The table, and with `--json` the plan as JSON: alone on stdout for "-", else to that file."""
    from .bench.common import emit_json

    if json_dest != "-":
        print(render(plan))
    emit_json(plan, json_dest)
