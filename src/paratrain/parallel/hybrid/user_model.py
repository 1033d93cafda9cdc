"""What the user's own loop finds in a tp, pp or hybrid model after pt.setup (the Python API): the
unsplit model's state dict on every rank, pretrained weights loaded into the shards, and model calls
that every rank runs together or that stop in one line.

Under tp a planned layer holds this rank's slice of each weight; under pp a rank holds only its
stage's layers (the others' are on the meta device, with no values). So, once the model is the
user's (adopt_optimizer):

    model.state_dict()          every tensor whole and current, keyed and shaped as the unsplit
                                model's, on every rank: a split tensor gathered over the tp group, a
                                stage's tensor broadcast from the stage that holds it, a tensor at a
                                time (a collective: every rank calls it; checked first, lockstep.py)
    model.load_state_dict(full) each rank takes its slice of the whole tensors it is given (the
                                other stages' entries are let go): no collective
    model.parameters()          under tp (pp = 1), a split parameter is a SplitParam of the unsplit
                                name, shape and dtype outside a forward, and its .grad after
                                pt.backward answers norms for the whole parameter (split_params.py):
                                torch's clip_grad_norm_ clips the global norm
    model(x)                    under tp, checked like the state dict (a split layer all-reduces
                                with the other tp ranks); under pp refused in one line: a rank holds
                                one stage, and pt.train_step / pt.eval_step run the schedule across them

The strategy's own checkpoints and export read the shards as they are (`shards()`).
"""

from __future__ import annotations

import contextlib

import torch

from paratrain.comm import collectives
from paratrain.comm.lockstep import FORWARD, FORWARD_NO_GRAD, STATE_DICT, LockstepCheck
from paratrain.parallel.base import refuse, said_by_one
from paratrain.parallel.hybrid.parallelize import stage_of_keys
from paratrain.parallel.hybrid.split_params import SplitParams
from paratrain.parallel.tensor.comm import all_gather_dim, shard_range


class UserModel:
    """Installs the hooks above on `mp.model` (mp: the ModelParallel strategy of this rank)."""

    def __init__(self, mp):
        self.mp, self.reading_shards = mp, False
        self.split: SplitParams | None = None  # under tp with pp = 1, once the optimizer is adopted
        self.keep_vars = False  # of the model.state_dict() call under way
        self.name, mesh = mp.cfg.parallel.strategy, mp.mesh
        why = "a split layer all-reduces with the other tp ranks" if mesh.pp == 1 else "its stages are on other ranks"
        self.lockstep = LockstepCheck(self.name, mp.cfg.parallel.timeout_s, why)
        self.whole = mp.full_meta.state_dict()  # meta tensors: every key's unsplit shape and dtype
        self.stage_of_key = stage_of_keys(mp.full_meta, mp.cfg, mp.bounds)
        model = mp.model
        model.register_forward_pre_hook(self._before_forward)
        # torch marks the hooks it is given (an attribute): so functions, not bound methods
        model.register_state_dict_pre_hook(lambda *args: self._before_state_dict(*args))
        model.register_state_dict_post_hook(lambda *args: self._whole_tensors(*args))
        model.register_load_state_dict_pre_hook(lambda *args: self._this_ranks_slices(*args))
        model.register_load_state_dict_post_hook(lambda *_: self._leave_split())

    @contextlib.contextmanager
    def shards(self):
        """The strategy's own reads (checkpoints, the export): the tensors as this rank holds them."""
        self.reading_shards = True
        with self._real_slices():
            try:
                yield
            finally:
                self.reading_shards = False

    def _real_slices(self):
        """The real slices in the model's modules in place of the SplitParams (split_params.py)."""
        return self.split.real() if self.split is not None else contextlib.nullcontext()

    def _leave_split(self) -> None:
        if self.split is not None:
            self.split.leave()

    # -- model(x) ---------------------------------------------------------------------------------
    def _before_forward(self, module, args) -> None:
        if self.reading_shards:
            return
        self.lockstep.check(FORWARD if torch.is_grad_enabled() else FORWARD_NO_GRAD)
        pp = self.mp.mesh.pp
        if pp > 1:
            refuse(
                f"model(...) under {self.name} with pp = {pp}: each rank holds one pipeline stage's layers, so "
                f"the model cannot run whole on one rank; train with pt.train_step(batch) and evaluate with "
                f"pt.eval_step(batch) on every rank, which run the schedule across the stages",
                said_by_one(),
            )

    # -- model.state_dict() -----------------------------------------------------------------------
    def _before_state_dict(self, module, prefix, keep_vars) -> None:
        """Under tp with pp = 1, state_dict(keep_vars=True) gives the parameters as the model holds
        them (each split one's SplitParam): no collective."""
        self.keep_vars = keep_vars and self.split is not None
        if self.reading_shards or self.keep_vars:
            return
        self.lockstep.check(STATE_DICT)
        if self.split is not None:
            self.split.enter()

    def _whole_tensors(self, module, state_dict, prefix, local_metadata) -> None:
        if self.reading_shards or self.keep_vars:
            return
        try:
            self._gather_whole(state_dict, prefix)
        finally:
            self._leave_split()

    def _gather_whole(self, state_dict, prefix) -> None:
        for key in list(state_dict):
            name = key[len(prefix) :]
            if name in self.whole:
                state_dict[key] = self._whole(name, state_dict[key])

    def _whole(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Collective: tensor `name` whole, on every rank (the same order of names on each)."""
        mp, mesh = self.mp, self.mp.mesh
        meta = self.whole[name]
        stage = self.stage_of_key[name] % mesh.pp
        if mesh.pp_rank == stage:
            whole = local.detach()
            if name in mp.shard_dims:
                dim = mp.shard_dims[name]
                whole = all_gather_dim(whole, dim, meta.shape[dim], mesh.tp_group)
        else:
            whole = torch.empty(meta.shape, dtype=meta.dtype, device=mp.rt.device)
        if mesh.pp > 1:
            whole = whole.contiguous()
            collectives.broadcast(whole, mesh.stage_rank(stage), "state-dict", group=mesh.pp_group)
        return whole

    # -- model.load_state_dict(full) --------------------------------------------------------------
    def _this_ranks_slices(self, module, state_dict, prefix, *_) -> None:
        """torch loads the slices into the real Parameters (the SplitParams are back after its
        post-hook, _leave_split)."""
        if self.split is not None:
            self.split.enter()
        if self.reading_shards:
            return
        mp, mesh = self.mp, self.mp.mesh
        with self.shards():
            held = module.state_dict(keep_vars=True)
        for name, meta in self.whole.items():
            key = prefix + name
            given = state_dict.get(key)
            if given is None or name not in held or given.shape != meta.shape:
                continue  # torch names what is missing or of another shape
            if held[name].is_meta:  # another stage's: nothing to load here
                state_dict[key] = torch.empty_like(held[name], device="meta")
            elif name in mp.shard_dims:
                dim = mp.shard_dims[name]
                start, end = shard_range(meta.shape[dim], mesh.tp, mesh.tp_rank)
                state_dict[key] = given.narrow(dim, start, end - start)
