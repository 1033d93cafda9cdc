"""ZeRO: data parallelism whose optimizer state (stage 1), gradients (2) and parameters (3) are sharded.

Trainable parameters form flat *units* (zero_comm.FlatUnit), each padded to a multiple of the world
size and cut into equal shards; rank r owns shard r of every unit, and the optimizer (any elementwise
one: sgd, adamw) sees only those shards, so each rank updates 1/N of the numbers and they come out
exactly as one process would compute them.

One optimizer step, per stage (N ranks; "full" = every rank holds all of it):

  stage 1   params full | grads full          | forward, backward -> buckets reduce-scattered
            (dp's GradientReducer, overlapped with backward) -> step on own shard -> all-gather params
  stage 2   params full | grads 1/N + in flight | backward: each bucket's gradients are copied into a
            short-lived flat buffer, reduce-scattered as soon as the bucket is complete (overlapped
            with the backward of the next bucket, at most one full bucket alive) and added into the
            rank's gradient shard -> step -> all-gather params
            (stages 1 and 2: the all-gathers start after the step and are waited for module by module
            in the next forward, so they overlap it)
  stage 3   params 1/N + gathered units | grads 1/N + in flight | one unit per module:

     forward:   pre-hook(m_i): gather m_i (wait for its prefetch), start gathering m_i+1 | run m_i |
                post-hook(m_i): free m_i's full parameters, hook m_i's outputs
     backward:  output-grad hook(m_i): gather m_i again, start gathering m_i-1 | m_i's backward |
                m_i's gradients complete: reduce-scatter them (async), free m_i's full parameters
     step:      optimizer on the shards; nothing to gather (the next forward gathers)

Global-norm clipping sums the squared shard norms over ranks (one all-reduce of a scalar).
Checkpoints: every rank writes the pieces of parameters and optimizer state it owns, keyed by
parameter name with their offsets within the parameter, so a checkpoint written at world N loads at
any world M (each rank reads the pieces overlapping its new shards).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import checkpoint as ckpt
from .. import collectives
from ..models.materialize import materialize
from ..optim import build_optimizer
from .base import Strategy, broadcast_tensors, clip_factor, unique_parameters
from .compression import CAST_DTYPES
from .data_parallel import make_buckets
from .zero_comm import FlatUnit, ShardReducer, StreamingShardReducer, all_gather

CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # never called themselves: their children are


def wire_dtype(cfg) -> torch.dtype | None:
    """parallel.compression for ZeRO: bf16 / fp16 reduce-scatter a 16-bit copy of each gradient
    bucket (the other codecs need an all-reduce of every rank's whole gradient: config rejects them)."""
    return CAST_DTYPES.get(cfg.parallel.compression)


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters())


