"""`paratrain plan --cluster FILE --search [--top K]`: the fastest layouts that fit.

Enumerates, for the config's model and global batch on the cluster's devices: dp x cp x tp x pp,
with context parallelism (cp 2, 4, 8 ..., for a model whose attention paratrain splits) beside tp
within a node (tp x cp ranks: the grid places cp next to tp, comm/grid.py) and under pp, the cp
ranks reading the same samples (the batch divides over dp = world / (tp x pp x cp)); for pure data
parallelism the ZeRO stage (dp, zero1-3), also with expert parallelism (ep 2, 4, 8 ... dividing
its experts, for a model with MoE layers: the strategies that take ep); for pipelines the
microbatch count (pp, 2pp, 4pp, 8pp where a replica's batch allows) and the schedule (1f1b,
interleaved with 2 virtual stages), and recompute (none, selective, full). Each candidate goes
through the same checks as `run` (an invalid one is dropped) and the same plan and prediction as
`paratrain plan`; those that do not fit the device's memory are dropped, the rest ranked by
predicted step time.

To search thousands of devices in seconds, a candidate is not a full plan (every rank's bytes and
messages): it is planned for one data-parallel replica's ranks, which hold and compute what every
replica does, checked against memory before it is timed; the model and data are built and checked
once per recompute mode and each layout checked on them (preflight.check_layout_against), and
every fake-tensor trace is played once per distinct shape for the whole search (`memoised_traces`).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product
from typing import TYPE_CHECKING

from paratrain.config import Config
from paratrain.errors import ConfigError
from paratrain.plan.traces import memoised_traces
from paratrain.preflight import load

if TYPE_CHECKING:
    from torch import nn


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int, divides: int) -> list[int]:
    """2, 4, 8 ... up to `limit`, each dividing `divides`."""
    return [d for d in (2**i for i in range(1, limit.bit_length())) if d <= limit and divides % d == 0]


def splits(model: nn.Module, world: int, devices_per_node: int) -> tuple[list[int], list[int]]:
    """(cp degrees, ep degrees) beyond 1 worth trying for the model: cp where paratrain splits its
    attention by sequence (a ring within a node, with tp: `candidates`), ep where it has MoE layers
    (dividing the fewest experts of a layer)."""
    from paratrain.models.hf import hf_experts
    from paratrain.models.moe import expert_layers
    from paratrain.parallel.context import hf
    from paratrain.parallel.context.attention import hooked

    # the gpt's attention takes the ring by its own hook; a transformers decoder from outside (hf.py)
    splits_sequence = hooked(model, "paratrain_attention") or (hf.is_hf(model) and hf.refusal(model) is None)
    cps = _powers_of_two(devices_per_node, world) if splits_sequence else []
    experts = [int(getattr(layer, "n_experts", 0)) for layer in expert_layers(model)]
    experts += [int(getattr(m, "num_experts", 0)) for m in hf_experts(model)]
    eps = _powers_of_two(min(experts), min(experts)) if experts and min(experts) > 1 else []
    return cps, [e for e in eps if world % e == 0]


def candidates(
    batch: int, world: int, devices_per_node: int, split: tuple[list[int], list[int]] = ([], [])
) -> list[list[str]]:
    """--set overrides of every layout to try (before the config's own checks). `split`: the cp
    and ep degrees beyond 1 to try (`splits`), each with the strategies whose spec declares it (ep:
    dp and zero1-3, parallel/registry.py)."""
    from paratrain.parallel.registry import SPECS

    replicas = [s for s in SPECS.values() if s.searched_as == "replica"]
    meshes = [s for s in SPECS.values() if s.searched_as == "mesh"]
    cps, eps = split
    out = []
    for tp in [d for d in _divisors(world) if d <= devices_per_node]:
        # tp x cp ranks within a node: the grid places cp next to tp (comm/grid.py), and both
        # exchange at every layer, so neither should cross the slower links between nodes
        for cp in [c for c in (1, *cps) if tp * c <= devices_per_node and world % (tp * c) == 0]:
            for pp in _divisors(world // (tp * cp)):
                dp = world // (tp * pp * cp)  # cp ranks read the same samples
                if batch % dp == 0:
                    strategies = replicas if tp == pp == 1 else meshes
                    out += _layouts(batch // dp, tp, pp, cp, eps, strategies)
    return out


def _layouts(per_replica: int, tp: int, pp: int, cp: int, eps: list[int], strategies: list) -> list[list[str]]:
    """The candidates of one (tp, pp, cp) grid: by recompute, then strategy and ep (it borrows the
    dp x cp ranks: `run`'s checks drop a degree that does not divide them), and for a pipeline
    the microbatches and the schedule."""
    grid = [f"parallel.tp={tp}", f"parallel.pp={pp}", *([f"parallel.cp={cp}"] if cp > 1 else [])]
    ways = [
        [f"parallel.strategy='{s.name}'", *([f"parallel.ep={ep}"] if ep > 1 else [])]
        for ep in (1, *eps)
        for s in strategies
        if ep == 1 or "ep" in s.degrees
    ]
    if pp > 1:
        ways = [
            [*way, f"parallel.microbatches={m}", f"parallel.schedule='{schedule}'", "parallel.balance='params'"]
            for way in ways
            for m, schedule in product((pp, 2 * pp, 4 * pp, 8 * pp), ("1f1b", "interleaved"))
            if per_replica % m == 0
        ]
    # a layout's recompute modes come none, selective, then full: `search` keeps the first that fits
    return [[*grid, f"train.recompute='{r}'", *way] for r in ("none", "selective", "full") for way in ways]


def replica_plan(cfg: Config, model, cluster) -> dict:
    """What the prediction and the fit need of `make_plan`'s plan, for the ranks of data-parallel
    replica 0 alone (every replica holds and computes the same): model state and activations per
    rank, the pipeline cut, the batch; with "capacity" judged as make_plan judges it."""
    from paratrain.config import microbatch_count
    from paratrain.cost.ranks import nbytes, optimizer_slots
    from paratrain.parallel.base import unique_parameters
    from paratrain.parallel.registry import spec
    from paratrain.plan.planner import capacity

    p, world, nproc = cfg.parallel, cluster.world, cluster.devices_per_node
    dp = spec(p.strategy).data_parallel_degree(cfg, world)  # cp ranks read the same samples
    per_replica, micro = cfg.data.batch_size // dp, microbatch_count(cfg)
    rows = per_replica // micro
    params = [t for _, t in unique_parameters(model)]
    total, slots = nbytes(params), optimizer_slots(cfg)
    replica, stages = spec(p.strategy).plan_replica(cfg, model, world, rows, cluster)
    if cluster.is_gpu:
        ranks = replica
    else:  # the busiest node's ranks together: every rank, each as its replica-0 twin
        twin = {(r.pp, r.tp): r for r in replica}
        ranks = [
            replace(twin[(r // (world // p.pp), r % p.tp)], rank=r, node=r // nproc, local_rank=r % nproc)
            for r in range(world)
        ]
    return {
        "capacity": capacity(ranks, "cuda" if cluster.is_gpu else "cpu", cluster),
        "world_size": world,
        "mesh": spec(p.strategy).mesh(cfg, world),
        "batch": {
            "global": cfg.data.batch_size,
            "per_replica": per_replica,
            "microbatches": micro,
            "rows_per_microbatch": rows,
        },
        "model": {"bytes": total},
        "optimizer": {"state_tensors_per_parameter": slots},
        "stages": stages,
        "ranks": [r.as_dict() for r in replica],
    }


def layout(cfg: Config, predicted: dict, breakdown: dict) -> dict:
    """The contract's "layouts" entry (plus the step's breakdown)."""
    p = cfg.parallel
    return {
        "parallel": {
            "strategy": p.strategy,
            "tp": p.tp,
            "pp": p.pp,
            "cp": p.cp,
            "ep": p.ep,
            "microbatches": p.microbatches,
            "schedule": p.schedule,
            "virtual_stages": p.virtual_stages,
        },
        "train": {"recompute": cfg.train.recompute},
        "predicted": predicted,
        "step_breakdown": breakdown,
    }


def search(config_path, overrides: list[str], cluster, top: int) -> list[dict]:
    """The `top` fastest layouts that fit, fastest first, as the contract's "layouts" entries (plus
    each one's step breakdown). Each candidate is judged on its replica plan: memory first, and only
    what fits is timed; its figures are those `paratrain plan` gives the layout alone (a test holds
    every candidate of a small search to the full plans)."""
    import torch

    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.parallel.registry import check_world
    from paratrain.plan.predict import predict
    from paratrain.preflight import check_layout_against, checked_model_and_data

    base = load(config_path, overrides)
    batch = base.data.batch_size
    with torch.device("meta"):
        split = splits(build_model(base, build_dataset(base, "train")), cluster.world, cluster.devices_per_node)
    ranked = []
    with memoised_traces():
        # the meta model and the training set by recompute (the only key here that may change the
        # model's build), built and checked once: each layout is checked on them as preflight does
        built: dict[str, tuple] = {}
        # A layout comes recomputing none, selective, then full (candidates): each keeps less and
        # runs more than the one before, so the first that fits is the layout's fastest.
        fitted = set()
        for sets in candidates(batch, cluster.world, cluster.devices_per_node, split):
            layout_key = tuple(s for s in sets if not s.startswith("train.recompute="))
            if layout_key in fitted:
                continue
            try:
                cfg = load(config_path, [*overrides, *sets])
                check_world(cfg, cluster.world)
                if cfg.train.recompute not in built:
                    built[cfg.train.recompute] = checked_model_and_data(cfg)
                model, train_set = built[cfg.train.recompute]
                check_layout_against(cfg, model, train_set)
            except ConfigError:
                continue
            plan = replica_plan(cfg, model, cluster)
            if not plan["capacity"]["fits"]:
                continue
            fitted.add(layout_key)
            predicted, breakdown = predict(cfg, model, plan, cluster)
            if predicted is not None:
                ranked.append(layout(cfg, predicted, breakdown))
    ranked.sort(key=lambda x: x["predicted"]["step_s"])
    return ranked[:top]


def _name(layout: dict) -> str:
    p = layout["parallel"]
    name = p["strategy"] if p["tp"] == p["pp"] == 1 else f"tp {p['tp']} x pp {p['pp']}"
    if p["pp"] > 1:
        name += f", {p['microbatches']} mb {p['schedule']}"
    name += "".join(f", {k} {p[k]}" for k in ("cp", "ep") if p.get(k, 1) > 1)
    recompute = layout["train"]["recompute"]
    return name + ("" if recompute == "none" else ", recompute" if recompute == "full" else ", selective recompute")


def render_search(layouts: list[dict]) -> list[str]:
    if not layouts:
        return ["search: no layout fits"]
    lines = [
        f"search: the {len(layouts)} fastest layouts that fit",
        f"{'layout':<44}{'step s':>9}{'MFU':>7}{'bubble s':>10}{'exposed comm s':>16}{'headroom GiB':>14}",
    ]
    for x in layouts:
        b = x["step_breakdown"]
        comm = sum(b.get(k, 0.0) for k in ("tp_comm_s", "p2p_s", "cp_comm_s", "ep_comm_s", "exposed_dp_comm_s"))
        lines.append(
            f"{_name(x):<44}{x['predicted']['step_s']:>9.4g}{x['predicted']['mfu']:>7.1%}"
            f"{b['bubble_s']:>10.3g}{comm:>16.3g}{b['memory_headroom_gib']:>14.3g}"
        )
    if len(layouts) > 1:
        win, second = layouts[0]["step_breakdown"], layouts[1]["step_breakdown"]
        parts = sorted({k for k in [*win, *second] if k.endswith("_s")})
        gap = max(parts, key=lambda k: second.get(k, 0.0) - win.get(k, 0.0))
        lines.append(
            f"why: {_name(layouts[0])} beats {_name(layouts[1])} most on "
            f"{gap[:-2].replace('_', ' ')} ({win.get(gap, 0.0):.3g} s against {second.get(gap, 0.0):.3g} s)"
        )
    return lines
