"""ZeRO: data parallelism whose optimizer state (stage 1), gradients (2) and parameters (3) are sharded.

Trainable parameters form flat *units* (comm.FlatUnit), each padded to a multiple of the world
size and cut into equal shards; rank r owns shard r of every unit, and the optimizer (any elementwise
one: sgd, adamw) sees only those shards, so each rank updates 1/N of the numbers and they come out
exactly as one process would compute them.

One optimizer step, per stage (N ranks; "full" = every rank holds all of it):

  stage 1   params full | grads full          | forward, backward -> buckets reduce-scattered
            (dp's GradientReducer, overlapped with backward) -> step on own shard -> all-gather params
  stage 2   params full | grads 1/N + in flight | backward: each bucket's gradients are copied into a
            short-lived flat buffer, reduce-scattered as soon as the bucket is complete (overlapped
            with the backward of the next bucket, at most one full bucket alive) and added into the
            rank's gradient shard -> step -> all-gather params (stages 1 and 2: started after the
            step, waited for module by module in the next forward, which they overlap)
  stage 3   params 1/N + gathered units | grads 1/N + in flight | one unit per module:

     forward:   pre-hook(m_i): gather m_i (wait for its prefetch), start gathering m_i+1 | run m_i |
                post-hook(m_i): free m_i's full parameters, hook m_i's outputs
     backward:  output-grad hook(m_i): gather m_i again (first finish reducing the gradients in
                flight if m_i's would not fit beside them) | m_i's backward | m_i's gradients
                complete: reduce-scatter them (async; on gloo each where autograd left it), free m_i's
                full parameters, start gathering m_i-1
                (prefetches only within twice the largest unit: zero/gather.py.ParameterGatherer)
     step:      optimizer on the shards; nothing to gather (the next forward gathers)

Replica groups (parallel.replicas = R, comm/grid.py): the units are sharded over the S = N/R ranks of
one replica, every rank still reading its own slice of the global batch; after the reduce-scatter
inside the replica each rank's gradient shard is averaged with the same shard of the other
replicas (one all-reduce of the shard over R ranks), so every replica steps on the global batch's
mean gradient. Stage 3 with replicas is HSDP: gathers and reduce-scatters stay inside a replica
(a node), only 1/S of the gradients cross between replicas. Replica 0 writes the checkpoints.

Mixed precision (train.precision = "bf16", every stage), as DeepSpeed's and Megatron's distributed
optimizer and FSDP2 with a bf16 param_dtype: bf16 working parameters (`unit.full`) and gradients, the
fp32 master copy only in each rank's shard (`unit.master`; the optimizer's pieces are views of it),
which steps with the gradient shard cast up for the step only, then is rounded into the bf16 shard
that is all-gathered. Per parameter: 2 + 2 bytes on every rank and 12 / N for the master and AdamW's
moments (stage 2: 2 + (2 + 12) / N; stage 3: (2 + 2 + 12) / N, its gathers and reduce-scatters
moving bf16, half of what fp32 parameters would), where fp32 autocast keeps 4 + 4 + 8 / N.

Frozen parameters (LoRA's base weights): no gradient or optimizer state; stage 3's own units (stages.py).
Global-norm clipping sums the squared shard norms over ranks (one all-reduce of a scalar).
Checkpoints: every rank writes the pieces of parameters and optimizer state it owns, keyed by
parameter name with their offsets within the parameter, so a checkpoint written at world N loads at
any world M (zero/reshard.py). Stage 3's units and their gathering: zero/gather.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.grid import replica_groups
from paratrain.data.batch import feed
from paratrain.optim import build_optimizer, rebuild_optimizer
from paratrain.parallel.base import Strategy, broadcast_tensors, clip_factor, refuse, unique_parameters
from paratrain.parallel.dp.batchnorm import BatchNormPolicy
from paratrain.parallel.zero import comm as zero_comm
from paratrain.parallel.zero.comm import FlatUnit, ShardReducer, all_gather, on_meta, shard_grad, wire_dtype
from paratrain.parallel.zero.experts import bucket_units, zero_experts
from paratrain.parallel.zero.export import full_precision_layout
from paratrain.parallel.zero.reshard import check_checkpoint, load_sharded_state, sharded_state
from paratrain.parallel.zero.user_tensors import GradShards


class Zero(Strategy):
    stage = 0
    splits_expert_weights = True  # parallel.ep: each rank keeps its experts alone (but in the own loop)
    reducer: ShardReducer | zero_comm.StreamingShardReducer  # stage 1's; stages 2 and 3 stream (stages.py)
    # The trainer builds models on the meta device for us (ZeroSpec.materializes_models; see models/materialize.py).

    def __init__(self, model: nn.Module, loss_fn, cfg, rt, own_loop: bool = False):  # own_loop: experts.py
        super().__init__(model, loss_fn, cfg, rt)
        self.replicas = replica_groups(cfg.parallel.replicas)
        self.group = group = self.replicas.inner  # None: the world is the one replica
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # every replica holds the same shards: replica 0 (ranks 0..world-1) saves them
        self.checkpoint_ranks, self.checkpoint_group = self.world, group
        self.device = rt.device
        self.mixed = cfg.train.precision == "bf16"
        self.zero_grad_called = True  # mixed precision: the pieces' gradients exist only in the step
        self.fresh_grads = True  # whether the backward under way starts the gradients afresh (no accumulation)
        self.split_sequences_and_experts(model)  # first: which experts this rank keeps, apart from the units
        self.kept_experts = zero_experts(cfg, model, self.experts and self.experts.mesh, own_loop)
        named = unique_parameters(model)
        # every parameter named, frozen ones too: an optimizer over all of them is the user's to
        # pass, and rebuild_optimizer leaves the frozen out (one process steps none without a gradient)
        self.name_of = {id(p): n for n, p in model.named_parameters()}
        self.frozen_units: list[FlatUnit] = []  # stage 3 shards those too (_make_units); 1 and 2 keep them whole
        self.units = self._make_units(model, named)
        self.slot_of = {id(p): (u, i) for u in self.all_units for i, p in enumerate(u.params)}
        self._allocate(model)
        self._load_initial_values(model)
        self.kept_experts.keep(model)
        self._install(model)
        self._setup_communication(model)
        self._overlap_gathers_with_forward(model)
        self.batchnorm = BatchNormPolicy(model, cfg.parallel.sync_batchnorm, group)
        self._make_pieces()
        self.optimizer = self._with_gathers(build_optimizer(self.pieces, cfg.train))
        self.user_grads = GradShards(self.name, group)
        self._hook_state_dicts(model)

    # -- layout ---------------------------------------------------------------------------------
    def _make_units(self, model, named) -> list[FlatUnit]:
        """Stages 1 and 2: one unit per gradient bucket (dp's make_buckets; of working parameters)."""
        return self.kept_experts.units(named, self.world, bucket_units(self.cfg), self._unit)

    @property
    def all_units(self) -> list[FlatUnit]:
        """The trainable units (gradients, optimizer) and the frozen ones (gathered, exported, saved)."""
        return self.units + self.frozen_units

    def _unit(self, index: int, module, params: list[nn.Parameter], expert: bool) -> FlatUnit:
        """A unit of the dense parameters, sharded over the replica, or of the kept experts (experts.py)."""
        rank, world, group, divisor = self.kept_experts.sharing if expert else (self.rank, self.world, self.group, 0)
        names = [self.name_of[id(p)] for p in params]
        u = FlatUnit(index, params, names, rank, world, self.device, module=module, group=group, divisor=divisor)
        u.dtype = zero_comm.working_dtype(self.cfg, u.dtype, self.stage)
        return u

    def _allocate(self, model) -> None:
        """Stages 1 and 2: the full flat parameter of every unit is kept; the shard is a view of it,
        and the master too unless it is a copy in full precision (mixed precision)."""
        for u in self.units:
            u.full = torch.zeros(u.numel, dtype=u.dtype, device=self.device)
            u.shard = nn.Parameter(u.full[u.lo : u.hi])
            full_precision = u.params[0].dtype
            u.master = torch.zeros(u.shard_numel, dtype=full_precision, device=self.device) if self.mixed else u.shard

    def _take_values(self, unit: FlatUnit, i: int, value: torch.Tensor) -> None:
        """Store parameter i of `unit` (the whole tensor) where this stage keeps it."""
        flat = value.detach().reshape(-1)
        unit.full[unit.offsets[i] : unit.offsets[i] + unit.numels[i]].copy_(flat)
        if unit.master is not unit.shard:
            unit.copy_own(unit.master, i, flat)

    def _load_initial_values(self, model) -> None:
        """Shard by shard for meta-built models (no rank holds the whole model), else from the model."""
        if not on_meta(model):
            for u in self.all_units:
                for i, p in enumerate(u.params):
                    self._take_values(u, i, p)
            model.to(self.device)  # buffers (and stages 1 and 2's frozen parameters)
            first = 0 if self.group is None else dist.get_global_rank(self.group, 0)
            broadcast_tensors(list(model.buffers()), src=first, group=self.group)
            self._sync_full_from_shards()
            return
        replicated: dict[int, torch.Tensor] = {}

        def keep(meta_tensor: torch.Tensor, value: torch.Tensor) -> None:
            slot = self.slot_of.get(id(meta_tensor))
            if slot is not None:
                self._take_values(*slot, value)
            elif id(meta_tensor) not in self.kept_experts.skipped:  # another rank's expert: dropped
                replicated[id(meta_tensor)] = value.to(self.device)

        self.kept_experts.materialize(model, self.cfg.train.seed, keep)  # (a rank's stacks cut: experts.py)
        for module in model.modules():  # buffers (and stages 1 and 2's frozen parameters): whole on every rank
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
            u.sync_work = all_gather(u.full, u.shard.detach(), f"zero-params-unit-{u.index}", u.group)

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
        for u in self.all_units:
            for p, view in zip(u.params, self._param_views(u)):
                new[id(p)] = nn.Parameter(view, requires_grad=u.trains)
            u.params = [new[id(p)] for p in u.params]
        for module in model.modules():
            for name, t in list(module._parameters.items()):
                if t is not None and id(t) in new:
                    module._parameters[name] = new[id(t)]
        self.slot_of = {id(p): (u, i) for u in self.all_units for i, p in enumerate(u.params)}

    def _param_views(self, u: FlatUnit) -> list[torch.Tensor]:
        return u.views(u.full)

    def _setup_communication(self, model) -> None:
        """Stage 1: dp's persistent buckets, reduce-scattered in place; the shard's grad is a view
        (the kept experts' in a reducer of their own, over their group: experts.py)."""
        self.reducer = self._shard_reducer(self.kept_experts.apart(self.units)[0], self.group)
        self.kept_experts.reduce_apart(self.units, self._shard_reducer)

    def _shard_reducer(self, units: list[FlatUnit], group, divisor: int = 0) -> ShardReducer:
        params = [p for u in reversed(units) for p in reversed(u.params)]  # registration order
        reducer = ShardReducer(params, self.cfg.parallel.bucket_mb, self.device, group, wire_dtype(self.cfg), divisor)
        for u, b in zip(units, reducer.buckets):
            assert [id(p) for p in u.params] == [id(p) for p in b.params], "bucket and unit layouts differ"
            u.shard.grad = reducer.own_slice(b)
        return reducer

    def _make_pieces(self) -> None:
        """The optimizer's parameters: each unit shard cut where the model's parameters meet, views
        of the master (the shard, or its full-precision copy) and of its gradient. An elementwise
        optimizer (SGD, Adam, AdamW, ...) computes the same numbers on them as on the whole
        parameters, and each piece can go into the param group of the parameter it belongs to (the
        Python API keeps the user's groups). A frozen unit's pieces are only saved and loaded."""
        self.pieces: list[nn.Parameter] = []
        for u in self.all_units:
            u.pieces = [
                (i, start, end, at, nn.Parameter(u.master.detach()[at : at + end - start]))
                for i, start, end, at in u.own_pieces()
            ]
            if u.trains:
                self.pieces.extend(piece for *_, piece in u.pieces)
        self._bind_piece_grads()

    def _bind_piece_grads(self, up: bool = False) -> None:
        """The pieces' gradients: views of the gradient shard; under mixed precision (`up`, just
        before a step) of its copy in full precision, which lives until the step ends."""
        if self.mixed and not up:
            return
        for u in self.units:
            grad = shard_grad(u).to(u.master.dtype)
            for _, start, end, at, piece in u.pieces:
                piece.grad = grad[at : at + end - start]

    def _with_gathers(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Every step of `optimizer` is followed by _after_step (stages 1 and 2: the parameters'
        all-gathers), whoever calls it: train_step or the user's own loop. Under mixed precision it
        is preceded by the gradients' cast up, and its zero_grad is noted (_pieces_let_go)."""
        optimizer.register_step_post_hook(lambda *_: self._after_step())
        if self.mixed:
            optimizer.register_step_pre_hook(lambda *_: self._bind_piece_grads(up=True))
            zero_grad = optimizer.zero_grad

            def noted_zero_grad(set_to_none: bool = True) -> None:
                self.zero_grad_called = True
                zero_grad(set_to_none)

            optimizer.zero_grad = noted_zero_grad  # type: ignore[method-assign]  # noted, then torch's own
        return optimizer

    # -- the step -------------------------------------------------------------------------------
    def train_step(self, batch) -> torch.Tensor:
        self.reducer.zero_grad()
        self.batchnorm.before_step()
        micro = self.micro_batches(batch)
        total = torch.zeros((), device=self.device)
        prof = self.profiler  # waits on gathers and reduce-scatters are its "comm" (paratrain.comm.collectives)
        for i, (x, y) in enumerate(micro):
            self._before_backward(i, last=i == len(micro) - 1)
            self.kept_experts.prepare(i, last=i == len(micro) - 1)
            with prof.phase("forward"), self.autocast():
                loss = self.loss_fn(feed(self.model, x), y)
            with prof.phase("backward"):
                (loss / len(micro)).backward()
            self._after_backward(last=i == len(micro) - 1)
            total += loss.detach()
        self._wait_gathers(self.units)  # parameters no forward used: their shard is about to change
        self.kept_experts.finish()
        grads = [shard_grad(u) for u in self.units]
        self._average_across_replicas(grads)
        with prof.phase("optimizer"):
            norm = self._grad_norm()  # global: the same decision on every rank
            # then _after_step (a hook of the optimizer's), skipped or not: it gathers the
            # parameters, unchanged after a skipped step
            self.skipped_step = self.step_if_finite(norm, self._scale_grads)
        return total / len(micro)

    def _grad_norm(self) -> torch.Tensor:
        return self.kept_experts.grad_norm(self.units, self.group)

    def _scale_grads(self, factor: torch.Tensor) -> None:
        for u in self.units:
            shard_grad(u).mul_(factor.to(shard_grad(u).dtype))

    def _average_across_replicas(self, grads: list[torch.Tensor]) -> None:
        zero_comm.average_across_replicas(self.units, grads, self.replicas)

    def _before_backward(self, micro: int, last: bool) -> None:
        assert isinstance(self.reducer, ShardReducer)  # stage 1's
        self.reducer.prepare(sync=last)  # stage 1 communicates once per step, like dp

    def _after_backward(self, last: bool) -> None:
        if last:
            self.reducer.finish()

    def _after_step(self) -> None:
        if self.mixed:  # the stepped masters rounded into the working shards; their gradients go
            for piece in self.pieces:
                piece.grad = None
            self._round_masters()
        self._start_gathers()  # waited for by the next forward, module by module

    # -- the Python API's own loop ----------------------------------------------------------------
    @classmethod
    def adopts_optimizers(cls, cfg) -> bool:
        return True

    def adopt_optimizer(self, optimizer):
        """The user's optimizer class and hyper-parameters over this rank's pieces, each piece in
        the param group of its parameter (a group may hold no piece on some rank)."""
        piece_of = {u.names[i]: piece for u in self.units for i, *_, piece in u.pieces}
        self.optimizer = self._with_gathers(rebuild_optimizer(optimizer, self.name_of, piece_of))
        self.optimizer.state_dict = self.optimizer.load_state_dict = self._refuse_optimizer_state  # type: ignore[method-assign]
        return self.optimizer

    def _refuse_optimizer_state(self, *_):
        """This rank's pieces only: keyed like no optimizer of the user's model, wrong to resume."""
        refuse(
            f"optimizer.state_dict() / load_state_dict() under {self.name}: the optimizer pt.setup returned holds "
            f"this rank's shard of the state; save and resume it with pt.save / pt.load (at any world size)"
        )

    def trained_params(self) -> list[nn.Parameter]:
        return [p for u in self.units for p in u.params]

    def backward_starts(self) -> None:
        """A backward before any zero_grad adds to the gradients (accumulation)."""
        self.fresh_grads = self._grads_let_go()
        self._take_back_model_grads()
        if self.fresh_grads:
            self.reducer.zero_grad()
        self._before_backward(0 if self.fresh_grads else 1, last=True)

    def backward_ended(self) -> None:
        """Each parameter's .grad becomes this rank's piece of its gradient, whose norm is global
        (user_tensors.py): torch's own clip_grad_norm_(model.parameters(), c) clips the global norm."""
        self._after_backward(last=True)
        if self.fresh_grads:  # (stages 2 and 3 let the gradient shards go until backward made them again)
            self._bind_piece_grads()
        self._wait_gathers(self.units)  # parameters no forward used: their shard is about to change
        self._average_across_replicas([shard_grad(u) for u in self.units])
        self.user_grads.install(self._grad_pieces())

    def _grad_pieces(self):
        """(parameter as the user's model holds it, this rank's piece of its gradient: a view of the
        gradient shard, maybe empty)."""
        for u in self.units:
            own = {i: (start, end, at) for i, start, end, at in u.own_pieces()}
            for i, p in enumerate(u.params):
                start, end, at = own.get(i, (0, 0, 0))
                yield self._held(p), shard_grad(u)[at : at + end - start]

    def _held(self, p: nn.Parameter) -> torch.Tensor:
        """What the user's model holds for parameter `p` (stages 1 and 2: `p` itself)."""
        return p

    def _grads_let_go(self) -> bool:
        """Whether the user's zero_grad() set gradients to None: the optimizer's pieces', or the
        model's (optimizer or model.zero_grad(); stage 1 keeps them in its buckets)."""
        return self._pieces_let_go() or any(p.grad is None for u in self.units for p in u.params)

    def _take_back_model_grads(self) -> None:
        """Before a backward, the model's .grad (the user's view of the shards) go back to what
        the backward accumulates into: stage 1's bucket views."""
        assert isinstance(self.reducer, ShardReducer)
        for b in self.reducer.buckets:
            b.bound = None
            b.bind_grads()

    def _pieces_let_go(self) -> bool:
        """Whether the optimizer's zero_grad() let the pieces' gradients go; under mixed precision,
        where they exist only during the step, whether it was called since the last backward."""
        if self.mixed:
            called, self.zero_grad_called = self.zero_grad_called, False
            return called
        return any(piece.grad is None for piece in self.pieces)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        norm = self._grad_norm()
        self._scale_grads(clip_factor(norm, max_norm))
        self.user_grads.changed()  # the norms torch's tools asked of p.grad before are stale
        return norm

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self):
        """This rank's pieces of every parameter and its optimizer state, keyed by parameter name."""
        return sharded_state(
            self.all_units, self.optimizer, self.model, self.rank, self.world, self.stage, self.kept_experts
        )

    check_checkpoint = staticmethod(check_checkpoint)  # the CLI's preflight of --resume

    def load_state_dict(self, reader) -> None:
        load_sharded_state(reader, self.all_units, self.optimizer, self.model, self.device, self.kept_experts)
        self._after_load()

    def _after_load(self) -> None:
        if self.mixed:
            self._round_masters(self.all_units)  # (frozen ones too: loaded, unlike stepped)
        self._sync_full_from_shards()

    def _round_masters(self, units: list[FlatUnit] | None = None) -> None:
        """The masters of `units` (default: the trainable ones, which a step changed) into their working shards."""
        with torch.no_grad():
            for u in self.units if units is None else units:
                u.shard.copy_(u.master)

    # -- the user's model.state_dict() and load_state_dict() -----------------------------------------
    def _hook_state_dicts(self, model) -> None:
        """model.state_dict() gives the full tensors and load_state_dict() takes them, as of the
        plain model, on every rank: hooks on each module holding parameters of a unit (its own, or
        the unit's whole subtree under stage 3) make them whole before the module's tensors are
        read or written, and hand them back to the shards after (a unit at a time under stage 3).
        state_dict(keep_vars=True) gives what the modules hold, untouched and not gathered (what
        paratrain's own export and checkpoints read by identity; under stage 3 a ShardedParam
        outside a unit's gathers once the model is the user's)."""
        for module in model.modules():
            # (name in the module, unit, index in the unit) of its own parameters
            direct = [(n, *self.slot_of[id(p)]) for n, p in module._parameters.items() if id(p) in self.slot_of]
            units = list({id(u): u for _, u, _ in direct}.values())
            units += [u for u in self.all_units if u.module is module and u not in units]
            if not units:
                continue
            module.register_state_dict_pre_hook(
                lambda m, prefix, keep_vars, units=units: self._before_state_dict(m, units, keep_vars)
            )
            module.register_state_dict_post_hook(
                lambda m, state, prefix, meta: self._after_state_dict(m, state, prefix)
            )
            module.register_load_state_dict_pre_hook(
                lambda m, state, prefix, *_, units=units, direct=direct: self._before_load_state_dict(
                    m, units, state, prefix, direct
                )
            )
            module.register_load_state_dict_post_hook(lambda m, _: self._after_load_state_dict(m))

    def _before_state_dict(self, module, units, keep_vars: bool) -> None:
        """Stages 1 and 2: the parameters' all-gathers after a step may still be in flight."""
        self._wait_gathers(units)

    def _after_state_dict(self, module, state: dict, prefix: str) -> None:
        pass

    def _before_load_state_dict(self, module, units, state: dict, prefix: str, direct) -> None:
        """Stages 1 and 2 load into the working parameters, of which the shard is a view, once the
        all-gathers after a step are in (or they would overwrite what is loaded)."""
        self._wait_gathers(units)
        self._load_masters(state, prefix, direct)

    def _load_masters(self, state: dict, prefix: str, direct) -> None:
        """Mixed precision: this rank's pieces of the module's own parameters (`direct`: (name,
        unit, index) of each) into the masters as given (the working ones get them rounded)."""
        if self.mixed:
            for name, u, i in direct:
                value = state.get(prefix + name)
                if isinstance(value, torch.Tensor) and value.shape == u.shapes[i]:
                    u.copy_own(u.master, i, value.detach().reshape(-1).to(u.master))

    def _after_load_state_dict(self, module) -> None:
        pass

    # -- the consolidated model -------------------------------------------------------------------
    def model_layout(self):
        return self.kept_experts.layout(full_precision_layout(self.all_units, self.model))

    def model_chunks(self):
        first = self.rt.rank == 0
        return self.kept_experts.chunks(self.all_units, self.model, first, self._gather_full_precision, self._release)

    def _gather_full_precision(self, u: FlatUnit) -> torch.Tensor:
        """The unit's whole flat parameter in full precision: the working one, or the masters gathered."""
        self._wait_gathers([u])
        if u.master is u.shard:
            return u.full.detach()
        flat = torch.empty(u.numel, dtype=u.master.dtype, device=self.device)
        all_gather(flat, u.master, f"zero-export-unit-{u.index}", u.group).wait()
        return flat

    def _release(self, u: FlatUnit) -> None:
        """After the unit is handed over (stage 3 frees its gathered parameters)."""
