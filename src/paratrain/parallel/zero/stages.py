"""ZeRO's three stages (engine.py has what they share and the whole story): stage 1 shards the
optimizer state, stage 2 the gradients besides (reduce-scattered bucket by bucket in backward),
stage 3 the parameters too (gathered unit by unit around each module's forward and backward)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from paratrain.comm.lockstep import LOAD_STATE_DICT, STATE_DICT, LockstepCheck
from paratrain.parallel.zero.comm import FlatUnit, StreamingShardReducer, wire_dtype
from paratrain.parallel.zero.engine import Zero
from paratrain.parallel.zero.gather import ParameterGatherer, module_units
from paratrain.parallel.zero.user_tensors import ShardedParam


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
        assert isinstance(self.reducer, StreamingShardReducer)
        self.reducer.prepare(accumulate=micro > 0)

    def _after_backward(self, last: bool) -> None:
        self.reducer.finish()

    def _grads_let_go(self) -> bool:
        """The model's gradients are freed as reduced: they are None, or the user's view of the
        shards (None again after the user's model.zero_grad())."""
        held = (self._held(p) for u in self.units for p in u.params)
        return self._pieces_let_go() or (self.user_grads.installed and any(p.grad is None for p in held))

    def _take_back_model_grads(self) -> None:
        """Backward puts each gradient into .grad for the reducer to take: it must find None there."""
        for u in self.units:
            for p in u.params:
                p.grad = self._held(p).grad = None


class Zero3(Zero2):
    name = "zero3"
    stage = 3
    gatherer: ParameterGatherer  # made by _setup_communication
    collective_forward = True  # each unit's parameters are gathered from every rank
    # At world 1 the full parameter is the shard itself (_allocate). A subclass may say False to run
    # the gathers' path alone in one process (the gatherer's memory budget is tested so).
    shard_is_full_alone = True

    def _make_units(self, model, named) -> list[FlatUnit]:
        """One unit per module (see `module_units`), indexed in reverse forward order like buckets;
        then the frozen parameters' (frozen_units)."""
        max_bytes = int(self.cfg.parallel.bucket_mb * 2**20)

        def modules(params, world: int):  # (the kept experts' apart: experts.py)
            return list(reversed(module_units(model, params, max_bytes)))

        units = self.kept_experts.units(named, self.world, modules, self._unit)
        self.frozen_units = self._make_frozen_units(model, max_bytes, first_index=len(units))
        return units

    def _make_frozen_units(self, model, max_bytes: int, first_index: int) -> list[FlatUnit]:
        """Frozen parameters (a LoRA model's base weights) are sharded like the trainable ones, so
        no rank holds the whole model: units of their own, one per module, gathered around its
        forward and backward, but apart from the gradients' reducer and the optimizer."""
        params = [p for p in model.parameters() if not p.requires_grad]  # (each once)
        units = []
        for index, (module, unit_params) in enumerate(reversed(module_units(model, params, max_bytes)), first_index):
            u = self._unit(index, module, unit_params, expert=False)
            u.trains = False
            units.append(u)
        return units

    def _allocate(self, model) -> None:
        """The full flat parameter of a unit has storage only while gathered; the shard is its own,
        and so is its full-precision master under mixed precision (else the shard itself). At world
        1 the shard is the whole parameter: the full one is the shard itself, gathered for good (no
        copy, no allocation)."""
        for u in self.all_units:
            u.shard = nn.Parameter(torch.zeros(u.shard_numel, dtype=u.dtype, device=self.device))
            if self._alone():
                u.full = u.shard.detach()
            else:
                u.full = torch.empty(u.numel, dtype=u.dtype, device=self.device)
                u.full.untyped_storage().resize_(0)
            full_precision = u.params[0].dtype
            u.master = torch.zeros(u.shard_numel, dtype=full_precision, device=self.device) if self.mixed else u.shard

    def _alone(self) -> bool:
        return self.world == 1 and self.shard_is_full_alone

    def _take_values(self, unit: FlatUnit, i: int, value: torch.Tensor) -> None:
        flat = value.detach().reshape(-1)
        unit.copy_own(unit.shard, i, flat)
        if unit.master is not unit.shard:
            unit.copy_own(unit.master, i, flat)

    def _sync_full_from_shards(self) -> None:
        pass  # parameters are gathered on demand

    def _param_views(self, u: FlatUnit) -> list[torch.Tensor]:
        """Views need storage to exist while they are made; it is freed again right after."""
        if self._alone():  # the shard's own storage
            return u.views(u.full)
        u.full.untyped_storage().resize_(u.full_nbytes())
        views = u.views(u.full)
        u.full.untyped_storage().resize_(0)
        return views

    def _setup_communication(self, model) -> None:
        after_backward = lambda u: self.gatherer.after_backward(u)  # noqa: E731 (the gatherer comes next)
        kwargs: dict[str, Any] = dict(on_launch=after_backward, wire_dtype=wire_dtype(self.cfg), in_place=True)
        self.reducer = StreamingShardReducer(self.units, self.group, in_order=False, **kwargs)
        # not self.lockstep: Strategy's (whether every rank steps together), which this shadowed
        self.lockstep_check = LockstepCheck(self.name, self.cfg.parallel.timeout_s)
        self.gatherer = ParameterGatherer(
            self.all_units, model, self.reducer, self.lockstep_check, always_gathered=self._alone()
        )
        # the model's state_dict call under way, and its gathers; the ShardedParams, once the model is the user's
        self.state_call, self.gathered_for = None, dict[nn.Module, list[FlatUnit]]()
        self.sharded, self.params_pinned = dict[int, ShardedParam](), False
        for u in self.units:
            u.shard.grad = u.grad_shard

    def _after_backward(self, last: bool) -> None:
        self.reducer.finish()
        self.gatherer.reshard_all()

    def train_step(self, batch) -> torch.Tensor:
        with self.lockstep_check.trusted():
            return super().train_step(batch)

    def _after_step(self) -> None:
        """Nothing to gather (the next forward gathers); under mixed precision the stepped masters
        rounded into the working shards, their gradients let go."""
        if self.mixed:
            for piece in self.pieces:
                piece.grad = None
            self._round_masters()

    def _overlap_gathers_with_forward(self, model) -> None:
        pass  # the ParameterGatherer's hooks gather on demand

    # -- what the user's model holds: ShardedParams outside a unit's gathers (user_tensors.py) ----------
    def adopt_optimizer(self, optimizer):
        """Also: the model is the user's from now on, so its modules hold a ShardedParam for each
        parameter whose unit is not gathered (a read of the parameter itself there would be a
        SIGSEGV: its storage is freed)."""
        optimizer = super().adopt_optimizer(optimizer)
        if self.gatherer.always_gathered:  # never freed: the modules hold the parameters for good
            return optimizer
        # the (module, name) of each parameter, several for a tied one
        self.places: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in self.model.modules():
            for name, p in module._parameters.items():
                if p is not None and id(p) in self.slot_of:
                    self.places.setdefault(id(p), []).append((module, name))
        self.sharded = {id(p): ShardedParam(p, n, self.name) for u in self.all_units for p, n in zip(u.params, u.names)}
        self.gatherer.on_gathered, self.gatherer.on_freed = self._put_params, self._put_sharded
        for u in self.all_units:
            if u.state == "free":
                self._put_sharded(u)
        return optimizer

    def _held(self, p: nn.Parameter) -> torch.Tensor:
        """The ShardedParam standing for `p` in the user's model (`p` before the model is the user's)."""
        return self.sharded.get(id(p), p)

    def _put_params(self, u: FlatUnit) -> None:
        for p in u.params:
            for module, name in self.places[id(p)]:
                module._parameters[name] = p

    def _put_sharded(self, u: FlatUnit) -> None:
        if not self.params_pinned:
            for p in u.params:
                for module, name in self.places[id(p)]:
                    # torch's stub wants a Parameter there: a ShardedParam passes for one (_is_param)
                    module._parameters[name] = self.sharded[id(p)]  # type: ignore[assignment]

    @contextlib.contextmanager
    def _parameters_in_place(self):
        """paratrain's own reading of the model (the export's names and layout, by identity): the
        parameters themselves in the modules, whatever is gathered (their values are not read)."""
        if not self.sharded:
            yield
            return
        self.params_pinned = True
        try:
            for u in self.all_units:
                self._put_params(u)
            yield
        finally:
            self.params_pinned = False
            for u in self.all_units:
                if u.state == "free":
                    self._put_sharded(u)

    def model_layout(self):
        with self._parameters_in_place():
            return super().model_layout()

    def state_dict(self):
        """(the frozen units' parameters found by identity: what ZeRO does not shard is the rest)"""
        with self._parameters_in_place():
            return super().state_dict()

    def load_state_dict(self, reader) -> None:
        with self._parameters_in_place():
            super().load_state_dict(reader)

    def model_chunks(self):
        with self._parameters_in_place():
            yield from super().model_chunks()

    def _gather_full_precision(self, u: FlatUnit) -> torch.Tensor:
        if u.master is not u.shard:  # mixed precision: the masters, not the bf16 working copy
            return super()._gather_full_precision(u)
        self.gatherer.unshard(u)
        return u.full.detach()

    # A state_dict or load_state_dict of the model gathers its units, so every rank must run it:
    # checked once per call, at the outermost module's hook (lockstep.py), before any gather.
    def _before_state_dict(self, module, units, keep_vars: bool) -> None:
        if not keep_vars:
            self._enter_state_call(module, STATE_DICT)
            self._gather_for(module, units)

    def _after_state_dict(self, module, state: dict, prefix: str) -> None:
        """What the module's units gave the state dict becomes copies of its own (their gathered
        storage is freed next: the tensors the user holds must not point at it); under mixed
        precision copies of the full-precision masters, gathered, as FSDP2's state_dict gives its
        float32 parameters, not the bf16 working copy."""
        for u in self.gathered_for.pop(module, []):
            storage = u.full.untyped_storage().data_ptr()
            masters = super()._gather_full_precision(u) if u.master is not u.shard else None
            for k, v in state.items():
                if k.startswith(prefix) and isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == storage:
                    if masters is None:
                        state[k] = v.clone()
                    else:  # the same elements of the masters' flat parameter
                        at = (v.data_ptr() - u.full.data_ptr()) // v.element_size()
                        state[k] = masters[at : at + v.numel()].view(v.shape).clone()
            self.gatherer.reshard(u)
        self._leave_state_call(module)

    def _before_load_state_dict(self, module, units, state: dict, prefix: str, direct) -> None:
        """Gathered, to be loaded into; under mixed precision this rank's pieces of the given
        values go to the masters as given (the shards get them rounded, _after_load_state_dict)."""
        self._enter_state_call(module, LOAD_STATE_DICT)
        self._gather_for(module, units)
        self._load_masters(state, prefix, direct)

    def _after_load_state_dict(self, module) -> None:
        """The loaded full parameters of the module's units into this rank's shards."""
        with torch.no_grad():
            for u in self.gathered_for.pop(module, []):
                u.shard.copy_(u.full[u.lo : u.hi])
                self.gatherer.reshard(u)
        self._leave_state_call(module)

    def calls_check(self):
        return self.lockstep_check

    def _enter_state_call(self, module, kind: int) -> None:
        if self.state_call is None:
            self.state_call = module
            self.lockstep_check.check(kind)

    def _leave_state_call(self, module) -> None:
        if self.state_call is module:
            self.state_call = None

    def _gather_for(self, module, units) -> None:
        """Gather the module's units not gathered yet (an enclosing module's call may hold them)."""
        free = [u for u in units if u.state == "free" or self.gatherer.always_gathered]
        for u in free:
            self.gatherer.unshard(u)
        self.gathered_for[module] = free

    def _release(self, u: FlatUnit) -> None:
        self.gatherer.reshard(u)
