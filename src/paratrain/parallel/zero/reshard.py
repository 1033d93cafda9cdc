"""ZeRO checkpoints, resharded across world sizes.

Every rank writes the pieces of parameters and optimizer state it owns, keyed by parameter name with
their [start, end) offsets within the flattened parameter (zero3's frozen parameters too, without
optimizer state); buffers and the frozen parameters of stages 1 and 2 (whole on every rank) go into
rank 0's file. A checkpoint written at world N loads at any world M: each rank
reads, from every rank's file, the pieces overlapping its new shards.

Under parallel.ep the kept experts' units (zero/experts.py) are pieces like any other, under the
dense model's names; a rank's model lacks the other ranks' experts, so their dense shapes
(`experts.shapes`: name -> shape) stand in for the model's where a checkpoint's layout is checked,
and a Hugging Face experts stack's slice writes and reads its pieces at their offsets in the whole
stack (`experts.offsets`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from paratrain import checkpoint as ckpt
from paratrain.parallel.base import unique_parameters
from paratrain.parallel.zero.comm import FlatUnit


class KeptExperts(Protocol):
    """What zero/experts.py says of the experts a rank keeps (AllExperts, SplitExperts)."""

    shapes: dict[str, list[int]]  # every expert parameter's name: its dense shape
    offsets: dict[str, int]  # a stack's name: where this rank's slice starts in it, flattened


def sharded_state(
    units: list[FlatUnit], optimizer, model: nn.Module, rank: int, world: int, stage: int, experts: KeptExperts
):
    """This rank's pieces of every parameter and its optimizer state, keyed by parameter name
    (the optimizer's parameters are those pieces: FlatUnit.pieces)."""
    tensors, pieces, scalars, shared = {}, {}, {}, {}
    for u in units:
        for i, start, end, _, piece in u.pieces:
            name = u.names[i]
            at = experts.offsets.get(name, 0)
            pieces[name] = [at + start, at + end]
            tensors[f"zero.param.{name}"] = piece.detach()
            for key, value in optimizer.state.get(piece, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == piece.shape:
                    tensors[f"zero.optim.{name}.{key}"] = value
                elif isinstance(value, torch.Tensor):
                    shared[f"zero.optim.{key}"] = value  # e.g. adam's step: the same for every piece
                elif value is not None:
                    scalars[key] = value
    tensors.update(shared)
    if rank == 0:
        tensors.update({f"replicated.{k}": v for k, v in replicated_state(model, units).items()})
    groups = [{k: v for k, v in g.items() if k != "params"} for g in own_state_dict(optimizer)["param_groups"]]
    meta = {
        "zero": {
            "stage": stage,
            "world_size": world,
            "pieces": pieces,
            "params": {**{n: list(s) for u in units for n, s in zip(u.names, u.shapes)}, **experts.shapes},
            "optimizer": {"param_groups": groups, "scalars": scalars},
        }
    }
    return tensors, meta


def own_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state_dict as its class gives it: this rank's pieces (the user's calls to it
    are refused on the instance, Zero.adopt_optimizer)."""
    return type(optimizer).state_dict(optimizer)


def check_checkpoint(reader, model: nn.Module) -> None:
    """Before any worker starts (the CLI's preflight, `model` on meta): the checkpoint's
    parameter names and shapes must be the model's. Reads only rank 0's safetensors header."""
    meta, shapes = ckpt.read_header(reader.path / ckpt.rank_file(0))
    saved = meta.get("zero")
    replicated = {k[len("replicated.") :]: shape for k, shape in shapes.items() if k.startswith("replicated.")}
    if not isinstance(saved, dict) or not isinstance(saved.get("params"), dict):
        raise ckpt.CheckpointMismatch("--resume", f"{reader.path} holds no ZeRO state")
    check_layout(model, saved["params"], replicated, key="--resume")


def load_sharded_state(
    reader, units: list[FlatUnit], optimizer, model: nn.Module, device: torch.device, experts: KeptExperts
) -> None:
    """Each rank takes, from every rank's file of the checkpoint, the pieces overlapping its own shards."""
    tensors0, meta0 = reader.load(rank=0)
    saved = meta0.get("zero")
    if saved is None:
        raise ckpt.CheckpointMismatch("resume", f"{reader.path} holds no ZeRO state")
    check_layout(
        model,
        saved["params"],
        {k[len("replicated.") :]: list(v.shape) for k, v in tensors0.items() if k.startswith("replicated.")},
        experts.shapes,
    )
    own = {}  # name: (start, end within the dense parameter, flattened; the piece)
    for u in units:
        for i, start, end, _, piece in u.pieces:
            at = experts.offsets.get(u.names[i], 0)
            own[u.names[i]] = (at + start, at + end, piece)
    piece_state: dict[str, dict[str, torch.Tensor]] = {name: {} for name in own}
    for r in range(reader.world_size):
        tensors, meta = (tensors0, meta0) if r == 0 else reader.load(rank=r)
        for name, (s, e) in meta["zero"]["pieces"].items():
            if name not in own:
                continue
            os_, oe, piece = own[name]
            a, b = max(s, os_), min(e, oe)
            if a >= b:
                continue
            dst, src = slice(a - os_, b - os_), slice(a - s, b - s)
            with torch.no_grad():
                piece[dst].copy_(tensors[f"zero.param.{name}"][src])
            prefix = f"zero.optim.{name}."
            for key in (k[len(prefix) :] for k in tensors if k.startswith(prefix)):
                buf = piece_state[name].setdefault(
                    key, torch.zeros(piece.numel(), dtype=tensors[prefix + key].dtype, device=device)
                )
                buf[dst].copy_(tensors[prefix + key][src])
    shared = {
        k[len("zero.optim.") :]: v for k, v in tensors0.items() if k.startswith("zero.optim.") and k.count(".") == 2
    }
    opt = saved["optimizer"]
    name_of = {id(piece): name for name, (_, _, piece) in own.items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]  # state_dict's numbering
    state = {
        index: {**piece_state[name_of[id(p)]], **{k: v.clone() for k, v in shared.items()}, **opt["scalars"]}
        for index, p in enumerate(params)
        if piece_state[name_of[id(p)]] or shared
    }
    current = own_state_dict(optimizer)
    groups = [dict(g, params=c["params"]) for g, c in zip(opt["param_groups"], current["param_groups"])]
    type(optimizer).load_state_dict(optimizer, {"state": state, "param_groups": groups})
    replicated = {k[len("replicated.") :]: v for k, v in tensors0.items() if k.startswith("replicated.")}
    with torch.no_grad():
        for k, v in replicated_state(model, units).items():
            v.copy_(replicated[k])


def replicated_state(model: nn.Module, units: Sequence[FlatUnit] = ()) -> dict[str, torch.Tensor]:
    """What ZeRO does not shard, by state_dict key: buffers and frozen parameters, less those in
    `units` (zero3's frozen units: pieces like the trainable ones)."""
    sharded = {id(p) for _, p in unique_parameters(model)} | {id(p) for u in units for p in u.params}
    return {k: v.detach() for k, v in model.state_dict(keep_vars=True).items() if id(v) not in sharded}


def check_layout(
    model: nn.Module, saved_params: dict, saved_replicated: dict, experts: dict | None = None, key: str = "resume"
) -> None:
    """Exit 2 naming the parameters or buffers whose name or shape differs from the checkpoint's
    (`experts`: every expert parameter's dense shape, where the model keeps some of them only)."""
    ours = {n: p.shape for n, p in unique_parameters(model)}
    ours.update({n: torch.Size(shape) for n, shape in (experts or {}).items()})
    ours.update({k: v.shape for k, v in replicated_state(model).items()})
    differs = ckpt.describe_mismatch(ours, {**saved_params, **saved_replicated})
    if differs:
        raise ckpt.CheckpointMismatch(key, differs)