class Zero(Strategy):
    stage = 0
    # The trainer builds models on the meta device for us (ZeroSpec.materializes_models; see models/materialize.py).

    def __init__(self, model: nn.Module, loss_fn, cfg, rt, group=None):
        super().__init__(model, loss_fn, cfg, rt)
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = rt.device
        named = unique_parameters(model)
        self.name_of = {id(p): n for n, p in named}
        self.units = self._make_units(model, named)
        self.slot_of = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}
        self._allocate(model)
        self._load_initial_values(model)
        self._install(model)
        self._setup_communication(model)
        self._overlap_gathers_with_forward(model)
        self.optimizer = build_optimizer([u.shard for u in self.units], cfg.train)

    # -- layout ---------------------------------------------------------------------------------
    def _make_units(self, model, named) -> list[FlatUnit]:
        """Stages 1 and 2: one unit per gradient bucket (dp's make_buckets)."""
        params = [p for _, p in named]
        buckets = make_buckets(params, int(self.cfg.parallel.bucket_mb * 2**20), self.device, self.world)
        return [
            FlatUnit(b.index, b.params, [self.name_of[id(p)] for p in b.params], self.rank, self.world, self.device)
            for b in buckets
        ]

    def _allocate(self, model) -> None:
        """Stages 1 and 2: the full flat parameter of every unit is kept; the shard is a view of it."""
        for u in self.units:
            u.full = torch.zeros(u.numel, dtype=u.dtype, device=self.device)
            u.shard = nn.Parameter(u.full[u.lo : u.hi])

    def _take_values(self, unit: FlatUnit, i: int, value: torch.Tensor) -> None:
        """Store parameter i of `unit` (the whole tensor) where this stage keeps it."""
        flat = value.detach().reshape(-1)
        unit.full[unit.offsets[i] : unit.offsets[i] + unit.numels[i]].copy_(flat)

    def _load_initial_values(self, model) -> None:
        """Shard by shard for meta-built models (no rank holds the whole model), else from the model."""
        if not on_meta(model):
            for u in self.units:
                for i, p in enumerate(u.params):
                    self._take_values(u, i, p)
            model.to(self.device)  # buffers and frozen parameters
            broadcast_tensors(list(model.buffers()), src=0, group=self.group)
            self._sync_full_from_shards()
            return
        replicated: dict[int, torch.Tensor] = {}

        def keep(meta_tensor: torch.Tensor, value: torch.Tensor) -> None:
            slot = self.slot_of.get(id(meta_tensor))
            if slot is not None:
                self._take_values(*slot, value)
            else:
                replicated[id(meta_tensor)] = value.to(self.device)

        materialize(model, self.cfg.train.seed, keep)
        for module in model.modules():  # buffers and frozen parameters: whole on every rank
            for name, t in list(module._parameters.items()):
                if t is not None and id(t) in replicated:
                    module._parameters[name] = nn.Parameter(replicated[id(t)], requires_grad=False)
            for name, t in list(module._buffers.items()):
                if t is not None and id(t) in replicated:
                    module._buffers[name] = replicated[id(t)]
        self._sync_full_from_shards()

    def _sync_full_from_shards(self) -> None:
        self._start_gathers()
        self._wait_gathers(self.units)

    def _start_gathers(self) -> None:
        for u in self.units:
            u.sync_work = all_gather(u.full, u.shard.detach(), f"zero-params-unit-{u.index}", self.group)

    def _wait_gathers(self, units) -> None:
        for u in units:
            if getattr(u, "sync_work", None) is not None:
                u.sync_work.wait()
                u.sync_work = None

    def _overlap_gathers_with_forward(self, model) -> None:
        """Stages 1 and 2: the parameter all-gathers started after a step finish during the next
        forward; each module waits only for the units holding its own parameters."""
        for module in model.modules():
            units = list(
                {
                    id(self.slot_of[id(p)][0]): self.slot_of[id(p)][0]
                    for p in module._parameters.values()
                    if p is not None and id(p) in self.slot_of
                }.values()
            )
            if units:
                module.register_forward_pre_hook(lambda m, args, units=units: self._wait_gathers(units))

    def _install(self, model) -> None:
        """Replace the model's parameters by views into the units' full flat parameters."""
        new = {}
        for u in self.units:
            for p, view in zip(u.params, self._param_views(u)):
                new[id(p)] = nn.Parameter(view, requires_grad=True)
            u.params = [new[id(p)] for p in u.params]
        for module in model.modules():
            for name, t in list(module._parameters.items()):
                if t is not None and id(t) in new:
                    module._parameters[name] = new[id(t)]
        self.slot_of = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}

    def _param_views(self, u: FlatUnit) -> list[torch.Tensor]:
        return u.views(u.full)

    def _setup_communication(self, model) -> None:
        """Stage 1: dp's persistent buckets, reduce-scattered in place; the shard's grad is a view."""
        params = [p for u in reversed(self.units) for p in reversed(u.params)]  # registration order
        self.reducer = ShardReducer(params, self.cfg.parallel.bucket_mb, self.device, self.group, wire_dtype(self.cfg))
        for u, b in zip(self.units, self.reducer.buckets):
            assert [id(p) for p in u.params] == [id(p) for p in b.params], "bucket and unit layouts differ"
            u.shard.grad = self.reducer.own_slice(b)

    # -- the step -------------------------------------------------------------------------------
    def train_step(self, batch) -> torch.Tensor:
        self.reducer.zero_grad()
        micro = self.micro_batches(batch)
        total = torch.zeros((), device=self.device)
        prof = self.profiler  # waits on gathers and reduce-scatters are its "comm" (paratrain.collectives)
        for i, (x, y) in enumerate(micro):
            self._before_backward(i, last=i == len(micro) - 1)
            with prof.phase("forward"), self.autocast():
                loss = self.loss_fn(self.model(x), y)
            with prof.phase("backward"):
                (loss / len(micro)).backward()
            self._after_backward(last=i == len(micro) - 1)
            total += loss.detach()
        self._wait_gathers(self.units)  # parameters no forward used: their shard is about to change
        with prof.phase("optimizer"):
            grads = [u.shard.grad for u in self.units]
            norm = sharded_grad_norm(grads, self.group)
            self.skipped_step = not bool(torch.isfinite(norm))  # the same on every rank: the norm is global
            if not self.skipped_step:
                if self.cfg.train.clip_grad_norm > 0:
                    factor = clip_factor(norm, self.cfg.train.clip_grad_norm)
                    for g in grads:
                        g.mul_(factor.to(g.dtype))
                self.optimizer.step()
                self._after_step()
        return total / len(micro)

    def _before_backward(self, micro: int, last: bool) -> None:
        self.reducer.prepare(sync=last)  # stage 1 communicates once per step, like dp

    def _after_backward(self, last: bool) -> None:
        if last:
            self.reducer.finish()

    def _after_step(self) -> None:
        self._start_gathers()  # waited for by the next forward, module by module

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self):
        """This rank's pieces of every parameter and its optimizer state, keyed by parameter name."""
        tensors, pieces, scalars, shared = {}, {}, {}, {}
        for u in self.units:
            state = self.optimizer.state.get(u.shard, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.numel() == u.shard_numel and value.dim() == 1:
                    continue
                if isinstance(value, torch.Tensor):
                    shared[f"zero.optim.{key}"] = value  # e.g. adam's step: the same for every shard
                elif value is not None:
                    scalars[key] = value
            for i, start, end, at in u.own_pieces():
                name = u.names[i]
                pieces[name] = [start, end]
                tensors[f"zero.param.{name}"] = u.shard.detach()[at : at + end - start]
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.numel() == u.shard_numel and value.dim() == 1:
                        tensors[f"zero.optim.{name}.{key}"] = value[at : at + end - start]
        tensors.update(shared)
        if self.rank == 0:
            tensors.update({f"replicated.{k}": v for k, v in self._replicated_state().items()})
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.state_dict()["param_groups"]]
        meta = {
            "zero": {
                "stage": self.stage,
                "world_size": self.world,
                "pieces": pieces,
                "params": {n: list(s) for u in self.units for n, s in zip(u.names, u.shapes)},
                "optimizer": {"param_groups": groups, "scalars": scalars},
            }
        }
        return tensors, meta

    def _replicated_state(self) -> dict[str, torch.Tensor]:
        """Buffers and frozen parameters: whole and identical on every rank."""
        return replicated_state(self.model)

    @staticmethod
    def check_checkpoint(reader, model: nn.Module) -> None:
        """Before any worker starts (the CLI's preflight, `model` on meta): the checkpoint's
        parameter names and shapes must be the model's. Reads only rank 0's safetensors header."""
        meta, shapes = ckpt.read_header(reader.path / ckpt.rank_file(0))
        saved = meta.get("zero")
        replicated = {k[len("replicated.") :]: shape for k, shape in shapes.items() if k.startswith("replicated.")}
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), dict):
            raise ckpt.CheckpointMismatch("--resume", f"{reader.path} holds no ZeRO state")
        check_layout(model, saved["params"], replicated, key="--resume")

    def load_state_dict(self, reader) -> None:
        tensors0, meta0 = reader.load(rank=0)
        saved = meta0.get("zero")
        if saved is None:
            raise ckpt.CheckpointMismatch("resume", f"{reader.path} holds no ZeRO state")
        check_layout(
            self.model,
            saved["params"],
            {k[len("replicated.") :]: list(v.shape) for k, v in tensors0.items() if k.startswith("replicated.")},
        )
        shard_state: dict[int, dict[str, torch.Tensor]] = {u.index: {} for u in self.units}
        own = {u.names[i]: (u, start, end, at) for u in self.units for i, start, end, at in u.own_pieces()}
        for r in range(reader.world_size):
            tensors, meta = (tensors0, meta0) if r == 0 else reader.load(rank=r)
            for name, (s, e) in meta["zero"]["pieces"].items():
                if name not in own:
                    continue
                u, os_, oe, at = own[name]
                a, b = max(s, os_), min(e, oe)
                if a >= b:
                    continue
                dst = slice(at + a - os_, at + b - os_)
                src = slice(a - s, b - s)
                with torch.no_grad():
                    u.shard[dst].copy_(tensors[f"zero.param.{name}"][src])
                prefix = f"zero.optim.{name}."
                for key in (k[len(prefix) :] for k in tensors if k.startswith(prefix)):
                    buf = shard_state[u.index].setdefault(
                        key, torch.zeros(u.shard_numel, dtype=tensors[prefix + key].dtype, device=self.device)
                    )
                    buf[dst].copy_(tensors[prefix + key][src])
        shared = {
            k[len("zero.optim.") :]: v for k, v in tensors0.items() if k.startswith("zero.optim.") and k.count(".") == 2
        }
        opt = saved["optimizer"]
        state = {
            i: {**shard_state[u.index], **{k: v.clone() for k, v in shared.items()}, **opt["scalars"]}
            for i, u in enumerate(self.units)
            if shard_state[u.index] or shared
        }
        current = self.optimizer.state_dict()
        groups = [dict(g, params=c["params"]) for g, c in zip(opt["param_groups"], current["param_groups"])]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        replicated = {k[len("replicated.") :]: v for k, v in tensors0.items() if k.startswith("replicated.")}
        with torch.no_grad():
            for k, v in self._replicated_state().items():
                v.copy_(replicated[k])
        self._after_load()

    def _after_load(self) -> None:
        self._sync_full_from_shards()

    def full_model_state(self):
        self._wait_gathers(self.units)
        if self.rank != 0:
            return None
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}


