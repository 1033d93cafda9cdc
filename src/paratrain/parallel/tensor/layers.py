"""Tensor parallelism (Megatron-style): layers split inside, across the ranks of the tp group.

    column-parallel Linear  W = [W_0; W_1; ...] by output rows: each rank computes its slice of the
                            output; input through copy_to_tp (its gradient is all-reduced)
    row-parallel Linear     W = [W_0, W_1, ...] by input columns: each rank takes its slice of the
                            input, the partial products are all-reduced; bias added once, after
    row-parallel on a whole input  each rank takes its slice of the input first (its gradient
                            gathered back): after a gathered column split (transformers'
                            colwise_gather_output -> rowwise_split_input, Phi3's attention and MLP)
    vocab-parallel Embedding  each rank holds a contiguous range of the vocabulary; ids outside it
                            give zeros, and one all-reduce assembles the rows
    hidden-parallel Embedding each rank holds a slice of every row (transformers' embedding_colwise);
                            the rows are gathered whole
    vocab-parallel cross-entropy  on logits split by vocabulary (a column-parallel head): global max,
                            sum of exponentials and target logit by all-reduces of per-token scalars,
                            so the full logits are never gathered

A plan maps module names to "colwise" / "rowwise" (and, for the built-in gpt, "vocab"). A column
split followed by a row split (q/k/v then proj; fc then proj) needs one all-reduce each way. The
modules are replaced in place, under the same names, so the state dict keeps the user's keys; the
shards are slices of the same initial weights every rank built, so training starts where one
process would.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.comm import collectives
from paratrain.cost.activations import TensorSharding
from paratrain.errors import ConfigError
from paratrain.optim import IGNORE_INDEX, LABEL_TOKENS_PER_SAMPLE
from paratrain.parallel.tensor.comm import copy_to_tp, gather_from_tp, reduce_from_tp, shard_range, split_to_tp
from paratrain.parallel.tensor.experts import (
    HOOK_STYLES,
    PACKS,
    PARAM_STYLES,
    install_hooks,
    param_split,
    shard_parameter,
    shard_slice,
)
from paratrain.parallel.tensor.model_plans import check_heads, expand, in_paratrain_styles, transformers_plan


class ColumnParallelLinear(nn.Module):
    shard_dims = {"weight": 0, "bias": 0}

    def __init__(self, linear: nn.Linear, group, rank: int, world: int):
        super().__init__()
        self.group = group
        self.in_features, self.full_out_features = linear.in_features, linear.out_features
        start, end = shard_range(linear.out_features, world, rank)
        self.out_features = end - start  # local: attention derives its local head count from it
        self.weight = nn.Parameter(linear.weight.detach()[start:end].clone())
        self.bias = nn.Parameter(linear.bias.detach()[start:end].clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class PackedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel over a fused output [gate; up] (transformers' packed_colwise): each rank holds
    its slice of the gate rows and of the up rows, so the model's own chunk into gate and up pairs
    them right."""

    packed_attrs = ("weight", "bias")

    def __init__(self, linear: nn.Linear, group, rank: int, world: int):
        nn.Module.__init__(self)
        self.group = group
        self.in_features, self.full_out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(shard_slice(linear.weight.detach(), 0, world, rank, PACKS).clone())
        bias = linear.bias
        self.bias = (
            nn.Parameter(shard_slice(bias.detach(), 0, world, rank, PACKS).clone()) if bias is not None else None
        )
        self.out_features = self.weight.shape[0]


class GatheredColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel, its output gathered whole on every rank (transformers' colwise_gather_output:
    a head whose logits the model's own loss reads)."""

    def __init__(self, linear: nn.Linear, group, rank: int, world: int):
        super().__init__(linear, group, rank, world)
        self.place = (rank, world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_tp(super().forward(x), self.group, self.full_out_features, self.place)


class RowParallelLinear(nn.Module):
    shard_dims = {"weight": 1}

    def __init__(self, linear: nn.Linear, group, rank: int, world: int):
        super().__init__()
        self.group = group
        self.full_in_features, self.out_features = linear.in_features, linear.out_features
        start, end = shard_range(linear.in_features, world, rank)
        self.in_features = end - start
        self.weight = nn.Parameter(linear.weight.detach()[:, start:end].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class SplitInputRowParallelLinear(RowParallelLinear):
    """Row-parallel on an input that is whole on every rank (transformers' rowwise_split_input and
    rowwise_rep): each rank multiplies its slice of it."""

    def __init__(self, linear: nn.Linear, group, rank: int, world: int):
        super().__init__(linear, group, rank, world)
        self.place = (rank, world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(split_to_tp(x, self.group, self.place))


class VocabParallelEmbedding(nn.Module):
    shard_dims = {"weight": 0}

    def __init__(self, emb: nn.Embedding, group, rank: int, world: int):
        super().__init__()
        self.group = group
        self.num_embeddings = emb.num_embeddings
        self.start, self.end = shard_range(emb.num_embeddings, world, rank)
        self.weight = nn.Parameter(emb.weight.detach()[self.start : self.end].clone())
        # the padding row (no gradient) where this rank holds it: a family with pad_token_id (Phi3)
        pad = self.full_padding_idx = emb.padding_idx
        self.padding_idx = pad - self.start if pad is not None and self.start <= pad < self.end else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.end)
        local = (idx - self.start).masked_fill(outside, 0)
        # ids outside the shard read row 0, then masked to zero (so they pass it no gradient)
        rows = F.embedding(local, self.weight, self.padding_idx)
        return reduce_from_tp(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class HiddenParallelEmbedding(nn.Module):
    """Each rank holds a slice of every embedding row (transformers' embedding_colwise); the rows
    are gathered whole."""

    shard_dims = {"weight": 1}

    def __init__(self, emb: nn.Embedding, group, rank: int, world: int):
        super().__init__()
        self.group, self.place = group, (rank, world)
        self.num_embeddings, self.embedding_dim = emb.num_embeddings, emb.embedding_dim
        self.padding_idx = self.full_padding_idx = emb.padding_idx
        start, end = shard_range(emb.embedding_dim, world, rank)
        self.weight = nn.Parameter(emb.weight.detach()[:, start:end].clone())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(idx, self.weight, self.padding_idx)
        return gather_from_tp(rows, self.group, self.embedding_dim, self.place)


STYLES: dict[str, Any] = {  # style -> its module class (each with its shard_dims)
    "colwise": ColumnParallelLinear,
    "rowwise": RowParallelLinear,
    "colwise_gather_output": GatheredColumnParallelLinear,
    "rowwise_split_input": SplitInputRowParallelLinear,
    "packed_colwise": PackedColumnParallelLinear,
    "vocab": VocabParallelEmbedding,
    "embedding_colwise": HiddenParallelEmbedding,
}
EMBEDDINGS = ("vocab", "embedding_colwise")


def plan_for(model: nn.Module, user_plan: dict) -> dict[str, str]:
    """parallel.tp_plan (wildcards expanded), else the model's own `paratrain_tp_plan()` (module
    name -> style), else a transformers model's own plan (tensor/model_plans.py), else none."""
    if user_plan:
        return in_paratrain_styles(expand(user_plan, model, strict=True), "parallel.tp_plan")
    own = getattr(model, "paratrain_tp_plan", None)
    return dict(own()) if callable(own) else transformers_plan(model)


def check_plan(model: nn.Module, plan: dict, tp: int, user: bool, own_loss: bool = False) -> None:
    """Every planned module exists, is a Linear, and splits evenly, and the model's own loss
    (`own_loss`: train.loss = "model") sees whole logits (ConfigError otherwise)."""
    from paratrain.models.gpt import GPT

    key = "parallel.tp_plan"
    if tp > 1 and not plan:
        raise ConfigError(
            key,
            f"tp = {tp} needs a plan for the model ({type(model).__name__} carries none of its own): a table of module name -> "
            f'colwise | rowwise (e.g. {{ "0" = "colwise", "2" = "rowwise" }})',
        )
    modules = dict(model.named_modules(remove_duplicate=False))
    holders: dict[int, list[str]] = {}  # parameter -> the modules holding it (several: tied)
    for owner, module in modules.items():
        for t in module.parameters(recurse=False):
            holders.setdefault(id(t), []).append(owner)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, style in plan.items():
        if name not in modules and name in params or style in HOOK_STYLES:
            check_other_entry(model, name, style, params.get(name), tp, user)
            continue
        if style not in STYLES:  # a plan's own paratrain_tp_plan(); the others are mapped (model_plans.py)
            raise ConfigError(key, f"{name!r}: style must be one of {' | '.join(STYLES)}, got {style!r}")
        if name not in modules or name == "":
            raise ConfigError(key, f"{name!r} is not a module of the model")
        module = modules[name]
        want = nn.Embedding if style in EMBEDDINGS else nn.Linear
        if not isinstance(module, want):
            raise ConfigError(key, f"{name!r} is a {type(module).__name__}, not a {want.__name__}")
        if sum(m is module for m in modules.values()) > 1:
            raise ConfigError(
                key, f"{name!r} is one module used in several places, which tensor parallelism cannot split"
            )
        for attr, t in module.named_parameters(recurse=False):
            others = [o for o in holders[id(t)] if o != name]
            # Tied weights stay tied only if every holder shards them alike (the gpt's vocab-parallel
            # embedding and column-parallel head both split rows of one (vocab, d) matrix):
            # otherwise each would get its own tensor, one sharded (or sharded otherwise), one not.
            if others and any(o not in plan or _shard_dim(plan[o], attr) != _shard_dim(style, attr) for o in others):
                raise ConfigError(
                    key,
                    f"{name!r} shares its {attr} with {', '.join(map(repr, others))} (tied "
                    f"weights or one module used twice), which this plan would split apart",
                )
        # User plans split evenly; the built-in gpt's vocabulary may split unevenly (by one row).
        dim = {
            "colwise": "out_features",
            "colwise_gather_output": "out_features",
            "packed_colwise": "out_features",
        }.get(style, "in_features" if style.startswith("rowwise") else "embedding_dim")
        size = getattr(module, dim) if style != "vocab" else tp
        parts = tp * (PACKS if style == "packed_colwise" else 1)  # a fused gate and up: each split alike
        if (user or parts > tp) and size % parts:
            raise ConfigError("parallel.tp", f"{parts} does not divide {name}.{dim} = {size} ({style}, tp {tp})")
    if user and isinstance(model, nn.Sequential):
        check_pairs(model, plan)
    head = last_linear(model)
    if own_loss and plan.get(head) == "colwise":
        # the model computes its loss inside its forward, on the logits this rank holds: a slice
        raise ConfigError(
            key,
            f'{head!r} = "colwise" leaves the logits split across the tp ranks, and train.loss = '
            f'"model" computes the loss inside the model, on one slice of them: split it '
            f'"colwise_gather_output" (or leave it whole)',
        )
    if isinstance(model, GPT):
        blocks: Any = model.blocks  # torch's stub types a ModuleList's items as Module
        heads = blocks[0].attn.q.out_features // blocks[0].attn.head_dim if len(blocks) else 0
        if heads % tp:
            raise ConfigError("parallel.tp", f"tp {tp} does not divide the gpt's {heads} attention heads")
    elif plan:
        check_heads(model, tp)


def check_other_entry(model: nn.Module, name: str, style: str, param, tp: int, user: bool) -> None:
    """A plan entry on a parameter (an experts' stack, tensor/experts.py) or a style that adds
    communication around a module's own forward: it exists, and splits evenly."""
    key = "parallel.tp_plan"
    if param is not None:
        if style not in PARAM_STYLES:
            raise ConfigError(
                key, f"{name!r} is a parameter: its style must be one of {' | '.join(PARAM_STYLES)}, got {style!r}"
            )
        dim, packs = param_split(style, param.dim())
        if dim is not None and (user or packs > 1) and param.shape[dim] % (tp * packs):
            raise ConfigError(
                "parallel.tp",
                f"{tp * packs} does not divide {name}'s dimension {dim} = {param.shape[dim]} ({style}, tp {tp})",
            )
        return
    module = dict(model.named_modules()).get(name)
    if module is None or name == "":
        raise ConfigError(key, f"{name!r} is not a module of the model")
    if style == "mla_kv_a_proj" and not (isinstance(module, nn.Linear) and _rope_dim(model)):
        raise ConfigError(key, f'{name!r} = "mla_kv_a_proj" needs a Linear and the model\'s config.qk_rope_head_dim')


def _rope_dim(model: nn.Module) -> int | None:
    return getattr(getattr(model, "config", None), "qk_rope_head_dim", None)


def check_pairs(model: nn.Sequential, plan: dict) -> None:
    """In an nn.Sequential (forward order = module order) a colwise Linear's output is split
    across the tp ranks, and only a rowwise Linear can take it (parameter-free modules between them
    act on each rank's part alike); a rowwise Linear needs such a split input. The model's output
    may stay split (the loss is vocab-parallel). Before, a plan that broke this passed `plan` and
    failed in the workers with a shape error."""
    key, split_by = "parallel.tp_plan", None
    for name, module in model.named_modules():
        if list(module.children()) or not any(True for _ in module.parameters(recurse=False)):
            continue  # containers and parameter-free modules (activations, dropout)
        style = plan.get(name)
        if split_by is not None and style != "rowwise":
            raise ConfigError(
                key,
                f"{name!r} takes the split output of colwise {split_by!r}, so it must be "
                f"rowwise (a colwise -> rowwise pair), but it is {style or 'not planned'}",
            )
        if split_by is None and style == "rowwise":
            raise ConfigError(
                key,
                f"{name!r} is rowwise but its input is whole: a rowwise Linear must follow "
                f"a colwise one (a colwise -> rowwise pair)",
            )
        split_by = name if style == "colwise" else None


def _shard_dim(style: str, attr: str) -> int | None:
    return STYLES[style].shard_dims.get(attr) if style in STYLES else None


def apply_tensor_parallel(model: nn.Module, plan: dict, group) -> dict[str, int]:
    """Replace the planned modules by their parallel versions, in place.

    Returns {state-dict key: dimension it is split along} for every sharded tensor."""
    return shard_modules(model, plan, group, dist.get_rank(group), dist.get_world_size(group))


def shard_modules(model: nn.Module, plan: dict, group, rank: int, world: int) -> dict[str, int]:
    """apply_tensor_parallel for tp rank `rank` of `world` (the planner plays a rank without a group)."""
    modules = dict(model.named_modules())
    tied: dict[int, list[tuple[str, str]]] = {}  # parameter -> the planned (module, attribute) holding it
    for name in plan:
        for attr, t in modules[name].named_parameters(recurse=False) if name in modules else ():
            tied.setdefault(id(t), []).append((name, attr))
    shard_dims = {}
    for name, style in plan.items():
        parent_name, _, attr = name.rpartition(".")
        if name not in modules:  # a parameter: sliced in place, its module's forward unchanged
            split = shard_parameter(modules[parent_name], attr, style, rank, world)
            shard_dims.update({name: split[0]} if split else {})
            continue
        if style in HOOK_STYLES:  # the module's own forward, communication around it
            install_hooks(modules[name], style, group, (rank, world), _rope_dim(model))
            continue
        parallel = STYLES[style](modules[name], group, rank, world)
        setattr(modules[parent_name], attr, parallel)
        prefix = f"{name}." if name else ""
        shard_dims.update(
            {prefix + p: d for p, d in parallel.shard_dims.items() if getattr(parallel, p, None) is not None}
        )
    # Each holder of a tied parameter cut the same slice of it (check_plan): tie the slices again.
    modules = dict(model.named_modules())
    for (first, first_attr), *rest in tied.values():
        for name, attr in rest:
            setattr(modules[name], attr, getattr(modules[first], first_attr))
    return shard_dims


def last_linear(model: nn.Module) -> str | None:
    """The name of the model's last Linear in module order: the one whose output a colwise split
    leaves split across the tp ranks (output_is_sharded, after the split)."""
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, ColumnParallelLinear, RowParallelLinear))]
    return names[-1] if names else None


def output_is_sharded(model: nn.Module) -> bool:
    """A model whose last Linear is column-parallel returns its last dimension split across ranks."""
    name = last_linear(model)
    last = model.get_submodule(name) if name else None
    return isinstance(last, ColumnParallelLinear) and not isinstance(last, GatheredColumnParallelLinear)


def full_width(model: nn.Module) -> int:
    last = [m for m in model.modules() if isinstance(m, ColumnParallelLinear)][-1]
    return last.full_out_features


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The built-in cross_entropy's value from vocabulary slices: targets at -100 count for
    nothing, and the sum of the others' losses is divided by `per_call` (the global batch's label
    tokens per sample times the call's rows, optim.LABEL_TOKENS_PER_SAMPLE) where given, else by
    their number."""

    @staticmethod
    def forward(ctx, logits, target, group, start: int, per_call: torch.Tensor | None = None):
        logits = logits.float()
        end = start + logits.shape[-1]
        peak = logits.max(dim=-1).values
        collectives.all_reduce(peak, "tp-ce-max", group=group, op=dist.ReduceOp.MAX)
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        mine = (target >= start) & (target < end)
        local_target = (target - start).masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        both = torch.stack([exp.sum(dim=-1), target_logit])  # one all-reduce for both
        collectives.all_reduce(both, "tp-ce-sums", group=group)
        sum_exp, target_logit = both
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        counted = (target != IGNORE_INDEX).to(exp.dtype)
        divisor = counted.sum() if per_call is None else per_call.to(exp.dtype)
        ctx.save_for_backward(exp, mine, local_target, counted / divisor)
        return ((sum_exp.log() - target_logit) * counted).sum() / divisor

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, local_target, weight = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_target] -= mine.to(g.dtype)
        return g * (grad * weight).unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, full: int) -> torch.Tensor:
    """The built-in cross_entropy (optim.py), from this rank's vocabulary slice of the logits."""
    start, _ = shard_range(full, dist.get_world_size(group), dist.get_rank(group))
    per_sample = LABEL_TOKENS_PER_SAMPLE.get()
    per_call = None if per_sample is None else per_sample * target.shape[0]
    return _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), group, start, per_call
    )


