"""train.compile = true: torch.compile block by block, under every strategy.

Each block's forward is compiled in place (`block.forward = torch.compile(block.forward)`), once
the strategy has placed, sharded and cut the model (a strategy may run a block on the meta device
while it builds, which compiled code cannot take), so that:
  * the module objects, their names and parameters stay what every strategy and checkpoint knows;
  * a strategy's hooks run outside the compiled code, between blocks, as in eager mode: dp's
    gradient buckets still start their all-reduce while backward goes on, ZeRO-3 still gathers a
    unit just before its block and frees it after; tensor parallelism's sharded layers are traced
    inside their block; a pipeline stage runs its own blocks, compiled;
  * where a strategy acts inside a block (forward hooks on modules within it: ZeRO-3's units when
    a block is bigger than parallel.bucket_mb, ZeRO-1/2's per-module waits for the gathers), the
    block's children are compiled instead, down to modules with no hook inside: traced, those hooks
    made a graph break per unit, and guards on each unit's own values (its name, its version
    counter), so one recompile per unit until torch's recompile_limit;
  * blocks of one kind share one compiled graph (torch's inline_inbuilt_nn_modules): the first step
    compiles each kind once;
  * each model's compiled code is its own: dynamo keeps it on the compiled frame's code object, and
    each model's forwards are called through a frame whose code object is the model's own, so
    several compiled models live in one process (a benchmark's contenders, the test tier's gang)
    without resetting, recompiling or crowding out each other's (torch's recompile_limit counts
    per code object), and a model's graphs go when it does.
The blocks: a model's pipeline_layers() (the built-in gpt: embedding, each transformer block,
head) or an nn.Sequential's children, those that hold parameters; else the elements of its
ModuleLists; else the whole model. Where the strategy runs nothing between blocks (dp at world 1:
no gradient bucket to start), the whole model is one region, one graph.
"""

from __future__ import annotations

import os
from typing import Any, cast

import torch
from torch import nn

from paratrain.errors import note


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The modules compile_blocks compiles, each once."""
    if hasattr(model, "pipeline_layers") or isinstance(model, nn.Sequential):  # the layers a pipeline cuts between
        layers = (
            cast(Any, model).pipeline_layers()
            if hasattr(model, "pipeline_layers")
            else list(cast(nn.Sequential, model))
        )
        layers = [m for m in layers if has_params(m)]
    else:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        inner = {id(m) for lst in lists for m in lst.modules() if m is not lst}
        layers = [m for lst in lists if id(lst) not in inner for m in lst] or [model]
    return list({id(m): m for m in layers}.values())


def has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks)


def compiled_regions(block: nn.Module) -> list[nn.Module]:
    """What of `block` compile_blocks compiles: the block, or where a module inside it carries
    forward hooks, each child the same way (the block's own code between them runs eagerly)."""
    containers = (nn.ModuleList, nn.ModuleDict)  # never called: only their elements are
    if not isinstance(block, containers) and not any(_hooked(m) for m in block.modules() if m is not block):
        return [block]
    return [r for child in block.children() if has_params(child) for r in compiled_regions(child)]


def _own_frame(forward, codes: dict):
    """A function that calls `forward`, for torch.compile to compile as its frame (torch would wrap
    one of its own modules' forward in its `inner`, whose one code object every compiled torch
    module of the process shares): dynamo keeps compiled code on the frame's code object, so each
    kind of forward gets a copy of its own in `codes` (one per model; a kind's blocks share it)."""

    def call(*args, **kwargs):
        return forward(*args, **kwargs)

    call.__code__ = codes.setdefault(getattr(forward, "__func__", forward), call.__code__.replace())
    return call


def compile_blocks(model: nn.Module, whole: bool = False) -> int:
    """Compile each block's forward in place (lazily: the first call traces it); how many regions.
    `whole` (a strategy with nothing to run between blocks: dp alone): the whole model as one
    region instead, where no module inside it carries forward hooks: one graph call and one set
    of guards a step instead of one per block (on a GPU, host time: issue 43 measured about 7 ms a
    step of GPT-2 small by blocks)."""
    import torch._inductor.config as inductor
    from torch._dynamo.utils import counters

    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        # inductor's pool of compile workers takes every core by default, in each rank: the rank's
        # share instead, as its threads (a share of 1 compiles in the process, with no pool to
        # start: a cold compile of the tests' GPT on 2 cores 62 s -> 36 s)
        inductor.compile_threads = max(1, torch.get_num_threads())
    # report_graph_breaks counts from here: the graphs and breaks of this model's first step
    counters.clear()
    if whole and not any(_hooked(m) for m in model.modules() if m is not model):
        regions = [model]
    else:
        regions = [r for block in blocks_of(model) for r in compiled_regions(block)]
    codes: dict = {}
    for region in regions:
        region.forward = torch.compile(_own_frame(region.forward, codes))
    return len(regions)


def report_graph_breaks(is_main: bool, seconds: float) -> None:
    """Once, after the first step: what torch.compile made of the blocks, and the graph breaks it
    met (each one's code runs eagerly)."""
    from torch._dynamo.utils import counters

    if not is_main:
        return
    breaks = counters["graph_break"]
    line = f"torch.compile: {counters['stats']['unique_graphs']} graph(s) in the first step's {seconds:.1f}s"
    if breaks:
        first = next(iter(breaks)).splitlines()[0][:160]
        line += f"; {sum(breaks.values())} graph break(s) of {len(breaks)} kind(s), the first: {first}"
    note(line)