class Zero1(Zero):
    name = "zero1"
    stage = 1


class Zero2(Zero):
    name = "zero2"
    stage = 2

    def _setup_communication(self, model) -> None:
        self.reducer = StreamingShardReducer(self.units, self.group, in_order=True, wire_dtype=wire_dtype(self.cfg))
        for u in self.units:
            u.shard.grad = u.grad_shard

    def _before_backward(self, micro: int, last: bool) -> None:
        self.reducer.prepare(accumulate=micro > 0)

    def _after_backward(self, last: bool) -> None:
        self.reducer.finish()


class Zero3(Zero2):
    name = "zero3"
    stage = 3
    collective_forward = True  # each unit's parameters are gathered from every rank

    def _make_units(self, model, named) -> list[FlatUnit]:
        """One unit per module (see `module_units`), indexed in reverse forward order like buckets."""
        groups = module_units(model, [p for _, p in named], int(self.cfg.parallel.bucket_mb * 2**20))
        return [
            FlatUnit(
                i, params, [self.name_of[id(p)] for p in params], self.rank, self.world, self.device, module=module
            )
            for i, (module, params) in enumerate(reversed(groups))
        ]

    def _allocate(self, model) -> None:
        """The full flat parameter of a unit has storage only while gathered; the shard is its own."""
        for u in self.units:
            u.full = torch.empty(u.numel, dtype=u.dtype, device=self.device)
            u.full.untyped_storage().resize_(0)
            u.shard = nn.Parameter(torch.zeros(u.shard_numel, dtype=u.dtype, device=self.device))

    def _take_values(self, unit: FlatUnit, i: int, value: torch.Tensor) -> None:
        flat = value.detach().reshape(-1)
        for j, start, end, at in unit.own_pieces():
            if j == i:
                with torch.no_grad():
                    unit.shard[at : at + end - start].copy_(flat[start:end])

    def _sync_full_from_shards(self) -> None:
        pass  # parameters are gathered on demand

    def _param_views(self, u: FlatUnit) -> list[torch.Tensor]:
        """Views need storage to exist while they are made; it is freed again right after."""
        u.full.untyped_storage().resize_(u.full_nbytes())
        views = u.views(u.full)
        u.full.untyped_storage().resize_(0)
        return views

    def _setup_communication(self, model) -> None:
        self.gatherer = ParameterGatherer(self.units, model, self.group)
        self.reducer = StreamingShardReducer(
            self.units, self.group, in_order=False, on_launch=self.gatherer.reshard, wire_dtype=wire_dtype(self.cfg)
        )
        for u in self.units:
            u.shard.grad = u.grad_shard

    def _after_backward(self, last: bool) -> None:
        self.reducer.finish()
        self.gatherer.reshard_all()

    def _after_step(self) -> None:
        pass

    def _overlap_gathers_with_forward(self, model) -> None:
        pass  # the ParameterGatherer's hooks gather on demand

    def _after_load(self) -> None:
        pass

    def full_model_state(self):
        """Unit by unit: gather (all ranks), rank 0 keeps a copy, free."""
        values = {}
        for u in self.units:
            self.gatherer.unshard(u)
            if self.rank == 0:
                values.update({id(p): p.detach().cpu().clone() for p in u.params})
            self.gatherer.reshard(u)
        if self.rank != 0:
            return None
        return {
            k: values[id(v)] if id(v) in values else v.detach().cpu().clone()
            for k, v in self.model.state_dict(keep_vars=True).items()
        }


