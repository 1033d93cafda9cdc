"""How a model becomes one rank's part of a (pp, dp, cp, tp) mesh: functions applied in this order, as
torchtitan's `apply_*(model, mesh, cfg)` are.

  0. decide_cut     where the pipeline cuts the layers (pipeline/cut.py: balanced by time or parameters);
                    decided on the whole, unsharded layers, since rank 0 times them alone, and
                    before tp, which changes no layer boundary;
  1. apply_tp       the planned Linear / Embedding modules become their shards (tensor/layers.py;
                    the plan is parallel.tp_plan or the model's own paratrain_tp_plan() or transformers plan); names are kept;
  2. cut_pipeline   this rank's stages become chunks; the layers of every other stage move to the
                    meta device (no memory); after tp, so that a chunk holds the sharded modules;
  3. wrap_dp        each chunk gets a GradientReducer over the dp x cp sub-group only (a cp rank
                    holds every parameter its position holds, its gradients those of its chunks);
                    last, since it buckets the parameters the rank finally holds.
Between 0 and 1 the engine makes the model's attention a ring over the cp group (parallel/context/:
no module is replaced, so tp and the cut apply to the hooked model as to the plain one).
ModelParallel (hybrid.py) runs them on rank 0's initial weights, broadcast first.
"""

from __future__ import annotations

from torch import nn

from paratrain.comm import grid
from paratrain.comm.grid import Mesh
from paratrain.config import Config, virtual_stages
from paratrain.models.layers import layers_of
from paratrain.parallel.base import unique_parameters
from paratrain.parallel.dp.engine import GradientReducer
from paratrain.parallel.pipeline.cut import allowed_cuts, decide_split, split_ties
from paratrain.parallel.pipeline.runner import StageChunk
from paratrain.parallel.tensor.layers import apply_tensor_parallel


def sync_ties(cfg: Config) -> bool:
    """Whether the engine sums the gradients of a parameter shared by layers of different stages
    (ModelParallel._sum_tied_grads): with one stage per rank each rank holds one copy (with tp, one
    shard of it, the same rows at every holder: tensor_parallel.check_plan)."""
    return virtual_stages(cfg) == 1


def decide_cut(model: nn.Module, cfg: Config, plan: dict, sample_fn, autocast, device, is_main: bool) -> list[int]:
    """Stage boundaries over pipeline_layers(model), the same on every rank: [0, 1] without pp."""
    p = cfg.parallel
    if p.pp == 1:
        return [0, 1]
    layers, n_stages = layers_of(model), p.pp * virtual_stages(cfg)
    allowed = allowed_cuts(model, layers, plan, sync_ties(cfg))
    bounds, costs = decide_split(layers, n_stages, allowed, p.balance, sample_fn, autocast, device)
    if is_main:
        unit, scale = ("ms", 1e3) if p.balance == "time" else ("M params", 1e-6)
        parts = []
        for s in range(n_stages):
            a, b = bounds[s], bounds[s + 1]
            parts.append(f"stage {s} (rank {s % p.pp}): layers {a}-{b - 1}, {sum(costs[a:b]) * scale:.3g} {unit}")
        print(f"pipeline split by {p.balance} into {n_stages} stages: " + "; ".join(parts), flush=True)
    return bounds


def stage_of_keys(model: nn.Module, cfg: Config, bounds: list[int]) -> dict[str, int]:
    """State-dict key -> the virtual stage holding it (keys outside every layer: stage 0)."""
    if cfg.parallel.pp == 1:
        return {k: 0 for k in model.state_dict()}
    layers = layers_of(model)
    stage_of_module: dict[int, int] = {}  # by identity: a layer may wrap the model's modules (hf_pipeline)
    for s in range(len(bounds) - 1):
        for layer in layers[bounds[s] : bounds[s + 1]]:
            for m in layer.modules():
                stage_of_module.setdefault(id(m), s)
    modules = dict(model.named_modules())
    return {k: stage_of_module.get(id(modules.get(k.rpartition(".")[0])), 0) for k in model.state_dict()}


def apply_tp(model: nn.Module, mesh: Mesh, plan: dict) -> dict[str, int]:
    """Shard the planned modules over the tp group; returns parameter name -> the dimension split."""
    return apply_tensor_parallel(model, plan, mesh.tp_group) if mesh.tp > 1 else {}


def cut_pipeline(model: nn.Module, mesh: Mesh, cfg: Config, bounds: list[int]) -> tuple[list[int], list[nn.Module]]:
    """This rank's virtual stages (ids) and their chunks; the other stages' layers go to meta."""
    p = cfg.parallel
    stage_ids = [c * p.pp + mesh.pp_rank for c in range(virtual_stages(cfg))]
    if p.pp == 1:
        return stage_ids, [model]
    layers = layers_of(model)
    stage_layers = [layers[bounds[s] : bounds[s + 1]] for s in range(len(bounds) - 1)]
    for s, group in enumerate(stage_layers):
        if s not in stage_ids:
            for layer in group:
                layer.to("meta")
    return stage_ids, [StageChunk(stage_layers[s], cfg.train.recompute) for s in stage_ids]


def wrap_dp(
    model: nn.Module, chunks: list[nn.Module], mesh: Mesh, cfg: Config, device
) -> tuple[list[GradientReducer], list[str], list[nn.Parameter]]:
    """One dp reducer per chunk; the parameters the rank holds, in chunk order, and their names."""
    name_of = {id(t): n for n, t in model.named_parameters()}
    reducers, names, params = [], [], []
    for chunk in chunks:
        chunk_params = [t for _, t in unique_parameters(chunk)]
        reducers.append(GradientReducer(chunk_params, cfg.parallel.bucket_mb, device, mesh.replica_group))
        names += [name_of[id(t)] for t in chunk_params]
        params += chunk_params
    return reducers, names, params


def tie_groups(model: nn.Module, full_meta: nn.Module, mesh: Mesh, bounds: list[int], rank: int, is_main: bool):
    """Collective. For each parameter that layers of different stages share: (this rank's copy,
    the group of the ranks holding a copy in this rank's (dp, cp, tp) column, whether this rank is
    the first of them), for the ties this rank holds. Every rank makes every group, in one order.
    Called once the model is cut and sharded: the copy is this rank's (sharded) tensor, found
    under whichever of the parameter's names its own stage uses."""
    mine = []
    names: dict[int, list[str]] = {}
    for n, t in full_meta.named_parameters(remove_duplicate=False):
        names.setdefault(id(t), []).append(n)
    layers = layers_of(full_meta)
    for param, name, holders in split_ties(full_meta, layers, bounds):  # stage = pp rank here
        mine_copy = next((t for t in map(model.get_parameter, names[id(param)]) if not t.is_meta), None)
        for d in range(mesh.dp):
            for c in range(mesh.cp):
                for tp_rank in range(mesh.tp):
                    ranks = [mesh.global_rank(q, d, tp_rank, c) for q in holders]
                    group = grid.subgroup(ranks)
                    if rank in ranks:
                        mine.append((mine_copy, group, rank == ranks[0]))
        if is_main:
            print(
                f"tied weights: {name} is shared by stages {holders}; their copies' gradients are summed every step",
                flush=True,
            )
    return mine


def tie_names(model: nn.Module) -> dict[str, list[str]]:
    """For each name of a parameter known by several names (tied), its other names."""
    names: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(t), []).append(name)
    return {n: [o for o in group if o != n] for group in names.values() if len(group) > 1 for n in group}
