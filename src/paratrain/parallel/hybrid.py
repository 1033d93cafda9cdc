"""Model parallelism on one device mesh: tensor (inside layers) x pipeline (across layers) x data.

Strategies "tp", "pp" and "hybrid" are this one engine; the config decides the degrees (tp and pp
from parallel.tp / parallel.pp, dp from the world size). Construction, on every rank:
  1. the (pp, dp, tp) mesh (mesh.py) and rank 0's initial weights everywhere;
  2. with pp > 1, the layers are cut into pp * v stages (pipeline.py), balanced by time or params;
  3. with tp > 1, the planned Linear / Embedding modules are replaced by their shards
     (tensor_parallel.py);
  4. layers of stages this rank does not run move to the meta device (no memory); its own stages
     become chunks, each with a dp GradientReducer over the dp sub-group only.
A step cuts the replica's batch into microbatches and runs the schedule (pipeline_schedules.py);
each chunk's reducer communicates during that chunk's last backward, overlapped with the rest.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch import nn

from .. import checkpoint as ckpt
from .. import collectives
from ..config import Config, ConfigError
from ..optim import build_optimizer
from .base import Strategy, broadcast_tensors, clip_factor, eval_sums, unique_parameters
from .data_parallel import GradientReducer
from .mesh import build_mesh
from .pipeline import (
    PipelineEngine,
    StageChunk,
    allowed_cuts,
    boundary_shape_fn,
    decide_split,
    pipeline_layers,
    split_ties,
    splittable_layers,
    tied_spans,
)
from .pipeline_schedules import SCHEDULES, forward_only, one_f_one_b
from .tensor_parallel import apply_tensor_parallel, check_plan, full_width, output_is_sharded, parallel_loss, plan_for
from .tp_comm import all_gather_dim, gather_from_tp, shard_range


def virtual_stages(cfg: Config) -> int:
    p = cfg.parallel
    return p.virtual_stages if p.schedule == "interleaved" and p.pp > 1 else 1


def sync_ties(cfg: Config) -> bool:
    """Whether the engine sums the gradients of a parameter shared by layers of different stages
    (ModelParallel._sum_tied_grads): with one stage per rank each rank holds one copy (with tp, one
    shard of it, the same rows at every holder: tensor_parallel.check_plan)."""
    return virtual_stages(cfg) == 1


def microbatch_count(cfg: Config) -> int:
    return cfg.train.grad_accum * (cfg.parallel.microbatches if cfg.parallel.pp > 1 else 1)


def meta_copy(model: nn.Module) -> nn.Module:
    """The model's structure with every tensor on the meta device (no copy of the weights)."""
    memo = {id(t): nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad) for t in model.parameters()}
    memo.update({id(t): torch.empty_like(t, device="meta") for t in model.buffers()})
    return copy.deepcopy(model, memo)


def check_model(cfg: Config, model: nn.Module) -> None:
    """Preflight (on a meta-device model): the plan fits the model and the model has enough layers."""
    p = cfg.parallel
    plan = plan_for(model, p.tp_plan) if p.tp > 1 else {}
    if p.tp > 1:
        check_plan(model, plan, p.tp, user=bool(p.tp_plan))
    if p.pp > 1:
        if pipeline_layers(model) is None:
            raise ConfigError(
                "parallel.pp",
                f"pp = {p.pp} needs a model that can be cut into layers: an "
                f"nn.Sequential or a module with pipeline_layers()",
            )
        stages, layers = p.pp * virtual_stages(cfg), splittable_layers(model, plan, sync_ties(cfg))
        if stages > layers:
            tied = "".join(
                f"; layers {a}-{b} share {name} (tied weights) and stay in one stage"
                for a, b, name in tied_spans(model, pipeline_layers(model), sync_ties(cfg))
            )
            raise ConfigError(
                "parallel.pp",
                f"{stages} pipeline stages (pp {p.pp} x {virtual_stages(cfg)} virtual) "
                f"but the model has only {layers} layer{'' if layers == 1 else 's'} to split{tied}",
            )