def replicated_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What ZeRO does not shard: buffers and frozen parameters, by state_dict key."""
    trainable = {id(p) for _, p in unique_parameters(model)}
    return {k: v.detach() for k, v in model.state_dict(keep_vars=True).items() if id(v) not in trainable}


def check_layout(model: nn.Module, saved_params: dict, saved_replicated: dict, key: str = "resume") -> None:
    """Exit 2 naming the parameters or buffers whose name or shape differs from the checkpoint's."""
    ours = {n: p.shape for n, p in unique_parameters(model)}
    ours.update({k: v.shape for k, v in replicated_state(model).items()})
    differs = ckpt.describe_mismatch(ours, {**saved_params, **saved_replicated})
    if differs:
        raise ckpt.CheckpointMismatch(key, differs)


def module_units(model: nn.Module, params: list[nn.Parameter], max_bytes: int) -> list[tuple[nn.Module, list]]:
    """Stage 3's units, in registration (forward) order: a module whose parameters total at most
    `max_bytes` is one unit with all of them; a bigger one is split into its children, its own direct
    parameters forming a unit of their own. The root's direct parameters, those of containers
    (ModuleList/ModuleDict are never called, so their hooks would never run) and parameters shared
    by several modules (a tied weight is used outside its own module's forward) form the root unit,
    which stays gathered from the start of forward to the end of its backward."""
    trainable = {id(p) for p in params}
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) in trainable:
                owners[id(p)] = owners.get(id(p), 0) + 1
    taken: set[int] = {i for i, n in owners.items() if n > 1}
    root_params = [p for p in params if id(p) in taken]
    units: list[tuple[nn.Module, list]] = []

    def subtree(module):
        seen, out = set(), []
        for p in module.parameters():
            if id(p) in trainable and id(p) not in taken and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def direct(module):
        return [p for p in module._parameters.values() if p is not None and id(p) in trainable and id(p) not in taken]

    def visit(module, is_root: bool):
        below = subtree(module)
        if not below:
            return
        if (
            not is_root
            and not isinstance(module, CONTAINERS)
            and sum(p.numel() * p.element_size() for p in below) <= max_bytes
        ):
            units.append((module, below))
            taken.update(id(p) for p in below)
            return
        own = direct(module)
        taken.update(id(p) for p in own)
        if own and not is_root and not isinstance(module, CONTAINERS):
            units.append((module, own))
        else:
            root_params.extend(own)
        for child in module.children():
            visit(child, False)

    visit(model, True)
    order = {id(p): i for i, p in enumerate(params)}
    if root_params:
        units.insert(0, (model, sorted(root_params, key=lambda p: order[id(p)])))
    return units