def parallel_loss(loss_fn, group, full: int):
    """The loss on a sharded output: vocab-parallel for the built-in cross-entropy, else on the
    gathered output (a user loss sees exactly what the unsplit model would return)."""
    from paratrain.optim import cross_entropy, output_logits

    if loss_fn is cross_entropy:
        return lambda out, y: vocab_parallel_cross_entropy(output_logits(out), y, group, full)
    return lambda out, y: loss_fn(gather_from_tp(out, group, full), y)


def planned_shard_dims(model: nn.Module, plan: dict) -> dict[str, int]:
    """Parameter name -> the dimension `plan` splits it along (the planner's count of shards)."""
    params = dict(model.named_parameters())
    out = {}
    for name, style in plan.items():
        if name in params:
            dim, _ = param_split(style, params[name].dim())
            out.update({name: dim} if dim is not None else {})
        elif style in STYLES:
            out.update({f"{name}.{t}": d for t, d in STYLES[style].shard_dims.items()})
    return out


def planned_sharding(plan: dict, tp: int) -> TensorSharding:
    """How the planner plays tp rank 0 of `plan` (cost/activations.py): its shards, and the loss on
    a vocabulary-sharded output, the vocabulary-parallel cross-entropy (a user loss there gathers
    the output first: not modelled, None)."""
    from paratrain.optim import cross_entropy

    def loss(model: nn.Module, loss_fn):
        if not output_is_sharded(model):
            return loss_fn
        if loss_fn is not cross_entropy:
            return None
        return lambda logits, target: _VocabParallelCrossEntropy.apply(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), None, 0
        )

    return TensorSharding(shard=lambda model: shard_modules(model, plan, None, 0, tp), loss=loss)