class ModelParallel(Strategy):
    name = "hybrid"
    check_model = staticmethod(check_model)

    def __init__(self, model, loss_fn, cfg, rt):
        super().__init__(model.to(rt.device), loss_fn, cfg, rt)
        p = cfg.parallel
        self.mesh = mesh = build_mesh(p.tp, p.pp, rt.device.type)
        self.dp_rank, self.dp_size = mesh.dp_rank, mesh.dp
        self.reports_loss = mesh.pp_rank == mesh.pp - 1 and mesh.tp_rank == 0
        broadcast_tensors(list(model.parameters()) + list(model.buffers()), src=0)
        self.full_meta = meta_copy(model)  # the unsplit model's keys, shapes and dtypes
        self.m = microbatch_count(cfg)
        self.v = virtual_stages(cfg)
        self.n_stages = p.pp * self.v
        plan = plan_for(model, p.tp_plan) if p.tp > 1 else {}

        # 2. the cut
        if p.pp > 1:
            layers = pipeline_layers(model)
            self.bounds, costs = decide_split(
                layers,
                self.n_stages,
                allowed_cuts(model, layers, plan, sync_ties(cfg)),
                p.balance,
                self._sample_input,
                self.autocast,
                rt.device,
            )
            if rt.is_main:
                self._log_split(costs)
        else:
            self.bounds = [0, 1]
        stage_of_key = self._stage_of_keys(model)
        self.tie_names = _tie_names(model)

        # 3. tensor parallelism (same names, sharded tensors)
        self.shard_dims = apply_tensor_parallel(model, plan, mesh.tp_group) if p.tp > 1 else {}
        self.sharded_output = p.tp > 1 and output_is_sharded(model)

        # 4. this rank's chunks; everything else to the meta device
        layers = pipeline_layers(model) if p.pp > 1 else [model]
        self.stage_ids = [c * p.pp + mesh.pp_rank for c in range(self.v)]
        stage_layers = [layers[self.bounds[s] : self.bounds[s + 1]] for s in range(self.n_stages)]
        for s, group in enumerate(stage_layers):
            if s not in self.stage_ids:
                for layer in group:
                    layer.to("meta")
        self.chunks = [
            StageChunk(stage_layers[s], cfg.train.recompute == "full") if p.pp > 1 else model for s in self.stage_ids
        ]
        self.owned_keys = [k for k, s in stage_of_key.items() if s in self.stage_ids]
        name_of = {id(t): n for n, t in model.named_parameters()}
        self.reducers, self.param_names, params = [], [], []
        for chunk in self.chunks:
            chunk_params = [t for _, t in unique_parameters(chunk)]
            self.reducers.append(GradientReducer(chunk_params, p.bucket_mb, rt.device, mesh.dp_group))
            self.param_names += [name_of[id(t)] for t in chunk_params]
            params += chunk_params
        self.params = params
        self.optimizer = build_optimizer(params, cfg.train)
        self.tied = self._tie_groups(model) if p.pp > 1 and sync_ties(cfg) else []

        if self.sharded_output:
            width = full_width(model)
            self.train_loss = parallel_loss(loss_fn, mesh.tp_group, width)
            self.full_output = lambda out: gather_from_tp(out, mesh.tp_group, width)
        else:
            self.train_loss, self.full_output = loss_fn, (lambda out: out)
        meta_layers = pipeline_layers(self.full_meta) if p.pp > 1 else [self.full_meta]
        shapes = boundary_shape_fn([meta_layers[self.bounds[s] : self.bounds[s + 1]] for s in range(self.n_stages)])
        self.engine = PipelineEngine(
            self.chunks,
            self.stage_ids,
            self.n_stages,
            lambda s: mesh.stage_rank(s % p.pp),
            mesh.pp_group,
            shapes,
            rt.device,
            p.timeout_s,
        )
        if rt.is_main and p.pp > 1:
            shm = sorted(self.engine.p2p.shm_senders)
            print(
                f"pipeline messages of rank 0: shared memory with ranks {shm}, torch.distributed otherwise"
                if shm
                else "pipeline messages: torch.distributed",
                flush=True,
            )
        schedule = SCHEDULES[p.schedule] if p.pp > 1 else one_f_one_b
        self.actions = schedule(p.pp, mesh.pp_rank, self.m, self.v)
        last_backward = {}
        for a in self.actions:
            if a.kind == "B":
                last_backward[a.chunk] = a.mb
        self.last_backward = last_backward

    # -- construction helpers -------------------------------------------------------------------
    def _sample_input(self) -> torch.Tensor:
        """The first microbatch of the training data: what the per-layer timing runs on."""
        from ..data import build_dataset, load_batch

        dataset = build_dataset(self.cfg, "train")
        rows = max(self.cfg.data.batch_size // self.dp_size // self.m, 1)
        x, _ = load_batch(dataset, torch.arange(min(rows, len(dataset))))
        return x.to(self.rt.device)

    def _tie_groups(self, model: nn.Module) -> list[tuple[nn.Parameter, object, bool]]:
        """Collective. For each parameter that layers of different stages share: (this rank's copy,
        the group of the ranks holding a copy in this rank's (dp, tp) column, whether this rank is
        the first of them), for the ties this rank holds. Every rank makes every group, in one order.
        Called once the model is cut and sharded: the copy is this rank's (sharded) tensor, found
        under whichever of the parameter's names its own stage uses."""
        mesh, mine = self.mesh, []
        names: dict[int, list[str]] = {}
        for n, t in self.full_meta.named_parameters(remove_duplicate=False):
            names.setdefault(id(t), []).append(n)
        layers = pipeline_layers(self.full_meta)
        for param, name, holders in split_ties(self.full_meta, layers, self.bounds):  # stage = pp rank here
            mine_copy = next((t for t in map(model.get_parameter, names[id(param)]) if not t.is_meta), None)
            for d in range(mesh.dp):
                for t in range(mesh.tp):
                    ranks = [mesh.global_rank(q, d, t) for q in holders]
                    group = dist.new_group(ranks)
                    if self.rt.rank in ranks:
                        mine.append((mine_copy, group, self.rt.rank == ranks[0]))
            if self.rt.is_main:
                print(
                    f"tied weights: {name} is shared by stages {holders}; their copies' gradients are summed "
                    f"every step",
                    flush=True,
                )
        return mine

    def _sum_tied_grads(self) -> torch.Tensor:
        """Sum each tied parameter's gradient over the stages holding a copy, so that every copy
        takes the step the one parameter of the unsplit model takes. Returns the change to this
        rank's share of the squared gradient norm: its copy's part out, the sum in, once (on the
        tie's first stage)."""
        change = torch.zeros((), dtype=torch.float64, device=self.rt.device)
        for param, group, first in self.tied:
            if param.grad is None:
                continue
            change -= param.grad.double().pow(2).sum()
            collectives.all_reduce(param.grad, "tied-weight-grad", group)
            if first:
                change += param.grad.double().pow(2).sum()
        return change

    def _stage_of_keys(self, model: nn.Module) -> dict[str, int]:
        """State-dict key -> the virtual stage holding it (keys outside every layer: stage 0)."""
        if self.cfg.parallel.pp == 1:
            return {k: 0 for k in model.state_dict()}
        name_of = {id(m): n for n, m in model.named_modules()}
        layers = pipeline_layers(model)
        prefix_stage = []
        for s in range(self.n_stages):
            prefix_stage += [(name_of[id(layer)] + ".", s) for layer in layers[self.bounds[s] : self.bounds[s + 1]]]
        return {k: next((s for prefix, s in prefix_stage if k.startswith(prefix)), 0) for k in model.state_dict()}

    def _log_split(self, costs: list[float]) -> None:
        p = self.cfg.parallel
        unit, scale = ("ms", 1e3) if p.balance == "time" else ("M params", 1e-6)
        parts = []
        for s in range(self.n_stages):
            a, b = self.bounds[s], self.bounds[s + 1]
            parts.append(f"stage {s} (rank {s % p.pp}): layers {a}-{b - 1}, {sum(costs[a:b]) * scale:.3g} {unit}")
        print(f"pipeline split by {p.balance} into {self.n_stages} stages: " + "; ".join(parts), flush=True)

    # -- the step -------------------------------------------------------------------------------
    @property
    def profiler(self):
        return self.engine.profiler

    @profiler.setter
    def profiler(self, profiler) -> None:  # the engine times the microbatches, the reducers their codecs
        self.engine.profiler = profiler
        for r in self.reducers:
            r.profiler = profiler

    def train_step(self, batch) -> torch.Tensor:
        for r in self.reducers:
            r.zero_grad()
        inputs, targets = batch

        def before_backward(a):
            self.reducers[a.chunk].prepare(sync=self.last_backward[a.chunk] == a.mb)

        losses = self.engine.run(
            self.actions,
            list(torch.chunk(inputs, self.m)),
            list(torch.chunk(targets, self.m)),
            self.train_loss,
            self.autocast,
            train=True,
            before_backward=before_backward,
        )
        chunk_norms = [r.finish() for r in self.reducers]
        with self.profiler.phase("optimizer"):
            norm = self._global_grad_norm(chunk_norms, self._sum_tied_grads())
            self.skipped_step = not math.isfinite(norm)  # the same norm, so the same decision, on every rank
            if not self.skipped_step:
                if self.cfg.train.clip_grad_norm > 0:
                    factor = clip_factor(torch.tensor(norm, device=self.rt.device), self.cfg.train.clip_grad_norm)
                    for t in self.params:
                        if t.grad is not None:
                            t.grad.mul_(factor)
                self.optimizer.step()
        if self.stage_ids[-1] == self.n_stages - 1:
            return torch.stack([loss.detach().float() for loss in losses]).mean()
        return torch.zeros((), device=self.rt.device)

    def _global_grad_norm(self, chunk_norms: list[torch.Tensor], tied_change: torch.Tensor) -> float:
        """The norm over all shards of the model. dp replicas hold equal gradients, so the
        world-wide sum of squares is divided by dp. Without tp the reducers' norms of their chunks
        are exact (corrected for tied copies: `tied_change`); with tp a replicated tensor (layer
        norms, row-parallel biases) counts once, on tp rank 0, and a tied tensor (its copies
        already summed) once, on its first stage."""
        if self.mesh.tp == 1:
            squares = tied_change + sum(n.double() ** 2 for n in chunk_norms)
        else:
            squares = torch.zeros((), dtype=torch.float64, device=self.rt.device)
            later_copies = {id(param) for param, _, first in self.tied if not first}
            grads = [
                t.grad
                for name, t in zip(self.param_names, self.params)
                if t.grad is not None
                and id(t) not in later_copies
                and (name in self.shard_dims or self.mesh.tp_rank == 0)
            ]
            if grads:
                squares += torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
        if dist.get_world_size() > 1:
            collectives.all_reduce(squares, "grad-norm")
        return math.sqrt(squares.item() / self.mesh.dp)

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for chunk in self.chunks:
            chunk.eval()
        try:
            xs, ys = list(torch.chunk(inputs, self.m)), list(torch.chunk(targets, self.m))
            actions = forward_only(self.cfg.parallel.pp, self.mesh.pp_rank, len(xs), self.v)
            sums = self.engine.run(
                actions,
                xs,
                ys,
                lambda out, y: eval_sums(self.loss_fn, self.full_output(out), y),
                self.autocast,
                train=False,
            )
        finally:
            for chunk in self.chunks:
                chunk.train()
        if self.reports_loss:
            return torch.stack(sums).sum(dim=0)
        return torch.zeros(4, dtype=torch.float64)

    # -- state ----------------------------------------------------------------------------------
    def _local_state(self) -> dict[str, torch.Tensor]:
        own = self.model.state_dict()
        return {k: own[k] for k in self.owned_keys}

    def state_dict(self):
        """dp rank 0 of every (pp, tp) position writes its shards under the unsplit model's names,
        with the dimension each sharded tensor is split along."""
        if self.mesh.dp_rank != 0:
            return {}, {}
        tensors = {f"model.{k}": v for k, v in self._local_state().items()}
        opt_tensors, opt_meta = ckpt.optimizer_to_tensors(self.optimizer, self.param_names)
        tensors.update(opt_tensors)
        return tensors, {"optimizer": opt_meta, "shard_dims": self.shard_dims}

    def load_state_dict(self, reader) -> None:
        """Any layout resumes any other: each rank reads the saved shards of every stage, joins a
        tensor's tp shards when the saved tp differs from ours, and cuts out its own slice."""
        saved = reader.manifest["config"]["parallel"]
        old_tp, old_pp = int(saved.get("tp", 1)), int(saved.get("pp", 1))
        old_dp = reader.world_size // (old_tp * old_pp)
        same_tp = old_tp == self.mesh.tp
        pieces: dict[str, list[torch.Tensor]] = {}
        scalars, groups, old_dims = {}, None, {}
        for q in range(old_pp):
            for t in [self.mesh.tp_rank] if same_tp else range(old_tp):
                tensors, meta = reader.load(rank=(q * old_dp) * old_tp + t)
                for k, v in tensors.items():
                    pieces.setdefault(k, []).append(v)
                scalars.update(meta["optimizer"]["scalars"])
                groups = groups or meta["optimizer"]["param_groups"]
                old_dims.update(meta.get("shard_dims", {}))

        def mine(key: str, name: str) -> torch.Tensor | None:
            """The saved tensor `key` (of parameter or buffer `name`) as this rank holds it."""
            parts = pieces.get(key)
            if parts is None or same_tp or parts[0].dim() == 0:
                return parts[0] if parts else None
            whole = torch.cat(parts, dim=old_dims[name]) if name in old_dims else parts[0]
            if name not in self.shard_dims:
                return whole
            dim = self.shard_dims[name]
            start, end = shard_range(whole.shape[dim], self.mesh.tp, self.mesh.tp_rank)
            return whole.narrow(dim, start, end - start)

        local = self._local_state()
        state = {k: mine(f"model.{k}", k) for k in local}
        missing = [k for k, v in state.items() if v is None]
        wrong = [k for k, v in state.items() if v is not None and v.shape != local[k].shape]
        if missing or wrong:
            raise ckpt.CheckpointMismatch(
                "resume", f"checkpoint does not match the model: missing {missing[:5]}, shape differs {wrong[:5]}"
            )
        with torch.no_grad():
            for k, t in local.items():
                t.copy_(state[k])
        optim = {}
        for name in self.param_names:
            # A tied parameter's state may be saved under another of its names: the name of the
            # copy a stage held, or the first name when one stage held all its uses.
            for saved in (name, *self.tie_names.get(name, ())):
                prefix = f"optim.{saved}."
                found = {
                    f"optim.{name}.{key[len(prefix) :]}": mine(key, saved) for key in pieces if key.startswith(prefix)
                }
                if found:
                    optim.update(found)
                    break
        ckpt.optimizer_from_tensors(
            self.optimizer, self.param_names, optim, {"param_groups": groups, "scalars": scalars}
        )

    def full_model_state(self):
        """Collective. tp shards are gathered inside each stage, then every stage's leader sends its
        tensors to rank 0 in one flat message per dtype; rank 0 knows every shape from the meta copy."""
        mesh = self.mesh
        full = self.full_meta.state_dict()
        mine = {}
        if mesh.dp_rank == 0:
            for k, t in self._local_state().items():
                if k in self.shard_dims:
                    dim = self.shard_dims[k]
                    t = all_gather_dim(t.detach(), dim, full[k].shape[dim], mesh.tp_group)
                mine[k] = t.detach()
        if mesh.dp_rank != 0 or mesh.tp_rank != 0:
            return None
        stage_keys = self._stage_keys(full)
        if self.rt.rank != 0:
            for flat in _flatten_by_dtype([mine[k] for k in stage_keys[mesh.pp_rank]]):
                dist.send(flat, dst=0)
            return None
        state = dict(mine)
        for q in range(1, mesh.pp):
            keys = stage_keys[q]
            metas = [full[k] for k in keys]
            for dtype, members in _group_by_dtype(metas).items():
                flat = torch.empty(sum(metas[i].numel() for i in members), dtype=dtype, device=self.rt.device)
                dist.recv(flat, src=mesh.global_rank(q, 0, 0))
                offset = 0
                for i in members:
                    n = metas[i].numel()
                    state[keys[i]] = flat[offset : offset + n].view(metas[i].shape)
                    offset += n
        return {k: state[k].cpu() for k in full}

    def _stage_keys(self, full: dict) -> list[list[str]]:
        """The keys each pipeline rank holds, in the unsplit model's order (the same cut on the
        meta copy tells every rank what the others hold)."""
        stage_of_key = self._stage_of_keys(self.full_meta)
        per_rank: list[list[str]] = [[] for _ in range(self.mesh.pp)]
        for k in full:
            per_rank[stage_of_key[k] % self.mesh.pp].append(k)
        return per_rank


def _tie_names(model: nn.Module) -> dict[str, list[str]]:
    """For each name of a parameter known by several names (tied), its other names."""
    names: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(t), []).append(name)
    return {n: [o for o in group if o != n] for group in names.values() if len(group) > 1 for n in group}


def _group_by_dtype(tensors) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _flatten_by_dtype(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat([tensors[i].reshape(-1) for i in members]) for members in _group_by_dtype(tensors).values()]
