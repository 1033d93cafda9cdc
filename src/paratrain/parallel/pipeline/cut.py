"""Where a pipeline cuts a model: its layers, the cuts allowed, and the balanced partition.

The layers are `model.pipeline_layers()` (the built-in gpt: embedding, blocks, head) or the
children of an nn.Sequential. They are cut into p*v contiguous stages (v virtual stages per rank
when interleaved) minimising the most expensive stage, where a layer's cost is its measured
forward+backward time on a sample microbatch (balance = "time", measured by rank 0 and broadcast,
so every rank takes the same decision) or its parameter count (balance = "params"). A cut never
falls between a column-parallel layer and the row-parallel layer that consumes its slices.
"""

from __future__ import annotations

import bisect
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm import collectives
from paratrain.models.layers import pipeline_layers


def parameters_outside(model: nn.Module, layers: list[nn.Module]) -> list[str]:
    """Names of the trainable parameters that no layer holds: no pipeline stage would train them
    (a hand-written pipeline_layers() that forgot GPT-2's position embedding trained on, exit 0,
    with that parameter frozen at its initial value)."""
    held = {id(t) for layer in layers for t in layer.parameters()}
    return [n for n, t in model.named_parameters() if t.requires_grad and id(t) not in held]


def allowed_cuts(model: nn.Module, layers: list[nn.Module], plan: dict, sync_ties: bool = False) -> list[bool]:
    """allowed[i]: may a stage end after layer i? Not inside a colwise -> rowwise pair, and not
    between two layers that share a parameter unless the engine keeps the copies in sync
    (tied_spans)."""
    name_of = {id(m): n for n, m in model.named_modules()}
    sharded, allowed = False, []
    for layer in layers:
        for module in layer.modules():
            style = plan.get(name_of.get(id(module)))
            if style == "colwise":
                sharded = True
            elif style == "rowwise":
                sharded = False
        allowed.append(not sharded)
    for first, last, _ in tied_spans(model, layers, sync_ties):
        for i in range(first, last):
            allowed[i] = False
    allowed[-1] = True
    return allowed


def shared_parameters(model: nn.Module, layers: list[nn.Module]) -> list[tuple[nn.Parameter, str, list[int], bool]]:
    """Each parameter that several layers use, such as an embedding tied to the output projection:
    (the parameter, its name, those layers, whether a module holding it is itself used by several
    layers), in layer order."""
    name_of = {id(t): n for n, t in model.named_parameters()}
    users: dict[int, list[int]] = {}
    owners: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for i, layer in enumerate(layers):
        for module in layer.modules():
            for t in module.parameters(recurse=False):
                params[id(t)] = t
                owners.setdefault(id(t), set()).add(id(module))
                if i not in users.setdefault(id(t), []):
                    users[id(t)].append(i)
    found = [
        (params[k], name_of.get(k, "?"), idx, len(owners[k]) < len(idx)) for k, idx in users.items() if len(idx) > 1
    ]
    return sorted(found, key=lambda f: (f[2], f[1]))


def tied_spans(model: nn.Module, layers: list[nn.Module], sync_ties: bool = False) -> list[tuple[int, int, str]]:
    """(first layer, last layer, parameter name) of each shared parameter whose layers must stay in
    one stage. A parameter that two modules share can be split across stages on different ranks
    when the engine sums its copies' gradients (`sync_ties`: the plain pipeline, one stage per
    rank and no tp); otherwise each stage would train its own copy apart. A module used twice
    always stays whole: moving one use's weights off a rank would take the other's with them."""
    return [
        (idx[0], idx[-1], name) for _, name, idx, reused in shared_parameters(model, layers) if reused or not sync_ties
    ]


def split_ties(
    model: nn.Module, layers: list[nn.Module], bounds: list[int]
) -> list[tuple[nn.Parameter, str, list[int]]]:
    """(parameter, name, the stages holding a copy) for each shared parameter that the cut `bounds`
    splits across stages."""
    found = []
    for param, name, idx, _ in shared_parameters(model, layers):
        stages = sorted({bisect.bisect_right(bounds, i) - 1 for i in idx})
        if len(stages) > 1:
            found.append((param, name, stages))
    return found


def partition(costs: list[float], n_stages: int, allowed: list[bool]) -> list[int]:
    """Stage boundaries [0, b1, ..., n] minimising the largest stage cost (exact, by dynamic
    programming over cut positions); every stage gets at least one layer."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest max-cost of splitting layers[:i] into k stages
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            if not allowed[i - 1]:
                continue
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], choice[k][i] = cost, j
    if best[n_stages][n] == inf:
        raise ValueError(f"cannot cut {n} layers into {n_stages} stages")
    bounds = [n]
    for k in range(n_stages, 0, -1):
        bounds.append(choice[k][bounds[-1]])
    return bounds[::-1]


def splittable_layers(model: nn.Module, plan: dict, sync_ties: bool = False) -> int:
    layers = pipeline_layers(model)
    return sum(allowed_cuts(model, layers, plan, sync_ties)) if layers else 1


def parameter_costs(layers: list[nn.Module]) -> list[float]:
    return [float(sum(p.numel() for p in layer.parameters())) + 1.0 for layer in layers]


def measured_costs(layers: list[nn.Module], sample: torch.Tensor, autocast, repeats: int = 3) -> list[float]:
    """Median forward+backward seconds of each layer on `sample`, fed through the layers in turn."""
    costs, x = [], sample
    for layer in layers:
        times = []
        for attempt in range(repeats + 1):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            with autocast():
                out = layer(inp)
            out.float().sum().backward()
            if attempt:  # the first run warms up allocators and kernels
                times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
        costs.append(statistics.median(times))
        x = out.detach()
    return costs


def decide_split(
    layers, n_stages: int, allowed, balance: str, sample_fn, autocast, device
) -> tuple[list[int], list[float]]:
    """Boundaries and per-layer costs; identical on every rank (rank 0 measures and broadcasts)."""
    if balance == "params":
        costs = parameter_costs(layers)
    else:
        measured = torch.zeros(len(layers), dtype=torch.float64)
        if dist.get_rank() == 0:
            measured = torch.tensor(measured_costs(layers, sample_fn(), autocast), dtype=torch.float64)
        if dist.get_world_size() > 1:
            measured = measured.to(device)
            collectives.broadcast(measured, 0, "pipeline-layer-costs")
        costs = measured.cpu().tolist()
    return partition(costs, n_stages, allowed), costs
