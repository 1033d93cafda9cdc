"""Tensor parallelism where the split tensors are no Linear or Embedding of their own: the styles of
mixture-of-experts layers, fused projections and multi-head latent attention in transformers' plans.

  a parameter's entry   `...experts.gate_up_proj` = "colwise" | "rowwise" | "packed_colwise" |
                        "packed_rowwise": the tensor (an experts' (E, out, in) stack, a 1-d bias)
                        becomes this rank's slice of its output dimension (colwise: the one before
                        last; a 1-d one's only) or of its input dimension (rowwise: the last; a 1-d
                        one whole); `packed_*`: a fused [gate; up] is split as gate and up each,
                        so each rank's slice is its gate rows then its up rows. The module's own
                        forward runs on the slices.
  packed_colwise        on a Linear: column-parallel over such a fused output (tensor/layers.py)
  moe_tp_experts        the experts module computes each rank's part of every expert: its input
                        and routing weights' gradients are all-reduced (copy_to_tp), its output summed
                        (reduce_from_tp)
  all_reduce, gather    the same for a module's one input and output (transformers' AllReduceParallel;
                        `gather`, older transformers' name, summed its outputs likewise)
  moe_identity_expert   an identity expert's input divided by the tp size: the experts' sum counts
                        it once (longcat_flash's zero experts)
  mla_kv_a_proj         the replicated kv_a projection of multi-head latent attention: the rotary
                        part of its output (the last qk_rope_head_dim) goes to this rank's heads
                        alone, so its gradient is all-reduced (copy_to_tp)

Expert parallelism's styles (grouped_gemm, ep_*: the experts themselves spread over ranks) are
parallel.ep's, not tensor parallelism's."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.parallel.tensor.comm import copy_to_tp, reduce_from_tp, shard_range

PARAM_STYLES = ("colwise", "rowwise", "packed_colwise", "packed_rowwise")
HOOK_STYLES = ("moe_tp_experts", "all_reduce", "moe_identity_expert", "mla_kv_a_proj")
EP_STYLES = ("grouped_gemm", "ep_dispatch_experts", "ep_router", "ep_experts")
PACKS = 2  # a fused [gate; up]


def param_split(style: str, ndim: int) -> tuple[int | None, int]:
    """(dimension split or None for whole, pieces packed along it) of a parameter planned `style`."""
    packs = PACKS if style.startswith("packed_") else 1
    if style.endswith("colwise"):
        return (ndim - 2 if ndim >= 2 else 0), packs
    return (ndim - 1 if ndim >= 2 else None), packs


def shard_slice(t: torch.Tensor, dim: int, world: int, rank: int, packs: int = 1) -> torch.Tensor:
    """Rank `rank`'s slice of `t` along `dim`: of each of `packs` equal pieces (a fused gate and
    up), its contiguous slice, concatenated."""
    parts = []
    for piece in t.chunk(packs, dim) if packs > 1 else [t]:
        start, end = shard_range(piece.shape[dim], world, rank)
        parts.append(piece.narrow(dim, start, end - start))
    return torch.cat(parts, dim) if packs > 1 else parts[0]


def join_shards(parts: list[torch.Tensor], dim: int, packs: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's shard_slice, in rank order."""
    if packs == 1:
        return torch.cat(parts, dim)
    pieces = [p.chunk(packs, dim) for p in parts]
    return torch.cat([torch.cat([p[i] for p in pieces], dim) for i in range(packs)], dim)


def shard_parameter(owner: nn.Module, attr: str, style: str, rank: int, world: int) -> tuple[int, int] | None:
    """Replace `owner.attr` by this rank's slice of it; (dimension, packs), or None if kept whole."""
    t = getattr(owner, attr)
    dim, packs = param_split(style, t.dim())
    if dim is None:
        return None
    full = t.shape[dim]
    setattr(owner, attr, nn.Parameter(shard_slice(t.detach(), dim, world, rank, packs).clone(), t.requires_grad))
    # what the plan check (tensor/verify.py) needs to gather it whole
    owner.__dict__.setdefault("tp_param_shards", {})[attr] = (dim, full, packs)
    return dim, packs


def install_hooks(module: nn.Module, style: str, group, place: tuple[int, int], rope_dim: int | None) -> None:
    """The communication `style` adds around the module's own forward (module docstring); off
    while `module.tp_hooks_off` (the plan check runs the module whole)."""
    module.tp_style, module.tp_hooks_off = style, False  # type: ignore[assignment]  # torch types a module's attribute as a tensor or module
    if style == "moe_identity_expert":
        module.register_forward_pre_hook(lambda m, args: None if m.tp_hooks_off else (args[0] / place[1], *args[1:]))
        return
    if style == "mla_kv_a_proj":

        def rotary_grads_summed(m, args, out):
            if m.tp_hooks_off:
                return None
            kept, rotary = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
            return torch.cat([kept, copy_to_tp(rotary, group)], dim=-1)

        module.register_forward_hook(rotary_grads_summed)
        return
    # moe_tp_experts also sums the routing weights' gradient (its third input, or top_k_weights=)
    summed = (0, 2) if style == "moe_tp_experts" else (0,)

    def inputs_copied(m, args, kwargs):
        if m.tp_hooks_off:
            return None
        args = tuple(copy_to_tp(a, group) if i in summed and torch.is_tensor(a) else a for i, a in enumerate(args))
        if style == "moe_tp_experts" and torch.is_tensor(kwargs.get("top_k_weights")):
            kwargs = {**kwargs, "top_k_weights": copy_to_tp(kwargs["top_k_weights"], group)}
        return args, kwargs

    def output_summed(m, args, out):
        if m.tp_hooks_off or out is None:
            return None
        if isinstance(out, tuple):
            return (reduce_from_tp(out[0], group), *out[1:])
        return reduce_from_tp(out, group)

    module.register_forward_pre_hook(inputs_copied, with_kwargs=True)
    module.register_forward_hook(output_summed)


def packed_shards(model: nn.Module) -> dict[str, int]:
    """State-dict key -> pieces packed in its split dimension, for each tensor split as a fused
    gate and up (`packed_*`): joined and cut by join_shards / shard_slice, not as one run."""
    out = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for attr, (_, _, packs) in module.__dict__.get("tp_param_shards", {}).items():
            if packs > 1:
                out[prefix + attr] = packs
        for attr in getattr(module, "packed_attrs", ()):
            out[prefix + attr] = PACKS
    return out