class ParameterGatherer:
    """Stage 3: gathers each unit's full parameters just before its module runs (forward and backward)
    and frees them after, prefetching the next unit in the forward order recorded on the first pass."""

    def __init__(self, units: list[FlatUnit], root: nn.Module, group):
        self.units, self.root, self.group = units, root, group
        self.order: list[FlatUnit] = []
        self.position: dict[int, int] = {}
        self.recording = True
        self.live_bytes = self.peak_bytes = 0  # full parameters gathered at once (for the memory benchmark)
        for u in units:
            u.state, u.gather_work = "free", None
            u.module.register_forward_pre_hook(lambda m, args, u=u: self._pre_forward(u))
            u.module.register_forward_hook(lambda m, args, out, u=u: self._post_forward(u, out))
        root.register_forward_hook(lambda m, args, out: self._end_of_forward())

    # -- gather and free ------------------------------------------------------------------------
    def _start(self, u: FlatUnit) -> None:
        u.full.untyped_storage().resize_(u.full_nbytes())
        self.live_bytes += u.full_nbytes()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        u.version = u.full._version
        u.gather_work = all_gather(u.full, u.shard.detach(), f"zero3-params-unit-{u.index}", self.group)
        u.state = "gathering"

    def _wait(self, u: FlatUnit) -> None:
        u.gather_work.wait()
        u.gather_work = None
        # Autograd saved these very tensors in forward; refilling them with the same values is not a
        # modification it should see, so the version counter (bumped by the gather, on gloo from its
        # worker thread by the time the work completes) goes back to where it was.
        torch._C._autograd._unsafe_set_version_counter((u.full,), (u.version,))

    def unshard(self, u: FlatUnit) -> None:
        if u.state == "free":
            self._start(u)
        if u.state == "gathering":
            self._wait(u)
            u.state = "gathered"

    def prefetch(self, u: FlatUnit | None) -> None:
        if u is not None and u.state == "free":
            self._start(u)

    def reshard(self, u: FlatUnit) -> None:
        if u.state == "gathering":
            self._wait(u)
        if u.state != "free":
            u.full.untyped_storage().resize_(0)
            self.live_bytes -= u.full_nbytes()
            u.state = "free"

    def reshard_all(self) -> None:
        for u in self.units:
            self.reshard(u)

    def _neighbour(self, u: FlatUnit, step: int) -> FlatUnit | None:
        i = self.position.get(id(u))
        if i is None or not 0 <= i + step < len(self.order):
            return None
        return self.order[i + step]

    # -- hooks ----------------------------------------------------------------------------------
    def _pre_forward(self, u: FlatUnit) -> None:
        if self.recording and id(u) not in self.position:
            self.position[id(u)] = len(self.order)
            self.order.append(u)
        self.unshard(u)
        if not self.recording:
            self.prefetch(self._neighbour(u, +1))

    def _post_forward(self, u: FlatUnit, output) -> None:
        if torch.is_grad_enabled():
            for t in torch.utils._pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, u=u: self._pre_backward(u))
            if u.module is self.root:
                return  # backward starts with it: keep it gathered
        self.reshard(u)

    def _end_of_forward(self) -> None:
        self.recording = False

    def _pre_backward(self, u: FlatUnit) -> None:
        self.unshard(u)
        # Backward runs the forward order in reverse; the root's backward is followed by the last unit's.
        self.prefetch(self.order[-1] if u.module is self.root else self._neighbour(u, -1))


def sharded_grad_norm(grads: list[torch.Tensor], group) -> torch.Tensor:
    """The global gradient norm of gradients sharded across ranks: the square root of the all-reduced
    sum of each rank's squared shard norms (padding is zero)."""
    squares = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
    if dist.get_world_size(group) > 1:
        collectives.all_reduce(squares, "zero-grad-norm", group=group)
    return squares.sqrt()
