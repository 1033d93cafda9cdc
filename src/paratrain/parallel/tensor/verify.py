"""`parallel.verify_plan`: a tensor-parallel plan verified on the first step, not trusted.

A plan can be wrong in ways no check of names and shapes sees: a fused `gate_up_proj` split colwise
gives each rank half of the gate rows and half of the up rows, which the model then chunks into a
"gate" and an "up" of the right shapes and the wrong values; training goes on, silently wrong. So
the first step runs each distinct sharded block once against the same block whole:

    block       a module holding column- and row-split modules as its direct children (an
                attention, an MLP: the split runs between them), or a planned module that takes and
                gives whole tensors (a gathered column split, a row split of a whole input, an
                embedding);
                one of each kind (its class and its children's plan entries), the first this rank
                holds (a pipeline stage holds some layers only)
    sharded     the block's input and output in the step's own forward (a forward hook, first call)
    whole       the same block with each planned child replaced by the whole module (its shards
                gathered over the tp group, one block at a time), on the same input, no gradient
    verdict     relative error of the outputs above the equivalence tolerance: exit 2 naming the
                block and its plan entries, on every rank (one agreed line)
    crash       a sharded forward that raises (a fused q, k, v split colwise, then cut in three by
                the model: "not enough values to unpack") is the mismatch found early: its tp ranks
                run the block whole on the same input at once, and where that runs, exit 2 naming
                the block and its entries, not the model's traceback (where the whole block fails
                too, the model's own error goes on)

Its cost: one block's forward per kind, and one all-gather of that block's weights, once."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm import collectives
from paratrain.data.batch import tensors_in, tree_map
from paratrain.errors import ConfigError
from paratrain.parallel.base import refuse
from paratrain.parallel.tensor.comm import gather_shards, shard_range
from paratrain.parallel.tensor.experts import PACKS
from paratrain.parallel.tensor.layers import HiddenParallelEmbedding, VocabParallelEmbedding
from paratrain.parallel.verify.verdict import agreed_line, how_far, relative_error, tolerance

# styles whose module takes and gives whole tensors: a block of its own (an experts module's with
# the parameters planned under it)
WHOLE_IN_AND_OUT = (
    "colwise_gather_output",
    "rowwise_split_input",
    "vocab",
    "embedding_colwise",
    "moe_tp_experts",
    "all_reduce",
)


def _held(module: nn.Module) -> bool:
    return not any(t.is_meta for t in module.parameters())


def blocks_of(model: nn.Module, plan: dict[str, str]) -> dict[str, list[str]]:
    """Block name -> its planned children, one block of each kind that this rank holds."""
    modules = dict(model.named_modules())
    children: dict[str, list[str]] = {}
    for name, style in plan.items():
        parent = name.rpartition(".")[0]
        if style in WHOLE_IN_AND_OUT:
            children.setdefault(name, []).append(name)
        elif parent:  # a split output or input: the block is where the pair meets
            children.setdefault(parent, []).append(name)
    kinds: dict[tuple, str] = {}
    for block, planned in children.items():
        # the layers' o_proj are one kind, the head (of the same class and style) another
        kind = (
            type(modules[block]).__name__,
            block.rpartition(".")[2],
            tuple((n[len(block) :], plan[n]) for n in planned),
        )
        if kind not in kinds and _held(modules[block]):
            kinds[kind] = block
    return {block: children[block] for block in kinds.values()}


def _clone(obj):
    return tree_map(lambda t: t.detach().clone(), obj)


def _without_caches(kwargs: dict) -> dict:
    """The block's keyword arguments less a key/value cache (transformers' `past_key_values`), which
    the first forward appended this step's keys to: the whole block computes them afresh, as the
    first forward did on its empty cache."""
    return {k: None if type(v).__name__.endswith("Cache") else v for k, v in kwargs.items()}


class PlanVerifier:
    """Captures each block's first forward, then `check()`s it against the whole block once."""

    def __init__(
        self, model: nn.Module, plan: dict[str, str], group, precision: str, device: torch.device, speaks: bool
    ):
        """`speaks`: this rank says the line of a block whose sharded forward crashes (one rank of
        the stage's tp ranks, which all crash alike)."""
        self.model, self.plan, self.group, self.precision, self.device = model, plan, group, precision, device
        self.speaks = speaks
        self.running_whole = False  # the hooks let the whole block's own forward pass
        self.blocks = blocks_of(model, plan)
        self.seen: dict[str, tuple] = {}
        # always_call: torch runs the hook after a forward that raised too (output None)
        self.handles = {
            b: model.get_submodule(b).register_forward_hook(
                functools.partial(self._capture, b), with_kwargs=True, always_call=True
            )
            for b in self.blocks
        }

    def _capture(self, block: str, module, args, kwargs, output) -> None:
        if self.running_whole:
            return
        crashed = sys.exc_info()[1]  # the exception torch is handling: the block's forward raised it
        if output is None and crashed is not None:
            self._refuse_if_whole_runs(block, args, kwargs, crashed)
        elif block not in self.seen:  # the first microbatch's; recomputation runs the forward again
            self.seen[block] = (_clone(args), _clone(_without_caches(kwargs)), _clone(output))
            self.handles.pop(block).remove()

    def _refuse_if_whole_runs(self, block: str, args, kwargs, crashed: BaseException) -> None:
        """Exit 2 naming `block` where its sharded forward raised `crashed` and the block whole
        runs on the same input (collective over the tp group, whose ranks all crashed); else return,
        and torch raises the model's own error. SystemExit, not an Exception: torch silences an
        always_call hook's exceptions."""
        try:
            with torch.no_grad():
                self._whole_output(block, _clone(args), _clone(_without_caches(kwargs)), contextlib.nullcontext)
        except Exception:  # the model fails whole as well: its own error, not the plan's
            return
        entries = self._entries(block)
        refuse(
            f"parallel.tp_plan: the plan breaks {block!r}: its forward on this rank's shards fails "
            f"({type(crashed).__name__}: {str(crashed).splitlines()[0][:160]}) where the block whole runs: check "
            f"its entries {entries} (a fused projection split colwise then cut, say); parallel.verify_plan = false "
            f"skips this check",
            self.speaks,
        )

    def _whole(self, name: str) -> nn.Module:
        """The planned module `name` whole, its shards gathered over the tp group."""
        part = self.model.get_submodule(name)
        dims = cast(Any, type(part)).shard_dims  # a tensor layer's (tensor/layers.py STYLES)
        full: dict[str, torch.Tensor] = {}
        for attr, t in part.named_parameters(recurse=False):
            if attr in dims:
                size, packs = _full_size(part, dims[attr]), PACKS if attr in getattr(part, "packed_attrs", ()) else 1
                full[attr] = gather_shards(t.detach().contiguous(), dims[attr], size, self.group, packs)
            else:
                full[attr] = t.detach()
        if isinstance(part, (VocabParallelEmbedding, HiddenParallelEmbedding)):
            rows, dim = full["weight"].shape
            whole: nn.Module = nn.Embedding(rows, dim, padding_idx=part.full_padding_idx, device="meta")
        else:
            out_f, in_f = full["weight"].shape
            whole = nn.Linear(in_f, out_f, bias="bias" in full and full["bias"] is not None, device="meta")
        for attr, gathered in full.items():
            setattr(whole, attr, nn.Parameter(gathered, requires_grad=False))
        return whole

    def _whole_parameter(self, name: str) -> nn.Parameter:
        """The planned parameter `name` whole (tensor/experts.shard_parameter's slices gathered)."""
        owner_name, _, attr = name.rpartition(".")
        owner = self.model.get_submodule(owner_name)
        shards = cast(dict, owner.tp_param_shards)  # set by tensor/experts.py (torch types it a tensor)
        dim, size, packs = shards[attr]
        full = gather_shards(getattr(owner, attr).detach().contiguous(), dim, size, self.group, packs)
        return nn.Parameter(full, requires_grad=False)

    @torch.no_grad()
    def _error(self, block: str, autocast) -> float:
        """Relative error of the block's sharded output against the whole block's."""
        args, kwargs, sharded = self.seen[block]
        out = self._whole_output(block, args, kwargs, autocast)
        a, b = tensors_in(sharded)[0].float(), tensors_in(out)[0].float()
        if a.shape[:-1] == b.shape[:-1] and a.shape[-1] < b.shape[-1]:
            # an output left split by a column split (a head read by the vocabulary-parallel loss):
            # this rank's slice of the whole one
            start, end = shard_range(b.shape[-1], dist.get_world_size(self.group), dist.get_rank(self.group))
            b = b[..., start:end]
        return relative_error(a, b)

    def _whole_output(self, block: str, args, kwargs, autocast):
        """Collective over the tp group: the block's output on `args`, `kwargs` with each planned
        child whole (the planned modules put back after)."""
        module, modules = self.model.get_submodule(block), dict(self.model.named_modules())
        planned = self.blocks[block]
        hooked = [modules[n] for n in planned if hasattr(modules.get(n), "tp_style")]  # tensor/experts.py
        params = [n for n in planned if n not in modules]  # an experts' stacks: sliced in place
        swapped = [(n, modules[n]) for n in planned if n in modules and modules[n] not in hooked]
        wholes = [self._whole(n) for n, _ in swapped]  # every tp rank gathers, in one order
        sliced = [(n, self.model.get_parameter(n)) for n in params]
        full = [self._whole_parameter(n) for n in params]
        self.running_whole = True
        try:
            for (name, _), whole in zip(swapped, wholes):
                _replace(self.model, block, name, whole)
            for (name, _), whole_param in zip(sliced, full):
                _replace(self.model, block, name, whole_param)
            for m in hooked:
                m.tp_hooks_off = True
            with autocast():
                out = module(*args, **kwargs)
        finally:
            self.running_whole = False
            for m in hooked:
                m.tp_hooks_off = False
            for name, part in [*swapped, *sliced]:
                _replace(self.model, block, name, part)
        return out

    def check(self, autocast) -> None:
        """Collective (every rank, once, after the first step's forward). ConfigError on a mismatch,
        the same line on every rank."""
        for handle in self.handles.values():
            handle.remove()
        limit, worst = tolerance(self.precision), None
        with collectives.unprofiled():  # the check's gathers are once, not the step's traffic
            for block in self.blocks:
                if block in self.seen:
                    err = self._error(block, autocast)
                    if not err <= limit and worst is None:
                        worst = (block, err)
            line = agreed_line("" if worst is None else self._line(*worst, limit), self.device)
        self.seen.clear()
        if line:
            raise ConfigError("parallel.tp_plan", line)

    def _entries(self, block: str) -> str:
        return ", ".join(f'"{n}" = "{self.plan[n]}"' for n in self.blocks[block])

    def _line(self, block: str, err: float, limit: float) -> str:
        entries = self._entries(block)
        return (
            f"the plan does not compute {block!r} as the whole model does ({how_far(err)} on the first step, "
            f"tolerance {limit:g}): check its entries {entries} (a fused projection split colwise "
            f"then chunked, say); parallel.verify_plan = false skips this check"
        )


def _full_size(part: nn.Module, dim: int) -> int:
    names = {0: ("full_out_features", "num_embeddings"), 1: ("full_in_features", "embedding_dim")}[dim]
    return next(getattr(part, n) for n in names if hasattr(part, n))


def _replace(model: nn.Module, block: str, name: str, module: nn.Module | nn.Parameter) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)
